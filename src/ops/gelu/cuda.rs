//! The launches of `kernels/gelu.cu`: plans (pure functions, executed by the CUDA launch and
//! by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// `gelu_fwd`: input x; output gelu(x), n values.
pub fn forward_plan(n: usize, dtype: DType) -> Result<LaunchPlan> {
    plan("gelu_fwd", 1, n, dtype)
}

/// `gelu_bwd`: inputs x and ∂y; output ∂x, n values.
pub fn backward_plan(n: usize, dtype: DType) -> Result<LaunchPlan> {
    plan("gelu_bwd", 2, n, dtype)
}

fn plan(stem: &str, inputs: usize, n: usize, dtype: DType) -> Result<LaunchPlan> {
    let mut args: Vec<KernelArg> = (0..inputs).map(KernelArg::Input).collect();
    args.push(KernelArg::Output(0));
    args.push(KernelArg::I32(int_arg("gelu", "size", n)?));
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
