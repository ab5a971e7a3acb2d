//! The launches of `kernels/head_solve.cu`: their plans (pure functions, executed by the CUDA
//! launch below and by the host harness in `tests/kernels_on_cpu`) and, with the `cuda`
//! feature, their execution on candle's stream.
//!
//! Blocks of [`THREADS`] threads: lanes (consecutive heads) × rows. The forward is two
//! launches, `head_pivots` (a block per [`LANES`] heads) then `head_sweep` (a block per sample
//! and [`sweep_lanes`] heads); the backward three, `head_pivots` of the adjoint, `head_sweep`
//! of ∂x and `head_reduce` (a block per [`ROWS`] nodes and [`LANES`] heads). No workspace and
//! no shared memory: the sweep works in place in its output.
//!
//! Global traffic of a sweep per (sample, node, head) complex value: the right-hand side read
//! once, x written once and read and written again by each pass (the working set of a block,
//! nodes × 32 values, stays in L2); the pivots, read by every sample, stay in L2 too.

use candle_core::{bail, DType, Result, Tensor};

use super::{check_args, check_skew_args, Dims};
use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::tree::Tree;

/// Threads per block (HEAD_THREADS in the kernel), lanes × rows.
pub const THREADS: u32 = 256;
/// Heads per block of `head_pivots` and `head_reduce`, and the narrowest sweep: consecutive
/// heads, a 32-byte sector of each node.
pub const LANES: u32 = 8;
/// Rows of a block of [`LANES`] heads: nodes of a level handled at once.
pub const ROWS: u32 = THREADS / LANES;

/// Heads per block of `head_sweep` for `batch` samples of `heads` heads on a device with
/// `sms` multiprocessors: the widest of 32, 16 and 8 whose grid still gives every
/// multiprocessor two blocks, else 8. On an H100 (132 SMs), 32 lanes took (64 samples,
/// 256 heads) of a 784-leaf quad tree 0.616 → 0.517 ms against 8 (512 blocks), and 8 lanes
/// took (16, 64) 0.242 → 0.090 ms against 32 (128 blocks against 32).
pub fn sweep_lanes(batch: usize, heads: usize, sms: usize) -> u32 {
    [32, 16]
        .into_iter()
        .find(|&lanes| heads.div_ceil(lanes as usize) * batch >= 2 * sms)
        .unwrap_or(LANES)
}

fn table(v: &[usize]) -> Vec<u32> {
    v.iter().map(|&x| x as u32).collect()
}

fn lane_blocks(heads: usize, lanes: u32) -> Result<u32> {
    Ok(int_arg("head_solve", "heads", heads)? as u32).map(|h| h.div_ceil(lanes))
}

/// `head_pivots`: input coef = [B; C] (2, nodes, heads, 2) or the skew form's s (heads, nodes,
/// 2); output piv (3, nodes, heads, 2).
fn pivots_plan(tree: &Tree, d: &Dims, dtype: DType, adjoint: bool) -> Result<LaunchPlan> {
    let op = "head_solve";
    Ok(LaunchPlan {
        kernel: kernel_name("head_pivots", dtype, true)?,
        grid: [lane_blocks(d.heads, LANES)?, 1, 1],
        block: [LANES, ROWS, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::Table(0),
            KernelArg::Table(1),
            KernelArg::I32(int_arg(op, "levels", tree.levels())?),
            KernelArg::I32(int_arg(op, "nodes", d.nodes)?),
            KernelArg::I32(int_arg(op, "heads", d.heads)?),
            KernelArg::I32(adjoint as i32),
            KernelArg::I32(d.skew as i32),
            KernelArg::Status,
        ],
        outputs: vec![3 * d.nodes * d.heads * 2],
        tables: vec![table(tree.level_starts()), table(tree.child_starts())],
        workspace_bytes: 0,
    })
}

/// `head_sweep`: inputs (rhs (batch, m, heads, 2), bias when `with_bias`, piv); output x.
fn sweep_plan(
    tree: &Tree,
    d: &Dims,
    m: usize,
    with_bias: bool,
    dtype: DType,
    limits: DeviceLimits,
) -> Result<LaunchPlan> {
    let op = "head_solve";
    if d.batch > 65_535 {
        bail!(
            "head_solve: batch {} exceeds the CUDA grid's 65,535",
            d.batch
        );
    }
    let (bias, piv) = match with_bias {
        true => (KernelArg::Input(1), KernelArg::Input(2)),
        false => (KernelArg::Null, KernelArg::Input(1)),
    };
    let lanes = sweep_lanes(d.batch, d.heads, limits.sms);
    Ok(LaunchPlan {
        kernel: kernel_name("head_sweep", dtype, true)?,
        grid: [lane_blocks(d.heads, lanes)?, d.batch as u32, 1],
        block: [lanes, THREADS / lanes, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            bias,
            piv,
            KernelArg::Output(0),
            KernelArg::Table(0),
            KernelArg::Table(1),
            KernelArg::I32(int_arg(op, "levels", tree.levels())?),
            KernelArg::I32(int_arg(op, "nodes", d.nodes)?),
            KernelArg::I32(int_arg(op, "heads", d.heads)?),
            KernelArg::I32(int_arg(op, "m", m)?),
            KernelArg::I32(int_arg(op, "leaves", d.leaves)?),
            KernelArg::I32((with_bias && d.skew) as i32),
        ],
        outputs: vec![d.batch * d.nodes * d.heads * 2],
        tables: vec![table(tree.level_starts()), table(tree.child_starts())],
        workspace_bytes: 0,
    })
}

/// `head_reduce`: inputs (λ, x); outputs [∂B; ∂C] (2, nodes, heads, 2) and, for a tree with
/// internal nodes, ∂bias (nodes − leaves, heads, 2); for the skew form ∂s (heads, nodes, 2) and
/// ∂bias (heads, nodes − leaves, 2).
fn reduce_plan(tree: &Tree, d: &Dims, dtype: DType) -> Result<LaunchPlan> {
    let op = "head_solve";
    let row_blocks = (d.nodes as u64).div_ceil(ROWS as u64);
    if row_blocks > 65_535 {
        bail!("head_solve: {} nodes exceed the CUDA grid", d.nodes);
    }
    let mut outputs = vec![d.coef_shape().iter().product()];
    let dbias = match d.internal() {
        0 => KernelArg::Null,
        k => {
            outputs.push(k * d.heads * 2);
            KernelArg::Output(1)
        }
    };
    Ok(LaunchPlan {
        kernel: kernel_name("head_reduce", dtype, true)?,
        grid: [lane_blocks(d.heads, LANES)?, row_blocks as u32, 1],
        block: [LANES, ROWS, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Input(1),
            KernelArg::Output(0),
            dbias,
            KernelArg::Table(0),
            KernelArg::I32(int_arg(op, "batch", d.batch)?),
            KernelArg::I32(int_arg(op, "nodes", d.nodes)?),
            KernelArg::I32(int_arg(op, "leaves", d.leaves)?),
            KernelArg::I32(int_arg(op, "heads", d.heads)?),
            KernelArg::I32(d.skew as i32),
        ],
        outputs,
        tables: vec![table(tree.parents())],
        workspace_bytes: 0,
    })
}

/// The launches of `head_solve(tree, u, bias, b, c)`: `head_pivots` (input coef = [b; c]
/// stacked on a new first axis; output piv), then `head_sweep` (inputs u, bias, piv; output x).
/// The status word is 1 + the first node with a bad pivot, or 0.
pub fn forward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 2]> {
    forward_plans_of(tree, &check_args(tree, u, bias, b, c)?, u.dtype(), limits)
}

/// [`forward_plans`] of `head_solve_skew(tree, u, bias, s)`: `head_pivots` reads s itself.
pub fn skew_forward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    s: &Tensor,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 2]> {
    forward_plans_of(tree, &check_skew_args(tree, u, bias, s)?, u.dtype(), limits)
}

fn forward_plans_of(
    tree: &Tree,
    d: &Dims,
    dt: DType,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 2]> {
    Ok([
        pivots_plan(tree, d, dt, false)?,
        sweep_plan(tree, d, d.m, d.internal() > 0, dt, limits)?,
    ])
}

/// The launches of the backward: `head_pivots` of the adjoint (input coef; output piv),
/// `head_sweep` (inputs ∂x, piv; output λ, of which ∂u is the first m nodes) and `head_reduce`
/// (inputs λ, x; outputs [∂b; ∂c] and, if the tree has internal nodes, ∂bias).
pub fn backward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 3]> {
    backward_plans_of(tree, &check_args(tree, u, bias, b, c)?, u.dtype(), limits)
}

/// [`backward_plans`] of `head_solve_skew(tree, u, bias, s)`: `head_pivots` reads s, and
/// `head_reduce` writes ∂s and ∂bias in their layouts.
pub fn skew_backward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    s: &Tensor,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 3]> {
    backward_plans_of(tree, &check_skew_args(tree, u, bias, s)?, u.dtype(), limits)
}

fn backward_plans_of(
    tree: &Tree,
    d: &Dims,
    dt: DType,
    limits: DeviceLimits,
) -> Result<[LaunchPlan; 3]> {
    Ok([
        pivots_plan(tree, d, dt, true)?,
        sweep_plan(tree, d, d.nodes, false, dt, limits)?,
        reduce_plan(tree, d, dt)?,
    ])
}

#[cfg(feature = "cuda")]
pub(super) use launch::{backward, forward};

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaStorage, Layout, Result, Storage, Tensor};

    use super::super::HeadSolveOp;
    use super::{pivots_plan, reduce_plan, sweep_plan};
    use crate::cuda::{self, HEAD_SOLVE};

    pub(in crate::ops::head_solve) fn forward(
        op: &HeadSolveOp,
        u: (&CudaStorage, &Layout),
        bias: (&CudaStorage, &Layout),
        coef: (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (dev, dt, d) = (u.0.device(), u.0.dtype(), &op.dims);
        let plan = pivots_plan(&op.tree, d, dt, false)?;
        let piv = cuda::launch(dev, HEAD_SOLVE, &plan, dt, &[coef])?.remove(0);
        let piv_l = Layout::contiguous(plan.outputs[0]);
        let with_bias = d.internal() > 0;
        let plan = sweep_plan(&op.tree, d, d.m, with_bias, dt, cuda::limits(dev)?)?;
        let inputs = match with_bias {
            true => vec![u, bias, (&piv, &piv_l)],
            false => vec![u, (&piv, &piv_l)],
        };
        Ok(cuda::launch(dev, HEAD_SOLVE, &plan, dt, &inputs)?.remove(0))
    }

    pub(in crate::ops::head_solve) fn backward(
        op: &HeadSolveOp,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let guards = [coef, x, g].map(|t| t.storage_and_layout());
        let mut s = Vec::with_capacity(3);
        for (st, l) in &guards {
            let Storage::Cuda(st) = &**st else {
                bail!("head_solve backward: tensors are not all on the same CUDA device")
            };
            s.push((st, *l));
        }
        let (coef, x, g) = (s[0], s[1], s[2]);
        let (dev, dt, d) = (g.0.device().clone(), g.0.dtype(), &op.dims);
        let plan = pivots_plan(&op.tree, d, dt, true)?;
        let piv = cuda::launch(&dev, HEAD_SOLVE, &plan, dt, &[coef])?.remove(0);
        let piv_l = Layout::contiguous(plan.outputs[0]);
        let plan = sweep_plan(&op.tree, d, d.nodes, false, dt, cuda::limits(&dev)?)?;
        let lam = cuda::launch(&dev, HEAD_SOLVE, &plan, dt, &[g, (&piv, &piv_l)])?.remove(0);
        let lam_l = Layout::contiguous(plan.outputs[0]);
        let plan = reduce_plan(&op.tree, d, dt)?;
        let mut out = cuda::launch(&dev, HEAD_SOLVE, &plan, dt, &[(&lam, &lam_l), x])?;
        let wrap = |s: CudaStorage, shape: Vec<usize>| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        };
        let dbias = match d.internal() {
            0 => Tensor::zeros(d.bias_shape(), dt, &candle_core::Device::Cuda(dev.clone()))?,
            _ => wrap(out.remove(1), d.bias_shape()),
        };
        let dcoef = wrap(out.remove(0), d.coef_shape());
        let lam = wrap(lam, vec![d.batch, d.nodes, d.heads, 2]);
        Ok((lam, dbias, dcoef))
    }
}
