//! The launches of `kernels/layer_norm.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::ops::rows::{partial_elems, slot_sums_bytes, sums_plan, RowSplit, THREADS};

/// The backward's shared memory: the slots' [∂w | ∂b] accumulators, in the compute type.
fn backward_shared(h: usize, dtype: DType) -> usize {
    slot_sums_bytes(2 * h, dtype)
}

/// Whether the kernels take rows of `h` values in `dtype` (f32, f64, f16 or bf16, and the
/// backward's accumulators within the shared memory every GPU grants a block).
pub fn supports(h: usize, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        && h > 0
        && backward_shared(h, dtype) <= DeviceLimits::DEFAULT_SHARED
}

fn row_args(rows: usize, split: RowSplit, h: usize, eps: f64) -> Result<[KernelArg; 4]> {
    Ok([
        KernelArg::I32(int_arg("layer_norm", "rows", rows)?),
        KernelArg::I32(int_arg("layer_norm", "rows per block", split.per_block)?),
        KernelArg::I32(int_arg("layer_norm", "width", h)?),
        KernelArg::U64(eps.to_bits()),
    ])
}

/// `layer_norm_fwd`: inputs x (rows, h), w, b; output y.
pub fn forward_plan(rows: usize, h: usize, eps: f64, dtype: DType) -> Result<LaunchPlan> {
    let split = RowSplit::new(rows);
    let mut args = vec![
        KernelArg::Input(0),
        KernelArg::Input(1),
        KernelArg::Input(2),
        KernelArg::Output(0),
    ];
    args.extend(row_args(rows, split, h, eps)?);
    Ok(LaunchPlan {
        kernel: kernel_name("layer_norm_fwd", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![rows * h],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `layer_norm_bwd` (inputs x, w, ∂y; outputs ∂x and the blocks' partial [∂w | ∂b] rows) and
/// `layer_norm_sums` (input the partials; output [∂w | ∂b]).
pub fn backward_plans(rows: usize, h: usize, eps: f64, dtype: DType) -> Result<[LaunchPlan; 2]> {
    let split = RowSplit::new(rows);
    let mut args = vec![
        KernelArg::Input(0),
        KernelArg::Input(1),
        KernelArg::Input(2),
        KernelArg::Output(0),
        KernelArg::Output(1),
    ];
    args.extend(row_args(rows, split, h, eps)?);
    let rows_plan = LaunchPlan {
        kernel: kernel_name("layer_norm_bwd", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: backward_shared(h, dtype),
        args,
        outputs: vec![rows * h, partial_elems(split.blocks * 2 * h, dtype)],
        tables: vec![],
        workspace_bytes: 0,
    };
    let sums = sums_plan("layer_norm", "layer_norm", split.blocks, 2 * h, dtype)?;
    Ok([rows_plan, sums])
}
