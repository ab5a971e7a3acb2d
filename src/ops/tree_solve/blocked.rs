//! The CPU solve for d × d blocks (d > 1): each Schur step a small LU solve with partial
//! pivoting, the pivot blocks eliminated once per head for the samples sharing its coefficients
//! ([`Factors`]) and the samples solved eight at a time, one per SIMD lane; samples with
//! coefficients of their own are eliminated and solved eight at a time, each lane pivoting
//! alone ([`OwnLanes`]).

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use super::pivoting::{Pivoting, Scalar};
use super::transpose::{from_lanes, to_lanes, LANES};
use super::{Side, TreeSolveOp};
use crate::ops::value::{best_simd, has_avx2, OutBuf, SharedOut, Value};
use crate::tree::Tree;

mod own_lanes;
use own_lanes::OwnLanes;

/// The coefficient blocks of one tree, read as the blocks of T_G or of T_Gᴴ.
struct Blocks<'a, F> {
    a: &'a [F],
    b: &'a [F],
    c: &'a [F],
    d: usize,
    side: Side,
}

impl<F: WithDType> Blocks<'_, F> {
    #[inline(always)]
    fn get<V: Value<F>>(&self, m: &[F], v: usize, i: usize, j: usize) -> V {
        let d = self.d;
        match self.side {
            Side::Forward => V::load(m, (v * d + i) * d + j),
            Side::Adjoint => V::load(m, (v * d + j) * d + i).conj(),
        }
    }
    /// Diagonal block entry A'_v[i][j].
    #[inline(always)]
    fn diag<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        self.get(self.a, v, i, j)
    }
    /// Entry [i][j] of the block at (row v, column parent(v)): B_v, or C_vᴴ for the adjoint.
    #[inline(always)]
    fn up<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        match self.side {
            Side::Forward => self.get(self.b, v, i, j),
            Side::Adjoint => self.get(self.c, v, i, j),
        }
    }
    /// Entry [i][j] of the block at (row parent(v), column v): C_v, or B_vᴴ for the adjoint.
    #[inline(always)]
    fn down<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        match self.side {
            Side::Forward => self.get(self.c, v, i, j),
            Side::Adjoint => self.get(self.b, v, i, j),
        }
    }
}

/// The elimination of one tree's pivot blocks, which depends on its coefficients alone: per
/// node v, Â_v's LU factorisation with partial pivoting as it was carried out (the row swapped
/// into each column, the multipliers, the upper factor and its diagonal's inverses), B̂_v, and
/// the block that carries û_v to the parent as [`Blocks::down`] reads it (C_v, or B_vᴴ for the
/// adjoint).
///
/// Solving [Â_c | −B_c | ũ_c] by LU treats every right-hand column on its own, so eliminating
/// the coefficient columns once (per head when the batch shares its coefficients) and replaying
/// the recorded steps on each sample's ũ columns gives the per-tree solve's values to the bit.
struct Factors<V, P> {
    d: usize,
    /// Per node and column, the row swapped into it: one, or one per lane ([`Pivoting`]).
    piv: Vec<P>,
    /// (nodes, column, row): the multiplier of `row` at the elimination of `column`.
    mult: Vec<V>,
    upper: Vec<V>,
    inv: Vec<V>,
    bhat: Vec<V>,
    down: Vec<V>,
}

/// A pivot that failed: the node whose block Â_v is singular or not finite.
struct BadPivot(usize);

/// LU with partial pivoting of the d × d `m` (row-major) in place, applied to the d × k `rhs`
/// as it goes, then back substitution: rhs becomes m⁻¹ rhs. Records the swaps, multipliers
/// and the diagonal's inverses in `piv`, `mult` (column-major) and `inv`; m keeps the upper
/// factor. False for a singular or non-finite pivot.
#[inline(always)]
fn factor_block<F: WithDType, V: Pivoting<F>>(
    m: &mut [V],
    rhs: &mut [V],
    (d, k): (usize, usize),
    piv: &mut [V::Rows],
    mult: &mut [V],
    inv: &mut [V],
) -> bool {
    for col in 0..d {
        let p = V::pivot_rows(m, col, d);
        V::swap_rows(m.as_chunks_mut::<1>().0, col, p, (d, d));
        V::swap_rows(rhs.as_chunks_mut::<1>().0, col, p, (d, k));
        if !m[col * d + col].pivot_ok() {
            return false;
        }
        piv[col] = p;
        let pinv = m[col * d + col].inv();
        for i in col + 1..d {
            let f = m[i * d + col].mul(pinv);
            mult[col * d + i] = f;
            for j in col..d {
                m[i * d + j] = m[i * d + j].sub(f.mul(m[col * d + j]));
            }
            for j in 0..k {
                rhs[i * k + j] = rhs[i * k + j].sub(f.mul(rhs[col * k + j]));
            }
        }
    }
    for i in 0..d {
        inv[i] = m[i * d + i].inv();
    }
    back_substitute(m, rhs, inv, d, k);
    true
}

/// rhs ← U⁻¹ rhs for the upper factor in `m` with its diagonal's inverses `inv`.
#[inline(always)]
fn back_substitute<F: WithDType, V: Value<F>>(
    m: &[V],
    rhs: &mut [V],
    inv: &[V],
    d: usize,
    k: usize,
) {
    for i in (0..d).rev() {
        for j in 0..k {
            let mut s = rhs[i * k + j];
            for l in i + 1..d {
                s = s.sub(m[i * d + l].mul(rhs[l * k + j]));
            }
            rhs[i * k + j] = s.mul(inv[i]);
        }
    }
}

impl<V: Copy, P: Copy> Factors<V, P> {
    /// The block size: `D`, or when `D` is 0 the one given at construction.
    #[inline(always)]
    fn d<const D: usize>(&self) -> usize {
        if D > 0 {
            D
        } else {
            self.d
        }
    }

    fn new(zero: V, no_rows: P, nodes: usize, d: usize) -> Self {
        let dd = d * d;
        Factors {
            d,
            piv: vec![no_rows; nodes * d],
            mult: vec![zero; nodes * dd],
            upper: vec![zero; nodes * dd],
            inv: vec![zero; nodes * d],
            bhat: vec![zero; nodes * dd],
            down: vec![zero; nodes * dd],
        }
    }

    /// Eliminates every pivot block of the tree `blk` describes, upward level by level:
    /// Â_c [B̂_c] = [−B_c], then Â_p += C_c B̂_c; the root's block last.
    #[inline(always)]
    fn eliminate<F: WithDType, const D: usize>(
        &mut self,
        tree: &Tree,
        blk: &Blocks<F>,
    ) -> std::result::Result<(), BadPivot>
    where
        V: Pivoting<F, Rows = P>,
    {
        let (n, d) = (tree.len(), self.d::<D>());
        let dd = d * d;
        for v in 0..n {
            for i in 0..d {
                for j in 0..d {
                    self.upper[v * dd + i * d + j] = blk.diag(v, i, j);
                    self.down[v * dd + i * d + j] = blk.down(v, i, j);
                }
            }
        }
        for k in 0..tree.levels() - 1 {
            for c in tree.level(k) {
                if !self.eliminate_node::<F, D>(blk, c, true) {
                    return Err(BadPivot(c));
                }
                let p = tree.parents()[c];
                for i in 0..d {
                    for l in 0..d {
                        let cil = self.down[c * dd + i * d + l];
                        for j in 0..d {
                            let e = p * dd + i * d + j;
                            self.upper[e] = cil.fma(self.bhat[c * dd + l * d + j], self.upper[e]);
                        }
                    }
                }
            }
        }
        let root = tree.root();
        if !self.eliminate_node::<F, D>(blk, root, false) {
            return Err(BadPivot(root));
        }
        Ok(())
    }

    /// Factors node c's block Â_c, solving Â_c B̂_c = −B_c with it when `with_b` (not at the
    /// root). False for a singular or non-finite pivot.
    #[inline(always)]
    fn eliminate_node<F: WithDType, const D: usize>(
        &mut self,
        blk: &Blocks<F>,
        c: usize,
        with_b: bool,
    ) -> bool
    where
        V: Pivoting<F, Rows = P>,
    {
        let d = self.d::<D>();
        let dd = d * d;
        let k = if with_b { d } else { 0 };
        let m = &mut self.upper[c * dd..(c + 1) * dd];
        let rhs = &mut self.bhat[c * dd..c * dd + k * d];
        if with_b {
            for i in 0..d {
                for j in 0..d {
                    rhs[i * d + j] = V::zero().sub(blk.up(c, i, j));
                }
            }
        }
        factor_block(
            m,
            rhs,
            (d, k),
            &mut self.piv[c * d..(c + 1) * d],
            &mut self.mult[c * dd..(c + 1) * dd],
            &mut self.inv[c * d..(c + 1) * d],
        )
    }

    /// rhs ← Â_v⁻¹ rhs (d × r, each entry `L` samples' values) by the steps recorded for v.
    #[inline(always)]
    fn replay<F: WithDType, const D: usize, const L: usize, const R: usize>(
        &self,
        v: usize,
        rhs: &mut [[V; L]],
        r: usize,
    ) where
        V: Pivoting<F, Rows = P>,
    {
        let (d, r) = (self.d::<D>(), if R > 0 { R } else { r });
        let dd = d * d;
        let (piv, mult) = (&self.piv[v * d..], &self.mult[v * dd..]);
        for col in 0..d {
            V::swap_rows(rhs, col, piv[col], (d, r));
            for i in col + 1..d {
                let f = mult[col * d + i];
                for j in 0..r {
                    let top = rhs[col * r + j];
                    lanes(&mut rhs[i * r + j], |l, y| y.sub(f.mul(top[l])));
                }
            }
        }
        let (upper, inv) = (&self.upper[v * dd..(v + 1) * dd], &self.inv[v * d..]);
        for i in (0..d).rev() {
            for j in 0..r {
                let mut s = rhs[i * r + j];
                for l in i + 1..d {
                    let (m, below) = (upper[i * d + l], rhs[l * r + j]);
                    lanes(&mut s, |k, y| y.sub(m.mul(below[k])));
                }
                lanes(&mut s, |_, y| y.mul(inv[i]));
                rhs[i * r + j] = s;
            }
        }
    }

    /// The solve of `L` samples at once, one per lane, with the eliminated blocks: upward
    /// û_c = Â_c⁻¹ ũ_c and ũ_p −= C_c û_c, the root's x = Â⁻¹ ũ, then downward
    /// x_c = û_c + B̂_c x_p; each lane's arithmetic that of a sample alone. `uhat` and `xs`:
    /// scratch of (nodes × d × r) entries.
    #[inline(always)]
    fn solve<F: WithDType, const D: usize, const L: usize, const R: usize>(
        &self,
        tree: &Tree,
        (u, x): ([&[F]; L], [&mut [F]; L]),
        r: usize,
        (uhat, xs): (&mut [[V; L]], &mut [[V; L]]),
    ) where
        V: Pivoting<F, Rows = P>,
    {
        let (n, d, r) = (tree.len(), self.d::<D>(), if R > 0 { R } else { r });
        let (dd, dr) = (d * d, d * r);
        let len = n * dr;
        let done = match L == LANES {
            // SAFETY: u[l] holds len values of V, uhat len groups of LANES (as L = LANES).
            true => unsafe {
                let rows = std::array::from_fn(|l| u[l].as_ptr().cast::<V>());
                to_lanes(rows, len, uhat.as_mut_ptr().cast::<[V; LANES]>())
            },
            false => 0,
        };
        for (e, uh) in uhat[..len].iter_mut().enumerate().skip(done) {
            *uh = std::array::from_fn(|l| V::load(u[l], e));
        }
        for k in 0..tree.levels() - 1 {
            for c in tree.level(k) {
                let (below, above) = uhat.split_at_mut((c + 1) * dr);
                let uc = &mut below[c * dr..];
                self.replay::<F, D, L, R>(c, uc, r);
                let p = tree.parents()[c];
                let up = &mut above[(p - c - 1) * dr..(p - c) * dr];
                for i in 0..d {
                    for l in 0..d {
                        let cil = self.down[c * dd + i * d + l];
                        for j in 0..r {
                            let from = uc[l * r + j];
                            lanes(&mut up[i * r + j], |k, y| y.sub(cil.mul(from[k])));
                        }
                    }
                }
            }
        }
        let root = tree.root();
        self.replay::<F, D, L, R>(root, &mut uhat[root * dr..(root + 1) * dr], r);
        xs[root * dr..(root + 1) * dr].copy_from_slice(&uhat[root * dr..(root + 1) * dr]);
        for k in (0..tree.levels() - 1).rev() {
            for c in tree.level(k) {
                let p = tree.parents()[c];
                for i in 0..d {
                    for j in 0..r {
                        let mut s = uhat[c * dr + i * r + j];
                        for l in 0..d {
                            let (b, xp) = (self.bhat[c * dd + i * d + l], xs[p * dr + l * r + j]);
                            lanes(&mut s, |k, y| b.fma(xp[k], y));
                        }
                        xs[c * dr + i * r + j] = s;
                    }
                }
            }
        }
        let mut x = x;
        let done = match L == LANES {
            // SAFETY: as above, x[l] holding len values this call may write.
            true => unsafe {
                let rows = std::array::from_fn(|l| x[l].as_mut_ptr().cast::<V>());
                from_lanes(xs.as_ptr().cast::<[V; LANES]>(), len, rows)
            },
            false => 0,
        };
        for (l, x) in x.iter_mut().enumerate() {
            for (e, v) in xs[..len].iter().enumerate().skip(done) {
                V::put(x, e, v[l]);
            }
        }
    }
}

/// y[l] ← f(l, y[l]) for every lane.
#[inline(always)]
fn lanes<V: Copy, const L: usize>(y: &mut [V; L], f: impl Fn(usize, V) -> V) {
    for (l, y) in y.iter_mut().enumerate() {
        *y = f(l, *y);
    }
}

/// Samples solved at once, one per SIMD lane, when they share their coefficients.
const SAMPLE_LANES: usize = LANES;

/// Samples per rayon task when the batch shares its coefficients: each task eliminates its
/// head's blocks once for them.
const SAMPLES_PER_TASK: usize = 16;

impl TreeSolveOp {
    /// The d × d block solve of every tree: `rhs` holds u (forward) or g (adjoint) and the
    /// solutions go to `out`. A rayon task takes one head and up to [`SAMPLES_PER_TASK`] samples
    /// sharing its coefficients, eliminates the pivot blocks once and solves the samples with
    /// them, eight at a time; or [`SAMPLE_LANES`] samples with coefficients of their own,
    /// eliminated and solved together in lanes ([`OwnLanes`]). The blocks' sizes 2, 3 and 4
    /// get their own copy of the code, with every loop's length known.
    pub(super) fn solve_blocks<F: WithDType, V: Scalar<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        match self.dims.d {
            2 => self.solve_blocks_d::<F, V, 2>(side, coef, rhs, out),
            3 => self.solve_blocks_d::<F, V, 3>(side, coef, rhs, out),
            4 => self.solve_blocks_d::<F, V, 4>(side, coef, rhs, out),
            _ => self.solve_blocks_d::<F, V, 0>(side, coef, rhs, out),
        }
    }

    /// [`Self::solve_blocks`] for blocks of size `D` (0: any size, read from the dimensions).
    fn solve_blocks_d<F: WithDType, V: Scalar<F>, const D: usize>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        let dims = self.dims;
        let d = if D > 0 { D } else { dims.d };
        let (n, r) = (dims.nodes, dims.r);
        let w = if self.opts.complex { 2 } else { 1 };
        let set = dims.coef_set() * w;
        let (ca, cb, cc) = (&coef[..set], &coef[set..2 * set], &coef[2 * set..3 * set]);
        let per_tree = n * d * r * w;
        let per_coef = n * d * d * w;
        let chunk = if dims.shared {
            SAMPLES_PER_TASK
        } else {
            SAMPLE_LANES
        };
        let chunks = dims.batch.div_ceil(chunk);
        let avx2 = has_avx2();
        let tree = &self.tree;
        (0..dims.heads * chunks).into_par_iter().try_for_each_init(
            || {
                (
                    Factors::<V, usize>::new(V::zero(), 0, n, d),
                    None::<OwnLanes<F, V>>,
                )
            },
            |(fac, own), task| {
                let (h, first) = (task % dims.heads, (task / dims.heads) * chunk);
                let samples = first..(first + chunk).min(dims.batch);
                let blocks_of = |b: usize| {
                    let c0 = dims.coef_tree(b, h) * w;
                    Blocks {
                        a: &ca[c0..c0 + per_coef],
                        b: &cb[c0..c0 + per_coef],
                        c: &cc[c0..c0 + per_coef],
                        d,
                        side,
                    }
                };
                let tree_of = |b: usize| b * dims.heads + h;
                let io = |b: usize| {
                    let t = tree_of(b);
                    // SAFETY: this task alone writes tree t's region of the output.
                    let x = unsafe { out.row(t * per_tree, per_tree) };
                    (&rhs[t * per_tree..(t + 1) * per_tree], x)
                };
                let group = |first: usize| {
                    let (u, x): (Vec<_>, Vec<_>) = (first..first + SAMPLE_LANES).map(io).unzip();
                    match (u.try_into(), x.try_into()) {
                        (Ok(u), Ok(x)) => (u, x),
                        _ => unreachable!("a group has {SAMPLE_LANES} samples"),
                    }
                };
                let eliminate = |fac: &mut Factors<V, usize>, b: usize| {
                    best_simd!(avx2, fac.eliminate::<F, D>(tree, &blocks_of(b)))
                        .map_err(|BadPivot(v)| self.pivot_error(side, tree_of(b), v))
                };
                if !dims.shared && samples.len() == SAMPLE_LANES {
                    let own = own.get_or_insert_with(|| OwnLanes::new(n, d, r));
                    let blocks = std::array::from_fn(|l| blocks_of(first + l));
                    if own.solve::<D>(tree, blocks, group(first), r, avx2) {
                        return Ok(());
                    }
                }
                let scratch = || vec![[V::zero(); 1]; n * d * r];
                let (mut uhat, mut xs) = (scratch(), scratch());
                let mut solve_one = |fac: &Factors<V, usize>, b: usize| {
                    let (u, x) = io(b);
                    let ws = (&mut uhat[..], &mut xs[..]);
                    best_simd!(avx2, fac.solve::<F, D, 1, 0>(tree, ([u], [x]), r, ws));
                };
                if !dims.shared {
                    // One by one: the samples short of a group, and a group where a lane's
                    // pivot failed (to name its sample).
                    for b in samples {
                        eliminate(fac, b)?;
                        solve_one(fac, b);
                    }
                    return Ok(());
                }
                eliminate(fac, first)?;
                let full = samples.len() / SAMPLE_LANES * SAMPLE_LANES;
                let scratch = || vec![[V::zero(); SAMPLE_LANES]; n * d * r];
                let (mut uhat_l, mut xs_l) = (scratch(), scratch());
                for g in samples
                    .clone()
                    .step_by(SAMPLE_LANES)
                    .take(full / SAMPLE_LANES)
                {
                    let ws = (&mut uhat_l[..], &mut xs_l[..]);
                    match r {
                        1 => best_simd!(
                            avx2,
                            fac.solve::<F, D, SAMPLE_LANES, 1>(tree, group(g), r, ws)
                        ),
                        _ => best_simd!(
                            avx2,
                            fac.solve::<F, D, SAMPLE_LANES, 0>(tree, group(g), r, ws)
                        ),
                    }
                }
                for b in samples.skip(full) {
                    solve_one(fac, b);
                }
                Ok(())
            },
        )
    }

    /// λ = T_G⁻ᴴ g, then the block gradients from λ and x: returns (∂u, ∂coef, partials) with
    /// ∂coef stacked like the coefficients per partial: per sample, or for shared coefficients
    /// one, already summed over the batch.
    pub(super) fn adjoint_and_grads<F: WithDType, V: Scalar<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>, usize)> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let mut lam = OutBuf::new(g.len());
        self.solve_all::<F, V>(Side::Adjoint, coef, g, lam.ptr())?;
        // SAFETY: the solve succeeded, so every tree's region is written.
        let lam = unsafe { lam.assume_filled() };
        // Block gradients per (partial, head): (3, partials, heads, nodes, d, d), the partials
        // the batch, or for shared coefficients one, summed over the batch in order as
        // `reduce_partials` would (a task per head and range of nodes).
        let (n, d, r) = (dims.nodes, dims.d, dims.r);
        let partials = if dims.shared { 1 } else { dims.batch };
        let per_set = partials * dims.heads * n * d * d * w;
        let tree = &self.tree;
        let lam_ref = &lam;
        let mut dcoef = OutBuf::new(3 * per_set);
        let dc = dcoef.ptr();
        let per_tree = n * d * r * w;
        let per_node = d * d * w;
        let chunks = if dims.shared {
            n.div_ceil(NODES_PER_TASK)
        } else {
            1
        };
        (0..partials * dims.heads * chunks)
            .into_par_iter()
            .for_each(|task| {
                let (slot, chunk) = (
                    task % (partials * dims.heads),
                    task / (partials * dims.heads),
                );
                let nodes = match dims.shared {
                    true => chunk * NODES_PER_TASK..((chunk + 1) * NODES_PER_TASK).min(n),
                    false => 0..n,
                };
                let (start, len) = ((slot * n + nodes.start) * per_node, nodes.len() * per_node);
                // SAFETY: the blocks of these nodes of this (partial, head) belong to this task.
                let (da, db, dcc) = unsafe {
                    (
                        dc.row(start, len),
                        dc.row(per_set + start, len),
                        dc.row(2 * per_set + start, len),
                    )
                };
                let samples = match dims.shared {
                    true => 0..dims.batch,
                    false => slot / dims.heads..slot / dims.heads + 1,
                };
                for b in samples.clone() {
                    let t = b * dims.heads + slot % dims.heads;
                    let (xs, ls) = (
                        &x[t * per_tree..][..per_tree],
                        &lam_ref[t * per_tree..][..per_tree],
                    );
                    let grads = (&mut da[..], &mut db[..], &mut dcc[..]);
                    let part = (nodes.clone(), b == samples.start);
                    match d {
                        2 => block_grads::<F, V, 2>(tree, d, r, (ls, xs), grads, part),
                        3 => block_grads::<F, V, 3>(tree, d, r, (ls, xs), grads, part),
                        4 => block_grads::<F, V, 4>(tree, d, r, (ls, xs), grads, part),
                        _ => block_grads::<F, V, 0>(tree, d, r, (ls, xs), grads, part),
                    }
                }
            });
        // SAFETY: every task wrote all entries of its blocks in the three sets.
        Ok((lam, unsafe { dcoef.assume_filled() }, partials))
    }
}

/// Nodes per task of the block gradients summed over the batch.
const NODES_PER_TASK: usize = 256;

/// One tree's block gradients from λ and x (each (nodes, d, r)) at the nodes `nodes`:
/// ∂A_v = −λ_v x_vᴴ, ∂B_v = −λ_v x_pᴴ and ∂C_v = −λ_p x_vᴴ (zero at the root), written to the
/// sets' blocks from `nodes.start` on (`first`), or added to them; for blocks of size `D`
/// (0: `d`).
#[inline(always)]
fn block_grads<F: WithDType, V: Value<F>, const D: usize>(
    tree: &Tree,
    d: usize,
    r: usize,
    (ls, xs): (&[F], &[F]),
    (da, db, dc): (&mut [F], &mut [F], &mut [F]),
    (nodes, first): (std::ops::Range<usize>, bool),
) {
    let d = if D > 0 { D } else { d };
    // −Σ_r λ_row[i][r] conj(x_col[j][r]) for the block at (row, col)
    let outer = |row: usize, col: usize, i: usize, j: usize| -> V {
        let mut s = V::zero();
        for k in 0..r {
            s = V::load(ls, (row * d + i) * r + k)
                .fma(V::load(xs, (col * d + j) * r + k).conj(), s);
        }
        V::zero().sub(s)
    };
    let put = |set: &mut [F], e: usize, g: V| match first {
        true => V::put(set, e, g),
        false => V::put(set, e, V::load(set, e).add(g)),
    };
    for v in nodes.clone() {
        let p = tree.parent(v);
        for i in 0..d {
            for j in 0..d {
                let e = ((v - nodes.start) * d + i) * d + j;
                put(da, e, outer(v, v, i, j));
                put(db, e, p.map_or(V::zero(), |p| outer(v, p, i, j)));
                put(dc, e, p.map_or(V::zero(), |p| outer(p, v, i, j)));
            }
        }
    }
}
