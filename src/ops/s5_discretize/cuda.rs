//! The launches of `kernels/s5_discretize.cu`: plans (pure functions, executed by the CUDA
//! launch and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use super::{S5Discretization, THREADS};
use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

fn plan(
    stem: &str,
    inputs: usize,
    p: usize,
    h: usize,
    how: S5Discretization,
    dtype: DType,
    out: usize,
) -> Result<LaunchPlan> {
    let mut args: Vec<KernelArg> = (0..inputs).map(KernelArg::Input).collect();
    args.extend([
        KernelArg::Output(0),
        KernelArg::I32(int_arg("s5_discretize", "state size", p)?),
        KernelArg::I32(int_arg("s5_discretize", "width", h)?),
        KernelArg::I32(how.bilinear as i32),
        KernelArg::I32(how.clip_eigs as i32),
    ]);
    int_arg("s5_discretize", "output size", out)?;
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [p.max(1) as u32, 1, 1],
        block: [THREADS as u32, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![out],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `s5_discretize_fwd`: inputs λ_re, λ_im, log Δ (P each) and B̃ (P, H, 2); output
/// [Λ̄ (P, 2) | B̄ (H, 2P)].
pub fn forward_plan(p: usize, h: usize, how: S5Discretization, dtype: DType) -> Result<LaunchPlan> {
    plan("s5_discretize_fwd", 4, p, h, how, dtype, 2 * p + 2 * p * h)
}

/// `s5_discretize_bwd`: inputs λ_re, λ_im, log Δ, B̃ and the gradients of Λ̄ (P, 2) and B̄
/// (H, 2P); output [∂λ_re | ∂λ_im | ∂log Δ | ∂B̃ (P, H, 2)].
pub fn backward_plan(
    p: usize,
    h: usize,
    how: S5Discretization,
    dtype: DType,
) -> Result<LaunchPlan> {
    plan("s5_discretize_bwd", 6, p, h, how, dtype, 3 * p + 2 * p * h)
}
