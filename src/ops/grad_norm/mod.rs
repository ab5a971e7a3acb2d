//! The global gradient norm ‖g‖₂ = √(Σ_p Σ_e g_{p,e}²) over a model's gradients, on the CPU and
//! on CUDA (`kernels/grad_norm.cu`, whose twin is the arithmetic here): one launch of partial
//! sums per 32 gradients and one that adds them, where candle takes a square, a sum, a cast
//! and an add per parameter (about 90 launches for S5 at the default size, in every captured
//! training step, which takes the norm each step). The sums run in the kernels' order: per
//! thread over its elements in order, then the block's threads in a fixed tree.

use candle_core::{bail, DType, Device, Result, Storage, Tensor};
use num_traits::Float;
use rayon::prelude::*;

pub mod cuda;

use super::value::contiguous;
use cuda::{blocks_for, SEGMENTS, THREADS};

/// ‖g‖₂ over `grads`, all f32 or all f64 on one device (the CPU or CUDA): a scalar of their
/// dtype.
pub fn grad_norm(grads: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = grads.first() else {
        bail!("grad_norm: no gradients")
    };
    let (dtype, device) = (first.dtype(), first.device());
    if !matches!(dtype, DType::F32 | DType::F64) {
        bail!("grad_norm: gradients of dtype {dtype:?} (f32 or f64)");
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
                DType::F32 => Tensor::new(norm_cpu::<f32>(grads)?, device)?,
                _ => Tensor::new(norm_cpu::<f64>(grads)?, device)?,
            };
            Ok(norm)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            use crate::cuda::{launch_tensors, GRAD_NORM};
            let sizes: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
            let mut parts = Vec::new();
            for plan in cuda::parts_plans(&sizes, dtype)? {
                let shape = [plan.outputs[0]];
                parts.extend(launch_tensors(GRAD_NORM, &plan, dtype, grads, &[&shape])?);
            }
            let parts = match parts.len() {
                1 => parts.remove(0),
                _ => Tensor::cat(&parts, 0)?,
            };
            let plan = cuda::sum_plan(parts.elem_count(), dtype)?;
            launch_tensors(GRAD_NORM, &plan, dtype, &[&parts], &[&[]])?
                .remove(0)
                .reshape(())
        }
        _ => bail!("grad_norm: gradients on {device:?} (the CPU or CUDA)"),
    }
}

/// The norm on the CPU, read in place (no tensor is made for a contiguous gradient).
fn norm_cpu<F: candle_core::WithDType + Float + Send + Sync>(grads: &[&Tensor]) -> Result<F> {
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| g.contiguous())
        .collect::<Result<_>>()?;
    let held: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
    let mut slices: Vec<&[F]> = Vec::with_capacity(held.len());
    for (s, l) in &held {
        let Storage::Cpu(s) = &**s else {
            bail!("grad_norm: a gradient is not on the CPU")
        };
        slices.push(contiguous(s, l)?);
    }
    Ok(sum_cpu(&parts_cpu(&slices)))
}

/// The CPU twin of `grad_norm_parts` over all the launches: the partial sums of squares in the
/// order the launches' outputs are joined.
pub fn parts_cpu<F: Float + Send + Sync>(grads: &[&[F]]) -> Vec<F> {
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
                    acc = acc + g[e] * g[e];
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
