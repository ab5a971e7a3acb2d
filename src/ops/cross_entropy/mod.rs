//! The classification loss in one launch each way (`kernels/cross_entropy.cu` on CUDA, its CPU
//! twin here). Of logits x (rows, C) and labels y:
//!
//!   logp = x − m − log Σ_c exp(x_c − m) per row (m its maximum),
//!   loss = −(1/rows) Σ_r logp[r, y_r],  correct = #{r : argmax_c x[r, c] = y_r}
//!
//! (the first maximal class counts as the argmax), and backward
//! ∂x = (exp(logp) − onehot(y)) · ∂loss / rows. The forward's three results are one row of
//! memory, [logp | loss | correct], so a step's loss and accuracy cost one launch; its sums run
//! in a fixed order (thread t of one block takes the rows t, t + 256, …, then a tree over the
//! threads), so results do not depend on the device's scheduling.

use candle_core::{bail, DType, Device, Result, Storage, Tensor, WithDType};
use num_traits::Float;

use super::value::contiguous;

pub mod cuda;

/// The threads whose partial sums the forward adds (`CE_THREADS`).
const THREADS: usize = cuda::THREADS as usize;

/// What [`cross_entropy`] computes, in the logits' dtype.
pub struct CrossEntropy {
    /// Log-probabilities (rows, classes).
    pub logp: Tensor,
    /// The mean negative log-likelihood of the labels (a scalar).
    pub loss: Tensor,
    /// How many rows' most likely class is their label (a scalar).
    pub correct: Tensor,
    /// The labels in the logits' dtype, as [`cross_entropy_backward`] reads them.
    pub labels: Tensor,
}

/// The loss of `logits` (rows, classes; f32 or f64 on the CPU or CUDA) for `labels` (rows;
/// whole numbers of any dtype, checked to lie in 0..classes where they are read on the CPU; on
/// CUDA a label outside makes the loss NaN).
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<CrossEntropy> {
    let (rows, classes) = logits.dims2()?;
    if labels.dims() != [rows] || classes == 0 {
        bail!(
            "cross_entropy: labels {:?} for logits {:?}, expected one label per row of classes",
            labels.dims(),
            logits.dims()
        );
    }
    let dtype = logits.dtype();
    let (logits, y) = (logits.contiguous()?, labels.to_dtype(dtype)?.contiguous()?);
    let n = rows * classes;
    let out = match logits.device() {
        Device::Cpu => {
            let (sx, lx) = logits.storage_and_layout();
            let (sy, ly) = y.storage_and_layout();
            let (Storage::Cpu(sx), Storage::Cpu(sy)) = (&*sx, &*sy) else {
                bail!("cross_entropy: the labels are not on the logits' device");
            };
            match dtype {
                DType::F32 => {
                    let v = forward_cpu::<f32>(contiguous(sx, lx)?, contiguous(sy, ly)?, classes)?;
                    Tensor::from_vec(v, n + 2, &Device::Cpu)?
                }
                DType::F64 => {
                    let v = forward_cpu::<f64>(contiguous(sx, lx)?, contiguous(sy, ly)?, classes)?;
                    Tensor::from_vec(v, n + 2, &Device::Cpu)?
                }
                dt => bail!("cross_entropy: dtype {dt:?} is not supported (f32 or f64)"),
            }
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let plan = cuda::forward_plan(rows, classes, dtype)?;
            let module = crate::cuda::CROSS_ENTROPY;
            crate::cuda::launch_tensors(module, &plan, dtype, &[&logits, &y], &[&[n + 2]])?
                .remove(0)
        }
        dev => bail!(
            "cross_entropy: device {:?} is not supported",
            dev.location()
        ),
    };
    Ok(CrossEntropy {
        logp: out.narrow(0, 0, n)?.reshape((rows, classes))?,
        loss: out.get(n)?,
        correct: out.get(n + 1)?,
        labels: y,
    })
}

/// ∂logits from ∂loss (a scalar), given the forward's `logp` and its `labels`
/// ([`CrossEntropy`]).
pub fn cross_entropy_backward(logp: &Tensor, labels: &Tensor, dloss: &Tensor) -> Result<Tensor> {
    let (rows, classes) = logp.dims2()?;
    let dtype = logp.dtype();
    if labels.dims() != [rows] || dloss.elem_count() != 1 {
        bail!(
            "cross_entropy_backward: labels {:?} and ∂loss {:?} for logp {:?}",
            labels.dims(),
            dloss.dims(),
            logp.dims()
        );
    }
    let g = dloss.to_dtype(dtype)?.reshape(1)?;
    let (logp, labels) = (logp.contiguous()?, labels.contiguous()?);
    match logp.device() {
        Device::Cpu => {
            let [(sp, lp), (sy, ly), (sg, lg)] =
                [&logp, &labels, &g].map(|t| t.storage_and_layout());
            let (Storage::Cpu(sp), Storage::Cpu(sy), Storage::Cpu(sg)) = (&*sp, &*sy, &*sg) else {
                bail!("cross_entropy_backward: tensors are not all on the CPU");
            };
            match dtype {
                DType::F32 => Tensor::from_vec(
                    backward_cpu::<f32>(
                        contiguous(sp, lp)?,
                        contiguous(sy, ly)?,
                        contiguous(sg, lg)?[0],
                    ),
                    (rows, classes),
                    &Device::Cpu,
                ),
                DType::F64 => Tensor::from_vec(
                    backward_cpu::<f64>(
                        contiguous(sp, lp)?,
                        contiguous(sy, ly)?,
                        contiguous(sg, lg)?[0],
                    ),
                    (rows, classes),
                    &Device::Cpu,
                ),
                dt => bail!("cross_entropy_backward: dtype {dt:?} is not supported"),
            }
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let plan = cuda::backward_plan(rows, classes, dtype)?;
            let module = crate::cuda::CROSS_ENTROPY;
            let mut out = crate::cuda::launch_tensors(
                module,
                &plan,
                dtype,
                &[&logp, &labels, &g],
                &[&[rows, classes]],
            )?;
            Ok(out.remove(0))
        }
        dev => bail!(
            "cross_entropy_backward: device {:?} is not supported",
            dev.location()
        ),
    }
}

/// The CPU twin of `cross_entropy_fwd`: the same operations in the same order.
fn forward_cpu<F: WithDType + Float + std::ops::AddAssign + std::ops::SubAssign>(
    x: &[F],
    y: &[F],
    classes: usize,
) -> Result<Vec<F>> {
    let rows = y.len();
    let mut out = vec![F::zero(); rows * classes + 2];
    let (mut loss, mut hit) = (vec![F::zero(); THREADS], vec![F::zero(); THREADS]);
    for r in 0..rows {
        let (xr, lr) = (
            &x[r * classes..][..classes],
            &mut out[r * classes..][..classes],
        );
        let (mut m, mut arg) = (xr[0], 0);
        for (c, &v) in xr.iter().enumerate().skip(1) {
            if v > m {
                m = v;
                arg = c;
            }
        }
        let mut s = F::zero();
        for &v in xr {
            s += (v - m).exp();
        }
        let lse = s.ln();
        for (l, &v) in lr.iter_mut().zip(xr) {
            *l = (v - m) - lse;
        }
        let label = y[r];
        let c = label
            .to_usize()
            .filter(|&c| c < classes && label.floor() == label);
        let Some(c) = c else {
            let label = label.to_f64();
            bail!("cross_entropy: label {label} of row {r} is not a class in 0..{classes}");
        };
        let t = r % THREADS;
        loss[t] -= lr[c];
        hit[t] += if arg == c { F::one() } else { F::zero() };
    }
    let mut half = THREADS / 2;
    while half > 0 {
        for t in 0..half {
            let (l, h) = (loss[t + half], hit[t + half]);
            loss[t] += l;
            hit[t] += h;
        }
        half /= 2;
    }
    out[rows * classes] = loss[0] / F::from(rows).unwrap_or_else(F::nan);
    out[rows * classes + 1] = hit[0];
    Ok(out)
}

/// The CPU twin of `cross_entropy_bwd`.
fn backward_cpu<F: WithDType + Float>(logp: &[F], y: &[F], g: F) -> Vec<F> {
    let (rows, classes) = (y.len(), logp.len() / y.len().max(1));
    let scale = g / F::from(rows).unwrap_or_else(F::nan);
    let mut dx = vec![F::zero(); rows * classes];
    for (e, d) in dx.iter_mut().enumerate() {
        let (r, c) = (e / classes, e % classes);
        let hot = if F::from(c) == Some(y[r]) {
            F::one()
        } else {
            F::zero()
        };
        *d = (logp[e].exp() - hot) * scale;
    }
    dx
}
