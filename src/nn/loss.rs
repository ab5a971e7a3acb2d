//! The labels' negative log-likelihood under a classifier's logits, and values' under a
//! Gaussian decoder's means and variances.

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

/// What [`gaussian_nll`] gives.
pub struct GaussianNll {
    /// The negative log-likelihood, 0.5 Σ_outputs (ln σ² + (μ − y)²/σ² + ln 2π) averaged over
    /// examples and steps.
    pub objective: Tensor,
    /// The mean squared error of the means.
    pub mse: Tensor,
}

/// The least variance the likelihood reads (S5's and CRU's): smaller ones are raised to it.
const MIN_VARIANCE: f64 = 1e-6;

/// The negative log-likelihood of values `y` (…, k) under Gaussians whose means and variances
/// are `out` (…, 2k): [μ | σ²], σ² at least 1e-6. With `by_hand` (f32 and f64 on the CPU and
/// CUDA) the objective is one node of candle's graph whose backward is written out: with
/// c = ∂objective · (k/2) / N over the N values,
///
///   ∂μ = c · 2(μ − y)/σ²,   ∂σ² = c · (1/σ² − (μ − y)²/σ⁴) where σ² ≥ 1e-6, else 0;
///
/// otherwise candle's autograd. The forward is the same ops either way.
pub fn gaussian_nll(out: &Tensor, y: &Tensor, by_hand: bool) -> Result<GaussianNll> {
    let fused = matches!(out.dtype(), DType::F32 | DType::F64)
        && (out.device().is_cpu() || out.device().is_cuda());
    let by_hand = by_hand && fused;
    let x = match by_hand {
        true => out.detach(),
        false => out.clone(),
    };
    let k = y.dim(D::Minus1)?;
    let diff = (x.narrow(D::Minus1, 0, k)? - y)?;
    let sq = diff.sqr()?;
    let mse = sq.mean_all()?;
    let raw = x.narrow(D::Minus1, k, k)?;
    let var = raw.maximum(MIN_VARIANCE)?;
    let per = (var.log()? + (&sq / &var)?)?.mean_all()?;
    let half_k = 0.5 * k as f64;
    let objective = ((per * half_k)? + half_k * (2.0 * std::f64::consts::PI).ln())?;
    if !by_hand {
        return Ok(GaussianNll { objective, mse });
    }
    let back = GaussianNllBackward {
        diff,
        var,
        live: raw.ge(MIN_VARIANCE)?.to_dtype(raw.dtype())?,
        half_k,
    };
    let objective = self::by_hand(out, &objective, out, Box::new(back), &GradSink::new())?;
    Ok(GaussianNll { objective, mse })
}

struct GaussianNllBackward {
    /// μ − y.
    diff: Tensor,
    /// σ², raised to the least variance.
    var: Tensor,
    /// 1 where the variance was not raised, else 0.
    live: Tensor,
    half_k: f64,
}

impl Backward for GaussianNllBackward {
    fn backward(&self, dloss: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let c = (dloss * (self.half_k / self.diff.elem_count() as f64))?;
        let ratio = (&self.diff / &self.var)?;
        let dmean = ratio.broadcast_mul(&(&c * 2.0)?)?;
        let dvar = ((1.0 - (&self.diff * &ratio)?)? / &self.var)?
            .mul(&self.live)?
            .broadcast_mul(&c)?;
        let dx = Tensor::cat(&[&dmean, &dvar], D::Minus1)?;
        Ok((dx, vec![]))
    }
}
