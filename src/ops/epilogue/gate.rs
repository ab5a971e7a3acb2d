//! The gated epilogue of the GLU activations as one op each way (`gate_fwd`, `gate_bwd` in
//! `kernels/epilogue.cu`; the CPU twins here): on f, z of shape (samples, …, features) and a
//! bias b per feature,
//!
//!   out = r + k ⊙ (f ⊙ s),  s = σ(z + b),
//!   ∂f = (∂out ⊙ k) ⊙ s,  ∂z = ((∂out ⊙ k) ⊙ f) ⊙ (s ⊙ (1 − s)),  ∂b = Σ ∂z,  ∂r = ∂out,
//!
//! with k the epilogue's dropout factor ([`super::Dropout`]) and r the residual (optional). In
//! candle ops this is a bias, a sigmoid, a product and the epilogue forward, and six ops
//! backward; for the blocks whose backward is written by hand, in every float dtype (f16 and
//! bf16 computed in f32).

use candle_core::{bail, DType, Device, Result, Storage, Tensor, WithDType};
use num_traits::Float;

use rayon::prelude::*;

use super::{Activation, Dropout, Epilogue, PER_TASK};
use crate::ops::value::{contiguous, is_half, narrowed_tensor, widened_values};

/// σ(x) as the kernel computes it.
fn sigmoid<F: Float>(x: F) -> F {
    F::one() / ((-x).exp() + F::one())
}

/// [r + k ⊙ (f ⊙ s), s] with s = σ(z + b) (see the module docs; [`gate_backward`] reads s): f, z
/// and `residual` of one shape (samples, …, features), b (features), one float dtype, on the
/// CPU or CUDA.
pub fn gate(
    f: &Tensor,
    z: &Tensor,
    b: &Tensor,
    residual: Option<&Tensor>,
    dropout: Option<Dropout>,
) -> Result<[Tensor; 2]> {
    let e = check(f, z, Some(b), residual, dropout)?;
    let mut inputs = vec![f.contiguous()?, z.contiguous()?, b.contiguous()?];
    inputs.extend(residual.map(Tensor::contiguous).transpose()?);
    let dims = f.dims();
    #[cfg(feature = "cuda")]
    if f.device().is_cuda() {
        let plan = super::cuda::gate_forward_plan(&e, residual.is_some(), f.dtype())?;
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = crate::cuda::launch_tensors(EPILOGUE, &plan, f.dtype(), &refs, &[dims, dims])?;
        return two(out);
    }
    fn run<F: WithDType + Float>(e: &Epilogue, v: &[&[F]]) -> [Vec<F>; 2] {
        let (f, z, b, r) = (v[0], v[1], v[2], v.get(3).copied());
        let (k, per, feat) = (e.factors::<F>(), e.per_sample, e.features);
        let (mut out, mut gate) = (vec![F::zero(); f.len()], vec![F::zero(); f.len()]);
        out.par_chunks_mut(PER_TASK)
            .zip(gate.par_chunks_mut(PER_TASK))
            .enumerate()
            .for_each(|(c, (out, gate))| {
                for (j, (o, g)) in out.iter_mut().zip(gate.iter_mut()).enumerate() {
                    let i = c * PER_TASK + j;
                    let ki = k
                        .as_ref()
                        .map_or(F::one(), |k| k[i / per * feat + i % feat]);
                    let s = sigmoid(z[i] + b[i % feat]);
                    let v = (f[i] * s) * ki;
                    *o = r.map_or(v, |r| r[i] + v);
                    *g = s;
                }
            });
        [out, gate]
    }
    on_cpu(&inputs, dims, |v| run(&e, v), |v| run(&e, v))
}

/// [∂f, ∂z] of [`gate`] from f, its s and the gradient `g` of its output (∂b is the sum of ∂z
/// over all but the last dimension; the residual's gradient is `g`).
pub fn gate_backward(
    f: &Tensor,
    s: &Tensor,
    dropout: Option<Dropout>,
    g: &Tensor,
) -> Result<[Tensor; 2]> {
    let e = check(f, s, None, Some(g), dropout)?;
    let inputs = [f, s, g].map(Tensor::contiguous);
    let [f, s, g] = inputs;
    let x = [f?, s?, g?];
    let dims = x[0].dims();
    #[cfg(feature = "cuda")]
    if x[0].device().is_cuda() {
        let plan = super::cuda::gate_backward_plan(&e, x[0].dtype())?;
        let refs = [&x[0], &x[1], &x[2]];
        let out = crate::cuda::launch_tensors(EPILOGUE, &plan, x[0].dtype(), &refs, &[dims, dims])?;
        return two(out);
    }
    fn run<F: WithDType + Float>(e: &Epilogue, v: &[&[F]]) -> [Vec<F>; 2] {
        let (f, s, g) = (v[0], v[1], v[2]);
        let (k, per, feat) = (e.factors::<F>(), e.per_sample, e.features);
        let (mut df, mut dz) = (vec![F::zero(); f.len()], vec![F::zero(); f.len()]);
        df.par_chunks_mut(PER_TASK)
            .zip(dz.par_chunks_mut(PER_TASK))
            .enumerate()
            .for_each(|(c, (df, dz))| {
                for (j, (df, dz)) in df.iter_mut().zip(dz.iter_mut()).enumerate() {
                    let i = c * PER_TASK + j;
                    let ki = k
                        .as_ref()
                        .map_or(F::one(), |k| k[i / per * feat + i % feat]);
                    let gk = g[i] * ki;
                    *df = gk * s[i];
                    *dz = (gk * f[i]) * (s[i] * (F::one() - s[i]));
                }
            });
        [df, dz]
    }
    on_cpu(&x, dims, |v| run(&e, v), |v| run(&e, v))
}

/// Runs a CPU twin on the operands `x` (contiguous, one dtype) in their dtype, f16 and bf16
/// as the kernels compute them: widened to f32, the results rounded back.
fn on_cpu(
    x: &[Tensor],
    dims: &[usize],
    f32: impl Fn(&[&[f32]]) -> [Vec<f32>; 2],
    f64: impl Fn(&[&[f64]]) -> [Vec<f64>; 2],
) -> Result<[Tensor; 2]> {
    let guards: Vec<_> = x.iter().map(|t| t.storage_and_layout()).collect();
    let mut cpu = Vec::with_capacity(guards.len());
    for (s, l) in &guards {
        match &**s {
            Storage::Cpu(s) => cpu.push((s, *l)),
            _ => bail!("gate: tensors are not all on the CPU"),
        }
    }
    fn slices<'a, F: WithDType>(
        cpu: &[(&'a candle_core::CpuStorage, &'a candle_core::Layout)],
    ) -> Result<Vec<&'a [F]>> {
        cpu.iter().map(|(s, l)| contiguous::<F>(s, l)).collect()
    }
    fn tensors<F: WithDType>([a, b]: [Vec<F>; 2], dims: &[usize]) -> Result<[Tensor; 2]> {
        Ok([
            Tensor::from_vec(a, dims, &Device::Cpu)?,
            Tensor::from_vec(b, dims, &Device::Cpu)?,
        ])
    }
    match x[0].dtype() {
        DType::F32 => tensors(f32(&slices(&cpu)?), dims),
        DType::F64 => tensors(f64(&slices(&cpu)?), dims),
        dt if is_half(dt) => {
            let wide = cpu
                .iter()
                .map(|(s, l)| widened_values(s, l))
                .collect::<Result<Vec<_>>>()?;
            let [a, b] = f32(&wide.iter().map(Vec::as_slice).collect::<Vec<_>>());
            Ok([narrowed_tensor(a, dims, dt)?, narrowed_tensor(b, dims, dt)?])
        }
        dt => bail!("gate: dtype {dt:?} is not supported (f32, f64, f16 or bf16)"),
    }
}

#[cfg(feature = "cuda")]
fn two(out: Vec<Tensor>) -> Result<[Tensor; 2]> {
    <[Tensor; 2]>::try_from(out).map_err(|_| candle_core::Error::Msg("gate: two outputs".into()))
}

#[cfg(feature = "cuda")]
use crate::cuda::EPILOGUE;

/// The call's [`Epilogue`] after checking the operands: z (or s) of f's shape, b (features) where
/// given, `other` (the residual, or ∂out) of f's shape, one dtype and device.
fn check(
    f: &Tensor,
    z: &Tensor,
    b: Option<&Tensor>,
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
        && b.is_none_or(|b| b.dims() == [features] && same(b))
        && other.is_none_or(|t| t.dims() == dims && same(t))
        && same(z);
    if !fits {
        bail!(
            "gate: f {dims:?}, z {:?}, b {:?} and {:?}: expected f and z of one shape, b \
             (features) and the residual or gradient of f's shape, one dtype and device",
            z.dims(),
            b.map(Tensor::dims),
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
