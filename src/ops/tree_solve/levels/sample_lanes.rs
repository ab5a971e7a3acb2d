//! Samples that share their head's coefficients, eight at a time in SIMD lanes: the pivots are
//! one value per node for all of them, so the sweep over eight trees is one sweep whose values
//! are eight lanes wide, each pivot broadcast. The lanes' steps are vertical (no shuffles
//! between a parent and its children, which the single-tree sweep needs), and each lane's
//! arithmetic is its sample's alone: the values of [`super::sweep`], to the bit.
//! The rows go into lanes and back by 8 × 8 transposes, eight nodes at a time.

use candle_core::WithDType;

use super::super::pivoting::Lanes;
use super::super::transpose::{from_lanes, to_lanes};
use super::Pivots;
use crate::ops::value::Value;
use crate::tree::Tree;

pub(super) use super::super::transpose::LANES;

/// One node's values in the eight samples.
pub(super) type Group<V> = Lanes<V, LANES>;

#[inline(always)]
fn splat<V: Copy>(v: V) -> Group<V> {
    Lanes([v; LANES])
}

/// Solves the trees whose right-hand sides (one per node) are `rhs[l]`, with the pivots `pv`
/// they share, into the nodes at `out[l]`; `s` is scratch.
///
/// # Safety
/// Each `out[l]` must point to `tree.len()` values that are the caller's alone to write.
#[inline(always)]
pub(super) unsafe fn solve<F: WithDType, V: Value<F>>(
    tree: &Tree,
    arity: &[usize],
    pv: &Pivots<V>,
    (rhs, out): ([&[V]; LANES], [*mut V; LANES]),
    s: &mut Vec<Group<V>>,
) {
    let n = tree.len();
    s.resize(n, splat(V::zero()));
    let done = to_lanes(rhs.map(|r| r.as_ptr()), n, s.as_mut_ptr().cast());
    for (v, x) in s.iter_mut().enumerate().skip(done) {
        *x = Lanes(std::array::from_fn(|l| rhs[l][v]));
    }
    upward::<F, V>(tree, arity, pv, s);
    downward::<F, V>(tree, arity, pv, s);
    let done = from_lanes(s.as_ptr().cast(), n, out);
    for (v, x) in s.iter().enumerate().skip(done) {
        for (o, x) in out.iter().zip(x.0) {
            o.add(v).write(x);
        }
    }
}

/// The upward sweep of [`super::sweep`] over eight lanes; ends with the root's x.
#[inline(always)]
fn upward<F: WithDType, V: Value<F>>(
    tree: &Tree,
    arity: &[usize],
    pv: &Pivots<V>,
    s: &mut [Group<V>],
) {
    let Pivots { inv, dn, .. } = pv;
    for (k, &arity) in arity.iter().enumerate().skip(1) {
        let ch = tree.level(k - 1);
        let (below, above) = s.split_at_mut(ch.end);
        let kids = &mut below[ch.clone()];
        for (u, i) in kids.iter_mut().zip(&inv[ch.clone()]) {
            *u = u.mul(splat(*i));
        }
        let level = tree.level(k);
        let pars = &mut above[..level.len()];
        let dn = &dn[ch.clone()];
        match arity {
            0 => {
                for (p, acc) in level.zip(pars.iter_mut()) {
                    for c in tree.children(p) {
                        let c = c - ch.start;
                        *acc = acc.sub(splat(dn[c]).mul(kids[c]));
                    }
                }
            }
            a => {
                let rows = kids.chunks_exact(a).zip(dn.chunks_exact(a));
                for (acc, (us, ds)) in pars.iter_mut().zip(rows) {
                    let mut x = *acc;
                    for (u, d) in us.iter().zip(ds) {
                        x = x.sub(splat(*d).mul(*u));
                    }
                    *acc = x;
                }
            }
        }
    }
    let root = tree.root();
    s[root] = s[root].mul(splat(inv[root]));
}

/// The downward sweep of [`super::sweep`] over eight lanes: x_c = û_c + B̂_c x_p from the
/// root's children down.
#[inline(always)]
fn downward<F: WithDType, V: Value<F>>(
    tree: &Tree,
    arity: &[usize],
    pv: &Pivots<V>,
    s: &mut [Group<V>],
) {
    for k in (1..tree.levels()).rev() {
        let ch = tree.level(k - 1);
        let (below, above) = s.split_at_mut(ch.end);
        let kids = &mut below[ch.clone()];
        let p0 = tree.level(k).start;
        let pars = &above[..tree.level(k).len()];
        let bh = &pv.bh[ch.clone()];
        match arity[k] {
            0 => {
                let parents = &tree.parents()[ch];
                for ((u, b), &p) in kids.iter_mut().zip(bh).zip(parents) {
                    *u = u.add(splat(*b).mul(pars[p - p0]));
                }
            }
            a => {
                let rows = kids.chunks_exact_mut(a).zip(bh.chunks_exact(a));
                for ((us, bs), xp) in rows.zip(pars) {
                    for (u, b) in us.iter_mut().zip(bs) {
                        *u = u.add(splat(*b).mul(*xp));
                    }
                }
            }
        }
    }
}
