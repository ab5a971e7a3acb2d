//! The labels' negative log-likelihood under a classifier's logits.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::{loss::nll, ops::log_softmax};

use super::by_hand::{by_hand, Backward, GradSink};
use crate::ops::{cross_entropy, cross_entropy_backward};

/// What [`log_softmax_nll`] gives.
pub struct Nll {
    /// The log-softmax of the logits (rows, classes).
    pub logp: Tensor,
    /// The mean negative log-likelihood of the labels.
    pub loss: Tensor,
    /// How many rows' most likely class (the first, in a tie) is their label, as an f64
    /// scalar.
    pub correct: Tensor,
}

/// The log-softmax of `logits` (rows, classes), the mean negative log-likelihood of `labels`
/// (rows, u32) under it, and the rows classified correctly. With `by_hand` (f32 and f64 on the
/// CPU and CUDA) all three are one fused op ([`cross_entropy()`]) and the loss one node of
/// candle's graph whose backward is the op's own, ∂logits = (softmax − onehot(labels)) ·
/// ∂loss / rows; otherwise candle's ops, through its autograd. The values agree to rounding.
pub fn log_softmax_nll(logits: &Tensor, labels: &Tensor, by_hand: bool) -> Result<Nll> {
    let fused = matches!(logits.dtype(), DType::F32 | DType::F64)
        && (logits.device().is_cpu() || logits.device().is_cuda());
    if !(by_hand && fused) {
        let logp = log_softmax(logits, D::Minus1)?;
        let loss = nll(&logp, labels)?;
        let correct = logp
            .argmax(1)?
            .eq(labels)?
            .to_dtype(DType::F64)?
            .sum_all()?;
        return Ok(Nll {
            logp,
            loss,
            correct,
        });
    }
    // The op reads the logits' values: no graph is recorded.
    let ce = cross_entropy(logits, labels)?;
    let back = NllBackward {
        logp: ce.logp.clone(),
        labels: ce.labels,
    };
    let loss = self::by_hand(logits, &ce.loss, logits, Box::new(back), &GradSink::new())?;
    Ok(Nll {
        logp: ce.logp,
        loss,
        correct: ce.correct.to_dtype(DType::F64)?,
    })
}

struct NllBackward {
    logp: Tensor,
    /// In the logits' dtype.
    labels: Tensor,
}

impl Backward for NllBackward {
    fn backward(&self, dloss: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let dx = cross_entropy_backward(&self.logp, &self.labels, dloss)?;
        Ok((dx, vec![]))
    }
}
