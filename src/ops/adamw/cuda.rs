//! The launch of `kernels/adamw.cu`: its plan (a pure function, executed by the CUDA launch,
//! `crate::cuda::launch_in_place`, and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

/// Threads per block (ADAMW_THREADS in the kernel).
pub const THREADS: u32 = 256;
/// The most blocks a launch uses; each thread takes every (grid × block)-th element.
const MAX_BLOCKS: usize = 4096;

/// `adamw_step`: targets θ (n values) and [m; v] (2 n values); inputs the gradient (n) and the
/// hyper-parameter row.
pub fn step_plan(n: usize, dtype: DType) -> Result<LaunchPlan> {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    Ok(LaunchPlan {
        kernel: kernel_name("adamw_step", dtype, false)?,
        grid: [blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Target(0),
            KernelArg::Target(1),
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::I32(int_arg("adamw", "parameter size", n)?),
        ],
        outputs: vec![],
        tables: vec![],
        workspace_bytes: 0,
    })
}
