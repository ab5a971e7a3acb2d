//! The CPU twin of `kernels/head_solve.cu`: the pivots, the sweep and the reduction with the
//! same arithmetic in the same order per (sample, node, head), so that the kernels run by the
//! host harness match it bit for bit (`head_staged` forms the same pivots on its way up, per
//! block instead of once). Samples are solved in parallel; within a node the loop runs over the heads,
//! which are contiguous, so it vectorises.

use std::borrow::Cow;

use candle_core::{bail, Device, Result, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{pivot_error, Dims, HeadSolveOp};
use crate::ops::value::{best_simd, contiguous, has_avx2, Complex, OutBuf, SharedOut, Value};
use crate::tree::Tree;

type C<F> = Complex<F>;

/// A (re, im) scalar slice as complex values.
#[inline(always)]
fn cx<F: WithDType>(s: &[F]) -> &[C<F>] {
    debug_assert_eq!(s.len() % 2, 0);
    // SAFETY: Complex<F> is repr(C) { re, im }: two F with F's alignment and no padding.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len() / 2) }
}

/// As [`cx`], mutable.
#[inline(always)]
fn cx_mut<F: WithDType>(s: &mut [F]) -> &mut [C<F>] {
    debug_assert_eq!(s.len() % 2, 0);
    // SAFETY: as in `cx`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len() / 2) }
}

/// Row `v` of a (rows, heads) slice: one node's heads.
#[inline(always)]
fn row<F>(s: &[C<F>], v: usize, heads: usize) -> &[C<F>] {
    &s[v * heads..(v + 1) * heads]
}

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
    let coef = cx(coef);
    let mut piv = vec![C::<F>::zero(); 3 * set];
    let mut a = vec![C::<F>::zero(); heads];
    for k in 0..tree.levels() {
        for v in tree.level(k) {
            a.fill(C::one());
            for c in tree.children(v) {
                let (bh, cp) = (
                    &piv[set + c * heads..][..heads],
                    &piv[2 * set + c * heads..][..heads],
                );
                for ((a, bh), cp) in a.iter_mut().zip(bh).zip(cp) {
                    *a = a.add(cp.mul(*bh));
                }
            }
            if let Some(h) = a.iter().position(|a| !a.pivot_ok()) {
                return Err((v, h));
            }
            let (b, c) = (
                &coef[v * heads..][..heads],
                &coef[set + v * heads..][..heads],
            );
            let (inv, rest) = piv[v * heads..].split_at_mut(set);
            let (bh, rest) = rest.split_at_mut(set);
            let rows = inv[..heads]
                .iter_mut()
                .zip(&mut bh[..heads])
                .zip(&mut rest[..heads]);
            for (h, ((inv, bh), cp)) in rows.enumerate() {
                let (mut bp, mut c_p) = (C::zero(), C::zero());
                if v != root {
                    (bp, c_p) = if adjoint {
                        (c[h].conj(), b[h].conj())
                    } else {
                        (b[h], c[h])
                    };
                }
                *inv = a[h].inv();
                *bh = C::zero().sub(bp.mul(*inv));
                *cp = c_p;
            }
        }
    }
    // SAFETY: a Vec of Complex<F> is its scalars, re and im in turn.
    let mut piv = std::mem::ManuallyDrop::new(piv);
    Ok(unsafe { Vec::from_raw_parts(piv.as_mut_ptr().cast(), 2 * piv.len(), 2 * piv.capacity()) })
}

/// x = M⁻¹ rhs for one sample, M as `piv` says (see `head_sweep` in the kernel): `rhs` is the
/// sample's (m, heads) right-hand sides, `bias` the internal nodes' (nodes − leaves, heads) or
/// None (zero), `x` the sample's (nodes, heads) output.
#[inline(always)]
fn sweep_sample<F: WithDType>(
    tree: &Tree,
    heads: usize,
    (rhs, m): (&[C<F>], usize),
    bias: Option<&[C<F>]>,
    piv: &[C<F>],
    x: &mut [C<F>],
) {
    let (n, leaves) = (tree.len(), tree.leaves());
    let set = n * heads;
    let (inv, bhat, cp) = (&piv[..set], &piv[set..2 * set], &piv[2 * set..]);
    let row = |s, v| row(s, v, heads);
    for (v, out) in x.chunks_exact_mut(heads).enumerate() {
        let bias = bias.filter(|_| v >= leaves).map(|b| row(b, v - leaves));
        match (v < m, bias) {
            (true, Some(b)) => {
                for ((o, r), b) in out.iter_mut().zip(row(rhs, v)).zip(b) {
                    *o = r.add(*b);
                }
            }
            (true, None) => out.copy_from_slice(row(rhs, v)),
            (false, Some(b)) => out.copy_from_slice(b),
            (false, None) => out.fill(C::zero()),
        }
    }
    for k in 1..tree.levels() {
        for p in tree.level(k) {
            let (below, above) = x.split_at_mut(p * heads);
            let acc = &mut above[..heads];
            for c in tree.children(p) {
                let xc = &mut below[c * heads..(c + 1) * heads];
                let terms = xc
                    .iter_mut()
                    .zip(row(inv, c))
                    .zip(row(cp, c))
                    .zip(acc.iter_mut());
                for (((xc, ic), cc), acc) in terms {
                    let uc = xc.mul(*ic);
                    *xc = uc;
                    *acc = acc.sub(cc.mul(uc));
                }
            }
        }
    }
    let root = n - 1;
    for (xr, ir) in x[root * heads..].iter_mut().zip(row(inv, root)) {
        *xr = xr.mul(*ir);
    }
    for k in (1..tree.levels()).rev() {
        for p in tree.level(k) {
            let (below, above) = x.split_at_mut(p * heads);
            let xp = &above[..heads];
            for c in tree.children(p) {
                let xc = &mut below[c * heads..(c + 1) * heads];
                for ((xc, bc), xp) in xc.iter_mut().zip(row(bhat, c)).zip(xp) {
                    *xc = xc.add(bc.mul(*xp));
                }
            }
        }
    }
}

/// Every sample's sweep, in parallel: (batch, nodes, heads, 2). The nodes from `m` on have no
/// right-hand side in `rhs`: the bias, or zero.
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
    let (bias, piv) = (bias.map(cx), cx(piv));
    (0..dims.batch).into_par_iter().for_each(|b| {
        let _ = &ptr;
        // SAFETY: each sample writes its own region.
        let x = cx_mut(unsafe { SharedOut::row(ptr, b * set, set) });
        let r = cx(&rhs[b * per..(b + 1) * per]);
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
    let set = 2 * nodes * heads;
    let mut dcoef = vec![F::zero(); 2 * set];
    let mut dbias = vec![F::zero(); 2 * dims.internal().max(1) * heads];
    let (db_all, dc_all) = dcoef.split_at_mut(set);
    let mut bias_of: Vec<Option<&mut [F]>> = (0..nodes).map(|_| None).collect();
    for (i, r) in dbias
        .chunks_mut(2 * heads)
        .enumerate()
        .take(dims.internal())
    {
        bias_of[leaves + i] = Some(r);
    }
    let avx2 = has_avx2();
    db_all
        .par_chunks_mut(2 * heads)
        .zip(dc_all.par_chunks_mut(2 * heads))
        .zip(bias_of.into_par_iter())
        .enumerate()
        .for_each(|(v, ((db, dc), dl))| {
            let rows = (cx_mut(db), cx_mut(dc), dl.map(cx_mut));
            best_simd!(avx2, reduce_node(tree, v, batch, heads, (lam, x), rows));
        });
    (dcoef, dbias)
}

/// One node's ∂B, ∂C and, for an internal node, ∂bias.
type NodeGrads<'a, F> = (&'a mut [C<F>], &'a mut [C<F>], Option<&'a mut [C<F>]>);

/// One node's gradients, summed over the batch in order.
#[inline(always)]
fn reduce_node<F: WithDType>(
    tree: &Tree,
    v: usize,
    batch: usize,
    heads: usize,
    (lam, x): (&[F], &[F]),
    (db, dc, dl): NodeGrads<'_, F>,
) {
    let (lam, x) = (cx(lam), cx(x));
    let row = |s, b, v| row(s, b * tree.len() + v, heads);
    let mut acc_l = vec![C::<F>::zero(); heads];
    db.fill(C::zero());
    dc.fill(C::zero());
    for b in 0..batch {
        let lv = row(lam, b, v);
        if let Some(p) = tree.parent(v) {
            let (xp, lp, xv) = (row(x, b, p), row(lam, b, p), row(x, b, v));
            let terms = db
                .iter_mut()
                .zip(dc.iter_mut())
                .zip(lv)
                .zip(xp)
                .zip(lp)
                .zip(xv);
            for (((((db, dc), lv), xp), lp), xv) in terms {
                *db = db.add(lv.mul(xp.conj()));
                *dc = dc.add(lp.mul(xv.conj()));
            }
        }
        for (a, l) in acc_l.iter_mut().zip(lv) {
            *a = a.add(*l);
        }
    }
    for (db, dc) in db.iter_mut().zip(dc.iter_mut()) {
        *db = C::zero().sub(*db);
        *dc = C::zero().sub(*dc);
    }
    if let Some(dl) = dl {
        dl.copy_from_slice(&acc_l);
    }
}

/// A (rows, cols) matrix of complex values transposed.
fn transposed<F: WithDType>(x: &[F], rows: usize, cols: usize) -> Vec<F> {
    let x = cx(x);
    let mut t = Vec::with_capacity(2 * rows * cols);
    for j in 0..cols {
        for i in 0..rows {
            let z = x[i * cols + j];
            t.extend([z.re, z.im]);
        }
    }
    t
}

/// The skew form's s (heads, nodes) as [B; C] (nodes, heads): B = 0 − s, C = conj(s), as
/// `head_pivots` forms them.
fn skew_coef<F: WithDType>(s: &[F], heads: usize, nodes: usize) -> Vec<F> {
    let st = transposed(s, heads, nodes);
    let mut coef = Vec::with_capacity(2 * st.len());
    coef.extend(cx(&st).iter().flat_map(|z| {
        let b = C::zero().sub(*z);
        [b.re, b.im]
    }));
    coef.extend(cx(&st).iter().flat_map(|z| {
        let c = z.conj();
        [c.re, c.im]
    }));
    coef
}

/// ∂s = conj(∂C) − ∂B (heads, nodes) from [∂B; ∂C] (nodes, heads), as `head_reduce` forms it.
fn skew_grad<F: WithDType>(dcoef: &[F], heads: usize, nodes: usize) -> Vec<F> {
    let (db, dc) = dcoef.split_at(dcoef.len() / 2);
    let ds: Vec<F> = cx(db)
        .iter()
        .zip(cx(dc))
        .flat_map(|(b, c)| {
            let d = c.conj().sub(*b);
            [d.re, d.im]
        })
        .collect();
    transposed(&ds, nodes, heads)
}

impl HeadSolveOp {
    pub(super) fn forward_t<F: WithDType>(
        &self,
        u: &[F],
        bias: &[F],
        coef: &[F],
    ) -> Result<Vec<F>> {
        let d = &self.dims;
        let (bias, coef) = (self.general_bias(bias), self.general_coef(coef));
        let piv = pivots(&self.tree, d.heads, &coef, false)
            .map_err(|(v, h)| pivot_error(v, h, "forward"))?;
        let bias = (d.internal() > 0).then_some(&bias[..]);
        Ok(sweep(&self.tree, d, (u, d.m), bias, &piv))
    }

    /// [B; C] of the general form: `coef` itself, or formed from the skew form's s.
    fn general_coef<'a, F: WithDType>(&self, coef: &'a [F]) -> Cow<'a, [F]> {
        let d = &self.dims;
        match d.skew {
            false => Cow::Borrowed(coef),
            true => Cow::Owned(skew_coef(coef, d.heads, d.nodes)),
        }
    }

    /// The bias as (internal, heads): `bias` itself, or the skew form's transposed.
    fn general_bias<'a, F: WithDType>(&self, bias: &'a [F]) -> Cow<'a, [F]> {
        let d = &self.dims;
        match d.skew {
            false => Cow::Borrowed(bias),
            true => Cow::Owned(transposed(bias, d.heads, d.internal().max(1))),
        }
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
        let coef = self.general_coef(coef);
        let piv = pivots(&self.tree, d.heads, &coef, true)
            .map_err(|(v, h)| pivot_error(v, h, "backward"))?;
        let lam = sweep(&self.tree, d, (g, d.nodes), None, &piv);
        let (mut dcoef, mut dbias) = reduce(&self.tree, d, &lam, x);
        if d.skew {
            dcoef = skew_grad(&dcoef, d.heads, d.nodes);
            dbias = transposed(&dbias, d.internal().max(1), d.heads);
        }
        let dev = &Device::Cpu;
        Ok((
            Tensor::from_vec(lam, (d.batch, d.nodes, d.heads, 2), dev)?,
            Tensor::from_vec(dbias, d.bias_shape(), dev)?,
            Tensor::from_vec(dcoef, d.coef_shape(), dev)?,
        ))
    }
}
