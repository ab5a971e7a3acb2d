//! The CPU twin for scalar blocks (d = 1): groups of [`LANES`] (batch, head) trees solved in
//! lock-step, one per SIMD lane, in the CUDA kernel's level order.

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use super::{Dims, Side, TreeSolveOp};
use crate::ops::value::{best_simd, has_avx2, OutBuf, SharedOut, Value};
use crate::tree::Tree;

/// Trees solved together on the CPU, one per SIMD lane: all (batch, head) trees share the
/// topology, so the per-node arithmetic of [`LANES`] trees runs as one vector operation.
pub const LANES: usize = 8;

/// The scalar (d = 1) coefficients of a group of trees, one slice per lane, read as T_G
/// (`ADJ = false`) or T_Gᴴ (`ADJ = true`). With `SAME` all lanes have the same coefficients
/// (one head, several batch elements, shared coefficients): each is loaded once and broadcast.
struct LaneCoefs<'a, F> {
    a: [&'a [F]; LANES],
    b: [&'a [F]; LANES],
    c: [&'a [F]; LANES],
}

impl<F: WithDType> LaneCoefs<'_, F> {
    #[inline(always)]
    fn gather<V: Value<F>, const CONJ: bool, const SAME: bool>(
        s: &[&[F]; LANES],
        e: usize,
    ) -> [V; LANES] {
        if SAME {
            [V::load_c::<CONJ>(s[0], e); LANES]
        } else {
            std::array::from_fn(|l| V::load_c::<CONJ>(s[l], e))
        }
    }
    /// A'_v: A_v, or conj(A_v) for the adjoint.
    #[inline(always)]
    fn diag<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(&self.a, v)
    }
    /// The (v, parent) entry: B_v, or conj(C_v) for the adjoint.
    #[inline(always)]
    fn up<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(if ADJ { &self.c } else { &self.b }, v)
    }
    /// The (parent, v) entry: C_v, or conj(B_v) for the adjoint.
    #[inline(always)]
    fn down<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(if ADJ { &self.b } else { &self.c }, v)
    }
}

/// Scratch of a lane group: per node, one value per lane.
struct LaneWorkspace<V> {
    ahat: Vec<[V; LANES]>,
    bhat: Vec<[V; LANES]>,
    uhat: Vec<[V; LANES]>,
    x: Vec<[V; LANES]>,
    /// The forward solution, lane-major, for the backward's block gradients.
    aux: Vec<[V; LANES]>,
}

impl<V: Copy> LaneWorkspace<V> {
    fn new() -> Self {
        LaneWorkspace {
            ahat: vec![],
            bhat: vec![],
            uhat: vec![],
            x: vec![],
            aux: vec![],
        }
    }

    fn sized(&mut self, zero: V, nodes: usize, r: usize) {
        self.ahat.resize(nodes, [zero; LANES]);
        self.bhat.resize(nodes, [zero; LANES]);
        self.uhat.resize(nodes * r, [zero; LANES]);
        self.x.resize(nodes * r, [zero; LANES]);
    }
}

/// How (batch, head) trees are grouped into lanes (see [`TreeSolveOp::lane_groups`]).
#[derive(Clone, Copy)]
struct LaneLayout {
    /// Lanes are batch elements of one head sharing its coefficients.
    same: bool,
    groups: usize,
    /// Groups per head when `same`.
    per_head: usize,
    batch: usize,
    heads: usize,
}

/// One group of lanes: the tree of each lane (padding lanes repeat the last tree and are not
/// written) and, when the lanes share a head, which head and which slice of the batch.
struct LaneGroup {
    trees: [usize; LANES],
    lanes: usize,
    head: usize,
    batch_group: usize,
}

impl LaneLayout {
    fn new(dims: Dims) -> Self {
        let same = dims.shared && dims.batch >= LANES;
        let per_head = dims.batch.div_ceil(LANES);
        let groups = if same {
            dims.heads * per_head
        } else {
            (dims.batch * dims.heads).div_ceil(LANES)
        };
        LaneLayout {
            same,
            groups,
            per_head,
            batch: dims.batch,
            heads: dims.heads,
        }
    }

    fn group(&self, index: usize, trees: usize) -> LaneGroup {
        if self.same {
            let (head, batch_group) = (index / self.per_head, index % self.per_head);
            let b0 = batch_group * LANES;
            let lanes = LANES.min(self.batch - b0);
            LaneGroup {
                trees: std::array::from_fn(|l| (b0 + l.min(lanes - 1)) * self.heads + head),
                lanes,
                head,
                batch_group,
            }
        } else {
            let t0 = index * LANES;
            let lanes = LANES.min(trees - t0);
            LaneGroup {
                trees: std::array::from_fn(|l| t0 + l.min(lanes - 1)),
                lanes,
                head: 0,
                batch_group: 0,
            }
        }
    }

    /// Gradient partials per head: one per batch group when lanes share a head (already
    /// summed over their lanes), else one per batch element.
    fn partials(&self) -> usize {
        if self.same {
            self.per_head
        } else {
            self.batch
        }
    }
}

/// Block gradients of one solved group (d = 1): with λ in `ws.x` and the forward's x in
/// `ws.aux`, ∂A_v = −Σ_r λ_v conj(x_v), ∂B_v = −Σ_r λ_v conj(x_parent), ∂C_v = −Σ_r λ_parent
/// conj(x_v) (zero for the root), written to the three partial sets, summed over the lanes
/// when they share a head.
#[inline(always)]
fn block_grads_lanes<F: WithDType, V: Value<F>>(
    tree: &Tree,
    r: usize,
    group: &LaneGroup,
    layout: &LaneLayout,
    heads: usize,
    sets: &[SharedOut<F>; 3],
    ws: &LaneWorkspace<V>,
) {
    let n = tree.len();
    let (lam, x) = (&ws.x, &ws.aux);
    let outer = |row: usize, col: usize| -> [V; LANES] {
        let mut s = [V::zero(); LANES];
        for j in 0..r {
            let (l_row, x_col) = (lam[row * r + j], x[col * r + j]);
            for l in 0..LANES {
                s[l] = l_row[l].fma(x_col[l].conj(), s[l]);
            }
        }
        s
    };
    let root = tree.root();
    let zero = [V::zero(); LANES];
    // Element e of set k, borrowed alone: the (batch group, head) or the tree identifies this
    // group, so no other task writes it.
    let put =
        |k: usize, e: usize, v: V| V::put(unsafe { sets[k].row(e * V::WIDTH, V::WIDTH) }, 0, v);
    for v in 0..n {
        let ga = outer(v, v);
        let (gb, gc) = if v == root {
            (zero, zero)
        } else {
            let p = tree.parents()[v];
            (outer(v, p), outer(p, v))
        };
        if layout.same {
            let e = (group.batch_group * heads + group.head) * n + v;
            for (k, g) in [ga, gb, gc].iter().enumerate() {
                let sum = g.iter().take(group.lanes).fold(V::zero(), |s, x| s.add(*x));
                put(k, e, V::zero().sub(sum));
            }
        } else {
            for (l, &t) in group.trees.iter().enumerate().take(group.lanes) {
                for (k, g) in [ga, gb, gc].iter().enumerate() {
                    put(k, t * n + v, V::zero().sub(g[l]));
                }
            }
        }
    }
}

/// Rows of `LANES` trees into lane-major order: `lanes[e][l]` = element e of tree l.
#[inline(always)]
fn to_lanes<F: WithDType, V: Value<F>>(rows: &[&[F]; LANES], lanes: &mut [[V; LANES]]) {
    for (e, v) in lanes.iter_mut().enumerate() {
        *v = std::array::from_fn(|l| V::load(rows[l], e));
    }
}

/// Lane `l` of lane-major values back into its tree's row.
#[inline(always)]
fn from_lane<F: WithDType, V: Value<F>>(lanes: &[[V; LANES]], l: usize, row: &mut [F]) {
    for (e, v) in lanes.iter().enumerate() {
        V::put(row, e, v[l]);
    }
}

/// The first lane (of `lanes` active ones) whose pivot is singular or not finite.
#[inline(always)]
fn bad_lane<F: WithDType, V: Value<F>>(piv: &[V; LANES], lanes: usize) -> Option<usize> {
    let ok = piv.iter().fold(true, |ok, p| ok & p.pivot_ok());
    if ok {
        None
    } else {
        (0..lanes).find(|&l| !piv[l].pivot_ok())
    }
}

/// Scalar-block (d = 1) solve of a group of trees in lock-step: the upward elimination, parent
/// by parent over the BFS levels (each parent gathers its contiguous children), the root, and
/// the downward substitution — the CUDA kernel's level order for every tree. `ws.uhat` holds
/// the right-hand sides on entry; the solution is left in `ws.x`; an error names the
/// (lane, node) of a bad pivot.
#[inline(always)]
fn solve_scalar_lanes<F: WithDType, V: Value<F>, const ADJ: bool, const SAME: bool>(
    tree: &Tree,
    r: usize,
    lanes: usize,
    io: &LaneCoefs<F>,
    ws: &mut LaneWorkspace<V>,
) -> std::result::Result<(), (usize, usize)> {
    let zero = [V::zero(); LANES];
    for k in 0..tree.levels() {
        for p in tree.level(k) {
            let mut ap = io.diag::<V, ADJ, SAME>(p);
            for c in tree.children(p) {
                let ac = ws.ahat[c];
                if let Some(l) = bad_lane(&ac, lanes) {
                    return Err((l, c));
                }
                let inv: [V; LANES] = std::array::from_fn(|l| ac[l].inv());
                let (bc, cc) = (io.up::<V, ADJ, SAME>(c), io.down::<V, ADJ, SAME>(c));
                let mut bh = zero;
                for l in 0..LANES {
                    bh[l] = V::zero().sub(bc[l]).mul(inv[l]);
                    ap[l] = cc[l].fma(bh[l], ap[l]);
                }
                ws.bhat[c] = bh;
                for j in 0..r {
                    let (uc, up) = (&mut ws.uhat[c * r + j], p * r + j);
                    let mut msg = zero;
                    for l in 0..LANES {
                        uc[l] = uc[l].mul(inv[l]);
                        msg[l] = cc[l].mul(uc[l]);
                    }
                    let upv = &mut ws.uhat[up];
                    for l in 0..LANES {
                        upv[l] = upv[l].sub(msg[l]);
                    }
                }
            }
            ws.ahat[p] = ap;
        }
    }
    let root = tree.root();
    let ar = ws.ahat[root];
    if let Some(l) = bad_lane(&ar, lanes) {
        return Err((l, root));
    }
    for j in 0..r {
        let ur = ws.uhat[root * r + j];
        ws.x[root * r + j] = std::array::from_fn(|l| ur[l].mul(ar[l].inv()));
    }
    for k in (1..tree.levels()).rev() {
        for p in tree.level(k) {
            for c in tree.children(p) {
                let bh = ws.bhat[c];
                for j in 0..r {
                    let (xp, uc) = (ws.x[p * r + j], ws.uhat[c * r + j]);
                    ws.x[c * r + j] = std::array::from_fn(|l| bh[l].fma(xp[l], uc[l]));
                }
            }
        }
    }
    Ok(())
}

impl TreeSolveOp {
    /// The scalar-block (d = 1) solve of every tree: `rhs` holds u (forward) or g (adjoint)
    /// and the solutions go to `out`.
    pub(super) fn solve_lanes<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        let w = if self.opts.complex { 2 } else { 1 };
        let per_tree = self.dims.nodes * self.dims.r * w;
        let avx2 = has_avx2();
        self.lane_groups::<F, V>(side, coef, rhs, |group, ws| {
            for (l, &t) in group.trees.iter().enumerate().take(group.lanes) {
                // SAFETY: this task alone writes its trees' regions of the output.
                let x = unsafe { out.row(t * per_tree, per_tree) };
                best_simd!(avx2, from_lane(&ws.x, l, x));
            }
            Ok(())
        })
    }

    /// The scalar-block (d = 1) solve of every tree, in groups of [`LANES`] trees solved in
    /// lock-step (see [`solve_scalar_lanes`]); `finish` receives each solved group, whose
    /// solution is in `ws.x` (lane-major).
    ///
    /// Lanes run over the batch elements of one head when those share their coefficients and
    /// the batch fills the lanes (coefficients are then loaded once per node and broadcast);
    /// otherwise over consecutive (batch, head) trees.
    fn lane_groups<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        finish: impl Fn(&LaneGroup, &mut LaneWorkspace<V>) -> Result<()> + Sync + Send,
    ) -> Result<()> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let set = dims.coef_set() * w;
        let (ca, cb, cc) = (&coef[..set], &coef[set..2 * set], &coef[2 * set..3 * set]);
        let per_tree = dims.nodes * dims.r * w;
        let per_coef = dims.nodes * w;
        let trees = dims.batch * dims.heads;
        let coef_at = |t: usize| dims.coef_tree(t / dims.heads, t % dims.heads) * w;
        let layout = LaneLayout::new(dims);
        let avx2 = has_avx2();
        (0..layout.groups).into_par_iter().try_for_each_init(
            LaneWorkspace::<V>::new,
            |ws, index| {
                let group = layout.group(index, trees);
                let t = group.trees;
                let io = LaneCoefs {
                    a: std::array::from_fn(|l| &ca[coef_at(t[l])..][..per_coef]),
                    b: std::array::from_fn(|l| &cb[coef_at(t[l])..][..per_coef]),
                    c: std::array::from_fn(|l| &cc[coef_at(t[l])..][..per_coef]),
                };
                ws.sized(V::zero(), dims.nodes, dims.r);
                // Right-hand sides into lane-major order.
                let u: [&[F]; LANES] = std::array::from_fn(|l| &rhs[t[l] * per_tree..][..per_tree]);
                best_simd!(avx2, to_lanes(&u, &mut ws.uhat));
                let (tree, r, lanes) = (&*self.tree, dims.r, group.lanes);
                let solved = match (side, layout.same) {
                    (Side::Forward, true) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, false, true>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Forward, false) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, false, false>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Adjoint, true) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, true, true>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Adjoint, false) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, true, false>(tree, r, lanes, &io, ws)
                        )
                    }
                };
                solved.map_err(|(l, v)| self.pivot_error(side, t[l], v))?;
                finish(&group, ws)
            },
        )
    }

    /// Backward for scalar blocks: λ = T_G⁻ᴴ g by the lane-group solve, then in the same group
    /// the block gradients −Σ_r λ_row conj(x_col), summed over the lanes when they are batch
    /// elements of one head. Returns ∂u and the gradient partials, shaped
    /// (3, partials, heads, nodes, 1, 1[, 2]) to be summed over dimension 1 (see [`LaneLayout`]).
    pub(super) fn backward_scalar<F: WithDType, V: Value<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>, usize)> {
        let dims = self.dims;
        let (n, r, w) = (dims.nodes, dims.r, if self.opts.complex { 2 } else { 1 });
        let per_tree = n * r * w;
        let layout = LaneLayout::new(dims);
        let partials = layout.partials();
        let set = partials * dims.heads * n * w;
        let mut du = OutBuf::new(g.len());
        let mut dcoef = OutBuf::new(3 * set);
        let (du_out, dc_out) = (du.ptr(), dcoef.ptr());
        let avx2 = has_avx2();
        self.lane_groups::<F, V>(Side::Adjoint, coef, g, |group, ws| {
            let t = group.trees;
            for (l, &tl) in t.iter().enumerate().take(group.lanes) {
                // SAFETY: this task alone writes its trees' regions of ∂u.
                let du = unsafe { du_out.row(tl * per_tree, per_tree) };
                for (e, le) in ws.x.iter().enumerate() {
                    V::put(du, e, le[l]);
                }
            }
            let xs: [&[F]; LANES] = std::array::from_fn(|l| &x[t[l] * per_tree..][..per_tree]);
            ws.aux.resize(n * r, [V::zero(); LANES]);
            for (e, xe) in ws.aux.iter_mut().enumerate() {
                *xe = std::array::from_fn(|l| V::load(xs[l], e));
            }
            // SAFETY: the three sets lie back to back in the buffer.
            let sets: [SharedOut<F>; 3] =
                std::array::from_fn(|k| unsafe { dc_out.offset(k * set) });
            best_simd!(
                avx2,
                block_grads_lanes::<F, V>(&self.tree, r, group, &layout, dims.heads, &sets, ws)
            );
            Ok(())
        })?;
        // SAFETY: every tree's ∂u region and every partial were written by its group.
        Ok((
            unsafe { du.assume_filled() },
            unsafe { dcoef.assume_filled() },
            partials,
        ))
    }
}
