//! The row layout of the kernels over (rows, h) tensors with per-column parameters
//! (`kernels/rows.cuh`: LayerNorm, the channel ops), and its CPU twin: block k of the grid takes
//! a contiguous run of rows, [`LANES`] threads per row; sums along a row add per lane
//! (columns ≡ lane mod [`LANES`]) and then the lanes in order; sums over rows (parameter
//! gradients) add per slot (row mod [`SLOTS`] within the block), then the slots in order
//! into one partial row per block, then the blocks in order. The CPU runs each block as a rayon
//! task and adds in the same orders, so both devices give the same sums.

use num_traits::Float;
use rayon::prelude::*;

use super::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use candle_core::{DType, Device, Result, Tensor, D};

/// Threads per block (ROWS_THREADS in `kernels/rows.cuh`).
pub const THREADS: u32 = 256;
/// Threads per row (ROWS_LANES).
pub const LANES: usize = 32;
/// Rows a block takes at a time (ROWS_SLOTS).
pub const SLOTS: usize = THREADS as usize / LANES;
/// The most blocks a row launch uses (and partial rows a column sum adds).
const MAX_BLOCKS: usize = 1024;
/// Threads per block of the element-wise kernels.
pub const ELEMENT_THREADS: u32 = 256;

/// How `rows` rows are cut into blocks: `blocks` runs of `per_block` rows (a multiple of
/// [`SLOTS`]; the last run may be shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSplit {
    pub blocks: usize,
    pub per_block: usize,
}

impl RowSplit {
    pub fn new(rows: usize) -> Self {
        let blocks = rows.div_ceil(SLOTS).clamp(1, MAX_BLOCKS);
        let per_block = rows.div_ceil(blocks).div_ceil(SLOTS).max(1) * SLOTS;
        RowSplit {
            blocks: rows.div_ceil(per_block).max(1),
            per_block,
        }
    }
}

/// Σᵢ f(i) for i in 0..h, added as the kernels add along a row.
#[inline(always)]
pub fn lane_sum<F: Float>(h: usize, f: impl Fn(usize) -> F) -> F {
    let mut lanes = [F::zero(); LANES];
    for i in 0..h {
        lanes[i % LANES] = lanes[i % LANES] + f(i);
    }
    add_lanes(&lanes)
}

/// The lanes' partial sums added in lane order, as the kernels end a sum along a row.
#[inline(always)]
pub fn add_lanes<F: Float>(lanes: &[F; LANES]) -> F {
    lanes.iter().fold(F::zero(), |s, &v| s + v)
}

/// Runs `row(r, out_row, acc)` for every row r of `rows` — `out_row`: row r of `out` (h values,
/// empty when `out` is), `acc`: the `n` column accumulators of r's slot — block by block as
/// the kernels do, and returns the column sums over all rows in the kernels' order.
pub fn column_sums<F: Float + Send + Sync>(
    rows: usize,
    h: usize,
    n: usize,
    out: &mut [F],
    row: impl Fn(usize, &mut [F], &mut [F]) + Sync,
) -> Vec<F> {
    let split = RowSplit::new(rows);
    let per = split.per_block;
    let block = |k: usize, chunk: &mut [F]| -> Vec<F> {
        let mut acc = vec![F::zero(); SLOTS * n];
        let first = k * per;
        for r in first..(first + per).min(rows) {
            let s = (r - first) % SLOTS;
            let o = if chunk.is_empty() {
                &mut []
            } else {
                &mut chunk[(r - first) * h..(r - first + 1) * h]
            };
            row(r, o, &mut acc[s * n..(s + 1) * n]);
        }
        (0..n)
            .map(|i| (0..SLOTS).fold(F::zero(), |t, s| t + acc[s * n + i]))
            .collect()
    };
    let partials: Vec<Vec<F>> = if out.is_empty() {
        (0..split.blocks)
            .into_par_iter()
            .map(|k| block(k, &mut []))
            .collect()
    } else {
        out.par_chunks_mut(per * h)
            .enumerate()
            .map(|(k, chunk)| block(k, chunk))
            .collect()
    };
    (0..n)
        .map(|i| partials.iter().fold(F::zero(), |t, p| t + p[i]))
        .collect()
}

/// Whether a row op's fused kernels take `x`: on CUDA what the op's `cuda_supports(h, dtype)`
/// says of rows of `x`'s last dimension, on the CPU (the CPU twins) rows of any width in the
/// dtypes the kernels have; elsewhere the ops fall back to candle's.
pub fn fused_rows(x: &Tensor, cuda_supports: fn(usize, DType) -> bool) -> Result<bool> {
    let h = x.dim(D::Minus1)?;
    Ok(match x.device() {
        Device::Cpu => cuda_supports(1, x.dtype()),
        Device::Cuda(_) => cuda_supports(h, x.dtype()),
        _ => false,
    })
}

/// Elements of `dtype` that hold `n` partial sums of a row launch, which the kernels keep in
/// the compute type (an f32 takes two f16/bf16 elements).
pub fn partial_elems(n: usize, dtype: DType) -> usize {
    match dtype {
        DType::F16 | DType::BF16 => 2 * n,
        _ => n,
    }
}

/// Shared memory of a row launch that accumulates `n` column sums per slot, in the compute
/// type (f64 for f64, f32 otherwise).
pub fn slot_sums_bytes(n: usize, dtype: DType) -> usize {
    let acc = if dtype == DType::F64 { 8 } else { 4 };
    SLOTS * n * acc
}

/// Grid size of an element-wise kernel over `n` elements (grid-strided above 4,096 blocks).
pub fn element_blocks(n: usize) -> u32 {
    n.div_ceil(ELEMENT_THREADS as usize).clamp(1, 4096) as u32
}

/// The launch adding `blocks` partial rows of `n` values (`{stem}_sums`): input 0 the
/// partials, output 0 the sums.
pub fn sums_plan(
    op: &str,
    stem: &str,
    blocks: usize,
    n: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: kernel_name(&format!("{stem}_sums"), dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::I32(int_arg(op, "blocks", blocks)?),
            KernelArg::I32(int_arg(op, "columns", n)?),
        ],
        outputs: vec![n],
        tables: vec![],
        workspace_bytes: 0,
    })
}
