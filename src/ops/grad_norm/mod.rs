//! The global gradient norm ‖g‖₂ = √(Σ_p Σ_e g_{p,e}²) over a model's gradients, on the CPU and
//! on CUDA (`kernels/grad_norm.cu`, whose twin is the arithmetic here): one launch of partial
//! sums per 32 gradients and one that adds them, where candle takes a square, a sum, a cast
//! and an add per parameter (about 90 launches for S5 at the default size, in every captured
//! training step, which takes the norm each step). The sums run in the kernels' order: per
//! thread over its elements in order, then the block's threads in a fixed tree. f16 and bf16
//! gradients (a mixed-precision step's) are read into f32 and summed there.

use candle_core::{bail, DType, Device, Result, Storage, Tensor};
use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

pub mod cuda;

use super::value::contiguous;
use cuda::{blocks_for, SEGMENTS, THREADS};

/// ‖g‖₂ over `grads`, all of one dtype (f32, f64, f16 or bf16) on one device (the CPU or
/// CUDA): a scalar of [`cuda::sums_dtype`] (f64 for f64 gradients, else f32).
pub fn grad_norm(grads: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = grads.first() else {
        bail!("grad_norm: no gradients")
    };
    let (dtype, device) = (first.dtype(), first.device());
    if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        bail!("grad_norm: gradients of dtype {dtype:?} (f32, f64, f16 or bf16)");
    }
    if let Some(k) = grads
        .iter()
        .position(|g| g.dtype() != dtype || !g.device().same_device(device))
    {
        bail!("grad_norm: gradient {k} is not of the first one's dtype and device");
    }
    match device {
        Device::Cpu => {
            let norm = match dtype {
                DType::F64 => Tensor::new(norm_cpu::<f64, f64>(grads, |x| x)?, device)?,
                DType::F32 => Tensor::new(norm_cpu::<f32, f32>(grads, |x| x)?, device)?,
                // Widened to f32 (exactly), then the f32 twin: the kernel's arithmetic.
                DType::F16 => Tensor::new(norm_cpu::<f16, f32>(grads, f16::to_f32)?, device)?,
                _ => Tensor::new(norm_cpu::<bf16, f32>(grads, bf16::to_f32)?, device)?,
            };
            Ok(norm)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            use crate::cuda::{launch_tensors, launch_tensors_into, GRAD_NORM};
            let sums = cuda::sums_dtype(dtype);
            let sizes: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
            let mut parts = Vec::new();
            for plan in cuda::parts_plans(&sizes, dtype)? {
                let shape = [plan.outputs[0]];
                parts.extend(launch_tensors_into(
                    GRAD_NORM,
                    &plan,
                    sums,
                    grads,
                    &[&shape],
                )?);
            }
            let parts = match parts.len() {
                1 => parts.remove(0),
                _ => Tensor::cat(&parts, 0)?,
            };
            let plan = cuda::sum_plan(parts.elem_count(), sums)?;
            launch_tensors(GRAD_NORM, &plan, sums, &[&parts], &[&[]])?
                .remove(0)
                .reshape(())
        }
        _ => bail!("grad_norm: gradients on {device:?} (the CPU or CUDA)"),
    }
}

/// The norm on the CPU of gradients stored as `T`, each value read into `F` by `load` (read
/// in place: no tensor is made for a contiguous gradient).
fn norm_cpu<T, F>(grads: &[&Tensor], load: fn(T) -> F) -> Result<F>
where
    T: candle_core::WithDType,
    F: Float + Send + Sync,
{
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| g.contiguous())
        .collect::<Result<_>>()?;
    let held: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
    let mut slices: Vec<&[T]> = Vec::with_capacity(held.len());
    for (s, l) in &held {
        let Storage::Cpu(s) = &**s else {
            bail!("grad_norm: a gradient is not on the CPU")
        };
        slices.push(contiguous(s, l)?);
    }
    Ok(sum_cpu(&parts_cpu(&slices, load)))
}

/// The CPU twin of `grad_norm_parts` over all the launches: the partial sums of squares in the
/// order the launches' outputs are joined, each stored value read into `F` by `load` (the
/// kernel's `to_acc`).
pub fn parts_cpu<T: Copy + Sync, F: Float + Send + Sync>(
    grads: &[&[T]],
    load: impl Fn(T) -> F + Sync,
) -> Vec<F> {
    let mut parts = Vec::new();
    for launch in grads.chunks(SEGMENTS) {
        let blocks = blocks_for(launch.iter().map(|g| g.len()).max().unwrap_or(0));
        let stride = blocks * THREADS;
        let work: Vec<(usize, usize)> = (0..launch.len())
            .flat_map(|p| (0..blocks).map(move |b| (p, b)))
            .collect();
        parts.par_extend(work.into_par_iter().map(|(p, b)| {
            let g = launch[p];
            block_sum(|t| {
                let mut acc = F::zero();
                let mut e = b * THREADS + t;
                while e < g.len() {
                    let x = load(g[e]);
                    acc = acc + x * x;
                    e += stride;
                }
                acc
            })
        }));
    }
    parts
}

/// The CPU twin of `grad_norm_sum`: √ of the partial sums added as the kernel adds them.
pub fn sum_cpu<F: Float>(parts: &[F]) -> F {
    block_sum(|t| {
        (t..parts.len())
            .step_by(THREADS)
            .fold(F::zero(), |acc, i| acc + parts[i])
    })
    .sqrt()
}

/// The sum of `thread(t)` over a block's threads, in the kernels' tree: pairs (t, t + s) for
/// s = 128, 64, ..., 1.
fn block_sum<F: Float>(thread: impl Fn(usize) -> F) -> F {
    let mut red: Vec<F> = (0..THREADS).map(thread).collect();
    let mut s = THREADS / 2;
    while s > 0 {
        for t in 0..s {
            red[t] = red[t] + red[t + s];
        }
        s /= 2;
    }
    red[0]
}
