//! The launches of `kernels/s5_timed.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::ops::rows::{
    element_blocks, partial_elems, slot_sums_bytes, sums_plan, RowSplit, ELEMENT_THREADS, THREADS,
};
use crate::ops::S5Discretization;

const OP: &str = "s5_timed";

/// The backward's shared memory: the slots' accumulators of (∂λ_re, ∂λ_im, ∂log Δ).
fn backward_shared(p: usize, dtype: DType) -> usize {
    slot_sums_bytes(3 * p, dtype)
}

/// Whether the kernels take P states in `dtype` (f32 or f64, and the backward's accumulators
/// within the shared memory every GPU grants a block: P ≤ 512 in f32, 256 in f64).
pub fn supports(p: usize, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64)
        && p > 0
        && backward_shared(p, dtype) <= DeviceLimits::DEFAULT_SHARED
}

fn how_args(how: S5Discretization) -> [KernelArg; 2] {
    [
        KernelArg::I32(how.bilinear as i32),
        KernelArg::I32(how.clip_eigs as i32),
    ]
}

/// `s5_timed_fwd`: inputs λ_re, λ_im, log Δ (P each), dt (n) and bu (n, P, 2); output
/// [gate (n, P, 2) | v (n, P, 2)].
pub fn forward_plan(n: usize, p: usize, how: S5Discretization, dtype: DType) -> Result<LaunchPlan> {
    let size = int_arg(OP, "output size", 4 * n * p)?;
    let mut args: Vec<KernelArg> = (0..5).map(KernelArg::Input).collect();
    args.extend([
        KernelArg::Output(0),
        KernelArg::I32(int_arg(OP, "samples", n)?),
        KernelArg::I32(int_arg(OP, "state size", p)?),
    ]);
    args.extend(how_args(how));
    Ok(LaunchPlan {
        kernel: kernel_name("s5_timed_fwd", dtype, false)?,
        grid: [element_blocks(n * p), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![size as usize],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `s5_timed_bwd` (inputs λ_re, λ_im, log Δ, dt, bu and the gradients of gate and v; outputs
/// ∂bu (n, P, 2), then the blocks' partial rows of (∂λ_re | ∂λ_im | ∂log Δ)) and
/// `s5_timed_sums` (input the partials; output the 3P sums).
pub fn backward_plans(
    n: usize,
    p: usize,
    how: S5Discretization,
    dtype: DType,
) -> Result<[LaunchPlan; 2]> {
    if !supports(p, dtype) {
        candle_core::bail!("s5_timed: {p} states in {dtype:?} have no backward launch");
    }
    let split = RowSplit::new(n);
    int_arg(OP, "gradient size", 2 * n * p)?;
    int_arg(OP, "partial sums", split.blocks * 3 * p)?;
    let mut args: Vec<KernelArg> = (0..7).map(KernelArg::Input).collect();
    args.extend([
        KernelArg::Output(0),
        KernelArg::Output(1),
        KernelArg::I32(int_arg(OP, "samples", n)?),
        KernelArg::I32(int_arg(OP, "rows per block", split.per_block)?),
        KernelArg::I32(int_arg(OP, "state size", p)?),
    ]);
    args.extend(how_args(how));
    let rows = LaunchPlan {
        kernel: kernel_name("s5_timed_bwd", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: backward_shared(p, dtype),
        args,
        outputs: vec![2 * n * p, partial_elems(split.blocks * 3 * p, dtype)],
        tables: vec![],
        workspace_bytes: 0,
    };
    let sums = sums_plan(OP, "s5_timed", split.blocks, 3 * p, dtype)?;
    Ok([rows, sums])
}
