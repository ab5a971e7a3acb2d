//! The launches of `kernels/channel.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::ops::rows::{
    element_blocks, partial_elems, slot_sums_bytes, sums_plan, RowSplit, ELEMENT_THREADS, THREADS,
};

/// The backward's shared memory: the slots' accumulators of ∂p, in the compute type.
fn backward_shared(h: usize, dtype: DType) -> usize {
    slot_sums_bytes(h, dtype)
}

/// Whether the kernels take rows of `h` values in `dtype` (f32, f64, f16 or bf16, and the
/// backward's accumulators within the shared memory every GPU grants a block).
pub fn supports(h: usize, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        && h > 0
        && backward_shared(h, dtype) <= DeviceLimits::DEFAULT_SHARED
}

/// `channel_fwd`: inputs x (n values, rows of h) and p (h); output x + p or x ⊙ p.
pub fn forward_plan(n: usize, h: usize, mul: bool, dtype: DType) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: kernel_name("channel_fwd", dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Output(0),
            KernelArg::I32(int_arg("channel op", "size", n)?),
            KernelArg::I32(int_arg("channel op", "width", h)?),
            KernelArg::I32(mul as i32),
        ],
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `channel_bwd` (inputs x, p, ∂y; outputs ∂x for mul, then the blocks' partial rows of ∂p)
/// and `channel_sums` (input the partials; output ∂p).
pub fn backward_plans(rows: usize, h: usize, mul: bool, dtype: DType) -> Result<[LaunchPlan; 2]> {
    let split = RowSplit::new(rows);
    let (dx, part, outputs) = match mul {
        true => (
            KernelArg::Output(0),
            KernelArg::Output(1),
            vec![rows * h, partial_elems(split.blocks * h, dtype)],
        ),
        false => (
            KernelArg::Null,
            KernelArg::Output(0),
            vec![partial_elems(split.blocks * h, dtype)],
        ),
    };
    let rows_plan = LaunchPlan {
        kernel: kernel_name("channel_bwd", dtype, false)?,
        grid: [split.blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: backward_shared(h, dtype),
        args: vec![
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Input(2),
            dx,
            part,
            KernelArg::I32(int_arg("channel op", "rows", rows)?),
            KernelArg::I32(int_arg("channel op", "rows per block", split.per_block)?),
            KernelArg::I32(int_arg("channel op", "width", h)?),
            KernelArg::I32(mul as i32),
        ],
        outputs,
        tables: vec![],
        workspace_bytes: 0,
    };
    let sums = sums_plan("channel op", "channel", split.blocks, h, dtype)?;
    Ok([rows_plan, sums])
}
