//! The launches of `kernels/gather.cu`: plans (pure functions, executed by the CUDA launch and
//! by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan, Table};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

fn plan(
    stem: &str,
    out_rows: usize,
    n: usize,
    tables: Vec<Table>,
    dtype: DType,
) -> Result<LaunchPlan> {
    int_arg("gather", "size", out_rows * n)?;
    let mut args = vec![KernelArg::Input(0)];
    args.extend((0..tables.len()).map(KernelArg::Table));
    args.extend([
        KernelArg::Output(0),
        KernelArg::I32(int_arg("gather", "rows", out_rows)?),
        KernelArg::I32(int_arg("gather", "columns", n)?),
    ]);
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(out_rows * n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![out_rows * n],
        tables,
        workspace_bytes: 0,
    })
}

/// `gather_fwd`: input x (rows, n), table the index; output (index.len(), n).
pub fn forward_plan(index: &Table, n: usize, dtype: DType) -> Result<LaunchPlan> {
    plan("gather_fwd", index.len(), n, vec![index.clone()], dtype)
}

/// `gather_bwd`: input ∂y (len, n), tables the inverted index (`starts`, rows + 1 values, and
/// `positions`); output ∂x (rows, n).
pub fn backward_plan(
    starts: &Table,
    positions: &Table,
    n: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    let rows = starts.len().saturating_sub(1);
    plan(
        "gather_bwd",
        rows,
        n,
        vec![starts.clone(), positions.clone()],
        dtype,
    )
}
