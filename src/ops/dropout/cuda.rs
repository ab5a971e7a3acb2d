//! The launch of `kernels/dropout.cu`: its plan (a pure function, executed by the CUDA launch
//! below and by the host harness in `tests/kernels_on_cpu`) and, with the `cuda` feature, its
//! execution on candle's stream.

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

/// Threads per block (DROPOUT_THREADS in the kernel).
pub const THREADS: u32 = 256;
/// The most blocks a launch uses; each thread takes every (grid × block)-th entry.
const MAX_BLOCKS: usize = 4096;

/// `dropout_keep`: no inputs, one output of rows × features entries (see
/// [`super::dropout_keep`]).
pub fn keep_plan(
    rows: usize,
    features: usize,
    site_hash: u64,
    first_row: u64,
    p: f64,
    dtype: DType,
) -> Result<LaunchPlan> {
    let n = rows * features;
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    Ok(LaunchPlan {
        kernel: kernel_name("dropout_keep", dtype, false)?,
        grid: [blocks as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Output(0),
            KernelArg::I32(int_arg("dropout", "rows", rows)?),
            KernelArg::I32(int_arg("dropout", "features", features)?),
            KernelArg::U64(site_hash),
            KernelArg::U64(first_row),
            KernelArg::U64(super::threshold(p)),
        ],
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}

#[cfg(feature = "cuda")]
pub(super) use launch::launch_keep;

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, DType, Result, Storage, Tensor};

    use crate::cuda::{self, DROPOUT};
    use crate::ops::plan::LaunchPlan;

    pub(in crate::ops::dropout) fn launch_keep(
        dev: &CudaDevice,
        plan: &LaunchPlan,
        dtype: DType,
        shape: (usize, usize),
    ) -> Result<Tensor> {
        let mut out = cuda::launch(dev, DROPOUT, plan, dtype, &[])?;
        let keep = Storage::Cuda(out.remove(0));
        Ok(Tensor::from_storage(keep, shape, BackpropOp::none(), false))
    }
}
