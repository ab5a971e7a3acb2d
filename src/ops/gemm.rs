//! Matrix products of operands read through explicit strides, one op each: C = A B with A and
//! B batches of matrices laid over a tensor's values (rows of its last dimension, transposed,
//! or any strides), C contiguous in whatever shape the caller names. The backward passes
//! written by hand need products such as Xᵀ ∂Y over all the rows of (batch, length, H)
//! tensors; as candle ops these are a reshape, a transpose, the product and a reshape back,
//! each an op of the step. The product itself is candle's (its CPU GEMM or cuBLAS), on the
//! same values in the same layouts; on CUDA an operand whose layout cuBLAS cannot read in place
//! (rows further apart than their length) is copied contiguous inside the op first. No
//! gradient flows through it: the backward passes by hand call it on detached tensors.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// A batch of matrices over a tensor's values: (batch, rows, columns) at element strides.
#[derive(Clone, Debug)]
pub struct Mat {
    t: Tensor,
    /// The first element's place in `t`'s values.
    offset: usize,
    dims: [usize; 3],
    strides: [usize; 3],
}

impl Mat {
    /// `t` as the rows of its last dimension: (elements / last, last). A tensor that is not
    /// contiguous is copied first.
    pub fn rows(t: &Tensor) -> Result<Mat> {
        Mat::matrix(t, t.dims().last().copied().unwrap_or(1))
    }

    /// `t`'s values as rows of `cols`: (elements / cols, cols), contiguous (or copied so first).
    pub fn matrix(t: &Tensor, cols: usize) -> Result<Mat> {
        let n = t.elem_count();
        if cols == 0 || n == 0 || !n.is_multiple_of(cols) {
            bail!("gemm: {:?} is not rows of {cols} values", t.dims());
        }
        Ok(Mat {
            t: t.contiguous()?,
            offset: 0,
            dims: [1, n / cols, cols],
            strides: [n, cols, 1],
        })
    }

    /// A batch of matrices of `dims` at element `strides` from element `offset` of `t`'s
    /// values (contiguous, or copied so first), each element within them.
    pub fn strided(
        t: &Tensor,
        offset: usize,
        dims: [usize; 3],
        strides: [usize; 3],
    ) -> Result<Mat> {
        let t = t.contiguous()?;
        if dims.contains(&0) || offset + reach(dims, strides) >= t.elem_count() {
            bail!(
                "gemm: matrices {dims:?} at strides {strides:?} from {offset} reach past the {} \
                 values of {:?}",
                t.elem_count(),
                t.dims()
            );
        }
        Ok(Mat {
            t,
            offset,
            dims,
            strides,
        })
    }

    /// The transposes.
    pub fn t(self) -> Mat {
        let [b, r, c] = self.dims;
        let [sb, sr, sc] = self.strides;
        Mat {
            dims: [b, c, r],
            strides: [sb, sc, sr],
            ..self
        }
    }

    /// Whether cuBLAS reads each matrix in place, as candle passes it: one of the two strides
    /// 1 and the other the matrix's extent along the unit-stride dimension (a leading
    /// dimension no larger).
    fn plain(&self) -> bool {
        let [_, r, c] = self.dims;
        let [_, sr, sc] = self.strides;
        ((sc == 1 || c == 1) && (sr == c || r == 1)) || ((sr == 1 || r == 1) && (sc == r || c == 1))
    }

    /// The operand for a product of `batch` matrices: its layout in `s` (at `at`), a batch of
    /// one read at batch stride 0; with `blas` and a layout cuBLAS cannot read, a contiguous
    /// copy and its layout.
    fn operand<S: BackendStorage>(
        &self,
        s: &S,
        at: &Layout,
        batch: usize,
        blas: bool,
    ) -> Result<(Option<S>, Layout)>
    where
        S::Device: BackendDevice<Storage = S>,
    {
        let shared = |strides: [usize; 3], offset| {
            let sb = if self.dims[0] == 1 { 0 } else { strides[0] };
            let [_, r, c] = self.dims;
            Layout::new(
                Shape::from((batch, r, c)),
                vec![sb, strides[1], strides[2]],
                offset,
            )
        };
        let offset = at.start_offset() + self.offset;
        if !blas || self.plain() {
            return Ok((None, shared(self.strides, offset)));
        }
        let [b, r, c] = self.dims;
        let own = Layout::new(
            Shape::from(self.dims.to_vec()),
            self.strides.to_vec(),
            offset,
        );
        // SAFETY: the copy writes every element.
        let mut copy = unsafe {
            s.device()
                .alloc_uninit(&Shape::from((b, r, c)), s.dtype())?
        };
        s.copy_strided_src(&mut copy, 0, &own)?;
        Ok((Some(copy), shared([r * c, c, 1], 0)))
    }
}

/// A B, each of A's matrices by B's (a batch of one on either side is shared by the other's),
/// as a contiguous tensor of `shape`.
pub fn gemm(a: &Mat, b: &Mat, shape: impl Into<Shape>) -> Result<Tensor> {
    product(a, b, shape.into(), false, None)
}

/// [`gemm`] with the operands prepared as for cuBLAS on any device (the copies of the layouts
/// it cannot read), so that the CPU tests run the CUDA path's preparation.
#[doc(hidden)]
pub fn gemm_as_for_cublas(a: &Mat, b: &Mat, shape: impl Into<Shape>) -> Result<Tensor> {
    product(a, b, shape.into(), true, None)
}

/// [`gemm`], its product then laid out anew in the same op: the output, of `shape`, is the
/// values of C (contiguous, (batch, m, n)) read in the order of `dims` at element `strides`
/// (a skinny batch of products is slower than one product and a copy of its result).
pub fn gemm_relaid(
    a: &Mat,
    b: &Mat,
    dims: [usize; 3],
    strides: [usize; 3],
    shape: impl Into<Shape>,
) -> Result<Tensor> {
    let shape = shape.into();
    let n = shape.elem_count();
    if dims.iter().product::<usize>() != n || reach(dims, strides) >= n {
        bail!("gemm: {dims:?} at strides {strides:?} is not a layout of {n} values");
    }
    product(a, b, shape, false, Some((dims, strides)))
}

/// The last element's place in a layout of `dims` at `strides` (from 0).
fn reach(dims: [usize; 3], strides: [usize; 3]) -> usize {
    dims.iter()
        .zip(strides)
        .map(|(d, s)| d.saturating_sub(1) * s)
        .sum()
}

fn product(
    a: &Mat,
    b: &Mat,
    shape: Shape,
    blas: bool,
    relaid: Option<([usize; 3], [usize; 3])>,
) -> Result<Tensor> {
    let ([ba, m, k], [bb, k2, n]) = (a.dims, b.dims);
    let batch = ba.max(bb);
    if k != k2 || (ba != bb && ba.min(bb) != 1) {
        bail!("gemm: {:?} by {:?} is not a product", a.dims, b.dims);
    }
    if shape.elem_count() != batch * m * n {
        bail!("gemm: a ({batch}, {m}, {n}) product cannot be shaped {shape:?}");
    }
    let op = Gemm {
        a: a.clone(),
        b: b.clone(),
        bmnk: (batch, m, n, k),
        shape,
        blas,
        relaid,
    };
    a.t.apply_op2_no_bwd(&b.t, &op)
}

struct Gemm {
    a: Mat,
    b: Mat,
    bmnk: (usize, usize, usize, usize),
    shape: Shape,
    /// Prepare the operands for cuBLAS even on the CPU (the tests').
    blas: bool,
    /// The output read from the product through these dims and strides ([`gemm_relaid`]).
    relaid: Option<([usize; 3], [usize; 3])>,
}

impl Gemm {
    /// The product on `a` and `b` (the operands' storages); `blas`: by cuBLAS, whose operands
    /// may need a copy first ([`Mat::operand`]).
    fn run<S: BackendStorage>(
        &self,
        (a, la): (&S, &Layout),
        (b, lb): (&S, &Layout),
        blas: bool,
    ) -> Result<(S, Shape)>
    where
        S::Device: BackendDevice<Storage = S>,
    {
        let batch = self.bmnk.0;
        let (a_copy, la) = self.a.operand(a, la, batch, blas)?;
        let (b_copy, lb) = self.b.operand(b, lb, batch, blas)?;
        let c = a_copy.as_ref().unwrap_or(a).matmul(
            b_copy.as_ref().unwrap_or(b),
            self.bmnk,
            &la,
            &lb,
        )?;
        let Some((dims, strides)) = self.relaid else {
            return Ok((c, self.shape.clone()));
        };
        let view = Layout::new(Shape::from(dims.to_vec()), strides.to_vec(), 0);
        // SAFETY: the copy writes every element.
        let mut out = unsafe { c.device().alloc_uninit(&self.shape, c.dtype())? };
        c.copy_strided_src(&mut out, 0, &view)?;
        Ok((out, self.shape.clone()))
    }
}

impl CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "gemm"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        la: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.run((a, la), (b, lb), self.blas)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.run((a, la), (b, lb), true)
    }
}
