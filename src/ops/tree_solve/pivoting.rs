//! Partial pivoting for the blocked solve: the values its LU runs on choose their own pivot
//! rows. A scalar takes one row per column; [`Lanes`] (samples with coefficients of their own,
//! one per SIMD lane) take one per lane and swap them by blends, so each lane's operations are
//! those of its sample solved alone.

use candle_core::WithDType;

use crate::ops::value::{Complex, Re, Value};

/// A value an LU with partial pivoting runs on.
pub(super) trait Pivoting<F: WithDType>: Value<F> {
    /// The row taken as pivot: one, or one per lane.
    type Rows: Copy + Send + Sync;
    /// Rows before any elimination (never read before they are set).
    const NO_ROWS: Self::Rows;
    /// The pivot rows of column `col` of the d × d row-major `m`: the row at or below `col`
    /// whose entry has the largest |·|² (the first of equals, as the CUDA kernels choose).
    fn pivot_rows(m: &[Self], col: usize, d: usize) -> Self::Rows;
    /// Swaps row `col` with row `p` in the first `rows` rows of `width` entries of `a` (in
    /// each lane with that lane's row).
    fn swap_rows<const L: usize>(
        a: &mut [[Self; L]],
        col: usize,
        p: Self::Rows,
        rows_width: (usize, usize),
    );
}

/// A scalar value (real or complex) of the blocked solve.
pub(super) trait Scalar<F: WithDType>: Pivoting<F, Rows = usize> + Norm2<F> {}

impl<F: WithDType, V: Pivoting<F, Rows = usize> + Norm2<F>> Scalar<F> for V {}

/// |v|² in the working precision.
pub(super) trait Norm2<F> {
    fn norm2(self) -> F;
}

impl<F: WithDType> Norm2<F> for Re<F> {
    #[inline(always)]
    fn norm2(self) -> F {
        self.0 * self.0
    }
}

impl<F: WithDType> Norm2<F> for Complex<F> {
    #[inline(always)]
    fn norm2(self) -> F {
        self.re * self.re + self.im * self.im
    }
}

/// Column `col`'s pivot row in `m` (d × d), read through `norm2`.
#[inline(always)]
fn pivot_row<V, F: PartialOrd>(m: &[V], col: usize, d: usize, norm2: impl Fn(&V) -> F) -> usize {
    let mut p = col;
    for i in col + 1..d {
        if norm2(&m[i * d + col]) > norm2(&m[p * d + col]) {
            p = i;
        }
    }
    p
}

macro_rules! scalar_pivoting {
    ($v:ident) => {
        impl<F: WithDType> Pivoting<F> for $v<F> {
            type Rows = usize;
            const NO_ROWS: usize = 0;
            #[inline(always)]
            fn pivot_rows(m: &[Self], col: usize, d: usize) -> usize {
                pivot_row(m, col, d, |v| v.norm2())
            }
            #[inline(always)]
            fn swap_rows<const L: usize>(
                a: &mut [[Self; L]],
                col: usize,
                p: usize,
                (_, width): (usize, usize),
            ) {
                if p != col {
                    for j in 0..width {
                        a.swap(col * width + j, p * width + j);
                    }
                }
            }
        }
    };
}

scalar_pivoting!(Re);
scalar_pivoting!(Complex);

/// `M` values, one per SIMD lane: the lanes of [`Value`]'s operations are independent, each
/// lane's arithmetic that of `V` alone. Stored lane after lane, so element e of lane l is
/// element `e · M + l` of an interleaved slice.
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub(super) struct Lanes<V, const M: usize>(pub [V; M]);

impl<V: Copy, const M: usize> Lanes<V, M> {
    #[inline(always)]
    fn map(self, f: impl Fn(V) -> V) -> Self {
        Lanes(std::array::from_fn(|l| f(self.0[l])))
    }
    #[inline(always)]
    fn zip(self, o: Self, f: impl Fn(V, V) -> V) -> Self {
        Lanes(std::array::from_fn(|l| f(self.0[l], o.0[l])))
    }
}

impl<F: WithDType, V: Value<F>, const M: usize> Value<F> for Lanes<V, M> {
    const WIDTH: usize = V::WIDTH * M;
    #[inline(always)]
    fn zero() -> Self {
        Lanes([V::zero(); M])
    }
    #[inline(always)]
    fn one() -> Self {
        Lanes([V::one(); M])
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.zip(o, V::add)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.zip(o, V::mul)
    }
    #[inline(always)]
    fn conj(self) -> Self {
        self.map(V::conj)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.zip(o, V::sub)
    }
    #[inline(always)]
    fn inv(self) -> Self {
        self.map(V::inv)
    }
    /// Every lane's pivot is usable.
    #[inline(always)]
    fn pivot_ok(self) -> bool {
        self.0.iter().fold(true, |ok, v| ok & v.pivot_ok())
    }
    #[inline(always)]
    fn load(s: &[F], e: usize) -> Self {
        Lanes(std::array::from_fn(|l| V::load(s, e * M + l)))
    }
    #[inline(always)]
    fn put(s: &mut [F], e: usize, v: Self) {
        for (l, v) in v.0.into_iter().enumerate() {
            V::put(s, e * M + l, v);
        }
    }
    #[inline(always)]
    fn fma(self, x: Self, b: Self) -> Self {
        Lanes(std::array::from_fn(|l| self.0[l].fma(x.0[l], b.0[l])))
    }
}

impl<F: WithDType, V, const M: usize> Pivoting<F> for Lanes<V, M>
where
    V: Scalar<F>,
{
    type Rows = [u32; M];
    const NO_ROWS: [u32; M] = [0; M];
    #[inline(always)]
    fn pivot_rows(m: &[Self], col: usize, d: usize) -> [u32; M] {
        std::array::from_fn(|l| pivot_row(m, col, d, |v| v.0[l].norm2()) as u32)
    }
    /// Row by row below `col`, a blend of the two rows in the lanes whose pivot it is.
    #[inline(always)]
    fn swap_rows<const L: usize>(
        a: &mut [[Self; L]],
        col: usize,
        p: [u32; M],
        (rows, width): (usize, usize),
    ) {
        let pick = |take: [bool; M], x: Self, y: Self| {
            Lanes(std::array::from_fn(
                |k| if take[k] { x.0[k] } else { y.0[k] },
            ))
        };
        for i in col + 1..rows {
            let take = p.map(|r| r as usize == i);
            if !take.contains(&true) {
                continue;
            }
            let (above, below) = a.split_at_mut(i * width);
            let top = &mut above[col * width..(col + 1) * width];
            for (t, r) in top
                .iter_mut()
                .flatten()
                .zip(below[..width].iter_mut().flatten())
            {
                (*t, *r) = (pick(take, *r, *t), pick(take, *t, *r));
            }
        }
    }
}
