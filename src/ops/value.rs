//! Scalar arithmetic shared by the CPU twins: real numbers and complex numbers stored as
//! (re, im) pairs, so one generic kernel body serves both (as the CUDA templates do).

use candle_core::{DType, WithDType};

/// The contiguous elements of a CPU storage under `l` (the ops make their inputs contiguous
/// before launching, so anything else is an internal error).
pub(crate) fn contiguous<'a, F: WithDType>(
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<&'a [F]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<F>()?[start..end]),
        None => candle_core::bail!("internal error: a custom op's input is not contiguous"),
    }
}

/// Whether an element-wise op of ours runs fused on `t`: f32, f64, f16 and bf16 on the CPU and
/// on CUDA (elsewhere the ops fall back to candle's).
pub(crate) fn fused_elementwise(t: &candle_core::Tensor) -> bool {
    use candle_core::Device;
    matches!(t.device(), Device::Cpu | Device::Cuda(_))
        && matches!(
            t.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
}

/// The values of an f16 or bf16 CPU storage under `l`, in f32: how the CPU twins of the kernels
/// read half precision (the kernels load each value into f32, compute in f32 and round only
/// what they store; the twins run their f32 arithmetic on these and [`narrowed`] rounds).
pub(crate) fn widened_values(
    s: &candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<Vec<f32>> {
    use candle_core::CpuStorage;
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("internal error: a custom op's input is not contiguous")
    };
    use half::slice::HalfFloatSliceExt;
    // The slice conversions run in SIMD lanes where the CPU has them (F16C), and are exact.
    Ok(match s {
        CpuStorage::F16(v) => v[a..b].to_f32_vec(),
        CpuStorage::BF16(v) => v[a..b].to_f32_vec(),
        s => {
            use candle_core::backend::BackendStorage;
            candle_core::bail!("internal error: {:?} is not half precision", s.dtype())
        }
    })
}

/// f32 results stored in `dtype` (f16 or bf16), each rounded to nearest even as the kernels'
/// stores round.
pub(crate) fn narrowed(v: Vec<f32>, dtype: DType) -> candle_core::Result<candle_core::CpuStorage> {
    use candle_core::CpuStorage;
    use half::vec::HalfFloatVecExt;
    // In SIMD lanes where the CPU has them (F16C, rounding to nearest even as `from_f32`).
    Ok(match dtype {
        DType::F16 => CpuStorage::F16(Vec::<half::f16>::from_f32_slice(&v)),
        DType::BF16 => CpuStorage::BF16(Vec::<half::bf16>::from_f32_slice(&v)),
        dt => candle_core::bail!("internal error: {dt:?} is not half precision"),
    })
}

/// [`narrowed`] as a CPU tensor of `shape`.
pub(crate) fn narrowed_tensor(
    v: Vec<f32>,
    shape: impl Into<candle_core::Shape>,
    dtype: DType,
) -> candle_core::Result<candle_core::Tensor> {
    let shape = shape.into();
    let dev = candle_core::Device::Cpu;
    match narrowed(v, dtype)? {
        candle_core::CpuStorage::F16(v) => candle_core::Tensor::from_vec(v, shape, &dev),
        candle_core::CpuStorage::BF16(v) => candle_core::Tensor::from_vec(v, shape, &dev),
        _ => unreachable!("narrowed makes half precision"),
    }
}

/// The kernels' compute type `Acc<T>` for values stored in `dtype`: f64 for f64, f32 otherwise.
pub(crate) fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Whether `dtype` is f16 or bf16.
pub(crate) fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `t` in f32 when it is f16 or bf16, else `t` itself: for what computes in f32 and f64 only
/// under half precision (a layer's parameter-side ops, the loss).
pub(crate) fn widened(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    match t.dtype() {
        DType::F16 | DType::BF16 => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}

/// The element types of the CPU twins' storage: the four float dtypes.
pub(crate) trait Elem: candle_core::WithDType + Send + Sync {
    fn values_mut(s: &mut candle_core::CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! elem {
    ($t:ty, $v:ident) => {
        impl Elem for $t {
            fn values_mut(s: &mut candle_core::CpuStorage) -> Option<&mut [Self]> {
                match s {
                    candle_core::CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
elem!(f32, F32);
elem!(f64, F64);
elem!(half::f16, F16);
elem!(half::bf16, BF16);

/// A stored value read into the compute type F, as the kernels' `to_acc` (f16/bf16 into f32).
pub(crate) trait Load<F>: Elem + Copy {
    fn load(self) -> F;
}

/// F stored as a value of this type (f32 into f16/bf16 rounded to nearest even), as the
/// kernels' `store_s`.
pub(crate) trait Store<F>: Elem {
    fn store(v: F) -> Self;
}

impl<F: Elem + Copy> Load<F> for F {
    fn load(self) -> F {
        self
    }
}
impl<F: Elem> Store<F> for F {
    fn store(v: F) -> Self {
        v
    }
}
impl Load<f32> for half::f16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
}
impl Load<f32> for half::bf16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
}
impl Store<f32> for half::f16 {
    fn store(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}
impl Store<f32> for half::bf16 {
    fn store(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

/// A field element the CPU kernels compute with: a real `F`, or a complex number over `F`.
pub(crate) trait Value<F: WithDType>: Copy + Send + Sync {
    /// Scalars per element in storage: 1 for real, 2 for complex (re, im).
    const WIDTH: usize;
    fn zero() -> Self;
    fn one() -> Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn conj(self) -> Self;
    fn sub(self, o: Self) -> Self;
    /// 1 / self.
    fn inv(self) -> Self;
    /// Usable as a pivot: non-zero and finite (in the working precision, branch-free, so that
    /// a check over SIMD lanes vectorises; `x - x == 0` fails for NaN and ±∞).
    fn pivot_ok(self) -> bool;
    /// Reads element `e` (not scalar `e`) of a storage slice.
    fn load(s: &[F], e: usize) -> Self;
    /// Writes element `e` (not scalar `e`) of a storage slice.
    fn put(s: &mut [F], e: usize, v: Self);
    /// Element `e` of a slice, conjugated when `CONJ`.
    #[inline(always)]
    fn load_c<const CONJ: bool>(s: &[F], e: usize) -> Self {
        let v = Self::load(s, e);
        if CONJ {
            v.conj()
        } else {
            v
        }
    }
    /// `a * x + b`, the step of the recurrence.
    #[inline(always)]
    fn fma(self, x: Self, b: Self) -> Self {
        self.mul(x).add(b)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct Complex<F> {
    pub re: F,
    pub im: F,
}

/// Real numbers. `Re` wraps the scalar so that the two impls do not overlap.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(transparent)]
pub(crate) struct Re<F>(pub F);

impl<F: WithDType> Value<F> for Re<F> {
    const WIDTH: usize = 1;
    #[inline(always)]
    fn zero() -> Self {
        Re(F::zero())
    }
    #[inline(always)]
    fn one() -> Self {
        Re(F::one())
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        Re(self.0 + o.0)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        Re(self.0 * o.0)
    }
    #[inline(always)]
    fn conj(self) -> Self {
        self
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        Re(self.0 - o.0)
    }
    #[inline(always)]
    fn inv(self) -> Self {
        Re(F::one() / self.0)
    }
    #[inline(always)]
    #[allow(clippy::eq_op)] // x - x is 0 exactly when x is finite
    fn pivot_ok(self) -> bool {
        (self.0 != F::zero()) & (self.0 - self.0 == F::zero())
    }
    #[inline(always)]
    fn load(s: &[F], e: usize) -> Self {
        Re(s[e])
    }
    #[inline(always)]
    fn put(s: &mut [F], e: usize, v: Self) {
        s[e] = v.0;
    }
}

impl<F: WithDType> Value<F> for Complex<F> {
    const WIDTH: usize = 2;
    #[inline(always)]
    fn zero() -> Self {
        Complex {
            re: F::zero(),
            im: F::zero(),
        }
    }
    #[inline(always)]
    fn one() -> Self {
        Complex {
            re: F::one(),
            im: F::zero(),
        }
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        Complex {
            re: self.re + o.re,
            im: self.im + o.im,
        }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        Complex {
            re: self.re * o.re - self.im * o.im,
            im: self.re * o.im + self.im * o.re,
        }
    }
    #[inline(always)]
    fn conj(self) -> Self {
        Complex {
            re: self.re,
            im: F::zero() - self.im,
        }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        Complex {
            re: self.re - o.re,
            im: self.im - o.im,
        }
    }
    #[inline(always)]
    fn inv(self) -> Self {
        let n = self.re * self.re + self.im * self.im;
        Complex {
            re: self.re / n,
            im: (F::zero() - self.im) / n,
        }
    }
    #[inline(always)]
    #[allow(clippy::eq_op)] // n - n is 0 exactly when n is finite
    fn pivot_ok(self) -> bool {
        let n = self.re * self.re + self.im * self.im;
        (n != F::zero()) & (n - n == F::zero())
    }
    #[inline(always)]
    fn load(s: &[F], e: usize) -> Self {
        Complex {
            re: s[2 * e],
            im: s[2 * e + 1],
        }
    }
    #[inline(always)]
    fn put(s: &mut [F], e: usize, v: Self) {
        s[2 * e] = v.re;
        s[2 * e + 1] = v.im;
    }
}

/// An output buffer written concurrently by rayon tasks that own disjoint sets of elements
/// (one (batch, channel-tile) sequence each, like one CUDA thread block).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut<F>(pub *mut F);
// SAFETY: every user writes only the elements of its own (batch, channel tile); the sets are
// disjoint, and the buffer outlives the parallel loop.
unsafe impl<F> Send for SharedOut<F> {}
unsafe impl<F> Sync for SharedOut<F> {}

impl<F> SharedOut<F> {
    /// The scalars `start..start + len` as a slice, so that the compiler sees an unaliased
    /// row (and vectorises the loop that fills it).
    ///
    /// # Safety
    /// The range must lie in the buffer and belong to the calling task alone while the slice
    /// lives.
    #[inline(always)]
    pub unsafe fn row<'a>(self, start: usize, len: usize) -> &'a mut [F] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }

    /// `len` values (`WIDTH` scalars each) from scalar `start` on, as a slice.
    ///
    /// # Safety
    /// As [`SharedOut::row`], and the scalars must have been written.
    #[inline(always)]
    pub unsafe fn values<'a, V: Value<F>>(self, start: usize, len: usize) -> &'a mut [V]
    where
        F: WithDType,
    {
        debug_assert_eq!(size_of::<V>(), V::WIDTH * size_of::<F>());
        std::slice::from_raw_parts_mut(self.0.add(start).cast::<V>(), len)
    }

    /// Writes `vals` (elements laid out as `WIDTH` scalars each) to scalars `start..`; with
    /// `stream`, by non-temporal stores: the lines go to memory without first being read into
    /// the cache, a quarter of the traffic of a scan whose output does not fit in the cache
    /// (see [`streams`]). A task that streams must call [`store_fence`] before it ends.
    ///
    /// # Safety
    /// As [`SharedOut::row`] for the `vals.len() * V::WIDTH` scalars written.
    #[inline(always)]
    pub unsafe fn write<V: Value<F>>(self, start: usize, vals: &[V], stream: bool)
    where
        F: WithDType,
    {
        // Re and Complex are laid out as their WIDTH scalars (repr transparent / C).
        debug_assert_eq!(size_of::<V>(), V::WIDTH * size_of::<F>());
        let dst = self.0.add(start).cast::<u8>();
        let src = vals.as_ptr().cast::<u8>();
        let n = size_of_val(vals);
        #[cfg(target_arch = "x86_64")]
        if stream {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            // Plain stores up to the first 16-byte boundary and after the last one; none in the
            // usual case of aligned rows of whole vectors, which skips two calls to memcpy per
            // row.
            let head = dst.align_offset(16).min(n);
            let end = head + (n - head) / 16 * 16;
            if head != 0 {
                std::ptr::copy_nonoverlapping(src, dst, head);
            }
            for i in (head..end).step_by(16) {
                let v = _mm_loadu_si128(src.add(i).cast::<__m128i>());
                _mm_stream_si128(dst.add(i).cast::<__m128i>(), v);
            }
            if end != n {
                std::ptr::copy_nonoverlapping(src.add(end), dst.add(end), n - end);
            }
            return;
        }
        let _ = stream;
        std::ptr::copy_nonoverlapping(src, dst, n);
    }
}

/// Outputs at least this large are written with non-temporal stores: with inputs at least as
/// large read alongside, they overflow a server's last-level cache (32 MiB on the 2-core EPYC
/// here), so the next op reads them from memory either way. Measured there: the
/// (8, 4096, 256) f32 scan forward 4.8 ms → 3.5 ms.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 20;

/// Whether an output of `n` scalars of `F` is written with non-temporal stores.
pub(crate) fn streams<F>(n: usize) -> bool {
    n * size_of::<F>() >= STREAM_MIN_BYTES
}

/// Orders a task's non-temporal stores ([`SharedOut::write`]) before whatever follows.
#[inline(always)]
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// A slice of scalars viewed as values of `WIDTH` scalars each (its length a multiple of it).
#[inline(always)]
pub(crate) fn as_values<F: WithDType, V: Value<F>>(s: &[F]) -> &[V] {
    debug_assert_eq!(size_of::<V>(), V::WIDTH * size_of::<F>());
    // SAFETY: Re and Complex are laid out as their WIDTH scalars (repr transparent / C), with
    // the scalar's alignment.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<V>(), s.len() / V::WIDTH) }
}

/// An output buffer of `n` scalars that a kernel fills through [`OutBuf::ptr`] and that only
/// becomes a vector, by [`OutBuf::assume_filled`], once every element is written (dropped
/// unfilled on an error path, it is never read).
pub(crate) struct OutBuf<F> {
    v: Vec<F>,
    n: usize,
}

impl<F: WithDType> OutBuf<F> {
    pub fn new(n: usize) -> Self {
        OutBuf {
            v: Vec::with_capacity(n),
            n,
        }
    }

    /// The buffer's pointer, for the tasks that fill disjoint parts of it.
    pub fn ptr(&mut self) -> SharedOut<F> {
        SharedOut(self.v.as_mut_ptr())
    }

    /// # Safety
    /// All `n` elements must have been written through [`OutBuf::ptr`].
    pub unsafe fn assume_filled(mut self) -> Vec<F> {
        // SAFETY: the capacity is n and the caller guarantees that all of it is initialised.
        self.v.set_len(self.n);
        self.v
    }
}

/// Evaluates `$call` compiled for AVX2 when `$avx2` (the CPU has it), else as compiled for the
/// baseline target: the lane loops then vectorise 8 floats wide instead of 4. The call is
/// expanded twice so that each copy has one call site and is inlined where it belongs.
macro_rules! best_simd {
    ($avx2:expr, $call:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2")]
            unsafe fn call_with_avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            if $avx2 {
                // SAFETY: the CPU supports AVX2 (detected at run time).
                unsafe { call_with_avx2(|| $call) }
            } else {
                $call
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $call
        }
    }};
}
pub(crate) use best_simd;
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
