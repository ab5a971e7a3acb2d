//! The CPU twin of `kernels/head_solve.cu`: the same three steps with the same arithmetic in
//! the same order per (sample, node, head), so that the kernels run by the host harness match
//! it bit for bit. Samples are solved in parallel; within a node the loop runs over the heads,
//! which are contiguous, so it vectorises.

use candle_core::{bail, Device, Result, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{pivot_error, Dims, HeadSolveOp};
use crate::ops::value::{best_simd, contiguous, has_avx2, Complex, OutBuf, SharedOut, Value};
use crate::tree::Tree;

type C<F> = Complex<F>;

/// Per head, the pivots of T_G (or, with `adjoint`, of T_Gᴴ): piv = [1/Â; B̂; C'], each
/// (nodes, heads), from coef = [B; C] (see `head_pivots` in the kernel). Err((node, head)) for
/// a singular or non-finite pivot.
pub(super) fn pivots<F: WithDType>(
    tree: &Tree,
    heads: usize,
    coef: &[F],
    adjoint: bool,
) -> std::result::Result<Vec<F>, (usize, usize)> {
    let n = tree.len();
    let set = n * heads;
    let root = n - 1;
    let mut piv = vec![F::zero(); 3 * set * 2];
    for k in 0..tree.levels() {
        for v in tree.level(k) {
            for h in 0..heads {
                let mut a = C::<F>::one();
                for c in tree.children(v) {
                    let e = c * heads + h;
                    a = a.add(C::load(&piv, 2 * set + e).mul(C::load(&piv, set + e)));
                }
                if !a.pivot_ok() {
                    return Err((v, h));
                }
                let inv = a.inv();
                let e = v * heads + h;
                let (mut bp, mut cp) = (C::zero(), C::zero());
                if v != root {
                    let (b, c) = (C::load(coef, e), C::load(coef, set + e));
                    (bp, cp) = if adjoint {
                        (c.conj(), b.conj())
                    } else {
                        (b, c)
                    };
                }
                C::put(&mut piv, e, inv);
                C::put(&mut piv, set + e, C::zero().sub(bp.mul(inv)));
                C::put(&mut piv, 2 * set + e, cp);
            }
        }
    }
    Ok(piv)
}

/// One node's heads as complex values: scalars `2 · v · heads ..` of a (nodes, heads, 2) slice.
#[inline(always)]
fn row<F>(s: &[F], v: usize, heads: usize) -> &[F] {
    &s[2 * v * heads..2 * (v + 1) * heads]
}

/// x = M⁻¹ rhs for one sample, M as `piv` says (see `head_sweep` in the kernel): `rhs` is the
/// sample's (m, heads) right-hand sides, `bias` the internal nodes' (nodes − leaves, heads) or
/// None, `x` the sample's (nodes, heads) output.
#[inline(always)]
fn sweep_sample<F: WithDType>(
    tree: &Tree,
    heads: usize,
    (rhs, m): (&[F], usize),
    bias: Option<&[F]>,
    piv: &[F],
    x: &mut [F],
) {
    let (n, leaves) = (tree.len(), tree.leaves());
    let set = n * heads;
    let (inv, bhat, cp) = (&piv[..2 * set], &piv[2 * set..4 * set], &piv[4 * set..]);
    let hw = 2 * heads;
    for v in 0..n {
        let out = &mut x[v * hw..(v + 1) * hw];
        match (v < m, v >= leaves, bias) {
            (true, true, Some(bias)) => {
                let (r, b) = (row(rhs, v, heads), row(bias, v - leaves, heads));
                for h in 0..heads {
                    C::put(out, h, C::load(r, h).add(C::load(b, h)));
                }
            }
            (true, _, _) => out.copy_from_slice(row(rhs, v, heads)),
            (false, _, bias) => {
                let bias = bias.expect("nodes without input have a bias");
                out.copy_from_slice(row(bias, v - leaves, heads))
            }
        }
    }
    for k in 1..tree.levels() {
        for p in tree.level(k) {
            let (below, above) = x.split_at_mut(p * hw);
            let acc = &mut above[..hw];
            for c in tree.children(p) {
                let xc = &mut below[c * hw..(c + 1) * hw];
                let (ic, cc) = (row(inv, c, heads), row(cp, c, heads));
                for h in 0..heads {
                    let uc = C::load(xc, h).mul(C::load(ic, h));
                    C::put(xc, h, uc);
                    C::put(acc, h, C::load(acc, h).sub(C::load(cc, h).mul(uc)));
                }
            }
        }
    }
    let root = n - 1;
    let (xr, ir) = (&mut x[root * hw..], row(inv, root, heads));
    for h in 0..heads {
        C::put(xr, h, C::load(xr, h).mul(C::load(ir, h)));
    }
    for k in (1..tree.levels()).rev() {
        for p in tree.level(k) {
            let (below, above) = x.split_at_mut(p * hw);
            let xp = &above[..hw];
            for c in tree.children(p) {
                let xc = &mut below[c * hw..(c + 1) * hw];
                let bc = row(bhat, c, heads);
                for h in 0..heads {
                    C::put(
                        xc,
                        h,
                        C::load(xc, h).add(C::load(bc, h).mul(C::load(xp, h))),
                    );
                }
            }
        }
    }
}

/// Every sample's sweep, in parallel: (batch, nodes, heads, 2).
fn sweep<F: WithDType>(
    tree: &Tree,
    dims: &Dims,
    (rhs, m): (&[F], usize),
    bias: Option<&[F]>,
    piv: &[F],
) -> Vec<F> {
    let set = 2 * dims.nodes * dims.heads;
    let mut out = OutBuf::<F>::new(dims.batch * set);
    let ptr = out.ptr();
    let per = 2 * m * dims.heads;
    let avx2 = has_avx2();
    (0..dims.batch).into_par_iter().for_each(|b| {
        let _ = &ptr;
        // SAFETY: each sample writes its own region.
        let x = unsafe { SharedOut::row(ptr, b * set, set) };
        let r = &rhs[b * per..(b + 1) * per];
        best_simd!(avx2, sweep_sample(tree, dims.heads, (r, m), bias, piv, x));
    });
    // SAFETY: every sample's region was written (sweep_sample writes every node first).
    unsafe { out.assume_filled() }
}

/// [∂B; ∂C] (2, nodes, heads, 2) and ∂bias (max(nodes − leaves, 1), heads, 2; zero for a tree
/// without internal nodes) from λ and x, (batch, nodes, heads, 2) each (see `head_reduce`).
fn reduce<F: WithDType>(tree: &Tree, dims: &Dims, lam: &[F], x: &[F]) -> (Vec<F>, Vec<F>) {
    let Dims {
        batch,
        heads,
        nodes,
        leaves,
        ..
    } = *dims;
    let set = nodes * heads;
    let mut dcoef = vec![F::zero(); 2 * 2 * set];
    let mut dbias = vec![F::zero(); 2 * dims.internal().max(1) * heads];
    let (db_all, dc_all) = dcoef.split_at_mut(2 * set);
    let bias_rows = dbias.chunks_mut(2 * heads);
    let avx2 = has_avx2();
    let node_rows = db_all
        .par_chunks_mut(2 * heads)
        .zip(dc_all.par_chunks_mut(2 * heads))
        .enumerate();
    let mut bias_of: Vec<Option<&mut [F]>> = (0..nodes).map(|_| None).collect();
    for (i, r) in bias_rows.enumerate().take(dims.internal()) {
        bias_of[leaves + i] = Some(r);
    }
    node_rows
        .zip(bias_of.into_par_iter())
        .for_each(|((v, (db, dc)), dl)| {
            best_simd!(avx2, reduce_node(tree, v, batch, heads, lam, x, db, dc, dl));
        });
    (dcoef, dbias)
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn reduce_node<F: WithDType>(
    tree: &Tree,
    v: usize,
    batch: usize,
    heads: usize,
    lam: &[F],
    x: &[F],
    db: &mut [F],
    dc: &mut [F],
    dl: Option<&mut [F]>,
) {
    let set = tree.len() * heads;
    let parent = tree.parent(v);
    let mut acc_b = vec![C::<F>::zero(); heads];
    let mut acc_c = vec![C::<F>::zero(); heads];
    let mut acc_l = vec![C::<F>::zero(); heads];
    for b in 0..batch {
        let (l, xs) = (
            &lam[2 * b * set..2 * (b + 1) * set],
            &x[2 * b * set..2 * (b + 1) * set],
        );
        let lv = row(l, v, heads);
        if let Some(p) = parent {
            let (xp, lp, xv) = (row(xs, p, heads), row(l, p, heads), row(xs, v, heads));
            for h in 0..heads {
                acc_b[h] = acc_b[h].add(C::load(lv, h).mul(C::load(xp, h).conj()));
                acc_c[h] = acc_c[h].add(C::load(lp, h).mul(C::load(xv, h).conj()));
            }
        }
        for (h, a) in acc_l.iter_mut().enumerate() {
            *a = a.add(C::load(lv, h));
        }
    }
    for h in 0..heads {
        C::put(db, h, C::zero().sub(acc_b[h]));
        C::put(dc, h, C::zero().sub(acc_c[h]));
    }
    if let Some(dl) = dl {
        for (h, a) in acc_l.iter().enumerate() {
            C::put(dl, h, *a);
        }
    }
}

impl HeadSolveOp {
    pub(super) fn forward_t<F: WithDType>(
        &self,
        u: &[F],
        bias: &[F],
        coef: &[F],
    ) -> Result<Vec<F>> {
        let d = &self.dims;
        let piv =
            pivots(&self.tree, d.heads, coef, false).map_err(|(v, h)| pivot_error(v, h, false))?;
        let bias = (d.internal() > 0).then_some(bias);
        Ok(sweep(&self.tree, d, (u, d.m), bias, &piv))
    }

    /// (λ, ∂bias, ∂coef) as tensors: λ (batch, nodes, heads, 2), ∂bias
    /// (max(nodes − leaves, 1), heads, 2), ∂coef (2, nodes, heads, 2).
    pub(super) fn backward_tensors<F: WithDType>(
        &self,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (sc, lc) = coef.storage_and_layout();
        let (sx, lx) = x.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sc), Storage::Cpu(sx), Storage::Cpu(sg)) = (&*sc, &*sx, &*sg) else {
            bail!("head_solve backward: tensors are not all on the CPU")
        };
        let (coef, x, g) = (
            contiguous::<F>(sc, lc)?,
            contiguous::<F>(sx, lx)?,
            contiguous::<F>(sg, lg)?,
        );
        let d = &self.dims;
        let piv =
            pivots(&self.tree, d.heads, coef, true).map_err(|(v, h)| pivot_error(v, h, true))?;
        let lam = sweep(&self.tree, d, (g, d.nodes), None, &piv);
        let (dcoef, dbias) = reduce(&self.tree, d, &lam, x);
        let dev = &Device::Cpu;
        Ok((
            Tensor::from_vec(lam, (d.batch, d.nodes, d.heads, 2), dev)?,
            Tensor::from_vec(dbias, (d.internal().max(1), d.heads, 2), dev)?,
            Tensor::from_vec(dcoef, (2, d.nodes, d.heads, 2), dev)?,
        ))
    }
}
