//! The labels' negative log-likelihood under a classifier's logits.

use candle_core::{Result, Tensor, D};
use candle_nn::{loss::nll, ops::log_softmax};

use super::by_hand::{by_hand, Backward, GradSink};

/// The log-softmax of `logits` (rows, classes) and the mean negative log-likelihood of
/// `labels` (rows, u32) under it. With `by_hand` the loss is one node of candle's graph whose
/// backward is written out, ∂logits = (softmax − onehot(labels)) · ∂loss / rows, in place of
/// the backward of the eight ops of the log-softmax and the five of the likelihood; the values
/// are the same.
pub fn log_softmax_nll(logits: &Tensor, labels: &Tensor, by_hand: bool) -> Result<[Tensor; 2]> {
    if !by_hand {
        let logp = log_softmax(logits, D::Minus1)?;
        let loss = nll(&logp, labels)?;
        return Ok([logp, loss]);
    }
    let logp = log_softmax(&logits.detach(), D::Minus1)?;
    let loss = nll(&logp, labels)?;
    let back = NllBackward {
        logp: logp.clone(),
        labels: labels.unsqueeze(1)?,
    };
    let loss = self::by_hand(logits, &loss, logits, Box::new(back), &GradSink::new())?;
    Ok([logp, loss])
}

struct NllBackward {
    logp: Tensor,
    /// (rows, 1).
    labels: Tensor,
}

impl Backward for NllBackward {
    fn backward(&self, dloss: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let rows = self.logp.dim(0)?;
        let scale = dloss.affine(1.0 / rows as f64, 0.0)?;
        let picked = scale.neg()?.broadcast_as((rows, 1))?.contiguous()?;
        let softmax = self.logp.exp()?.broadcast_mul(&scale)?;
        Ok((softmax.scatter_add(&self.labels, &picked, 1)?, vec![]))
    }
}
