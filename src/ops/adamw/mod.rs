//! One fused AdamW step of one parameter (`kernels/adamw.cu` on CUDA, its CPU twin here): from
//! θ, the moments m, v and the gradient g, the new [m'; v'; θ'] in one tensor, so that an
//! optimiser step enqueues one launch per parameter (a step written in candle ops took
//! seventeen, and on CUDA the host's time per launch, not the GPU, set the pace).
//!
//!   ĝ = s g,  m' = β₁ m + (1 − β₁) ĝ,  v' = β₂ v + (1 − β₂) ĝ²,
//!   θ' = θ − η (m' / c₁) / (√(v' / c₂) + ε) − η λ θ,  c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
//!
//! with s the gradient-clipping factor (a device scalar) or 1. No gradient flows through it.

use candle_core::{bail, DType, Device, Result, Tensor, WithDType};
use rayon::prelude::*;

pub mod cuda;

/// The hyper-parameters of one step of one parameter group, in the kernel's order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwHyper {
    pub beta1: f64,
    pub beta2: f64,
    /// 1 − β₁ᵗ at step t (1-based).
    pub c1: f64,
    /// 1 − β₂ᵗ.
    pub c2: f64,
    pub eps: f64,
    /// The learning rate η of this step.
    pub lr: f64,
    /// The weight decay λ.
    pub weight_decay: f64,
}

impl AdamwHyper {
    /// The row the kernel reads, as a tensor of `dtype` on `device` (made once per step and
    /// group, and shared by the group's parameters).
    pub fn to_tensor(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let h = [
            self.beta1,
            self.beta2,
            self.c1,
            self.c2,
            self.eps,
            self.lr,
            self.weight_decay,
        ];
        Tensor::new(&h, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }
}

/// The new moments and parameter, stacked: (3, θ's shape) = [m'; v'; θ'] (see the module doc).
/// θ, m, v and g have one shape; `scale` (one element) and `hyper` (an
/// [`AdamwHyper::to_tensor`] row) are of θ's dtype, which is f32 or f64; all on one device.
pub fn adamw_step(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    scale: Option<&Tensor>,
    hyper: &Tensor,
) -> Result<Tensor> {
    let dtype = theta.dtype();
    if !matches!(dtype, DType::F32 | DType::F64) {
        bail!("adamw_step: parameters of dtype {dtype:?} are not supported (f32 or f64)");
    }
    for (what, t) in [("m", m), ("v", v), ("gradient", g)] {
        if t.dims() != theta.dims() || t.dtype() != dtype {
            bail!(
                "adamw_step: {what} is {:?} {:?}, the parameter {:?} {dtype:?}",
                t.dims(),
                t.dtype(),
                theta.dims()
            );
        }
    }
    if hyper.dims() != [7] || hyper.dtype() != dtype {
        bail!("adamw_step: the hyper-parameter row must be 7 values of {dtype:?}");
    }
    if let Some(s) = scale {
        if s.elem_count() != 1 || s.dtype() != dtype {
            bail!("adamw_step: the gradient scale must be one value of {dtype:?}");
        }
    }
    let mut shape = vec![3];
    shape.extend_from_slice(theta.dims());
    match theta.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let plan = cuda::step_plan(theta.elem_count(), scale.is_some(), dtype)?;
            let mut inputs = vec![theta, m, v, g];
            inputs.extend(scale);
            inputs.push(hyper);
            let out =
                crate::cuda::launch_tensors(crate::cuda::ADAMW, &plan, dtype, &inputs, &[&shape]);
            Ok(out?.remove(0))
        }
        device => match dtype {
            DType::F32 => Tensor::from_vec(
                step_cpu::<f32>(theta, m, v, g, scale, hyper)?,
                shape,
                device,
            ),
            _ => Tensor::from_vec(
                step_cpu::<f64>(theta, m, v, g, scale, hyper)?,
                shape,
                device,
            ),
        },
    }
}

/// A CPU tensor's values in order.
fn values<F: WithDType>(t: &Tensor) -> Result<Vec<F>> {
    t.flatten_all()?.to_vec1::<F>()
}

/// The CPU twin of `adamw_step_*`: the same operations in the same order, in F.
fn step_cpu<F: WithDType + num_traits::Float + Send + Sync>(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    scale: Option<&Tensor>,
    hyper: &Tensor,
) -> Result<Vec<F>> {
    let h = values::<F>(hyper)?;
    let (b1, b2, c1, c2, eps, eta, wd) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    let s = match scale {
        Some(s) => values::<F>(s)?[0],
        None => F::one(),
    };
    let (theta, m, v, g) = (
        values::<F>(theta)?,
        values::<F>(m)?,
        values::<F>(v)?,
        values::<F>(g)?,
    );
    let n = theta.len();
    let mut out = vec![F::zero(); 3 * n];
    let (om, rest) = out.split_at_mut(n);
    let (ov, ot) = rest.split_at_mut(n);
    const CHUNK: usize = 1 << 14;
    om.par_chunks_mut(CHUNK)
        .zip(ov.par_chunks_mut(CHUNK))
        .zip(ot.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, ((om, ov), ot))| {
            for k in 0..om.len() {
                let e = c * CHUNK + k;
                let gs = g[e] * s;
                let mn = b1 * m[e] + (F::one() - b1) * gs;
                let vn = b2 * v[e] + (F::one() - b2) * (gs * gs);
                let update = (mn / c1) / ((vn / c2).sqrt() + eps);
                let th = theta[e];
                om[k] = mn;
                ov[k] = vn;
                ot[k] = (th - eta * update) - eta * wd * th;
            }
        });
    Ok(out)
}
