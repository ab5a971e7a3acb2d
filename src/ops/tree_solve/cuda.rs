//! The launches of `kernels/tree_solve.cu`: their plans (pure functions, executed by the CUDA
//! launch below and by the host harness in `tests/kernels_on_cpu`) and, with the `cuda`
//! feature, their execution on candle's stream.
//!
//! Grid: one block of [`THREADS`] threads per (batch, head) tree ([`SMALL_TREE_THREADS`] for
//! small scalar-block trees in shared memory). Per-tree state, in the
//! accumulation type (f32, or f64 for f64), lives in dynamic shared memory when the device
//! grants that much to a block (opting in above 48 KiB), else in a global workspace with one
//! slice per tree:
//! * scalar blocks (`tree_fwd`, `tree_bwd`): n·(1 + r) values; in shared memory also B' and C'
//!   (n values each) and the child table (n + 1 ints) when those fit too ("staged": the
//!   levels' loops then read no global memory);
//! * d × d blocks (`tree_block_fwd`, `tree_block_bwd`): n·d·(d + r) values plus one d × d LU
//!   scratch block per thread that can own a parent at once ([`lu_slots`]).
//!
//! Trees across lanes (`tree_lanes_fwd`, `tree_lanes_block_fwd`, ..., `kernels/tree_lanes.cu`),
//! for blocks up to [`LANE_MAX_D`]: a block of [`LANE_THREADS`] threads holds `lanes` trees ×
//! `LANE_THREADS / lanes` rows, all its state in shared memory: per pivot lane (one for
//! coefficients shared by the batch, whose lanes are then samples of one head; else one per
//! lane) A', B' (then B̂) and C' (n·d² values each), and per lane n·d·r right-hand sides, each
//! lane's array at an odd stride.
//! The lanes per block: [`lane_choice`].
//!
//! The sweep (`tree_pivots`, then `tree_sweep_fwd`/`tree_sweep_bwd`, `kernels/tree_sweep.cu`;
//! `tree_block_pivots`, `tree_sweep_block_*` for blocks up to [`SWEEP_MAX_D`]), in f32 and f64:
//! the pivots of each coefficient set eliminated once into a global buffer, then a block per
//! tree, or for coefficients shared by the batch per several samples of one head (lanes,
//! [`lane_choice`] again), which read its pivots together. Scalar blocks keep only the nodes
//! above the leaves in shared memory and stream the leaves from global memory (up to
//! [`SWEEP_WIDE_THREADS`] threads forward, [`SWEEP_THREADS`] backward, one per parent of the
//! leaves); d × d blocks keep every node's n·d·r right-hand sides ([`SWEEP_BLOCK_THREADS`]). A scalar block whose coefficient set's
//! pivots (3n values) fit in shared memory beside its right-hand sides eliminates them there
//! itself, and the sweep is one launch (`tree_sweep_fwd` on u and coef).
//!
//! [`TreeLayout::Auto`](super::TreeLayout::Auto) chooses per pass, by the layouts' measured
//! times: for coefficients shared by the batch the sweep for d × d blocks, and for scalar
//! blocks the lanes backward and a block per tree (small real trees) or the sweep forward;
//! a block per tree for per-sample coefficients. Which layout and its sizes: `cuda/layout.rs`.

use candle_core::{bail, DType, Result, Tensor};

use super::{check_args, Dims, TreeSolveOp, TreeSolveOptions};
use crate::ops::plan::{int_arg, kernel_name, DeviceLimits, KernelArg, LaunchPlan, Table};
use crate::tree::Tree;

mod layout;
use layout::{Pass, Resolved};

/// Threads per block (TREE_THREADS in the kernel), and for the trees of [`SMALL_TREE_BYTES`].
pub const THREADS: u32 = 256;
/// Threads per block of a scalar-block tree whose state fits in shared memory within
/// [`SMALL_TREE_BYTES`]. Its solve is a chain of dependent steps per level, latency-bound: on
/// H100, 256 threads let 3 trees share an SM (by registers) and 1,024-leaf 4-ary trees took
/// 0.157 ms at (16, 256); 64 threads let 12 (4 by shared memory at 48 KiB), 0.112 ms. Larger
/// trees (the global path, complex 1,024-leaf ones) were slower with 64.
pub const SMALL_TREE_THREADS: u32 = 64;
/// See [`SMALL_TREE_THREADS`].
pub const SMALL_TREE_BYTES: usize = 48 * 1024;

/// Threads per block of the lanes layout (LANE_THREADS in `kernels/tree_lanes.cu`).
pub const LANE_THREADS: u32 = 256;
/// Threads per block of the scalar sweep's backward, at most (SWEEP_THREADS in
/// `kernels/tree_sweep.cu`).
pub const SWEEP_THREADS: u32 = 512;
/// Threads per block of the scalar sweep's forward and of `tree_pivots`, at most
/// (SWEEP_WIDE_THREADS; complex f64's is [`SWEEP_THREADS`]).
pub const SWEEP_WIDE_THREADS: u32 = 1024;
/// Threads per block of the sweep layout's d × d kernels (SWEEP_BLOCK_THREADS).
pub const SWEEP_BLOCK_THREADS: u32 = 256;
/// The largest blocks the sweep layout takes (SWEEP_MAX_D in the kernel).
pub const SWEEP_MAX_D: usize = 4;
/// The largest blocks the lanes layout takes (LANE_MAX_D in the kernel).
pub const LANE_MAX_D: usize = 4;
/// Trees per block the lanes layout may take, widest first.
pub const LANE_WIDTHS: [u32; 4] = [16, 8, 4, 2];

/// The lanes per block of the lanes layout, given how many trees can share a block (`cap`: the
/// batch for shared coefficients, else all) and, per width, the blocks of the grid and the
/// shared memory of a block: the widest that fits and still gives every multiprocessor two
/// blocks, else the narrowest that fits (the most blocks); None when no width of two or more
/// fits.
pub fn lane_choice(
    limits: DeviceLimits,
    cap: usize,
    blocks: impl Fn(u32) -> usize,
    bytes: impl Fn(u32) -> usize,
) -> Option<u32> {
    let fits: Vec<u32> = LANE_WIDTHS
        .into_iter()
        .filter(|&l| l as usize <= cap.next_power_of_two() && limits.fits_shared(bytes(l)))
        .collect();
    fits.iter()
        .copied()
        .find(|&l| blocks(l) >= 2 * limits.sms)
        .or(fits.last().copied())
}

/// The LU scratch blocks a d × d block solve of `tree` needs: one per thread that owns a
/// parent in the widest level (at most [`THREADS`]), and one for the root.
pub fn lu_slots(tree: &Tree) -> usize {
    (1..tree.levels())
        .map(|k| tree.level(k).len())
        .max()
        .unwrap_or(1)
        .clamp(1, THREADS as usize)
}

impl TreeSolveOp {
    fn tables(&self) -> Vec<Table> {
        let tree = &self.tree;
        [tree.level_table(), tree.child_table(), tree.parent_table()]
            .map(Table::clone)
            .to_vec()
    }

    /// `tree_pivots` (`tree_block_pivots` for d > 1): input coef, output the pivots
    /// (3, sets, nodes, d, d[, 2]) of T_G or (adjoint) T_Gᴴ, a set per head for shared
    /// coefficients, else per tree.
    fn pivots_plan(&self, dtype: DType, adjoint: bool) -> Result<LaunchPlan> {
        let Dims {
            batch,
            heads,
            nodes,
            d,
            shared,
            ..
        } = self.dims;
        let op = "tree_solve";
        let sets = if shared { heads } else { batch * heads };
        let w = if self.opts.complex { 2 } else { 1 };
        let mut args = vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::Table(0),
            KernelArg::Table(1),
            KernelArg::Table(2),
            KernelArg::I32(int_arg(op, "levels", self.tree.levels())?),
            KernelArg::I32(int_arg(op, "nodes", nodes)?),
        ];
        if d > 1 {
            args.push(KernelArg::I32(d as i32));
        }
        args.push(KernelArg::I32(int_arg(op, "coefficient sets", sets)?));
        args.extend([KernelArg::I32(adjoint as i32), KernelArg::Status]);
        let stem = if d > 1 {
            "tree_block_pivots"
        } else {
            "tree_pivots"
        };
        Ok(LaunchPlan {
            kernel: kernel_name(stem, dtype, self.opts.complex)?,
            grid: [sets as u32, 1, 1],
            block: [self.pivots_threads(dtype), 1, 1],
            shared_bytes: 0,
            args,
            outputs: vec![3 * sets * nodes * d * d * w],
            tables: self.tables(),
            workspace_bytes: 0,
        })
    }

    /// Threads per block of `tree_pivots`, as the sweep's forward but at least
    /// [`SWEEP_THREADS`], or of `tree_block_pivots`.
    fn pivots_threads(&self, dtype: DType) -> u32 {
        match self.dims.d {
            1 => self.scalar_sweep_threads("fwd", dtype).max(SWEEP_THREADS),
            _ => SWEEP_BLOCK_THREADS,
        }
    }

    /// `tree_sweep_{pass}` (`tree_sweep_block_{pass}` for d > 1) with `inputs` tensor arguments
    /// (the pivots second, or coef where the blocks stage the pivots) and `outputs`: a block
    /// per `lanes` samples of a head (coefficients shared by the batch) or per tree.
    fn sweep_plan(
        &self,
        pass: &str,
        dtype: DType,
        limits: DeviceLimits,
        lanes: u32,
        inputs: usize,
        outputs: Vec<usize>,
    ) -> Result<LaunchPlan> {
        let Dims {
            batch,
            heads,
            nodes,
            d,
            r,
            shared,
        } = self.dims;
        let op = "tree_solve";
        let mut args: Vec<KernelArg> = (0..inputs)
            .map(KernelArg::Input)
            .chain((0..outputs.len()).map(KernelArg::Output))
            .chain((0..3).map(KernelArg::Table))
            .collect();
        args.push(KernelArg::I32(int_arg(op, "levels", self.tree.levels())?));
        args.push(KernelArg::I32(int_arg(op, "nodes", nodes)?));
        // Tree indices are ints in the kernel.
        int_arg(op, "batch × heads", batch * heads)?;
        let (stem, threads) = match d {
            1 => ("tree_sweep", self.scalar_sweep_threads(pass, dtype)),
            _ => {
                args.push(KernelArg::I32(d as i32));
                ("tree_sweep_block", SWEEP_BLOCK_THREADS)
            }
        };
        for (what, v) in [("r", r), ("batch", batch), ("heads", heads)] {
            args.push(KernelArg::I32(int_arg(op, what, v)?));
        }
        // A tree per block for per-sample coefficients (one lane).
        let grid = self.lane_blocks(lanes);
        let block = [lanes, threads / lanes, 1];
        args.push(KernelArg::I32(shared as i32));
        let mut shared_bytes = self.sweep_bytes(dtype, lanes);
        if d == 1 {
            let stage = self.sweep_stages(dtype, limits, lanes);
            args.extend([KernelArg::I32(stage as i32), KernelArg::Status]);
            if stage {
                shared_bytes += self.staged_pivot_bytes(dtype);
            }
        }
        Ok(LaunchPlan {
            kernel: kernel_name(&format!("{stem}_{pass}"), dtype, self.opts.complex)?,
            grid: [int_arg(op, "blocks", grid)? as u32, 1, 1],
            block,
            shared_bytes,
            args,
            outputs,
            tables: self.tables(),
            workspace_bytes: 0,
        })
    }

    /// The lanes-layout launch of `pass` ("fwd" or "bwd").
    fn lanes_plan(
        &self,
        pass: &str,
        dtype: DType,
        lanes: u32,
        inputs: usize,
        outputs: Vec<usize>,
    ) -> Result<LaunchPlan> {
        let Dims {
            batch,
            heads,
            nodes,
            d,
            r,
            shared,
        } = self.dims;
        let op = "tree_solve";
        let tree = &self.tree;
        // Tree indices are ints in the kernel.
        int_arg(op, "batch × heads", batch * heads)?;
        let mut args: Vec<KernelArg> = (0..inputs)
            .map(KernelArg::Input)
            .chain((0..outputs.len()).map(KernelArg::Output))
            .chain((0..3).map(KernelArg::Table))
            .collect();
        args.push(KernelArg::I32(int_arg(op, "levels", tree.levels())?));
        args.push(KernelArg::I32(int_arg(op, "nodes", nodes)?));
        if d > 1 {
            args.push(KernelArg::I32(d as i32));
        }
        for (what, v) in [("r", r), ("batch", batch), ("heads", heads)] {
            args.push(KernelArg::I32(int_arg(op, what, v)?));
        }
        args.push(KernelArg::I32(shared as i32));
        args.push(KernelArg::Status);
        let stem = if d > 1 { "block_" } else { "" };
        Ok(LaunchPlan {
            kernel: kernel_name(
                &format!("tree_lanes_{stem}{pass}"),
                dtype,
                self.opts.complex,
            )?,
            grid: [int_arg(op, "blocks", self.lane_blocks(lanes))? as u32, 1, 1],
            block: [lanes, LANE_THREADS / lanes, 1],
            shared_bytes: self.lanes_bytes(dtype, lanes),
            args,
            outputs,
            tables: self.tables(),
            workspace_bytes: 0,
        })
    }

    /// The launch of `pass` ("fwd" or "bwd": `tree_fwd`, or `tree_block_fwd` for d > 1) with
    /// `inputs` tensor arguments and the outputs that follow them.
    fn plan(
        &self,
        pass: &str,
        dtype: DType,
        limits: DeviceLimits,
        layout: Resolved,
        inputs: usize,
        outputs: Vec<usize>,
    ) -> Result<LaunchPlan> {
        let Dims {
            batch,
            heads,
            nodes,
            d,
            r,
            shared: shared_coef,
        } = self.dims;
        match layout {
            Resolved::Lanes(lanes) => return self.lanes_plan(pass, dtype, lanes, inputs, outputs),
            Resolved::Sweep(lanes) => {
                return self.sweep_plan(pass, dtype, limits, lanes, inputs, outputs)
            }
            Resolved::Tree => {}
        }
        let op = "tree_solve";
        let trees = int_arg(op, "batch × heads", batch * heads)?;
        let staged_bytes = self
            .staged_per_tree(dtype)
            .filter(|&b| limits.fits_shared(b));
        let bytes = staged_bytes.unwrap_or(self.workspace_per_tree(dtype));
        let in_shared = limits.fits_shared(bytes);
        // In global memory, as many blocks as the budget holds slices (at least one), each
        // taking trees in turn.
        let blocks = match in_shared {
            true => trees as usize,
            false => (limits.workspace_bytes / bytes).clamp(1, trees as usize),
        };
        let threads = match d == 1 && in_shared && bytes <= SMALL_TREE_BYTES {
            true => SMALL_TREE_THREADS,
            false => THREADS,
        };
        let tree = &self.tree;
        let mut args: Vec<KernelArg> = (0..inputs)
            .map(KernelArg::Input)
            .chain((0..outputs.len()).map(KernelArg::Output))
            .chain((0..3).map(KernelArg::Table))
            .collect();
        args.push(KernelArg::I32(int_arg(op, "levels", tree.levels())?));
        args.push(KernelArg::I32(int_arg(op, "nodes", nodes)?));
        if d > 1 {
            args.push(KernelArg::I32(int_arg(op, "d", d)?));
        }
        args.push(KernelArg::I32(int_arg(op, "r", r)?));
        args.push(KernelArg::I32(int_arg(op, "heads", heads)?));
        args.push(KernelArg::I32(trees));
        args.push(KernelArg::I32(shared_coef as i32));
        if d > 1 {
            args.push(KernelArg::I32(lu_slots(tree) as i32));
        } else {
            args.push(KernelArg::I32(staged_bytes.is_some() as i32));
        }
        args.push(if in_shared {
            KernelArg::Null
        } else {
            KernelArg::Workspace
        });
        args.push(KernelArg::Status);
        let stem = match d {
            1 => format!("tree_{pass}"),
            _ => format!("tree_block_{pass}"),
        };
        Ok(LaunchPlan {
            kernel: kernel_name(&stem, dtype, self.opts.complex)?,
            grid: [blocks as u32, 1, 1],
            block: [threads, 1, 1],
            shared_bytes: if in_shared { bytes } else { 0 },
            args,
            outputs,
            tables: self.tables(),
            workspace_bytes: if in_shared { 0 } else { blocks * bytes },
        })
    }

    fn rhs_len(&self) -> usize {
        let Dims {
            batch,
            heads,
            nodes,
            d,
            r,
            ..
        } = self.dims;
        batch * heads * nodes * d * r * if self.opts.complex { 2 } else { 1 }
    }

    /// Whether `layout` first eliminates the pivots in a launch of their own: the sweep, unless
    /// its blocks stage them ([`Self::sweep_stages`]).
    fn pivots_apart(&self, layout: Resolved, dtype: DType, limits: DeviceLimits) -> bool {
        match layout {
            Resolved::Sweep(lanes) => !self.sweep_stages(dtype, limits, lanes),
            _ => false,
        }
    }

    /// The forward's launches: `tree_fwd` (or `tree_block_fwd`, `tree_lanes_fwd`,
    /// `tree_sweep_fwd` staging its pivots, ...), inputs (u, coef = [A; B; C]), output x; or
    /// `tree_pivots` (input coef, output the pivots) and `tree_sweep_fwd` (or
    /// `tree_sweep_block_fwd`; inputs u and the pivots, output x).
    fn forward_plans(&self, dtype: DType, limits: DeviceLimits) -> Result<Vec<LaunchPlan>> {
        let layout = self.resolve(Pass::Forward, dtype, limits)?;
        let x = vec![self.rhs_len()];
        let solve = self.plan("fwd", dtype, limits, layout, 2, x)?;
        Ok(match self.pivots_apart(layout, dtype, limits) {
            true => vec![self.pivots_plan(dtype, false)?, solve],
            false => vec![solve],
        })
    }

    /// The backward's launches: inputs (∂x, coef, x), outputs ∂u and the coefficient gradients
    /// (3, rows, heads, nodes, d, d[, 2]), a row per sample or ([`Self::gradient_rows`]) per
    /// block of samples; where the sweep takes the pivots apart ([`Self::pivots_apart`]) the
    /// adjoint's pivots first, which replace coef.
    fn backward_plans(&self, dtype: DType, limits: DeviceLimits) -> Result<Vec<LaunchPlan>> {
        let Dims {
            heads, nodes, d, ..
        } = self.dims;
        let layout = self.resolve(Pass::Backward, dtype, limits)?;
        let w = if self.opts.complex { 2 } else { 1 };
        let dcoef = 3 * self.gradient_rows(layout) * heads * nodes * d * d * w;
        let outputs = vec![self.rhs_len(), dcoef];
        let solve = self.plan("bwd", dtype, limits, layout, 3, outputs)?;
        Ok(match self.pivots_apart(layout, dtype, limits) {
            true => vec![self.pivots_plan(dtype, true)?, solve],
            false => vec![solve],
        })
    }
}

/// The launches that `tree_solve(tree, a, b, c, u, opts)` makes on a GPU with `limits`, in
/// order: one, whose inputs are (u, coef) with coef = [a; b; c] stacked on a new first axis and
/// whose output is x; or, in the sweep layout where its blocks do not eliminate the pivots
/// themselves, two: `tree_pivots` (input coef, output the pivots) and `tree_sweep_fwd` (inputs
/// u and those pivots, output x). The status word is 1 + the first node with a bad pivot, or 0.
pub fn forward_plans(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
    limits: DeviceLimits,
) -> Result<Vec<LaunchPlan>> {
    let dims = check_args(tree, a, b, c, u, opts)?;
    TreeSolveOp::new(tree, dims, opts).forward_plans(u.dtype(), limits)
}

/// The launches of the backward of `tree_solve` on a GPU with `limits`: one, whose inputs are
/// (∂x, coef, x) and whose outputs are ∂u and the coefficient gradients, (3, rows, heads,
/// nodes, d, d[, 2]) with a row per sample, or for shared coefficients in the lanes and sweep
/// layouts per block of samples (the op sums the rows for shared coefficients); or, where the
/// sweep takes the pivots apart, the adjoint's pivots first, which take coef's place in the
/// second launch's inputs.
pub fn backward_plans(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    x: &Tensor,
    opts: TreeSolveOptions,
    limits: DeviceLimits,
) -> Result<Vec<LaunchPlan>> {
    let dims = check_args(tree, a, b, c, x, opts)?;
    TreeSolveOp::new(tree, dims, opts).backward_plans(x.dtype(), limits)
}

/// The one launch of [`forward_plans`], for the layouts that take one.
pub fn forward_plan(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
    limits: DeviceLimits,
) -> Result<LaunchPlan> {
    one(forward_plans(tree, a, b, c, u, opts, limits)?)
}

/// The one launch of [`backward_plans`], for the layouts that take one.
pub fn backward_plan(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    x: &Tensor,
    opts: TreeSolveOptions,
    limits: DeviceLimits,
) -> Result<LaunchPlan> {
    one(backward_plans(tree, a, b, c, x, opts, limits)?)
}

fn one(mut plans: Vec<LaunchPlan>) -> Result<LaunchPlan> {
    match plans.len() {
        1 => Ok(plans.remove(0)),
        n => bail!("tree_solve: this layout takes {n} launches, not one"),
    }
}

#[cfg(feature = "cuda")]
pub(super) use launch::{backward, forward};

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaStorage, Layout, Result, Storage, Tensor};

    use super::super::TreeSolveOp;
    use crate::cuda::{self, Module, TREE_LANES, TREE_SOLVE, TREE_SWEEP};
    use crate::ops::plan::LaunchPlan;

    /// The module of a plan's kernel: `kernels/tree_lanes.cu`, `kernels/tree_sweep.cu` or
    /// `kernels/tree_solve.cu`.
    fn module(plan: &LaunchPlan) -> Module {
        let k = &plan.kernel;
        match () {
            _ if k.starts_with("tree_lanes_") => TREE_LANES,
            _ if k.starts_with("tree_sweep_") || k.contains("pivots_") => TREE_SWEEP,
            _ => TREE_SOLVE,
        }
    }

    pub(in crate::ops::tree_solve) fn forward(
        op: &TreeSolveOp,
        u: (&CudaStorage, &Layout),
        coef: (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (dev, dt) = (u.0.device(), u.0.dtype());
        let plans = op.forward_plans(dt, cuda::limits(dev)?)?;
        let [pivots, sweep] = &plans[..] else {
            let plan = &plans[0];
            return Ok(cuda::launch(dev, module(plan), plan, dt, &[u, coef])?.remove(0));
        };
        let piv = cuda::launch(dev, module(pivots), pivots, dt, &[coef])?.remove(0);
        let piv_l = Layout::contiguous(pivots.outputs[0]);
        Ok(cuda::launch(dev, module(sweep), sweep, dt, &[u, (&piv, &piv_l)])?.remove(0))
    }

    pub(in crate::ops::tree_solve) fn backward(
        op: &TreeSolveOp,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let x = x.contiguous()?;
        let guards = [g, coef, &x].map(|t| t.storage_and_layout());
        let mut inputs = Vec::with_capacity(3);
        for (s, l) in &guards {
            let Storage::Cuda(s) = &**s else {
                bail!("tree_solve backward: tensors are not all on the same CUDA device")
            };
            inputs.push((s, *l));
        }
        let (dev, dt) = (inputs[0].0.device().clone(), g.dtype());
        let plans = op.backward_plans(dt, cuda::limits(&dev)?)?;
        let (plan, out) = match &plans[..] {
            [pivots, sweep] => {
                let piv = cuda::launch(&dev, module(pivots), pivots, dt, &[inputs[1]])?.remove(0);
                let piv_l = Layout::contiguous(pivots.outputs[0]);
                let ins = [inputs[0], (&piv, &piv_l), inputs[2]];
                (sweep, cuda::launch(&dev, module(sweep), sweep, dt, &ins)?)
            }
            _ => (
                &plans[0],
                cuda::launch(&dev, module(&plans[0]), &plans[0], dt, &inputs)?,
            ),
        };
        let dims = op.dims;
        let tail: &[usize] = if op.opts.complex { &[2] } else { &[] };
        let w = if op.opts.complex { 2 } else { 1 };
        let rows = plan.outputs[1] / (3 * dims.heads * dims.nodes * dims.d * dims.d * w);
        let shapes = [
            g.dims().to_vec(),
            [&[3, rows, dims.heads, dims.nodes, dims.d, dims.d][..], tail].concat(),
        ];
        let mut wrapped = out.into_iter().zip(shapes).map(|(s, shape)| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        });
        let du = wrapped.next().expect("two outputs");
        let dcoef = wrapped.next().expect("two outputs");
        // Shared coefficients sum the gradient rows (samples, or blocks of samples).
        let dcoef = if dims.shared { dcoef.sum(1)? } else { dcoef };
        Ok((du, dcoef))
    }
}
