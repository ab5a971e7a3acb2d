//! The launches of `kernels/masked_mean.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// `masked_mean_fwd`: inputs h (batch, steps, features) and the lengths (batch); output
/// (batch, features).
pub fn forward_plan(
    batch: usize,
    steps: usize,
    features: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    plan(
        "masked_mean_fwd",
        batch,
        steps,
        features,
        batch * features,
        dtype,
    )
}

/// `masked_mean_bwd`: inputs ∂out (batch, features) and the lengths; output ∂h.
pub fn backward_plan(
    batch: usize,
    steps: usize,
    features: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    plan(
        "masked_mean_bwd",
        batch,
        steps,
        features,
        batch * steps * features,
        dtype,
    )
}

fn plan(
    stem: &str,
    batch: usize,
    steps: usize,
    features: usize,
    out: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    let int = |what, v| int_arg("masked_mean", what, v).map(KernelArg::I32);
    int("size", batch * steps * features)?;
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(out), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Output(0),
            int("batch", batch)?,
            int("steps", steps)?,
            int("features", features)?,
        ],
        outputs: vec![out],
        tables: vec![],
        workspace_bytes: 0,
    })
}
