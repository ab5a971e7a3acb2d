//! The launch of `kernels/adamw.cu`: its plan (a pure function, executed by the CUDA launch,
//! `crate::cuda::launch_tensors`, and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

/// Threads per block (ADAMW_THREADS in the kernel).
pub const THREADS: u32 = 256;
/// The most blocks a launch uses; each thread takes every (grid × block)-th element.
const MAX_BLOCKS: usize = 4096;

/// `adamw_step`: inputs θ, m, v, g, the clipping scale (when `scaled`) and the hyper-parameter
/// row; one output of 3 n values.
pub fn step_plan(n: usize, scaled: bool, dtype: DType) -> Result<LaunchPlan> {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    let mut args: Vec<KernelArg> = (0..4).map(KernelArg::Input).collect();
    args.push(match scaled {
        true => KernelArg::Input(4),
        false => KernelArg::Null,
    });
    args.push(KernelArg::Input(4 + scaled as usize));
    args.push(KernelArg::Output(0));
    args.push(KernelArg::I32(int_arg("adamw", "parameter size", n)?));
    Ok(LaunchPlan {
        kernel: kernel_name("adamw_step", dtype, false)?,
        grid: [blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![3 * n],
        tables: vec![],
        workspace_bytes: 0,
    })
}
