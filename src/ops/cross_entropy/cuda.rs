//! The launches of `kernels/cross_entropy.cu`: plans (pure functions, executed by the CUDA
//! launch and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// Threads of the forward's one block (CE_THREADS in the kernel).
pub const THREADS: u32 = 256;

fn ints(rows: usize, classes: usize) -> Result<[KernelArg; 2]> {
    int_arg("cross_entropy", "size", rows * classes + 2)?;
    Ok([
        KernelArg::I32(int_arg("cross_entropy", "rows", rows)?),
        KernelArg::I32(int_arg("cross_entropy", "classes", classes)?),
    ])
}

/// `cross_entropy_fwd`: inputs the logits (rows, classes) and the labels (rows); output
/// [logp | loss | correct] (rows · classes + 2).
pub fn forward_plan(rows: usize, classes: usize, dtype: DType) -> Result<LaunchPlan> {
    let mut args = vec![
        KernelArg::Input(0),
        KernelArg::Input(1),
        KernelArg::Output(0),
    ];
    args.extend(ints(rows, classes)?);
    Ok(LaunchPlan {
        kernel: kernel_name("cross_entropy_fwd", dtype, false)?,
        grid: [1, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![rows * classes + 2],
        tables: vec![],
        workspace_bytes: 0,
    })
}

/// `cross_entropy_bwd`: inputs logp (its first rows · classes values are read), the labels and
/// ∂loss (one value); output ∂logits (rows · classes).
pub fn backward_plan(rows: usize, classes: usize, dtype: DType) -> Result<LaunchPlan> {
    let mut args = vec![
        KernelArg::Input(0),
        KernelArg::Input(1),
        KernelArg::Input(2),
        KernelArg::Output(0),
    ];
    args.extend(ints(rows, classes)?);
    Ok(LaunchPlan {
        kernel: kernel_name("cross_entropy_bwd", dtype, false)?,
        grid: [element_blocks(rows * classes), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![rows * classes],
        tables: vec![],
        workspace_bytes: 0,
    })
}
