//! The block gradients of one scalar-block tree (the backward's second half, after the adjoint
//! solve), added to a sum: each node's values against its parent's, a uniform level's parents
//! repeated eight children at a time.

use candle_core::WithDType;

use crate::ops::value::Value;
use crate::tree::Tree;

/// `out[v]` = `vals[parent(v)]` for every node (the root's own value at the root), level by
/// level: a uniform level's parents repeated, eight children at a time (see `push_down`).
#[inline(always)]
fn spread_parents<V: Copy>(tree: &Tree, arity: &[usize], vals: &[V], out: &mut Vec<V>) {
    #[inline(always)]
    fn repeat<V: Copy, const K: usize>(pars: &[V], out: &mut [V]) {
        let blocks = out.len() / 8;
        let (o8, rest) = out.split_at_mut(blocks * 8);
        for (i, o) in o8.chunks_exact_mut(8).enumerate() {
            let x: [V; 8] = std::array::from_fn(|l| pars[(i * 8 + l) / K]);
            o.copy_from_slice(&x);
        }
        for (i, o) in rest.iter_mut().enumerate() {
            *o = pars[(blocks * 8 + i) / K];
        }
    }
    let root = tree.root();
    out.clear();
    out.resize(tree.len(), vals[root]);
    for (k, &a) in arity.iter().enumerate().skip(1) {
        let (ch, level) = (tree.level(k - 1), tree.level(k));
        let (pars, o) = (&vals[level.clone()], &mut out[ch.clone()]);
        match a {
            2 => repeat::<V, 2>(pars, o),
            3 => repeat::<V, 3>(pars, o),
            4 => repeat::<V, 4>(pars, o),
            _ => {
                for (o, &p) in o.iter_mut().zip(&tree.parents()[ch]) {
                    *o = vals[p];
                }
            }
        }
    }
}

/// Adds ∂A_v, ∂B_v, ∂C_v of one tree before their sign to `out` (3 × n): Σ_r λ_v conj(x_v),
/// Σ_r λ_v conj(x_parent) and Σ_r λ_parent conj(x_v) (nothing at the root), each tree's sum
/// formed from zero in the order of r before it is added. `xs` and `lp` are scratch.
#[inline(always)]
pub(super) fn add_grads<F: WithDType, V: Value<F>>(
    tree: &Tree,
    arity: &[usize],
    r: usize,
    lam: &[V],
    x: &[F],
    out: &mut [V],
    (xs, lp): (&mut Vec<V>, &mut Vec<V>),
) {
    let (n, root) = (tree.len(), tree.root());
    xs.clear();
    xs.extend((0..n * r).map(|e| V::load(x, e).conj()));
    let (ga, rest) = out.split_at_mut(n);
    let (gb, gc) = rest.split_at_mut(n);
    if r == 1 {
        let add = |g: &mut V, a: V, b: V| *g = g.add(V::zero().add(a.mul(b)));
        for ((g, l), x) in ga.iter_mut().zip(lam).zip(xs.iter()) {
            add(g, *l, *x);
        }
        // conj(x) and λ of each node's parent; the root is its own, its terms taken out.
        let (b_root, c_root) = (gb[root], gc[root]);
        spread_parents(tree, arity, xs, lp);
        for ((g, l), x) in gb.iter_mut().zip(lam).zip(lp.iter()) {
            add(g, *l, *x);
        }
        spread_parents(tree, arity, lam, lp);
        for ((g, l), x) in gc.iter_mut().zip(lp.iter()).zip(xs.iter()) {
            add(g, *l, *x);
        }
        (gb[root], gc[root]) = (b_root, c_root);
        return;
    }
    for v in 0..n {
        let p = tree.parents()[v];
        let (mut da, mut db, mut dc) = (V::zero(), V::zero(), V::zero());
        for j in 0..r {
            let xv = xs[v * r + j];
            da = da.add(lam[v * r + j].mul(xv));
            if v != root {
                db = db.add(lam[v * r + j].mul(xs[p * r + j]));
                dc = dc.add(lam[p * r + j].mul(xv));
            }
        }
        ga[v] = ga[v].add(da);
        if v != root {
            gb[v] = gb[v].add(db);
            gc[v] = gc[v].add(dc);
        }
    }
}
