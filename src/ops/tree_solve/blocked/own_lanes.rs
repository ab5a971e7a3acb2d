//! Samples with coefficients of their own, eight at a time in SIMD lanes ([`OwnLanes`]).

use candle_core::WithDType;

use super::super::pivoting::{Lanes, Pivoting, Scalar};
use super::{Blocks, Factors, SAMPLE_LANES};
use crate::ops::value::{best_simd, Value};
use crate::tree::Tree;

/// The solve of [`SAMPLE_LANES`] samples of a head that have coefficients of their own, one
/// per lane of a [`Lanes`] value: their coefficients and right-hand sides interleaved, the
/// pivot blocks eliminated with each lane choosing its own rows, the solutions spread back.
/// Each lane's arithmetic is its sample's solved alone, to the bit.
pub(super) struct OwnLanes<F, V> {
    fac: Factors<Lanes<V, SAMPLE_LANES>, [u32; SAMPLE_LANES]>,
    /// A, B and C of the samples, then u and x, interleaved (element e of lane l at
    /// e · SAMPLE_LANES + l).
    coef: [Vec<F>; 3],
    u: Vec<F>,
    x: Vec<F>,
    uhat: Vec<[Lanes<V, SAMPLE_LANES>; 1]>,
    xs: Vec<[Lanes<V, SAMPLE_LANES>; 1]>,
}

impl<F: WithDType, V: Scalar<F>> OwnLanes<F, V> {
    pub(super) fn new(n: usize, d: usize, r: usize) -> Self {
        let zero = Lanes::<V, SAMPLE_LANES>::zero();
        let no_rows = <Lanes<V, SAMPLE_LANES> as Pivoting<F>>::NO_ROWS;
        OwnLanes {
            fac: Factors::new(zero, no_rows, n, d),
            coef: Default::default(),
            u: vec![],
            x: vec![],
            uhat: vec![[zero]; n * d * r],
            xs: vec![[zero]; n * d * r],
        }
    }

    /// Solves the samples whose coefficients `blocks` reads, right-hand sides `u` into `x`.
    /// False, writing nothing, where a lane's pivot is singular or not finite.
    pub(super) fn solve<const D: usize>(
        &mut self,
        tree: &Tree,
        blocks: [Blocks<F>; SAMPLE_LANES],
        (u, x): ([&[F]; SAMPLE_LANES], [&mut [F]; SAMPLE_LANES]),
        r: usize,
        avx2: bool,
    ) -> bool {
        let w = V::WIDTH;
        for (k, dst) in self.coef.iter_mut().enumerate() {
            let sets = blocks.each_ref().map(|b| [b.a, b.b, b.c][k]);
            interleave(dst, &sets, w);
        }
        let [a, b, c] = self.coef.each_ref().map(|v| &v[..]);
        let (d, side) = (blocks[0].d, blocks[0].side);
        let blk = Blocks { a, b, c, d, side };
        if best_simd!(avx2, self.fac.eliminate::<F, D>(tree, &blk)).is_err() {
            return false;
        }
        interleave(&mut self.u, &u, w);
        self.x.resize(self.u.len(), F::zero());
        let ws = (&mut self.uhat[..], &mut self.xs[..]);
        let io = ([&self.u[..]], [&mut self.x[..]]);
        match r {
            1 => best_simd!(avx2, self.fac.solve::<F, D, 1, 1>(tree, io, r, ws)),
            _ => best_simd!(avx2, self.fac.solve::<F, D, 1, 0>(tree, io, r, ws)),
        }
        spread(&self.x, x, w);
        true
    }
}

/// `dst` ← the slices' elements (`w` scalars each) interleaved: element e of slice l at
/// e · (number of slices) + l.
fn interleave<F: WithDType>(dst: &mut Vec<F>, srcs: &[&[F]; SAMPLE_LANES], w: usize) {
    let len = srcs[0].len();
    dst.resize(len * SAMPLE_LANES, F::zero());
    match w {
        1 => lanes_of::<F, 1>(dst, srcs),
        _ => lanes_of::<F, 2>(dst, srcs),
    }
}

/// [`interleave`] for elements of `W` scalars (a loop of known length, not a copy call per
/// element).
#[inline(always)]
fn lanes_of<F: Copy, const W: usize>(dst: &mut [F], srcs: &[&[F]; SAMPLE_LANES]) {
    for (e, out) in dst.chunks_exact_mut(W * SAMPLE_LANES).enumerate() {
        for (l, s) in srcs.iter().enumerate() {
            out[l * W..(l + 1) * W].copy_from_slice(&s[e * W..(e + 1) * W]);
        }
    }
}

/// The inverse of [`interleave`]: lane l's elements to `dst[l]`.
fn spread<F: Copy>(src: &[F], dst: [&mut [F]; SAMPLE_LANES], w: usize) {
    #[inline(always)]
    fn of<F: Copy, const W: usize>(src: &[F], mut dst: [&mut [F]; SAMPLE_LANES]) {
        for (e, from) in src.chunks_exact(W * SAMPLE_LANES).enumerate() {
            for (l, d) in dst.iter_mut().enumerate() {
                d[e * W..(e + 1) * W].copy_from_slice(&from[l * W..(l + 1) * W]);
            }
        }
    }
    match w {
        1 => of::<F, 1>(src, dst),
        _ => of::<F, 2>(src, dst),
    }
}
