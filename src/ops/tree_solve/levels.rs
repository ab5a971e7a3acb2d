//! The CPU twin for scalar blocks (d = 1): every tree solved level by level, with the CUDA
//! kernel's operations per node (`tree_fwd`, `tree_bwd`) in its order.
//!
//! Two things make it fast. The pivots — Â_v⁻¹ and B̂_v, which depend on the coefficients
//! alone — are computed once per coefficient set: once per head for the samples that share a
//! head's coefficients, then each sample is a sweep of its right-hand sides. And a level's
//! children are contiguous nodes, so the elementwise steps of a level (û_c = ũ_c Â_c⁻¹, the
//! messages C_c û_c, x_c = û_c + B̂_c x_p) are loops over contiguous memory, which the compiler
//! vectorises; each parent then subtracts its children's messages one by one, in the kernel's
//! order. Samples that share the pivots go eight at a time, one per SIMD lane
//! ([`sample_lanes`]), where every step is vertical.

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use super::{Side, TreeSolveOp};
use crate::ops::value::{as_values, has_avx2, OutBuf, SharedOut, Value};
use crate::tree::Tree;

mod grads;
mod sample_lanes;

use grads::add_grads;

/// Samples one task solves after computing its coefficient set's pivots.
const SAMPLES_PER_TASK: usize = 16;

/// The pivots of one coefficient set, read as T_G or (adjoint) T_Gᴴ: `inv[v]` = Â_v⁻¹,
/// `bh[v]` = B̂_v = −Â_v⁻¹ B'_v and `dn[v]` = C'_v, the (parent, v) entry.
struct Pivots<V> {
    inv: Vec<V>,
    bh: Vec<V>,
    dn: Vec<V>,
}

/// A task's scratch: the pivots, one level's worth of messages or parent values, and for the
/// backward the gradient blocks (3 × n) of a tree or summed over a task's samples, and two
/// node-sized rows.
struct Scratch<V> {
    piv: Pivots<V>,
    m: Vec<V>,
    acc: Vec<V>,
    xs: Vec<V>,
    lp: Vec<V>,
    lanes: Vec<sample_lanes::Group<V>>,
}

impl<V> Scratch<V> {
    fn new() -> Self {
        let piv = Pivots {
            inv: vec![],
            bh: vec![],
            dn: vec![],
        };
        let [m, acc, xs, lp] = std::array::from_fn(|_| vec![]);
        Scratch {
            piv,
            m,
            acc,
            xs,
            lp,
            lanes: vec![],
        }
    }
}

/// Children per parent of each level k ≥ 1 when every parent of the level has the same number
/// (K), else 0: such a level's children come K to a parent, in order.
fn level_arities(tree: &Tree) -> Vec<usize> {
    let mut arity = vec![0];
    for k in 1..tree.levels() {
        let mut counts = tree.level(k).map(|p| tree.children(p).len());
        let first = counts.next().unwrap_or(0);
        arity.push(if counts.all(|c| c == first) { first } else { 0 });
    }
    arity
}

/// For every parent p of level k (its values `pars`, the level below's `a` and `b` by child):
/// acc = pars[p], then acc = f(acc, a_c, b_c) for each child c in order. With a uniform
/// `arity` the children come in chunks, a loop the compiler vectorises across parents.
#[inline(always)]
fn fold_children<V: Copy>(
    tree: &Tree,
    k: usize,
    arity: usize,
    pars: &mut [V],
    a: &[V],
    b: &[V],
    f: impl Fn(V, V, V) -> V,
) {
    // Eight parents at a time in local arrays, which the compiler keeps in vector registers
    // (it does not vectorise the strided loop over the slices themselves).
    #[inline(always)]
    fn chunks<V: Copy, const K: usize>(pars: &mut [V], a: &[V], b: &[V], f: impl Fn(V, V, V) -> V) {
        let blocks = pars.len() / 8;
        let (a8, a_rest) = a.split_at(blocks * 8 * K);
        let (b8, b_rest) = b.split_at(blocks * 8 * K);
        let (p8, p_rest) = pars.split_at_mut(blocks * 8);
        for (p, (a, b)) in p8
            .chunks_exact_mut(8)
            .zip(a8.chunks_exact(8 * K).zip(b8.chunks_exact(8 * K)))
        {
            let mut acc: [V; 8] = std::array::from_fn(|l| p[l]);
            for j in 0..K {
                let (av, bv): ([V; 8], [V; 8]) = (
                    std::array::from_fn(|l| a[l * K + j]),
                    std::array::from_fn(|l| b[l * K + j]),
                );
                for l in 0..8 {
                    acc[l] = f(acc[l], av[l], bv[l]);
                }
            }
            p.copy_from_slice(&acc);
        }
        for (p, (a, b)) in p_rest
            .iter_mut()
            .zip(a_rest.chunks_exact(K).zip(b_rest.chunks_exact(K)))
        {
            let mut acc = *p;
            for j in 0..K {
                acc = f(acc, a[j], b[j]);
            }
            *p = acc;
        }
    }
    match arity {
        2 => chunks::<V, 2>(pars, a, b, f),
        3 => chunks::<V, 3>(pars, a, b, f),
        4 => chunks::<V, 4>(pars, a, b, f),
        _ => {
            let (first, p0) = (tree.level(k - 1).start, tree.level(k).start);
            for p in tree.level(k) {
                let mut acc = pars[p - p0];
                for c in tree.children(p) {
                    acc = f(acc, a[c - first], b[c - first]);
                }
                pars[p - p0] = acc;
            }
        }
    }
}

/// The pivots of the coefficients `[a, b, c]` (n elements each) of T_G, or of T_Gᴴ with
/// `ADJ` (A' = conj(A), B' = conj(C), C' = conj(B)): upward over the levels, each child c of a
/// parent p inverted (Â_c⁻¹), B̂_c = (0 − B'_c) Â_c⁻¹, and Â_p = A'_p + Σ_c C'_c B̂_c in child
/// order. Err(node) for the first pivot, in level order, that is singular or not finite.
#[inline(always)]
fn pivots<F: WithDType, V: Value<F>, const ADJ: bool>(
    tree: &Tree,
    arity: &[usize],
    [a, b, c]: [&[F]; 3],
    pv: &mut Pivots<V>,
) -> std::result::Result<(), usize> {
    let n = tree.len();
    let (up, down) = if ADJ { (c, b) } else { (b, c) };
    let load = |out: &mut Vec<V>, s: &[F]| {
        out.clear();
        out.extend((0..n).map(|v| V::load_c::<ADJ>(s, v)));
    };
    // inv holds Â until a level is inverted; bh holds B' until then.
    load(&mut pv.inv, a);
    load(&mut pv.bh, up);
    load(&mut pv.dn, down);
    let Pivots { inv, bh, dn } = pv;
    let check = |inv: &[V], range: std::ops::Range<usize>| {
        let ok = inv[range.clone()]
            .iter()
            .fold(true, |ok, p| ok & p.pivot_ok());
        match ok {
            true => Ok(()),
            false => Err(range
                .clone()
                .find(|&v| !inv[v].pivot_ok())
                .unwrap_or(range.start)),
        }
    };
    for k in 1..tree.levels() {
        let ch = tree.level(k - 1);
        check(inv, ch.clone())?;
        for (i, b) in inv[ch.clone()].iter_mut().zip(&mut bh[ch.clone()]) {
            *i = i.inv();
            *b = V::zero().sub(*b).mul(*i);
        }
        let pars = &mut inv[tree.level(k)];
        fold_children(
            tree,
            k,
            arity[k],
            pars,
            &dn[ch.clone()],
            &bh[ch],
            |ap, d, b| ap.add(d.mul(b)),
        );
    }
    let root = tree.root();
    check(inv, root..root + 1)?;
    inv[root] = inv[root].inv();
    Ok(())
}

/// One tree's solve in place: `s` (n × r) holds its right-hand sides and receives x. Upward,
/// û_c = ũ_c Â_c⁻¹ and ũ_p −= C'_c û_c for each child in order; the root's x = ũ Â⁻¹;
/// downward, x_c = û_c + B̂_c x_p.
#[inline(always)]
fn sweep<F: WithDType, V: Value<F>>(
    tree: &Tree,
    arity: &[usize],
    r: usize,
    pv: &Pivots<V>,
    s: &mut [V],
    m: &mut Vec<V>,
) {
    if r > 1 {
        return sweep_columns::<F, V>(tree, r, pv, s, m);
    }
    let Pivots { inv, bh, dn } = pv;
    for k in 1..tree.levels() {
        let ch = tree.level(k - 1);
        let (below, above) = s.split_at_mut(ch.end);
        let kids = &mut below[ch.clone()];
        for (u, i) in kids.iter_mut().zip(&inv[ch.clone()]) {
            *u = u.mul(*i);
        }
        let pars = &mut above[..tree.level(k).len()];
        fold_children(tree, k, arity[k], pars, &dn[ch], kids, |acc, d, u| {
            acc.sub(d.mul(u))
        });
    }
    let root = tree.root();
    s[root] = s[root].mul(inv[root]);
    for k in (1..tree.levels()).rev() {
        let ch = tree.level(k - 1);
        let (below, above) = s.split_at_mut(ch.end);
        let kids = &mut below[ch.clone()];
        let pars = &above[..tree.level(k).len()];
        let bh = &bh[ch.clone()];
        match arity[k] {
            0 => {
                // Each child's parent value, then the level in one loop.
                m.clear();
                m.extend(
                    tree.parents()[ch]
                        .iter()
                        .map(|&p| pars[p - tree.level(k).start]),
                );
                for ((u, b), xp) in kids.iter_mut().zip(bh).zip(m.iter()) {
                    *u = u.add(b.mul(*xp));
                }
            }
            2 => push_down::<F, V, 2>(kids, bh, pars),
            3 => push_down::<F, V, 3>(kids, bh, pars),
            4 => push_down::<F, V, 4>(kids, bh, pars),
            a => {
                let rows = kids.chunks_exact_mut(a).zip(bh.chunks_exact(a));
                for ((us, bs), xp) in rows.zip(pars) {
                    for (u, b) in us.iter_mut().zip(bs) {
                        *u = u.add(b.mul(*xp));
                    }
                }
            }
        }
    }
}

/// x_c = û_c + B̂_c x_p for a level whose children come K to a parent.
#[inline(always)]
fn push_down<F: WithDType, V: Value<F>, const K: usize>(kids: &mut [V], bh: &[V], pars: &[V]) {
    // Eight children at a time through local arrays (see `fold_children`).
    let blocks = kids.len() / 8;
    let (k8, k_rest) = kids.split_at_mut(blocks * 8);
    let (b8, b_rest) = bh.split_at(blocks * 8);
    for (i, (us, bs)) in k8.chunks_exact_mut(8).zip(b8.chunks_exact(8)).enumerate() {
        let xp: [V; 8] = std::array::from_fn(|l| pars[(i * 8 + l) / K]);
        let mut u: [V; 8] = std::array::from_fn(|l| us[l]);
        for l in 0..8 {
            u[l] = u[l].add(bs[l].mul(xp[l]));
        }
        us.copy_from_slice(&u);
    }
    let first = blocks * 8;
    for (i, (u, b)) in k_rest.iter_mut().zip(b_rest).enumerate() {
        *u = u.add(b.mul(pars[(first + i) / K]));
    }
}

/// [`sweep`] for r > 1 right-hand sides: node v's are `s[v * r..][..r]`.
fn sweep_columns<F: WithDType, V: Value<F>>(
    tree: &Tree,
    r: usize,
    pv: &Pivots<V>,
    s: &mut [V],
    m: &mut Vec<V>,
) {
    let Pivots { inv, bh, dn } = pv;
    for k in 1..tree.levels() {
        let ch = tree.level(k - 1);
        let rows = &mut s[ch.start * r..ch.end * r];
        for (row, i) in rows.chunks_exact_mut(r).zip(&inv[ch.clone()]) {
            for u in row.iter_mut() {
                *u = u.mul(*i);
            }
        }
        m.clear();
        for (row, d) in rows.chunks_exact(r).zip(&dn[ch.clone()]) {
            m.extend(row.iter().map(|u| d.mul(*u)));
        }
        for p in tree.level(k) {
            for c in tree.children(p) {
                let msg = &m[(c - ch.start) * r..][..r];
                for (u, x) in s[p * r..][..r].iter_mut().zip(msg) {
                    *u = u.sub(*x);
                }
            }
        }
    }
    let root = tree.root();
    for u in &mut s[root * r..][..r] {
        *u = u.mul(inv[root]);
    }
    for k in (1..tree.levels()).rev() {
        let ch = tree.level(k - 1);
        m.clear();
        for &p in &tree.parents()[ch.clone()] {
            m.extend_from_slice(&s[p * r..][..r]);
        }
        let rows = &mut s[ch.start * r..ch.end * r];
        for ((row, b), xp) in rows
            .chunks_exact_mut(r)
            .zip(&bh[ch.clone()])
            .zip(m.chunks_exact(r))
        {
            for (u, x) in row.iter_mut().zip(xp) {
                *u = u.add(b.mul(*x));
            }
        }
    }
}

impl TreeSolveOp {
    /// The tasks of a scalar-block solve: (head, first sample, samples), each computing the
    /// pivots of its head's coefficients once when they are shared, per tree otherwise.
    fn level_tasks(&self) -> Vec<(usize, usize, usize)> {
        let (batch, heads) = (self.dims.batch, self.dims.heads);
        let per = batch
            .div_ceil(batch.div_ceil(SAMPLES_PER_TASK).max(1))
            .max(1);
        (0..heads)
            .flat_map(|h| {
                (0..batch)
                    .step_by(per)
                    .map(move |b0| (h, b0, per.min(batch - b0)))
            })
            .collect()
    }

    /// The coefficients [A, B, C] of tree (bi, hi), n elements each.
    fn tree_coefs<'a, F: WithDType>(&self, coef: &'a [F], bi: usize, hi: usize) -> [&'a [F]; 3] {
        let w = if self.opts.complex { 2 } else { 1 };
        let (set, per) = (self.dims.coef_set() * w, self.dims.nodes * w);
        let at = self.dims.coef_tree(bi, hi) * w;
        std::array::from_fn(|k| &coef[k * set + at..][..per])
    }

    /// Computes the pivots of tree (bi, hi)'s coefficients, read as `side`, into `ws`.
    #[inline(always)]
    fn tree_pivots<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        coef: &[F],
        (bi, hi): (usize, usize),
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        let c = self.tree_coefs(coef, bi, hi);
        let ok = match side {
            Side::Forward => pivots::<F, V, false>(&self.tree, arity, c, &mut ws.piv),
            Side::Adjoint => pivots::<F, V, true>(&self.tree, arity, c, &mut ws.piv),
        };
        ok.map_err(|v| self.pivot_error(side, bi * self.dims.heads + hi, v))
    }

    /// Solves tree (bi, hi) of `side`: its right-hand sides from `rhs` into its region of
    /// `out`, solved there in place. The pivots are computed anew for
    /// per-sample coefficients or a task's `first` sample, else those in `ws` are reused.
    ///
    /// # Safety
    /// The tree's region of `out` must be this task's alone.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn solve_tree<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        (coef, rhs, out): (&[F], &[F], SharedOut<F>),
        (bi, hi): (usize, usize),
        first: bool,
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        let dims = self.dims;
        let (n, r) = (dims.nodes, dims.r);
        let per_tree = n * r * V::WIDTH;
        if first || !dims.shared {
            self.tree_pivots(side, arity, coef, (bi, hi), ws)?;
        }
        let t = bi * dims.heads + hi;
        let row = as_values::<F, V>(&rhs[t * per_tree..][..per_tree]);
        out.write(t * per_tree, row, false);
        let s = out.values::<V>(t * per_tree, n * r);
        sweep::<F, V>(&self.tree, arity, r, &ws.piv, s, &mut ws.m);
        Ok(())
    }

    /// Solves the trees of samples `bi..bi + LANES` of head `hi`, which share its coefficients
    /// and have one right-hand side per node, in SIMD lanes ([`sample_lanes`]).
    ///
    /// # Safety
    /// The trees' regions of `out` must be this task's alone.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn solve_lanes<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        (coef, rhs, out): (&[F], &[F], SharedOut<F>),
        (bi, hi): (usize, usize),
        first: bool,
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        let dims = self.dims;
        debug_assert!(dims.shared && dims.r == 1);
        if first {
            self.tree_pivots(side, arity, coef, (bi, hi), ws)?;
        }
        let per_tree = dims.nodes * V::WIDTH;
        let at = |l: usize| ((bi + l) * dims.heads + hi) * per_tree;
        let rows = std::array::from_fn(|l| as_values::<F, V>(&rhs[at(l)..][..per_tree]));
        let outs = std::array::from_fn(|l| out.0.add(at(l)).cast::<V>());
        sample_lanes::solve::<F, V>(&self.tree, arity, &ws.piv, (rows, outs), &mut ws.lanes);
        Ok(())
    }

    /// Solves sample `bi` of a task over samples `b0..end` of head `hi` and, where they go in
    /// lanes, the next ones with it; returns how many it solved. The pivots are computed at the
    /// task's first sample (or every tree's own).
    ///
    /// # Safety
    /// As [`TreeSolveOp::solve_tree`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn solve_next<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        io: (&[F], &[F], SharedOut<F>),
        (bi, hi): (usize, usize),
        (b0, end): (usize, usize),
        ws: &mut Scratch<V>,
    ) -> Result<usize> {
        if self.in_lanes::<F>(bi, end) {
            self.solve_lanes(side, arity, io, (bi, hi), bi == b0, ws)?;
            Ok(sample_lanes::LANES)
        } else {
            self.solve_tree(side, arity, io, (bi, hi), bi == b0, ws)?;
            Ok(1)
        }
    }

    /// Whether samples `bi..` of a task ending before `end` go [`sample_lanes::LANES`] at a
    /// time: in f32 (real or complex; in f64 the lanes measured no faster than one tree at a
    /// time).
    fn in_lanes<F>(&self, bi: usize, end: usize) -> bool {
        let dims = self.dims;
        size_of::<F>() == 4 && dims.shared && dims.r == 1 && end - bi >= sample_lanes::LANES
    }

    /// The scalar-block (d = 1) solve of every tree: `rhs` holds u (forward) or g (adjoint)
    /// and the solutions go to `out`.
    pub(super) fn solve_levels<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        let arity = level_arities(&self.tree);
        let avx2 = has_avx2();
        self.level_tasks()
            .into_par_iter()
            .try_for_each_init(Scratch::<V>::new, |ws, task| {
                let io = (coef, rhs);
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU supports AVX2 (detected at run time).
                    return unsafe { self.forward_task_avx2(side, &arity, io, task, out, ws) };
                }
                self.forward_task(side, &arity, io, task, out, ws)
            })
    }

    /// [`TreeSolveOp::forward_task`] compiled for AVX2. (A closure passed to `best_simd!`
    /// would hold the whole task and was not inlined into the AVX2 function.)
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn forward_task_avx2<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        io: (&[F], &[F]),
        task: (usize, usize, usize),
        out: SharedOut<F>,
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        self.forward_task(side, arity, io, task, out, ws)
    }

    /// [`TreeSolveOp::backward_task`] compiled for AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn backward_task_avx2<F: WithDType, V: Value<F>>(
        &self,
        arity: &[usize],
        io: (&[F], &[F], &[F]),
        task: (usize, usize, usize),
        parts: (usize, usize),
        outs: (SharedOut<F>, SharedOut<F>),
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        self.backward_task(arity, io, task, parts, outs, ws)
    }

    /// Task `(hi, b0, count)` of [`TreeSolveOp::solve_levels`].
    #[inline(always)]
    fn forward_task<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        arity: &[usize],
        io: (&[F], &[F]),
        (hi, b0, count): (usize, usize, usize),
        out: SharedOut<F>,
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        let (mut bi, end) = (b0, b0 + count);
        while bi < end {
            // SAFETY: this task alone writes its trees' regions of the output.
            bi += unsafe {
                self.solve_next(side, arity, (io.0, io.1, out), (bi, hi), (b0, end), ws)?
            };
        }
        Ok(())
    }

    /// Backward for scalar blocks: λ = T_G⁻ᴴ g by the adjoint solve, then in the same task the
    /// block gradients −Σ_r λ_row conj(x_col): per tree for per-sample coefficients, summed
    /// over each task's samples in order for shared ones. Returns ∂u and the gradient
    /// partials, (3, partials, heads, nodes, 1, 1[, 2]) to be summed over dimension 1: the
    /// batch, or the tasks of a head (see [`TreeSolveOp::level_tasks`]).
    pub(super) fn backward_scalar<F: WithDType, V: Value<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>, usize)> {
        let dims = self.dims;
        let tasks = self.level_tasks();
        let per_head = tasks.len() / dims.heads.max(1);
        let partials = if dims.shared { per_head } else { dims.batch };
        let mut du = OutBuf::new(g.len());
        let mut dcoef = OutBuf::new(3 * partials * dims.heads * dims.nodes * V::WIDTH);
        let outs = (du.ptr(), dcoef.ptr());
        let arity = level_arities(&self.tree);
        let avx2 = has_avx2();
        tasks.into_par_iter().enumerate().try_for_each_init(
            Scratch::<V>::new,
            |ws, (index, task)| {
                let part = index % per_head.max(1);
                let (io, parts) = ((coef, g, x), (part, partials));
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU supports AVX2 (detected at run time).
                    return unsafe { self.backward_task_avx2(&arity, io, task, parts, outs, ws) };
                }
                self.backward_task(&arity, io, task, parts, outs, ws)
            },
        )?;
        // SAFETY: every tree's ∂u region and every partial were written by its task.
        Ok((
            unsafe { du.assume_filled() },
            unsafe { dcoef.assume_filled() },
            partials,
        ))
    }

    /// Task `(hi, b0, count)` of [`TreeSolveOp::backward_scalar`], the `part`-th of its head.
    #[inline(always)]
    fn backward_task<F: WithDType, V: Value<F>>(
        &self,
        arity: &[usize],
        (coef, g, x): (&[F], &[F], &[F]),
        (hi, b0, count): (usize, usize, usize),
        (part, partials): (usize, usize),
        (du_out, dc_out): (SharedOut<F>, SharedOut<F>),
        ws: &mut Scratch<V>,
    ) -> Result<()> {
        let dims = self.dims;
        let (n, r, w) = (dims.nodes, dims.r, V::WIDTH);
        let (per_tree, set) = (n * r * w, partials * dims.heads * n * w);
        // The negated blocks `vals` (3 × n) into partial `part` of the three sets.
        let put = |part: usize, vals: &[V], neg: &mut Vec<V>| {
            neg.clear();
            neg.extend(vals.iter().map(|v| V::zero().sub(*v)));
            for (k, row) in neg.chunks_exact(n).enumerate() {
                let at = k * set + (part * dims.heads + hi) * n * w;
                // SAFETY: the partial (the tree, or this task's slot of its head) is this
                // task's alone.
                unsafe { dc_out.write(at, row, false) };
            }
        };
        ws.acc.clear();
        ws.acc.resize(3 * n, V::zero());
        let (end, io) = (b0 + count, (coef, g, du_out));
        let mut solved = b0;
        for bi in b0..end {
            let t = bi * dims.heads + hi;
            // SAFETY: this task alone writes its trees' regions of ∂u, and a tree's region is
            // read once the solve has written it.
            let lam = unsafe {
                if bi == solved {
                    let task = (b0, end);
                    solved += self.solve_next(Side::Adjoint, arity, io, (bi, hi), task, ws)?;
                }
                du_out.values::<V>(t * per_tree, n * r)
            };
            let xs = &x[t * per_tree..][..per_tree];
            // Shared coefficients sum the task's trees, else each tree's own from zero.
            if !dims.shared {
                ws.acc.fill(V::zero());
            }
            let scratch = (&mut ws.xs, &mut ws.lp);
            add_grads::<F, V>(&self.tree, arity, r, lam, xs, &mut ws.acc, scratch);
            if !dims.shared {
                put(bi, &ws.acc, &mut ws.m);
            }
        }
        if dims.shared {
            put(part, &ws.acc, &mut ws.m);
        }
        Ok(())
    }
}
