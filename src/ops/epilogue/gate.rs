//! The gated epilogue of the GLU activations as one op each way (`gate_fwd`, `gate_bwd` in
//! `kernels/epilogue.cu`; the CPU twins here): on f, z of shape (samples, …, features) and a
//! bias b per feature,
//!
//!   out = r + k ⊙ (f ⊙ s),  s = σ(z + b),
//!   ∂f = (∂out ⊙ k) ⊙ s,  ∂z = ((∂out ⊙ k) ⊙ f) ⊙ (s ⊙ (1 − s)),  ∂b = Σ ∂z,  ∂r = ∂out,
//!
//! with k the epilogue's dropout factor ([`super::Dropout`]) and r the residual (optional). In
//! candle ops this is a bias, a sigmoid, a product and the epilogue forward, and six ops
//! backward; f32 and f64, for the blocks whose backward is written by hand.

use candle_core::{bail, DType, Device, Result, Storage, Tensor, WithDType};
use num_traits::Float;

use super::{Activation, Dropout, Epilogue};
use crate::ops::value::contiguous;

/// σ(x) as the kernel computes it.
fn sigmoid<F: Float>(x: F) -> F {
    F::one() / ((-x).exp() + F::one())
}

/// r + k ⊙ (f ⊙ σ(z + b)) (see the module docs): f, z and `residual` of one shape
/// (samples, …, features), b (features), all f32 or f64 on the CPU or CUDA.
pub fn gate(
    f: &Tensor,
    z: &Tensor,
    b: &Tensor,
    residual: Option<&Tensor>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let e = check(f, z, b, residual, dropout)?;
    let mut inputs = vec![f.contiguous()?, z.contiguous()?, b.contiguous()?];
    inputs.extend(residual.map(Tensor::contiguous).transpose()?);
    #[cfg(feature = "cuda")]
    if f.device().is_cuda() {
        let plan = super::cuda::gate_forward_plan(&e, residual.is_some(), f.dtype())?;
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let module = crate::cuda::EPILOGUE;
        let mut out = crate::cuda::launch_tensors(module, &plan, f.dtype(), &refs, &[f.dims()])?;
        return Ok(out.remove(0));
    }
    fn run<F: WithDType + Float>(e: &Epilogue, x: &[Tensor], dims: &[usize]) -> Result<Tensor> {
        let guards: Vec<_> = x.iter().map(|t| t.storage_and_layout()).collect();
        let mut v = Vec::with_capacity(guards.len());
        for (s, l) in &guards {
            match &**s {
                Storage::Cpu(s) => v.push(contiguous::<F>(s, l)?),
                _ => bail!("gate: tensors are not all on the CPU"),
            }
        }
        let (f, z, b, r) = (v[0], v[1], v[2], v.get(3).copied());
        let feat = e.features;
        let out = e.map(|i, k| {
            let g = (f[i] * sigmoid(z[i] + b[i % feat])) * k;
            r.map_or(g, |r| r[i] + g)
        });
        Tensor::from_vec(out, dims, &Device::Cpu)
    }
    match f.dtype() {
        DType::F32 => run::<f32>(&e, &inputs, f.dims()),
        DType::F64 => run::<f64>(&e, &inputs, f.dims()),
        dt => bail!("gate: dtype {dt:?} is not supported (f32 or f64)"),
    }
}

/// [∂f, ∂z] of [`gate`] from the gradient `g` of its output (∂b is the sum of ∂z over all but
/// the last dimension; the residual's gradient is `g`).
pub fn gate_backward(
    f: &Tensor,
    z: &Tensor,
    b: &Tensor,
    dropout: Option<Dropout>,
    g: &Tensor,
) -> Result<[Tensor; 2]> {
    let e = check(f, z, b, Some(g), dropout)?;
    let inputs = [f, z, b, g].map(Tensor::contiguous);
    let [f, z, b, g] = inputs;
    let (f, z, b, g) = (f?, z?, b?, g?);
    #[cfg(feature = "cuda")]
    if f.device().is_cuda() {
        let plan = super::cuda::gate_backward_plan(&e, f.dtype())?;
        let module = crate::cuda::EPILOGUE;
        let dims = f.dims();
        let out = crate::cuda::launch_tensors(
            module,
            &plan,
            f.dtype(),
            &[&f, &z, &b, &g],
            &[dims, dims],
        )?;
        let [df, dz] = <[Tensor; 2]>::try_from(out)
            .map_err(|_| candle_core::Error::Msg("gate backward: two outputs".into()))?;
        return Ok([df, dz]);
    }
    fn run<F: WithDType + Float>(e: &Epilogue, x: [&Tensor; 4]) -> Result<[Tensor; 2]> {
        let guards = x.map(|t| t.storage_and_layout());
        let mut v = Vec::with_capacity(4);
        for (s, l) in &guards {
            match &**s {
                Storage::Cpu(s) => v.push(contiguous::<F>(s, l)?),
                _ => bail!("gate backward: tensors are not all on the CPU"),
            }
        }
        let (f, z, b, g, feat) = (v[0], v[1], v[2], v[3], e.features);
        let s = |i: usize| sigmoid(z[i] + b[i % feat]);
        let df = e.map(|i, k| (g[i] * k) * s(i));
        let dz = e.map(|i, k| {
            let si = s(i);
            ((g[i] * k) * f[i]) * (si * (F::one() - si))
        });
        let dims = x[0].dims();
        Ok([
            Tensor::from_vec(df, dims, &Device::Cpu)?,
            Tensor::from_vec(dz, dims, &Device::Cpu)?,
        ])
    }
    match f.dtype() {
        DType::F32 => run::<f32>(&e, [&f, &z, &b, &g]),
        DType::F64 => run::<f64>(&e, [&f, &z, &b, &g]),
        dt => bail!("gate backward: dtype {dt:?} is not supported (f32 or f64)"),
    }
}

/// The call's [`Epilogue`] after checking the operands: `other` (the residual, or ∂out) of f's
/// shape, z of f's shape, b (features), one dtype and device.
fn check(
    f: &Tensor,
    z: &Tensor,
    b: &Tensor,
    other: Option<&Tensor>,
    dropout: Option<Dropout>,
) -> Result<Epilogue> {
    let dims = f.dims();
    if dims.len() < 2 {
        bail!("gate: the input must have a sample and a feature dimension, got {dims:?}");
    }
    let features = dims[dims.len() - 1];
    let same = |t: &Tensor| t.dtype() == f.dtype() && t.device().same_device(f.device());
    let fits = z.dims() == dims
        && b.dims() == [features]
        && other.is_none_or(|t| t.dims() == dims && same(t))
        && same(z)
        && same(b);
    if !fits {
        bail!(
            "gate: f {dims:?}, z {:?}, b {:?} and {:?}: expected f and z of one shape, b \
             (features) and the residual or gradient of f's shape, one dtype and device",
            z.dims(),
            b.dims(),
            other.map(Tensor::dims)
        );
    }
    if let Some(d) = dropout {
        if !(0.0..1.0).contains(&d.p) {
            bail!("gate: the dropout rate must be in [0, 1), got {}", d.p);
        }
    }
    if !(f.device().is_cpu() || f.device().is_cuda()) {
        bail!("gate: device {:?} is not supported", f.device().location());
    }
    Ok(Epilogue::new(dims, Activation::Identity, dropout))
}
