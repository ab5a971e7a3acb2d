//! Which CUDA layout a tree solve runs in on a device ([`TreeSolveOp::resolve`]), and the sizes
//! that decide it: each layout's shared memory, the lanes per block, the gradient rows.

use candle_core::{bail, DType, Result};

use super::super::{Dims, TreeLayout, TreeSolveOp};
use super::{
    lane_choice, lu_slots, LANE_MAX_D, SMALL_TREE_BYTES, SWEEP_MAX_D, SWEEP_THREADS,
    SWEEP_WIDE_THREADS,
};
use crate::ops::plan::DeviceLimits;

impl TreeSolveOp {
    /// Bytes of one value of the kernels' state: f32, or f64 for f64 (the sweep's pivots, kept
    /// in the storage type, are the same: it takes f32 and f64 only), twice that for complex.
    fn value_bytes(&self, dtype: DType) -> usize {
        let acc = if dtype == DType::F64 { 8 } else { 4 };
        acc * if self.opts.complex { 2 } else { 1 }
    }

    /// Bytes of state one tree needs.
    pub(super) fn workspace_per_tree(&self, dtype: DType) -> usize {
        let Dims { nodes, d, r, .. } = self.dims;
        let values = match d {
            1 => nodes * (1 + r),
            _ => nodes * d * (d + r) + lu_slots(&self.tree) * d * d,
        };
        values * self.value_bytes(dtype)
    }

    /// Bytes of a scalar-block tree's state with its couplings and child table staged beside
    /// it (see the `cuda` module's doc); None for d > 1, which does not stage.
    pub(super) fn staged_per_tree(&self, dtype: DType) -> Option<usize> {
        let Dims { nodes, d, .. } = self.dims;
        (d == 1).then(|| {
            self.workspace_per_tree(dtype) + 2 * nodes * self.value_bytes(dtype) + (nodes + 1) * 4
        })
    }

    /// Bytes of shared memory a block of `lanes` trees needs in the lanes layout.
    pub(super) fn lanes_bytes(&self, dtype: DType, lanes: u32) -> usize {
        let Dims {
            nodes,
            d,
            r,
            shared,
            ..
        } = self.dims;
        let pivot_lanes = if shared { 1 } else { lanes as usize };
        let odd = |n: usize| n | 1;
        (3 * pivot_lanes * odd(nodes * d * d) + lanes as usize * odd(nodes * d * r))
            * self.value_bytes(dtype)
    }

    /// Blocks of the lanes layout's grid with `lanes` trees each: per head, the batch in
    /// blocks, for shared coefficients; else all trees in blocks.
    pub(super) fn lane_blocks(&self, lanes: u32) -> usize {
        let Dims {
            batch,
            heads,
            shared,
            ..
        } = self.dims;
        match shared {
            true => heads * batch.div_ceil(lanes as usize),
            false => (batch * heads).div_ceil(lanes as usize),
        }
    }

    /// The lanes per block the lanes layout would take ([`lane_choice`]), None where it does
    /// not take this solve.
    pub(super) fn lanes(&self, dtype: DType, limits: DeviceLimits) -> Option<u32> {
        let Dims {
            batch,
            heads,
            d,
            shared,
            ..
        } = self.dims;
        if d > LANE_MAX_D {
            return None;
        }
        let cap = if shared { batch } else { batch * heads };
        lane_choice(
            limits,
            cap,
            |l| self.lane_blocks(l),
            |l| self.lanes_bytes(dtype, l),
        )
    }

    /// Bytes of shared memory a block of `lanes` trees takes in the sweep layout, each lane's
    /// array at an odd stride: for d × d blocks its n·d·r right-hand sides, for scalar blocks
    /// those of the nodes above the leaves (the leaves are streamed).
    pub(super) fn sweep_bytes(&self, dtype: DType, lanes: u32) -> usize {
        let Dims { nodes, d, r, .. } = self.dims;
        let per_lane = match d {
            1 => (nodes - self.first_inner()) * r,
            _ => nodes * d * r,
        };
        lanes as usize * (per_lane | 1) * self.value_bytes(dtype)
    }

    /// Whether a scalar sweep block of `lanes` eliminates its coefficient set's pivots itself,
    /// into shared memory beside its right-hand sides (3n values of the storage type), in one
    /// launch; else `tree_pivots` eliminates each set once into global memory first. Never
    /// for d × d blocks.
    pub(super) fn sweep_stages(&self, dtype: DType, limits: DeviceLimits, lanes: u32) -> bool {
        self.dims.d == 1
            && limits.fits_shared(self.sweep_bytes(dtype, lanes) + self.staged_pivot_bytes(dtype))
    }

    /// Bytes of a scalar sweep block's staged pivots ([`Self::sweep_stages`]).
    pub(super) fn staged_pivot_bytes(&self, dtype: DType) -> usize {
        3 * self.dims.nodes * self.value_bytes(dtype)
    }

    /// The first node above the leaves (level 0); 0 for a one-node tree.
    fn first_inner(&self) -> usize {
        match self.tree.levels() {
            1 => 0,
            _ => self.tree.level(1).start,
        }
    }

    /// Whether the sweep layout takes this solve: blocks up to [`SWEEP_MAX_D`] in f32 or f64
    /// whose right-hand sides fit in a block's shared memory.
    pub(super) fn sweeps(&self, dtype: DType, limits: DeviceLimits) -> bool {
        self.dims.d <= SWEEP_MAX_D
            && matches!(dtype, DType::F32 | DType::F64)
            && limits.fits_shared(self.sweep_bytes(dtype, 1))
    }

    /// The lanes per block of the sweep layout: for coefficients shared by the batch, samples of
    /// one head that read its pivots together, as many as [`lane_choice`] takes (for scalar
    /// blocks only where every multiprocessor still gets two blocks); else one tree per block.
    pub(super) fn sweep_lanes(&self, dtype: DType, limits: DeviceLimits) -> u32 {
        let Dims {
            batch, d, shared, ..
        } = self.dims;
        if !shared {
            return 1;
        }
        let blocks = |l: u32| self.lane_blocks(l);
        let choice = lane_choice(limits, batch, blocks, |l| self.sweep_bytes(dtype, l));
        match d {
            1 => choice.filter(|&l| blocks(l) >= 2 * limits.sms).unwrap_or(1),
            _ => choice.unwrap_or(1),
        }
    }

    /// Threads per block of the scalar sweep's `pass` ("fwd" or "bwd"): the parents above the
    /// leaves, a power of two from 64 to [`SWEEP_WIDE_THREADS`] forward (complex f64: to
    /// [`SWEEP_THREADS`], as backward).
    pub(super) fn scalar_sweep_threads(&self, pass: &str, dtype: DType) -> u32 {
        let parents = match self.tree.levels() {
            1 => 1,
            _ => self.tree.level(1).len(),
        };
        let most = match pass == "fwd" && self.value_bytes(dtype) <= 8 {
            true => SWEEP_WIDE_THREADS,
            false => SWEEP_THREADS,
        };
        (parents.next_power_of_two() as u32).clamp(64, most)
    }

    /// The layout `pass` of this solve runs in on a device with `limits`: as asked, an error
    /// where that layout does not take it; for [`TreeLayout::Auto`] the fastest measured
    /// (H100, `myo bench tree`; docs/performance.md) among those that take it:
    /// * coefficients per sample: a block per tree (the lanes, each with its own pivots, took
    ///   2.4× as long forward and backward);
    /// * shared d × d blocks: the sweep (d = 2: 3.3× faster than a block per tree, 2.2× than
    ///   the lanes; d = 4: 3.2×), else the lanes, else a block per tree;
    /// * shared scalar blocks, forward: a block per tree for real trees it stages within
    ///   [`SMALL_TREE_BYTES`] (1,024 leaves, 4-ary: 0.111 ms against the lanes' 0.152 and the
    ///   sweep's 0.172), else the sweep (complex: 0.220 against 0.271; Path-X's 32,767 nodes:
    ///   0.875 against 1.66);
    /// * shared scalar blocks, backward: the lanes (real 0.27 ms against 0.38, complex 0.57
    ///   against 0.92), else the sweep (Path-X 3.1 against 3.6), else a block per tree.
    pub(super) fn resolve(
        &self,
        pass: Pass,
        dtype: DType,
        limits: DeviceLimits,
    ) -> Result<Resolved> {
        let lanes = self.lanes(dtype, limits);
        let sweeps = self.sweeps(dtype, limits);
        Ok(match (self.opts.layout, lanes) {
            (TreeLayout::Tree, _) => Resolved::Tree,
            (TreeLayout::Lanes, Some(l)) => Resolved::Lanes(l),
            (TreeLayout::Lanes, None) => bail!(
                "tree_solve: the lanes layout needs blocks up to d = {LANE_MAX_D} (d = {}) and two \
                 trees in a block's shared memory ({} bytes here, the device grants {})",
                self.dims.d,
                self.lanes_bytes(dtype, 2),
                limits.shared_per_block
            ),
            (TreeLayout::Sweep, _) if !sweeps => bail!(
                "tree_solve: the sweep layout needs blocks up to d = {SWEEP_MAX_D} (d = {}), f32 \
                 or f64 ({dtype:?}) and a tree's right-hand sides in a block's shared memory ({} \
                 bytes here, the device grants {})",
                self.dims.d,
                self.sweep_bytes(dtype, 1),
                limits.shared_per_block
            ),
            (TreeLayout::Sweep, _) => Resolved::Sweep(self.sweep_lanes(dtype, limits)),
            (TreeLayout::Auto, lanes) => self.auto(pass, dtype, limits, lanes, sweeps),
        })
    }

    /// [`TreeLayout::Auto`]'s choice (see [`Self::resolve`]), given the lanes per block the
    /// lanes layout would take and whether the sweep takes the solve.
    fn auto(
        &self,
        pass: Pass,
        dtype: DType,
        limits: DeviceLimits,
        lanes: Option<u32>,
        sweeps: bool,
    ) -> Resolved {
        let Dims { d, shared, .. } = self.dims;
        let sweep = Resolved::Sweep(self.sweep_lanes(dtype, limits));
        let lanes = lanes.map(Resolved::Lanes);
        let small_real_tree = !self.opts.complex
            && self
                .staged_per_tree(dtype)
                .is_some_and(|b| b <= SMALL_TREE_BYTES && limits.fits_shared(b));
        let first = match (shared, d, pass) {
            (false, ..) => None,
            (true, 1, Pass::Forward) if small_real_tree => None,
            (true, 1, Pass::Forward) => sweeps.then_some(sweep),
            (true, 1, Pass::Backward) => lanes.or(sweeps.then_some(sweep)),
            (true, _, _) => sweeps.then_some(sweep).or(lanes),
        };
        first.unwrap_or(Resolved::Tree)
    }
    /// Coefficient-gradient rows the backward writes per head: one per sample, or for shared
    /// coefficients in the lanes and sweep layouts one per block of samples.
    pub(super) fn gradient_rows(&self, layout: Resolved) -> usize {
        match (layout, self.dims.shared) {
            (Resolved::Lanes(l) | Resolved::Sweep(l), true) => self.dims.batch.div_ceil(l as usize),
            _ => self.dims.batch,
        }
    }
}

/// The pass a layout is chosen for: [`TreeLayout::Auto`] may choose each apart (the backward
/// reads only the forward's output, never its layout's state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    Backward,
}

/// The layout a solve runs in ([`TreeSolveOp::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resolved {
    Tree,
    Lanes(u32),
    /// Lanes per block: samples of a head for d × d blocks shared by the batch, else 1.
    Sweep(u32),
}
