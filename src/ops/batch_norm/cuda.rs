//! The launches of `kernels/batch_norm.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`). `dtype` is the rows' (x, ∂y, y, ∂x, γ,
//! β, the running averages); the statistics, the partial sums included, are in
//! [`stats_dtype`]`(dtype)`, and the launches that write them allocate their outputs in it.

use candle_core::{DType, Result};

use super::stats_dtype;
use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::ops::rows::{
    element_blocks, slot_sums_bytes, sums_plan, RowSplit, ELEMENT_THREADS, THREADS,
};

/// Shared memory of the stats launches: the slots' accumulators of `width` columns.
fn stats_shared(width: usize, dtype: DType) -> usize {
    slot_sums_bytes(width, dtype)
}

/// Whether the kernels take rows of `h` values in `dtype` (f32, f64, f16 or bf16, and the
/// backward's [∂γ | ∂β] accumulators within the shared memory every GPU grants a block).
pub fn supports(h: usize, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        && h > 0
        && stats_shared(2 * h, dtype) <= DeviceLimits::DEFAULT_SHARED
}

fn ints(rows: usize, split: RowSplit, h: usize) -> Result<[KernelArg; 3]> {
    Ok([
        KernelArg::I32(int_arg("batch_norm", "rows", rows)?),
        KernelArg::I32(int_arg("batch_norm", "rows per block", split.per_block)?),
        KernelArg::I32(int_arg("batch_norm", "width", h)?),
    ])
}

/// `batch_norm_stats` (inputs x, then μ if `centred`; output the blocks' partial rows of Σx,
/// or of Σ(x − μ)²) and `batch_norm_sums` (input the partials; output the column sums), both
/// writing statistics.
pub fn stats_plans(rows: usize, h: usize, centred: bool, dtype: DType) -> Result<[LaunchPlan; 2]> {
    let split = RowSplit::new(rows);
    let mean = match centred {
        true => KernelArg::Input(1),
        false => KernelArg::Null,
    };
    let mut args = vec![KernelArg::Input(0), mean, KernelArg::Output(0)];
    args.extend(ints(rows, split, h)?);
    let stats = LaunchPlan {
        kernel: kernel_name("batch_norm_stats", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: stats_shared(h, dtype),
        args,
        outputs: vec![split.blocks * h],
        tables: vec![],
        workspace_bytes: 0,
    };
    let sums = sums_plan(
        "batch_norm",
        "batch_norm",
        split.blocks,
        h,
        stats_dtype(dtype),
    )?;
    Ok([stats, sums])
}

/// An element-wise launch over `n` values of rows of `h` with these pointer arguments.
fn elementwise(
    stem: &str,
    n: usize,
    h: usize,
    eps: f64,
    pointers: Vec<KernelArg>,
    dtype: DType,
) -> Result<LaunchPlan> {
    let mut args = pointers;
    args.extend([
        KernelArg::I32(int_arg("batch_norm", "size", n)?),
        KernelArg::I32(int_arg("batch_norm", "width", h)?),
        KernelArg::U64(eps.to_bits()),
    ]);
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `batch_norm_apply`: inputs x (n values, rows of h), μ, σ², γ, β; output y.
pub fn apply_plan(n: usize, h: usize, eps: f64, dtype: DType) -> Result<LaunchPlan> {
    let mut pointers: Vec<KernelArg> = (0..5).map(KernelArg::Input).collect();
    pointers.push(KernelArg::Output(0));
    elementwise("batch_norm_apply", n, h, eps, pointers, dtype)
}

/// `batch_norm_bwd_stats` (inputs x, μ, σ², ∂y; output the blocks' partial [∂γ | ∂β] rows)
/// and `batch_norm_pair` (input the partials; outputs ∂γ and ∂β), both writing statistics.
pub fn backward_stats_plans(
    rows: usize,
    h: usize,
    eps: f64,
    dtype: DType,
) -> Result<[LaunchPlan; 2]> {
    let split = RowSplit::new(rows);
    let mut args: Vec<KernelArg> = (0..4).map(KernelArg::Input).collect();
    args.push(KernelArg::Output(0));
    args.extend(ints(rows, split, h)?);
    args.push(KernelArg::U64(eps.to_bits()));
    let stats = LaunchPlan {
        kernel: kernel_name("batch_norm_bwd_stats", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: stats_shared(2 * h, dtype),
        args,
        outputs: vec![split.blocks * 2 * h],
        tables: vec![],
        workspace_bytes: 0,
    };
    let pair = LaunchPlan {
        kernel: kernel_name("batch_norm_pair", stats_dtype(dtype), false)?,
        grid: [element_blocks(2 * h), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::Output(1),
            KernelArg::I32(int_arg("batch_norm", "blocks", split.blocks)?),
            KernelArg::I32(int_arg("batch_norm", "width", h)?),
        ],
        outputs: vec![h, h],
        tables: vec![],
        workspace_bytes: 0,
    };
    Ok([stats, pair])
}

/// `batch_norm_bwd`: inputs x (n values, rows of h), μ, σ², γ, ∂y, the whole batch's ∂γ and
/// ∂β, its row count (one value); output ∂x.
pub fn backward_plan(n: usize, h: usize, eps: f64, dtype: DType) -> Result<LaunchPlan> {
    let mut pointers: Vec<KernelArg> = (0..8).map(KernelArg::Input).collect();
    pointers.push(KernelArg::Output(0));
    elementwise("batch_norm_bwd", n, h, eps, pointers, dtype)
}

/// `batch_norm_running`, in place: targets the running mean and variance (h values each),
/// inputs μ, σ² and the row count (one value); the decay by its bits.
pub fn running_plan(h: usize, decay: f64, dtype: DType) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: kernel_name("batch_norm_running", dtype, false)?,
        grid: [element_blocks(h), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Target(0),
            KernelArg::Target(1),
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Input(2),
            KernelArg::I32(int_arg("batch_norm", "width", h)?),
            KernelArg::U64(decay.to_bits()),
        ],
        outputs: vec![],
        tables: vec![],
        workspace_bytes: 0,
    })
}
