//! The Myo tree solve x = T_G⁻¹ u (Myosotis paper §3.2–3.5, Appendix A).
//!
//! T_G is a block matrix with the sparsity of a rooted [`Tree`]: per node v a diagonal block A_v
//! (d × d), B_v at (row v, column parent(v)) and C_v at (row parent(v), column v); the root's B
//! and C are unused. Shapes:
//! * u, x: (batch, heads, nodes, d, r): r right-hand sides per node;
//! * A, B, C: (heads, nodes, d, d) shared across the batch, or (batch, heads, nodes, d, d);
//! * complex (d = 1 in the layer; any d here): a trailing dimension of 2 (re, im) on all four.
//!
//! # Algorithm (shared by the CPU twin and the CUDA kernel)
//! Upward over the BFS levels, leaves first, each child c of parent p eliminated by a Schur
//! step: B̂_c = −Â_c⁻¹ B_c, û_c = Â_c⁻¹ ũ_c, then Â_p = A_p + Σ_c C_c B̂_c and
//! ũ_p = u_p − Σ_c C_c û_c. The root is solved, x_R = Â_R⁻¹ ũ_R, and the downward pass
//! substitutes x_c = û_c + B̂_c x_p, root to leaves.
//!
//! # Backward
//! λ = T_G⁻ᴴ g is one more tree solve with the adjoint matrix (blocks A_vᴴ on the diagonal, C_vᴴ
//! at the child's row, B_vᴴ at the parent's: B and C swap roles); then ∂u = λ and, on the
//! sparsity pattern only, ∂A_v = −λ_v x_vᴴ, ∂B_v = −λ_v x_parentᴴ, ∂C_v = −λ_parent x_vᴴ, summed
//! over r and, for shared coefficients, over the batch. Nothing is kept from the forward but its
//! output x: the adjoint's pivots are recomputed (they are the Â_vᴴ of the forward) rather than
//! stored, which costs one solve's arithmetic and saves n·d² values per tree.
//!
//! # Singular pivots
//! A pivot block Â_v that is singular (zero pivot in partial-pivoting LU) or not finite is an
//! error naming the batch, head and node: the layer's parameterisation keeps T_G diagonally
//! dominant, so a failure means diverged parameters, and it stops training instead of feeding
//! NaN forward.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::value::{Complex, OutBuf, Re, SharedOut, Value};
use crate::tree::Tree;

/// Options of [`tree_solve`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeSolveOptions {
    /// Complex values: every tensor has a trailing dimension of 2 (re, im).
    pub complex: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    batch: usize,
    heads: usize,
    nodes: usize,
    d: usize,
    r: usize,
    /// Coefficients shared across the batch: (heads, nodes, d, d).
    shared: bool,
}

impl Dims {
    /// Element offset of tree (bi, hi)'s first coefficient block within one of A, B, C.
    fn coef_tree(&self, bi: usize, hi: usize) -> usize {
        let t = if self.shared {
            hi
        } else {
            bi * self.heads + hi
        };
        t * self.nodes * self.d * self.d
    }
    /// Elements in one of A, B, C.
    fn coef_set(&self) -> usize {
        let trees = if self.shared {
            self.heads
        } else {
            self.batch * self.heads
        };
        trees * self.nodes * self.d * self.d
    }
    /// Element offset of tree (bi, hi)'s u (or x).
    fn rhs_tree(&self, bi: usize, hi: usize) -> usize {
        (bi * self.heads + hi) * self.nodes * self.d * self.r
    }
}

/// x = T_G⁻¹ u for the tree `tree` with blocks `a` (diagonal), `b` (child row, parent column)
/// and `c` (parent row, child column). See the module docs for shapes. CPU computes f32 and
/// f64 (f16/bf16 in f32).
pub fn tree_solve(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Tensor> {
    let dims = check_args(tree, a, b, c, u, opts)?;
    if !u.device().is_cpu() {
        bail!(
            "tree_solve: device {:?} is not supported yet (no CUDA kernel yet; use the CPU)",
            u.device().location()
        );
    }
    let dtype = u.dtype();
    if u.device().is_cpu() && matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        return tree_solve(tree, &up(a)?, &up(b)?, &up(c)?, &up(u)?, opts)?.to_dtype(dtype);
    }
    let coef = Tensor::stack(&[a, b, c], 0)?;
    let op = TreeSolveOp {
        tree: Arc::new(tree.clone()),
        dims,
        opts,
    };
    u.contiguous()?.apply_op2(&coef, op)
}

fn check_args(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Dims> {
    let tail: &[usize] = if opts.complex { &[2] } else { &[] };
    let ud = u.dims();
    if ud.len() != 5 + tail.len() || ud[5..] != *tail {
        bail!(
            "tree_solve: u must be (batch, heads, nodes, d, r{}), got shape {ud:?}",
            if opts.complex { ", 2" } else { "" }
        );
    }
    let (batch, heads, nodes, d, r) = (ud[0], ud[1], ud[2], ud[3], ud[4]);
    if ud.contains(&0) {
        bail!("tree_solve: u has an empty dimension, shape {ud:?}");
    }
    if nodes != tree.len() {
        bail!(
            "tree_solve: u has {nodes} nodes (dimension 2) but the tree has {}",
            tree.len()
        );
    }
    for (name, t) in [("b", b), ("c", c)] {
        if t.dims() != a.dims() {
            bail!(
                "tree_solve: {name} has shape {:?} but a has {:?}",
                t.dims(),
                a.dims()
            );
        }
    }
    let with_tail = |s: &[usize]| [s, tail].concat();
    let shared = if a.dims() == with_tail(&[heads, nodes, d, d]) {
        true
    } else if a.dims() == with_tail(&[batch, heads, nodes, d, d]) {
        false
    } else {
        bail!(
            "tree_solve: coefficients have shape {:?}; with u of shape {ud:?} they must be {:?} \
             (shared across the batch) or {:?}",
            a.dims(),
            with_tail(&[heads, nodes, d, d]),
            with_tail(&[batch, heads, nodes, d, d])
        );
    };
    for (name, t) in [("a", a), ("b", b), ("c", c)] {
        if t.dtype() != u.dtype() {
            bail!(
                "tree_solve: {name} has dtype {:?} but u has {:?}",
                t.dtype(),
                u.dtype()
            );
        }
        if !t.device().same_device(u.device()) {
            bail!(
                "tree_solve: {name} is on {:?} but u is on {:?}",
                t.device().location(),
                u.device().location()
            );
        }
    }
    if !matches!(
        u.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) {
        bail!("tree_solve: dtype {:?} is not supported", u.dtype());
    }
    Ok(Dims {
        batch,
        heads,
        nodes,
        d,
        r,
        shared,
    })
}

struct TreeSolveOp {
    tree: Arc<Tree>,
    dims: Dims,
    opts: TreeSolveOptions,
}

fn cpu_slice<'a, F: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [F]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<F>()?[start..end]),
        None => bail!("tree_solve: internal error, input is not contiguous"),
    }
}

/// The matrix a solve runs on: T_G itself, or its adjoint T_Gᴴ for the backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Forward,
    Adjoint,
}

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

/// Per-thread scratch for one tree solve.
struct Workspace<V> {
    ahat: Vec<V>,
    bhat: Vec<V>,
    uhat: Vec<V>,
    m: Vec<V>,
    rhs: Vec<V>,
}

impl<V: Copy> Workspace<V> {
    fn new(zero: V) -> Self {
        Workspace {
            ahat: vec![zero],
            bhat: vec![zero],
            uhat: vec![zero],
            m: vec![zero],
            rhs: vec![zero],
        }
    }
    fn size(&mut self, zero: V, nodes: usize, d: usize, r: usize) {
        self.ahat.resize(nodes * d * d, zero);
        self.bhat.resize(nodes * d * d, zero);
        self.uhat.resize(nodes * d * r, zero);
        self.m.resize(d * d, zero);
        self.rhs.resize(d * (d + r), zero);
    }
}

/// A pivot that failed: the node whose block Â_v is singular or not finite.
struct BadPivot(usize);

#[inline(always)]
fn pivot_ok(p: f64) -> bool {
    p > 0.0 && p.is_finite()
}

/// Solves m X = rhs in place for a d × d `m` and a d × k `rhs` (row-major), by LU with
/// partial pivoting; m is destroyed and rhs becomes X.
fn lu_solve<F: WithDType, V: Value<F>>(m: &mut [V], rhs: &mut [V], d: usize, k: usize) -> bool {
    for col in 0..d {
        let mut piv = col;
        for i in col + 1..d {
            if m[i * d + col].abs2() > m[piv * d + col].abs2() {
                piv = i;
            }
        }
        if !pivot_ok(m[piv * d + col].abs2()) {
            return false;
        }
        if piv != col {
            for j in 0..d {
                m.swap(col * d + j, piv * d + j);
            }
            for j in 0..k {
                rhs.swap(col * k + j, piv * k + j);
            }
        }
        let inv = m[col * d + col].inv();
        for i in col + 1..d {
            let f = m[i * d + col].mul(inv);
            for j in col..d {
                m[i * d + j] = m[i * d + j].sub(f.mul(m[col * d + j]));
            }
            for j in 0..k {
                rhs[i * k + j] = rhs[i * k + j].sub(f.mul(rhs[col * k + j]));
            }
        }
    }
    for i in (0..d).rev() {
        let inv = m[i * d + i].inv();
        for j in 0..k {
            let mut s = rhs[i * k + j];
            for l in i + 1..d {
                s = s.sub(m[i * d + l].mul(rhs[l * k + j]));
            }
            rhs[i * k + j] = s.mul(inv);
        }
    }
    true
}

/// One tree's solve with scalar blocks (d = 1): the upward elimination and the downward
/// substitution over the BFS levels, as the CUDA kernel runs them. `x` is the tree's output
/// (n × r) and also holds the solved parents during the downward pass.
fn solve_scalar<F: WithDType, V: Value<F>>(
    tree: &Tree,
    blk: &Blocks<F>,
    u: &[F],
    x: &mut [F],
    r: usize,
    ws: &mut Workspace<V>,
) -> std::result::Result<(), BadPivot> {
    let n = tree.len();
    let (ahat, bhat, uhat) = (&mut ws.ahat[..n], &mut ws.bhat[..n], &mut ws.uhat[..n * r]);
    for (v, av) in ahat.iter_mut().enumerate() {
        *av = blk.diag(v, 0, 0);
    }
    for (e, uh) in uhat.iter_mut().enumerate() {
        *uh = V::load(u, e);
    }
    // Upward: level by level, each child eliminated into its parent.
    for k in 0..tree.levels() - 1 {
        for c in tree.level(k) {
            if !pivot_ok(ahat[c].abs2()) {
                return Err(BadPivot(c));
            }
            let inv = ahat[c].inv();
            let p = tree.parents()[c];
            bhat[c] = V::zero().sub(blk.up::<V>(c, 0, 0)).mul(inv);
            let cc = blk.down::<V>(c, 0, 0);
            ahat[p] = cc.fma(bhat[c], ahat[p]);
            for j in 0..r {
                let uc = uhat[c * r + j].mul(inv);
                uhat[c * r + j] = uc;
                uhat[p * r + j] = uhat[p * r + j].sub(cc.mul(uc));
            }
        }
    }
    // The root, then downward: x_c = û_c + B̂_c x_p.
    let root = tree.root();
    if !pivot_ok(ahat[root].abs2()) {
        return Err(BadPivot(root));
    }
    let inv = ahat[root].inv();
    for j in 0..r {
        V::put(x, root * r + j, uhat[root * r + j].mul(inv));
    }
    for k in (0..tree.levels() - 1).rev() {
        for c in tree.level(k) {
            let p = tree.parents()[c];
            for j in 0..r {
                let xp = V::load(x, p * r + j);
                V::put(x, c * r + j, bhat[c].fma(xp, uhat[c * r + j]));
            }
        }
    }
    Ok(())
}

/// One tree's solve with d × d blocks: the same passes as [`solve_scalar`], each Schur step a
/// small LU solve Â_c [B̂_c | û_c] = [−B_c | ũ_c].
fn solve_blocked<F: WithDType, V: Value<F>>(
    tree: &Tree,
    blk: &Blocks<F>,
    u: &[F],
    x: &mut [F],
    r: usize,
    ws: &mut Workspace<V>,
) -> std::result::Result<(), BadPivot> {
    let (n, d) = (tree.len(), blk.d);
    let (dd, dr, w) = (d * d, d * r, d + r);
    let Workspace {
        ahat,
        bhat,
        uhat,
        m,
        rhs,
    } = ws;
    for v in 0..n {
        for i in 0..d {
            for j in 0..d {
                ahat[v * dd + i * d + j] = blk.diag(v, i, j);
            }
        }
    }
    for (e, uh) in uhat[..n * dr].iter_mut().enumerate() {
        *uh = V::load(u, e);
    }
    for k in 0..tree.levels() - 1 {
        for c in tree.level(k) {
            m.copy_from_slice(&ahat[c * dd..(c + 1) * dd]);
            for i in 0..d {
                for j in 0..d {
                    rhs[i * w + j] = V::zero().sub(blk.up(c, i, j));
                }
                for j in 0..r {
                    rhs[i * w + d + j] = uhat[c * dr + i * r + j];
                }
            }
            if !lu_solve(m, rhs, d, w) {
                return Err(BadPivot(c));
            }
            for i in 0..d {
                bhat[c * dd + i * d..c * dd + (i + 1) * d].copy_from_slice(&rhs[i * w..i * w + d]);
                uhat[c * dr + i * r..c * dr + (i + 1) * r]
                    .copy_from_slice(&rhs[i * w + d..(i + 1) * w]);
            }
            // Messages to the parent: Â_p += C_c B̂_c, ũ_p −= C_c û_c.
            let p = tree.parents()[c];
            for i in 0..d {
                for l in 0..d {
                    let cil: V = blk.down(c, i, l);
                    for j in 0..d {
                        let e = p * dd + i * d + j;
                        ahat[e] = cil.fma(bhat[c * dd + l * d + j], ahat[e]);
                    }
                    for j in 0..r {
                        let e = p * dr + i * r + j;
                        uhat[e] = uhat[e].sub(cil.mul(uhat[c * dr + l * r + j]));
                    }
                }
            }
        }
    }
    let root = tree.root();
    m.copy_from_slice(&ahat[root * dd..(root + 1) * dd]);
    rhs[..dr].copy_from_slice(&uhat[root * dr..(root + 1) * dr]);
    if !lu_solve(m, &mut rhs[..dr], d, r) {
        return Err(BadPivot(root));
    }
    for (e, v) in rhs[..dr].iter().enumerate() {
        V::put(x, root * dr + e, *v);
    }
    for k in (0..tree.levels() - 1).rev() {
        for c in tree.level(k) {
            let p = tree.parents()[c];
            for i in 0..d {
                for j in 0..r {
                    let mut s = uhat[c * dr + i * r + j];
                    for l in 0..d {
                        s = bhat[c * dd + i * d + l].fma(V::load(x, p * dr + l * r + j), s);
                    }
                    V::put(x, c * dr + i * r + j, s);
                }
            }
        }
    }
    Ok(())
}

impl TreeSolveOp {
    /// Solves every (batch, head) tree in parallel: `rhs` holds u (forward) or g (adjoint) and
    /// the solutions go to `out`.
    fn solve_all<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let set = dims.coef_set() * w;
        let (ca, cb, cc) = (&coef[..set], &coef[set..2 * set], &coef[2 * set..3 * set]);
        let per_tree = dims.nodes * dims.d * dims.r * w;
        let per_coef = dims.nodes * dims.d * dims.d * w;
        (0..dims.batch * dims.heads)
            .into_par_iter()
            .try_for_each_init(
                || Workspace::<V>::new(V::zero()),
                |ws, t| {
                    let (bi, hi) = (t / dims.heads, t % dims.heads);
                    ws.size(V::zero(), dims.nodes, dims.d, dims.r);
                    let c0 = dims.coef_tree(bi, hi) * w;
                    let blk = Blocks {
                        a: &ca[c0..c0 + per_coef],
                        b: &cb[c0..c0 + per_coef],
                        c: &cc[c0..c0 + per_coef],
                        d: dims.d,
                        side,
                    };
                    let u0 = dims.rhs_tree(bi, hi) * w;
                    let u = &rhs[u0..u0 + per_tree];
                    // SAFETY: this task alone writes tree (bi, hi)'s region of the output.
                    let x = unsafe { out.row(u0, per_tree) };
                    let solved = if dims.d == 1 {
                        solve_scalar(&self.tree, &blk, u, x, dims.r, ws)
                    } else {
                        solve_blocked(&self.tree, &blk, u, x, dims.r, ws)
                    };
                    solved.map_err(|BadPivot(v)| {
                        candle_core::Error::Msg(format!(
                            "tree_solve: the pivot block of node {v} (batch {bi}, head {hi}{}) is \
                         singular or not finite; T_G must stay invertible (the Myo layer keeps it \
                         diagonally dominant)",
                            if side == Side::Adjoint {
                                ", backward"
                            } else {
                                ""
                            }
                        ))
                    })
                },
            )
    }

    fn forward_t<F: WithDType>(&self, u: &[F], coef: &[F]) -> Result<Vec<F>> {
        let mut out = OutBuf::new(u.len());
        if self.opts.complex {
            self.solve_all::<F, Complex<F>>(Side::Forward, coef, u, out.ptr())?
        } else {
            self.solve_all::<F, Re<F>>(Side::Forward, coef, u, out.ptr())?
        }
        // SAFETY: the solve succeeded, so every tree's region is written.
        Ok(unsafe { out.assume_filled() })
    }

    /// λ = T_G⁻ᴴ g, then the block gradients from λ and x: returns (∂u, ∂coef) with ∂coef
    /// stacked like the coefficients, per sample (summed over the batch by the caller when
    /// shared).
    fn backward_t<F: WithDType>(&self, coef: &[F], x: &[F], g: &[F]) -> Result<(Vec<F>, Vec<F>)> {
        let lam = if self.opts.complex {
            self.adjoint_and_grads::<F, Complex<F>>(coef, x, g)
        } else {
            self.adjoint_and_grads::<F, Re<F>>(coef, x, g)
        }?;
        Ok(lam)
    }

    fn adjoint_and_grads<F: WithDType, V: Value<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>)> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let mut lam = OutBuf::new(g.len());
        self.solve_all::<F, V>(Side::Adjoint, coef, g, lam.ptr())?;
        // SAFETY: the solve succeeded, so every tree's region is written.
        let lam = unsafe { lam.assume_filled() };
        // Per-(batch, head) block gradients: (3, batch, heads, nodes, d, d).
        let (n, d, r) = (dims.nodes, dims.d, dims.r);
        let per_set = dims.batch * dims.heads * n * d * d * w;
        let tree = &self.tree;
        let lam_ref = &lam;
        let mut dcoef = OutBuf::new(3 * per_set);
        let dc = dcoef.ptr();
        (0..dims.batch * dims.heads).into_par_iter().for_each(|t| {
            let per_tree = n * d * r * w;
            let (xs, ls) = (
                &x[t * per_tree..][..per_tree],
                &lam_ref[t * per_tree..][..per_tree],
            );
            let per_coef = n * d * d * w;
            // SAFETY: tree t's blocks of each gradient set belong to this task.
            let (da, db, dcc) = unsafe {
                (
                    dc.row(t * per_coef, per_coef),
                    dc.row(per_set + t * per_coef, per_coef),
                    dc.row(2 * per_set + t * per_coef, per_coef),
                )
            };
            // −Σ_r λ_row[i][r] conj(x_col[j][r]) for the block at (row, col)
            let outer = |row: usize, col: usize, i: usize, j: usize| -> V {
                let mut s = V::zero();
                for k in 0..r {
                    s = V::load(ls, (row * d + i) * r + k)
                        .fma(V::load(xs, (col * d + j) * r + k).conj(), s);
                }
                V::zero().sub(s)
            };
            for v in 0..n {
                let p = tree.parent(v);
                for i in 0..d {
                    for j in 0..d {
                        let e = (v * d + i) * d + j;
                        V::put(da, e, outer(v, v, i, j));
                        V::put(db, e, p.map_or(V::zero(), |p| outer(v, p, i, j)));
                        V::put(dcc, e, p.map_or(V::zero(), |p| outer(p, v, i, j)));
                    }
                }
            }
        });
        // SAFETY: every tree wrote all entries of its blocks in the three sets.
        Ok((lam, unsafe { dcoef.assume_filled() }))
    }
}

impl CustomOp2 for TreeSolveOp {
    fn name(&self) -> &'static str {
        "tree-solve"
    }

    fn cpu_fwd(
        &self,
        su: &CpuStorage,
        lu: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match su.dtype() {
            DType::F32 => CpuStorage::F32(
                self.forward_t(cpu_slice::<f32>(su, lu)?, cpu_slice::<f32>(sc, lc)?)?,
            ),
            DType::F64 => CpuStorage::F64(
                self.forward_t(cpu_slice::<f64>(su, lu)?, cpu_slice::<f64>(sc, lc)?)?,
            ),
            dt => bail!("tree_solve: dtype {dt:?} is not supported on the CPU"),
        };
        Ok((out, lu.shape().clone()))
    }

    fn bwd(
        &self,
        _u: &Tensor,
        coef: &Tensor,
        x: &Tensor,
        grad_x: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad_x.contiguous()?;
        let coef = coef.contiguous()?;
        let (du, dcoef) = match g.dtype() {
            DType::F32 => self.backward_tensors::<f32>(&coef, x, &g)?,
            DType::F64 => self.backward_tensors::<f64>(&coef, x, &g)?,
            dt => bail!("tree_solve backward: dtype {dt:?} is not supported on the CPU"),
        };
        Ok((Some(du), Some(dcoef)))
    }
}

impl TreeSolveOp {
    fn backward_tensors<F: WithDType>(
        &self,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let read = |t: &Tensor| -> Result<Vec<F>> { t.flatten_all()?.to_vec1::<F>() };
        let (coef_v, x_v, g_v) = (read(coef)?, read(x)?, read(g)?);
        let (du, dcoef) = self.backward_t(&coef_v, &x_v, &g_v)?;
        let dims = self.dims;
        let mut shape = vec![3, dims.batch, dims.heads, dims.nodes, dims.d, dims.d];
        if self.opts.complex {
            shape.push(2);
        }
        let dcoef = Tensor::from_vec(dcoef, shape, &Device::Cpu)?;
        let dcoef = if dims.shared { dcoef.sum(1)? } else { dcoef };
        Ok((Tensor::from_vec(du, g.shape(), &Device::Cpu)?, dcoef))
    }
}

/// The same solve as the paper's Listing 1, in plain candle ops: a loop over the BFS levels,
/// each level one batch of tensor operations (children's messages reach their parents by
/// `index_add`, parents' solutions come back down by `index_select`). Scalar blocks (d = 1),
/// real or complex. Differentiable by candle's autograd: the benchmark baseline and an
/// independent check of the op and its backward.
pub fn tree_solve_reference(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Tensor> {
    let dims = check_args(tree, a, b, c, u, opts)?;
    if dims.d != 1 {
        bail!(
            "tree_solve_reference: only scalar blocks (d = 1), got d = {}",
            dims.d
        );
    }
    let batched = |t: &Tensor| {
        if dims.shared {
            t.unsqueeze(0)
        } else {
            Ok(t.clone())
        }
    };
    let (a, b, c) = (batched(a)?, batched(b)?, batched(c)?);
    let level = |t: &Tensor, k: usize| t.narrow(2, tree.level(k).start, tree.level(k).len());
    let complex = opts.complex;
    let mul = |x: &Tensor, y: &Tensor| {
        if complex {
            complex_mul(x, y)
        } else {
            x.broadcast_mul(y)
        }
    };
    let div = |x: &Tensor, y: &Tensor| {
        if complex {
            complex_div(x, y)
        } else {
            x.broadcast_div(y)
        }
    };
    // Sum of per-child messages into their parents (a level of `parents` nodes).
    let to_parents = |msg: &Tensor, idx: &Tensor, parents: usize| {
        let mut shape = msg.dims().to_vec();
        shape[2] = parents;
        Tensor::zeros(shape, msg.dtype(), msg.device())?.index_add(idx, msg, 2)
    };
    let mut ahat = level(&a, 0)?;
    let mut uhat = level(u, 0)?;
    let mut down = Vec::with_capacity(tree.levels());
    for k in 0..tree.levels() - 1 {
        let up = tree.level(k + 1).start;
        let idx: Vec<u32> = tree
            .level(k)
            .map(|v| (tree.parents()[v] - up) as u32)
            .collect();
        let idx = Tensor::new(idx, u.device())?;
        let bhat = div(&level(&b, k)?.neg()?, &ahat)?;
        let uhat_k = div(&uhat, &ahat)?;
        let ck = level(&c, k)?;
        let parents = tree.level(k + 1).len();
        ahat = level(&a, k + 1)?.broadcast_add(&to_parents(&mul(&ck, &bhat)?, &idx, parents)?)?;
        uhat = (level(u, k + 1)? - to_parents(&mul(&ck, &uhat_k)?, &idx, parents)?)?;
        down.push((uhat_k, bhat, idx));
    }
    let mut x = div(&uhat, &ahat)?;
    let mut levels = vec![x.clone()];
    for (uhat_k, bhat, idx) in down.into_iter().rev() {
        x = (uhat_k + mul(&bhat, &x.index_select(&idx, 2)?)?)?;
        levels.push(x.clone());
    }
    levels.reverse();
    Tensor::cat(&levels, 2)
}

fn re_im(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let last = x.rank() - 1;
    Ok((x.narrow(last, 0, 1)?, x.narrow(last, 1, 1)?))
}

/// x · y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_mul(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ((xr, xi), (yr, yi)) = (re_im(x)?, re_im(y)?);
    let re = (xr.broadcast_mul(&yr)? - xi.broadcast_mul(&yi)?)?;
    let im = (xr.broadcast_mul(&yi)? + xi.broadcast_mul(&yr)?)?;
    Tensor::cat(&[re, im], x.rank() - 1)
}

/// x / y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_div(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ((xr, xi), (yr, yi)) = (re_im(x)?, re_im(y)?);
    let n = (yr.sqr()? + yi.sqr()?)?;
    let re = (xr.broadcast_mul(&yr)? + xi.broadcast_mul(&yi)?)?.broadcast_div(&n)?;
    let im = (xi.broadcast_mul(&yr)? - xr.broadcast_mul(&yi)?)?.broadcast_div(&n)?;
    Tensor::cat(&[re, im], x.rank() - 1)
}
