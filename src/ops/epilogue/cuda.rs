//! The launches of `kernels/epilogue.cu`: plans (pure functions, executed by the CUDA launch and
//! by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use super::{Activation, Epilogue};
use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// `epilogue_fwd`: inputs y and, with `residual`, r; output r + k ⊙ act(y).
pub fn forward_plan(e: &Epilogue, residual: bool, dtype: DType) -> Result<LaunchPlan> {
    let second = match residual {
        true => KernelArg::Input(1),
        false => KernelArg::Null,
    };
    plan("epilogue_fwd", e, second, dtype)
}

/// `epilogue_bwd`: inputs y and ∂out; output ∂y.
pub fn backward_plan(e: &Epilogue, dtype: DType) -> Result<LaunchPlan> {
    plan("epilogue_bwd", e, KernelArg::Input(1), dtype)
}

fn plan(stem: &str, e: &Epilogue, second: KernelArg, dtype: DType) -> Result<LaunchPlan> {
    let n = e.samples * e.per_sample;
    let int = |what, v| int_arg("epilogue", what, v).map(KernelArg::I32);
    let drop = e.dropout.unwrap_or_default();
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            second,
            KernelArg::Output(0),
            int("size", n)?,
            int("sample size", e.per_sample)?,
            int("features", e.features)?,
            KernelArg::I32((e.activation == Activation::Gelu) as i32),
            KernelArg::I32(e.dropout.is_some() as i32),
            KernelArg::U64(drop.site_hash),
            KernelArg::U64(drop.first_row),
            KernelArg::U64(drop.threshold()),
            KernelArg::U64(drop.scale().to_bits()),
        ],
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}
