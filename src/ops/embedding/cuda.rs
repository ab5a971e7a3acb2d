//! The launches of `kernels/embedding.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use super::{LANES, STAGE};
use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// The most column blocks of the backward (a grid's y dimension).
const MAX_COLUMN_BLOCKS: usize = 65_535;

/// `embedding_fwd`: inputs the ids (n, as values of `dtype`) and W (vocab, h); output (n, h).
pub fn forward_plan(n: usize, h: usize, vocab: usize, dtype: DType) -> Result<LaunchPlan> {
    plan(
        "embedding_fwd",
        n,
        h,
        vocab,
        dtype,
        [element_blocks(n * h), 1, 1],
        ELEMENT_THREADS,
    )
    .map(|p| LaunchPlan {
        outputs: vec![n * h],
        ..p
    })
}

/// `embedding_bwd`: inputs the ids (n) and ∂y (n, h); output ∂W (vocab, h). One block per row
/// of ∂W and 32 columns.
pub fn backward_plan(n: usize, h: usize, vocab: usize, dtype: DType) -> Result<LaunchPlan> {
    let columns = h.div_ceil(LANES);
    if columns > MAX_COLUMN_BLOCKS || vocab == 0 {
        candle_core::bail!("embedding: a table of {vocab} rows of {h} has no backward launch");
    }
    plan(
        "embedding_bwd",
        n,
        h,
        vocab,
        dtype,
        [vocab as u32, columns as u32, 1],
        STAGE as u32,
    )
    .map(|p| LaunchPlan {
        outputs: vec![vocab * h],
        ..p
    })
}

fn plan(
    stem: &str,
    n: usize,
    h: usize,
    vocab: usize,
    dtype: DType,
    grid: [u32; 3],
    threads: u32,
) -> Result<LaunchPlan> {
    let int = |what, v| int_arg("embedding", what, v).map(KernelArg::I32);
    int("size", n * h)?;
    int("table size", vocab * h)?;
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid,
        block: [threads, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Output(0),
            int("positions", n)?,
            int("width", h)?,
            int("vocabulary", vocab)?,
        ],
        outputs: vec![],
        tables: vec![],
        workspace_bytes: 0,
    })
}
