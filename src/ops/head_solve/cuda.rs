//! The launches of `kernels/head_solve.cu`: their plans (pure functions, executed by the CUDA
//! launch below and by the host harness in `tests/kernels_on_cpu`) and, with the `cuda`
//! feature, their execution on candle's stream.
//!
//! A solve ([`Solve`]) is one `head_staged` launch where a tree's values for a block's lanes fit
//! in shared memory: a block per sample and [`staged_lanes`] heads, which forms the pivots on
//! its way up and reads each right-hand side once and writes each x once (global traffic per
//! (sample, node, head) complex value: one read, one write; the couplings, read by every sample,
//! stay in L2). Larger trees take two launches: `head_pivots` (a block per [`LANES`] heads)
//! writes the pivots, then `head_sweep` (a block per sample and [`sweep_lanes`] heads) works in
//! place in its output (x written, then read and written again by each pass). The forward is a
//! solve; the backward a solve of the adjoint, then `head_reduce` (a block per [`ROWS`] nodes
//! and [`LANES`] heads).

use candle_core::{bail, DType, Result, Tensor};

use super::{check_args, check_skew_args, Dims};
use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan};
use crate::tree::Tree;

/// Threads per block (HEAD_THREADS in the kernel), lanes × rows.
pub const THREADS: u32 = 256;
/// Threads per block of `head_staged` (HEAD_STAGED_THREADS), lanes × rows.
pub const STAGED_THREADS: u32 = 512;
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

/// Heads per block of `head_staged`: the complex values of a node in one 32-byte sector, 4 in
/// f32 and 2 in f64 (the narrowest blocks, so that small batches get many of them).
pub fn staged_lanes(dtype: DType) -> u32 {
    (32 / (2 * dtype.size_in_bytes())) as u32
}

/// The shared memory of a `head_staged` block: every node's value and every internal node's
/// pivot slot, per lane, each array rounded up to a multiple of 4 nodes (the kernel's
/// `staged_slot` permutes nodes within aligned groups of 4).
pub fn staged_bytes(tree: &Tree, dtype: DType) -> usize {
    let slots = tree.len().next_multiple_of(4) + (tree.len() - tree.leaves()).next_multiple_of(4);
    slots * staged_lanes(dtype) as usize * 2 * dtype.size_in_bytes()
}

/// The launches of one solve, x = M⁻¹ rhs (M = T_G, or T_Gᴴ in the backward).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Solve {
    /// `head_staged`: inputs (rhs, bias when the solve has one, coef); output x.
    Staged(LaunchPlan),
    /// `head_pivots` (input coef; output piv), then `head_sweep` (inputs rhs, bias when the
    /// solve has one, piv; output x).
    Global {
        pivots: LaunchPlan,
        sweep: LaunchPlan,
    },
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
        tables: vec![tree.level_table().clone(), tree.child_table().clone()],
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
    let lanes = sweep_lanes(d.batch, d.heads, limits.sms);
    let by_head = KernelArg::I32((with_bias && d.skew) as i32);
    let block = [lanes, THREADS / lanes, 1];
    let name = kernel_name("head_sweep", dtype, true)?;
    sample_plan(tree, d, m, with_bias, (name, block, 0), vec![by_head])
}

/// `head_staged`: inputs (rhs (batch, m, heads, 2), bias when `with_bias`, coef); output x.
fn staged_plan(
    tree: &Tree,
    d: &Dims,
    m: usize,
    with_bias: bool,
    adjoint: bool,
    dtype: DType,
) -> Result<LaunchPlan> {
    let lanes = staged_lanes(dtype);
    let block = [lanes, STAGED_THREADS / lanes, 1];
    let name = kernel_name("head_staged", dtype, true)?;
    let shared = staged_bytes(tree, dtype);
    let tail = vec![
        KernelArg::I32(adjoint as i32),
        KernelArg::I32(d.skew as i32),
        KernelArg::Status,
    ];
    sample_plan(tree, d, m, with_bias, (name, block, shared), tail)
}

/// A launch of a block per sample and `block[0]` heads, (kernel, block, shared bytes) as given:
/// arguments (rhs, bias or null, the third input, x, the level and child tables, levels, nodes,
/// heads, m, leaves), then `tail`.
fn sample_plan(
    tree: &Tree,
    d: &Dims,
    m: usize,
    with_bias: bool,
    (kernel, block, shared_bytes): (String, [u32; 3], usize),
    tail: Vec<KernelArg>,
) -> Result<LaunchPlan> {
    let op = "head_solve";
    let (bias, third) = match with_bias {
        true => (KernelArg::Input(1), KernelArg::Input(2)),
        false => (KernelArg::Null, KernelArg::Input(1)),
    };
    if d.batch > 65_535 {
        bail!(
            "head_solve: batch {} exceeds the CUDA grid's 65,535",
            d.batch
        );
    }
    let mut args = vec![
        KernelArg::Input(0),
        bias,
        third,
        KernelArg::Output(0),
        KernelArg::Table(0),
        KernelArg::Table(1),
        KernelArg::I32(int_arg(op, "levels", tree.levels())?),
        KernelArg::I32(int_arg(op, "nodes", d.nodes)?),
        KernelArg::I32(int_arg(op, "heads", d.heads)?),
        KernelArg::I32(int_arg(op, "m", m)?),
        KernelArg::I32(int_arg(op, "leaves", d.leaves)?),
    ];
    args.extend(tail);
    Ok(LaunchPlan {
        kernel,
        grid: [lane_blocks(d.heads, block[0])?, d.batch as u32, 1],
        block,
        shared_bytes,
        args,
        outputs: vec![d.batch * d.nodes * d.heads * 2],
        tables: vec![tree.level_table().clone(), tree.child_table().clone()],
        workspace_bytes: 0,
    })
}

/// A solve of `m` right-hand sides per sample (plus the bias when `with_bias`): staged where
/// the tree fits in the device's shared memory, else pivots and sweep.
fn solve_plans(
    tree: &Tree,
    d: &Dims,
    m: usize,
    with_bias: bool,
    adjoint: bool,
    dt: DType,
    limits: DeviceLimits,
) -> Result<Solve> {
    if staged_bytes(tree, dt) <= limits.shared_per_block {
        return Ok(Solve::Staged(staged_plan(
            tree, d, m, with_bias, adjoint, dt,
        )?));
    }
    Ok(Solve::Global {
        pivots: pivots_plan(tree, d, dt, adjoint)?,
        sweep: sweep_plan(tree, d, m, with_bias, dt, limits)?,
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
        tables: vec![tree.parent_table().clone()],
        workspace_bytes: 0,
    })
}

/// The launches of `head_solve(tree, u, bias, b, c)`: a solve with inputs u, bias and
/// coef = [b; c] stacked on a new first axis (see [`Solve`]). The status word is 1 + the first
/// node with a bad pivot, or 0.
pub fn forward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
    limits: DeviceLimits,
) -> Result<Solve> {
    forward_plans_of(tree, &check_args(tree, u, bias, b, c)?, u.dtype(), limits)
}

/// [`forward_plans`] of `head_solve_skew(tree, u, bias, s)`: the kernels read s itself.
pub fn skew_forward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    s: &Tensor,
    limits: DeviceLimits,
) -> Result<Solve> {
    forward_plans_of(tree, &check_skew_args(tree, u, bias, s)?, u.dtype(), limits)
}

fn forward_plans_of(tree: &Tree, d: &Dims, dt: DType, limits: DeviceLimits) -> Result<Solve> {
    solve_plans(tree, d, d.m, d.internal() > 0, false, dt, limits)
}

/// The launches of the backward: the adjoint's solve (inputs ∂x and coef; output λ, of which ∂u
/// is the first m nodes), then `head_reduce` (inputs λ, x; outputs [∂b; ∂c] and, if the tree
/// has internal nodes, ∂bias).
pub fn backward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
    limits: DeviceLimits,
) -> Result<(Solve, LaunchPlan)> {
    backward_plans_of(tree, &check_args(tree, u, bias, b, c)?, u.dtype(), limits)
}

/// [`backward_plans`] of `head_solve_skew(tree, u, bias, s)`: the solve reads s, and
/// `head_reduce` writes ∂s and ∂bias in their layouts.
pub fn skew_backward_plans(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    s: &Tensor,
    limits: DeviceLimits,
) -> Result<(Solve, LaunchPlan)> {
    backward_plans_of(tree, &check_skew_args(tree, u, bias, s)?, u.dtype(), limits)
}

fn backward_plans_of(
    tree: &Tree,
    d: &Dims,
    dt: DType,
    limits: DeviceLimits,
) -> Result<(Solve, LaunchPlan)> {
    Ok((
        solve_plans(tree, d, d.nodes, false, true, dt, limits)?,
        reduce_plan(tree, d, dt)?,
    ))
}

#[cfg(feature = "cuda")]
pub(super) use launch::{backward, forward};

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

    use super::super::HeadSolveOp;
    use super::{backward_plans_of, forward_plans_of, Solve};
    use crate::cuda::{self, HEAD_SOLVE};

    type Operand<'a> = (&'a CudaStorage, &'a Layout);

    /// Runs a solve's launches: rhs, the bias if the solve has one, coef.
    fn run(
        dev: &CudaDevice,
        solve: &Solve,
        dt: DType,
        rhs: Operand,
        bias: Option<Operand>,
        coef: Operand,
    ) -> Result<CudaStorage> {
        let (plan, piv) = match solve {
            Solve::Staged(plan) => (plan, None),
            Solve::Global { pivots, sweep } => {
                let piv = cuda::launch(dev, HEAD_SOLVE, pivots, dt, &[coef])?.remove(0);
                (sweep, Some((piv, Layout::contiguous(pivots.outputs[0]))))
            }
        };
        let last = match &piv {
            Some((p, l)) => (p, l),
            None => coef,
        };
        let inputs: Vec<Operand> = [Some(rhs), bias, Some(last)]
            .into_iter()
            .flatten()
            .collect();
        Ok(cuda::launch(dev, HEAD_SOLVE, plan, dt, &inputs)?.remove(0))
    }

    pub(in crate::ops::head_solve) fn forward(
        op: &HeadSolveOp,
        u: Operand,
        bias: Operand,
        coef: Operand,
    ) -> Result<CudaStorage> {
        let (dev, dt, d) = (u.0.device(), u.0.dtype(), &op.dims);
        let solve = forward_plans_of(&op.tree, d, dt, cuda::limits(dev)?)?;
        let bias = (d.internal() > 0).then_some(bias);
        run(dev, &solve, dt, u, bias, coef)
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
        let (solve, reduce) = backward_plans_of(&op.tree, d, dt, cuda::limits(&dev)?)?;
        let lam = run(&dev, &solve, dt, g, None, coef)?;
        let lam_l = Layout::contiguous(d.batch * d.nodes * d.heads * 2);
        let mut out = cuda::launch(&dev, HEAD_SOLVE, &reduce, dt, &[(&lam, &lam_l), x])?;
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
