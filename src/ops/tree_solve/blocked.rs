//! The CPU solve for d × d blocks (d > 1): one tree per rayon task, each Schur step a small LU
//! solve with partial pivoting.

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use super::{Side, TreeSolveOp};
use crate::ops::value::{OutBuf, SharedOut, Value};
use crate::tree::Tree;

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

/// Solves m X = rhs in place for a d × d `m` and a d × k `rhs` (row-major), by LU with
/// partial pivoting; m is destroyed and rhs becomes X.
fn lu_solve<F: WithDType, V: Value<F>>(m: &mut [V], rhs: &mut [V], d: usize, k: usize) -> bool {
    for col in 0..d {
        let mut piv = col;
        for i in col + 1..d {
            if m[i * d + col].norm2() > m[piv * d + col].norm2() {
                piv = i;
            }
        }
        if !m[piv * d + col].pivot_ok() {
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
    /// The d × d block solve of every tree, one per rayon task: `rhs` holds u (forward) or g
    /// (adjoint) and the solutions go to `out`.
    pub(super) fn solve_blocks<F: WithDType, V: Value<F>>(
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
        let trees = dims.batch * dims.heads;
        let coef_at = |t: usize| dims.coef_tree(t / dims.heads, t % dims.heads) * w;
        (0..trees).into_par_iter().try_for_each_init(
            || Workspace::<V>::new(V::zero()),
            |ws, t| {
                ws.size(V::zero(), dims.nodes, dims.d, dims.r);
                let c0 = coef_at(t);
                let blk = Blocks {
                    a: &ca[c0..c0 + per_coef],
                    b: &cb[c0..c0 + per_coef],
                    c: &cc[c0..c0 + per_coef],
                    d: dims.d,
                    side,
                };
                let u = &rhs[t * per_tree..(t + 1) * per_tree];
                // SAFETY: this task alone writes tree t's region of the output.
                let x = unsafe { out.row(t * per_tree, per_tree) };
                solve_blocked(&self.tree, &blk, u, x, dims.r, ws)
                    .map_err(|BadPivot(v)| self.pivot_error(side, t, v))
            },
        )
    }

    /// λ = T_G⁻ᴴ g, then the block gradients from λ and x: returns (∂u, ∂coef) with ∂coef
    /// stacked like the coefficients, per sample (summed over the batch by the caller when
    /// shared).
    pub(super) fn adjoint_and_grads<F: WithDType, V: Value<F>>(
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
