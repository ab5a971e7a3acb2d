//! GELU in its tanh form (candle's `gelu`, jax's `approximate=True`), one fused op forward and
//! one backward on the CPU and on CUDA (`kernels/gelu.cu`, whose twin is the arithmetic here):
//!
//!   gelu(x) = ½ x (1 + tanh z),   z = √(2/π) (x + 0.044715 x³),
//!   gelu′(x) = ½ (1 + tanh z) + ½ x (1 − tanh² z) √(2/π) (1 + 3 · 0.044715 x²).
//!
//! candle's backward of `gelu` takes about a dozen passes over the tensor (two `powf`, a
//! `tanh`, …); this op takes one forward and one backward, with tanh z = 1 − 2 / (1 + e^{2z}).
//! f16 and bf16 compute in f32 and round what they store, on both devices. On other devices
//! [`gelu`] is candle's own.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::value::{
    contiguous, fused_elementwise, is_half, narrowed, narrowed_tensor, widened_values,
};

pub mod cuda;

/// Elements per rayon task.
const PER_TASK: usize = 1 << 14;
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const CUBIC: f64 = 0.044_715;

/// GELU (tanh approximation), fused forward and backward.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let fused = fused_elementwise(x);
    if fused {
        x.contiguous()?.apply_op1(GeluOp)
    } else {
        x.gelu()
    }
}

/// tanh z and the inner argument's derivative factor, shared by value and slope.
#[inline(always)]
fn tanh_z<F: Float>(x: F) -> F {
    let c = F::from(SQRT_2_OVER_PI).expect("const");
    let k = F::from(CUBIC).expect("const");
    let z = c * (x + k * x * x * x);
    // e^{2z} overflows to ∞ for large z, giving exactly 1; underflows to 0 giving −1.
    F::one() - (F::one() + F::one()) / (F::one() + (z + z).exp())
}

#[inline(always)]
pub(crate) fn value<F: Float>(x: F) -> F {
    let half = F::from(0.5).expect("const");
    half * x * (F::one() + tanh_z(x))
}

#[inline(always)]
pub(crate) fn slope<F: Float>(x: F) -> F {
    let half = F::from(0.5).expect("const");
    let c = F::from(SQRT_2_OVER_PI).expect("const");
    let k3 = F::from(3.0 * CUBIC).expect("const");
    let t = tanh_z(x);
    half * (F::one() + t) + half * x * (F::one() - t * t) * c * (F::one() + k3 * x * x)
}

fn map<F: WithDType + Float>(x: &[F], f: impl Fn(F, usize) -> F + Sync) -> Vec<F> {
    let mut y = vec![F::zero(); x.len()];
    y.par_chunks_mut(PER_TASK)
        .zip(x.par_chunks(PER_TASK))
        .enumerate()
        .for_each(|(c, (ys, xs))| {
            for (i, (y, &x)) in ys.iter_mut().zip(xs).enumerate() {
                *y = f(x, c * PER_TASK + i);
            }
        });
    y
}

struct GeluOp;

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(map(contiguous::<f32>(s, l)?, |x, _| value(x))),
            DType::F64 => CpuStorage::F64(map(contiguous::<f64>(s, l)?, |x, _| value(x))),
            dt if is_half(dt) => narrowed(map(&widened_values(s, l)?, |x, _| value(x)), dt)?,
            dt => bail!("gelu: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plan = cuda::forward_plan(l.shape().elem_count(), s.dtype())?;
        let mut out =
            crate::cuda::launch(s.device(), crate::cuda::GELU, &plan, s.dtype(), &[(s, l)])?;
        Ok((out.remove(0), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let plan = cuda::backward_plan(x.elem_count(), x.dtype())?;
            let g = g.to_dtype(x.dtype())?;
            let mut dx = crate::cuda::launch_tensors(
                crate::cuda::GELU,
                &plan,
                x.dtype(),
                &[x, &g],
                &[x.dims()],
            )?;
            return Ok(Some(dx.remove(0)));
        }
        let g = g.contiguous()?;
        let (sx, lx) = x.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sx), Storage::Cpu(sg)) = (&*sx, &*sg) else {
            bail!("gelu backward: tensors are not all on the CPU")
        };
        fn dx<F: WithDType + Float>(x: &[F], g: &[F], shape: &Shape) -> Result<Tensor> {
            Tensor::from_vec(map(x, |x, i| g[i] * slope(x)), shape, &Device::Cpu)
        }
        Ok(Some(match x.dtype() {
            DType::F32 => dx::<f32>(contiguous(sx, lx)?, contiguous(sg, lg)?, x.shape())?,
            DType::F64 => dx::<f64>(contiguous(sx, lx)?, contiguous(sg, lg)?, x.shape())?,
            dt if is_half(dt) => {
                let (x32, g32) = (widened_values(sx, lx)?, widened_values(sg, lg)?);
                narrowed_tensor(map(&x32, |x, i| g32[i] * slope(x)), x.shape(), dt)?
            }
            dt => bail!("gelu backward: dtype {dt:?} is not fused on the CPU"),
        }))
    }
}
