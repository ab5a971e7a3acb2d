//! S5's readout matrices from C̃ in one op, forward and backward, on the CPU and on CUDA
//! (`kernels/s5_readout.cu`, whose twin is the arithmetic here). With C̃ stored (H, D·P, 2) for
//! D directions and the scan's states x (…, P, 2), Re(s C̃ x) = Σ_p s C_re x_re − s C_im x_im is
//! one matmul x · R_d per direction against
//!
//!   R_d[2p, j] = s C̃[j, dP + p].re,   R_d[2p + 1, j] = −s C̃[j, dP + p].im,
//!
//! s = 2 with conj_sym (the conjugate half of the spectrum), else 1. The op returns the R_d
//! stacked as one contiguous (D·2P, H) tensor, so each direction's matrix is a view; the
//! backward is the same map transposed. The Myo layer's scalar heads read out the same way
//! (D = 1, s = 1). In candle ops this was a sign-and-scale row uploaded
//! every forward, a broadcast product and a copy per direction (and their gradients: a product,
//! a reduction and the copies back). f16 and bf16 are read into f32 and rounded on store, which
//! the scale ±1 or ±2 leaves exact; other devices take those candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::value::{contiguous, is_half, narrowed, narrowed_tensor, widened_values};

pub mod cuda;

/// Elements per rayon task.
const PER_TASK: usize = 1 << 14;

/// The (D·2P, H) readout matrices of C̃ (H, D·P, 2) for `dirs` directions (see the module
/// docs); `conj_sym` doubles them.
pub fn s5_readout(c: &Tensor, dirs: usize, conj_sym: bool) -> Result<Tensor> {
    let (h, dp, two) = c.dims3()?;
    if two != 2 || dirs == 0 || dp % dirs != 0 {
        bail!(
            "s5_readout: C has shape {:?}, expected (H, {dirs} x P, 2)",
            c.dims()
        );
    }
    let op = ReadoutOp {
        dirs,
        p: dp / dirs,
        h,
        scale: if conj_sym { 2 } else { 1 },
    };
    let fused = matches!(
        c.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) && (c.device().is_cpu() || c.device().is_cuda());
    if fused {
        c.contiguous()?.apply_op1(op)
    } else {
        op.reference(c)
    }
}

/// The backward of [`s5_readout`] on its own, for layers that compute gradients by hand: ∂C̃
/// from the gradient `g` of the readout matrices (f32, f64, f16 and bf16 on the CPU and CUDA).
pub fn s5_readout_backward(c: &Tensor, dirs: usize, conj_sym: bool, g: &Tensor) -> Result<Tensor> {
    let (h, dp, _) = c.dims3()?;
    let op = ReadoutOp {
        dirs,
        p: dp / dirs.max(1),
        h,
        scale: if conj_sym { 2 } else { 1 },
    };
    match op.bwd(c, g, g)? {
        Some(dc) => Ok(dc),
        None => bail!("s5_readout backward: no gradient"),
    }
}

struct ReadoutOp {
    dirs: usize,
    p: usize,
    h: usize,
    scale: i32,
}

impl ReadoutOp {
    /// The same in candle ops (any device and float dtype).
    fn reference(&self, c: &Tensor) -> Result<Tensor> {
        let s = self.scale as f64;
        let signs = Tensor::new(&[s, -s], c.device())?.to_dtype(c.dtype())?;
        let c = c.broadcast_mul(&signs)?;
        let per_dir = (0..self.dirs)
            .map(|d| {
                c.narrow(1, d * self.p, self.p)?
                    .reshape((self.h, 2 * self.p))?
                    .t()
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&per_dir, 0)?.contiguous()
    }

    /// The signed scale of component `comp` (0: re, 1: im).
    fn sign<F: Float>(&self, comp: usize) -> F {
        let s = F::from(self.scale).expect("scale");
        if comp == 1 {
            -s
        } else {
            s
        }
    }

    fn fwd_t<F: WithDType + Float>(&self, c: &[F]) -> Vec<F> {
        let (dirs, p, h) = (self.dirs, self.p, self.h);
        let mut r = vec![F::zero(); dirs * 2 * p * h];
        r.par_chunks_mut(PER_TASK)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (i, v) in chunk.iter_mut().enumerate() {
                    let e = t * PER_TASK + i;
                    let (row, j) = (e / h, e % h);
                    let (d, q) = (row / (2 * p), row % (2 * p));
                    *v = c[((j * dirs + d) * p + q / 2) * 2 + q % 2] * self.sign(q % 2);
                }
            });
        r
    }

    fn bwd_t<F: WithDType + Float>(&self, g: &[F]) -> Vec<F> {
        let (dirs, p, h) = (self.dirs, self.p, self.h);
        let mut dc = vec![F::zero(); h * dirs * p * 2];
        dc.par_chunks_mut(PER_TASK)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (i, v) in chunk.iter_mut().enumerate() {
                    let e = t * PER_TASK + i;
                    let (j, k) = (e / (dirs * p * 2), e % (dirs * p * 2));
                    let (dp, comp) = (k / 2, k % 2);
                    let row = (dp / p) * 2 * p + (dp % p) * 2 + comp;
                    *v = g[row * h + j] * self.sign(comp);
                }
            });
        dc
    }
}

impl CustomOp1 for ReadoutOp {
    fn name(&self) -> &'static str {
        "s5-readout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(self.fwd_t(contiguous::<f32>(s, l)?)),
            DType::F64 => CpuStorage::F64(self.fwd_t(contiguous::<f64>(s, l)?)),
            dt if is_half(dt) => narrowed(self.fwd_t(&widened_values(s, l)?), dt)?,
            dt => bail!("s5_readout: dtype {dt:?} is not fused"),
        };
        Ok((out, Shape::from((self.dirs * 2 * self.p, self.h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plan = cuda::plan(false, self.dirs, self.p, self.h, self.scale, s.dtype())?;
        let module = crate::cuda::S5_READOUT;
        let mut out = crate::cuda::launch(s.device(), module, &plan, s.dtype(), &[(s, l)])?;
        Ok((out.remove(0), Shape::from((self.dirs * 2 * self.p, self.h))))
    }

    fn bwd(&self, c: &Tensor, _r: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.to_dtype(c.dtype())?.contiguous()?;
        #[cfg(feature = "cuda")]
        if c.device().is_cuda() {
            let plan = cuda::plan(true, self.dirs, self.p, self.h, self.scale, c.dtype())?;
            let module = crate::cuda::S5_READOUT;
            let dc = crate::cuda::launch_tensors(module, &plan, c.dtype(), &[&g], &[c.dims()])?;
            return Ok(dc.into_iter().next());
        }
        let (sg, lg) = g.storage_and_layout();
        let Storage::Cpu(sg) = &*sg else {
            bail!("s5_readout backward: the gradient is not on the CPU")
        };
        let dc = match c.dtype() {
            DType::F32 => Tensor::from_vec(
                self.bwd_t(contiguous::<f32>(sg, lg)?),
                c.dims(),
                &Device::Cpu,
            )?,
            DType::F64 => Tensor::from_vec(
                self.bwd_t(contiguous::<f64>(sg, lg)?),
                c.dims(),
                &Device::Cpu,
            )?,
            dt if is_half(dt) => {
                narrowed_tensor(self.bwd_t(&widened_values(sg, lg)?), c.dims(), dt)?
            }
            dt => bail!("s5_readout backward: dtype {dt:?} is not fused"),
        };
        Ok(Some(dc))
    }
}
