//! The launches of `kernels/s5_readout.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// `s5_readout_fwd` (input C̃; output the (D·2P, H) matrices) or `s5_readout_bwd` (input their
/// gradient; output ∂C̃), `dirs` directions of `p` states, `h` channels, scale s.
pub fn plan(
    backward: bool,
    dirs: usize,
    p: usize,
    h: usize,
    scale: i32,
    dtype: DType,
) -> Result<LaunchPlan> {
    let n = dirs * 2 * p * h;
    let stem = if backward {
        "s5_readout_bwd"
    } else {
        "s5_readout_fwd"
    };
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::I32(int_arg("s5_readout", "directions", dirs)?),
            KernelArg::I32(int_arg("s5_readout", "state size", p)?),
            KernelArg::I32(int_arg("s5_readout", "width", h)?),
            KernelArg::I32(scale),
        ],
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}
