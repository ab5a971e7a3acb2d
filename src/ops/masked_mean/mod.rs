//! The mean over each sample's valid steps as one op, forward and backward
//! (`kernels/masked_mean.cu` on CUDA, its CPU twin here): for h (batch, L, H) and lengths
//! len_b in 1..=L,
//!
//!   out[b, j] = (Σ_{t < len_b} h[b, t, j]) / len_b,
//!   ∂h[b, t, j] = ∂out[b, j] / len_b for t < len_b, else 0.
//!
//! In candle ops this was a step index and a mask made every forward (two uploads on CUDA), a
//! broadcast product, two sums and a quotient, and their gradients. The sum runs in step order,
//! as candle's did, so the CPU result is the same. f32, f64, and f16/bf16 summed in f32 (the
//! lengths then f32 too); on other devices the candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::value::{acc_dtype, contiguous, is_half, narrowed, narrowed_tensor, widened_values};

pub mod cuda;

/// The mean of `h` (batch, L, H) over the first `lengths[b]` steps of each sample b: (batch,
/// H). `lengths` (batch) holds whole numbers in 1..=L of any dtype (checked where they are
/// read on the CPU; on CUDA the caller checks them where the batch is made).
pub fn masked_mean(h: &Tensor, lengths: &Tensor) -> Result<Tensor> {
    let (batch, steps, features) = h.dims3()?;
    if lengths.dims() != [batch] {
        bail!(
            "masked_mean: lengths have shape {:?}, expected ({batch})",
            lengths.dims()
        );
    }
    let op = MaskedMean {
        batch,
        steps,
        features,
    };
    let fused = matches!(
        h.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) && matches!(h.device(), Device::Cpu | Device::Cuda(_));
    if !fused {
        return op.composed(h, &lengths.to_dtype(h.dtype())?);
    }
    let len = lengths.to_dtype(acc_dtype(h.dtype()))?;
    h.contiguous()?.apply_op2(&len.contiguous()?, op)
}

/// The backward of [`masked_mean`] on its own, for callers that compute gradients by hand:
/// ∂h (shaped like `h`) from the gradient `g` (batch, H) of the means; f32, f64, f16 and bf16
/// on the CPU and CUDA.
pub fn masked_mean_backward(h: &Tensor, lengths: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (batch, steps, features) = h.dims3()?;
    if lengths.dims() != [batch] || g.dims() != [batch, features] {
        bail!(
            "masked_mean_backward: lengths {:?} and gradient {:?} do not fit h {:?}",
            lengths.dims(),
            g.dims(),
            h.dims()
        );
    }
    let op = MaskedMean {
        batch,
        steps,
        features,
    };
    let len = lengths.to_dtype(acc_dtype(h.dtype()))?.contiguous()?;
    match op.bwd(h, &len, g, g)? {
        (Some(dh), _) => Ok(dh),
        (None, _) => bail!("masked_mean_backward: no gradient"),
    }
}

#[derive(Clone, Copy)]
struct MaskedMean {
    batch: usize,
    steps: usize,
    features: usize,
}

impl MaskedMean {
    /// The same in candle ops.
    fn composed(&self, h: &Tensor, len: &Tensor) -> Result<Tensor> {
        let steps = Tensor::arange(0u32, self.steps as u32, h.device())?
            .to_dtype(h.dtype())?
            .unsqueeze(0)?;
        let mask = steps
            .broadcast_lt(&len.unsqueeze(1)?)?
            .to_dtype(h.dtype())?;
        let sum = h.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        sum.broadcast_div(&len.unsqueeze(1)?)
    }

    /// The CPU twin of `masked_mean_fwd`.
    fn forward_cpu<F: WithDType + Float + std::ops::AddAssign>(
        &self,
        h: &[F],
        len: &[F],
    ) -> Vec<F> {
        let (l, w) = (self.steps, self.features);
        let mut out = vec![F::zero(); self.batch * w];
        out.par_chunks_mut(w).enumerate().for_each(|(b, row)| {
            let count = len[b].to_usize().unwrap_or(0).min(l);
            for (j, o) in row.iter_mut().enumerate() {
                let mut s = F::zero();
                for t in 0..count {
                    s += h[(b * l + t) * w + j];
                }
                *o = s / len[b];
            }
        });
        out
    }

    /// The CPU twin of `masked_mean_bwd`.
    fn backward_cpu<F: WithDType + Float>(&self, g: &[F], len: &[F]) -> Vec<F> {
        let (l, w) = (self.steps, self.features);
        let mut dh = vec![F::zero(); self.batch * l * w];
        dh.par_chunks_mut(l * w)
            .enumerate()
            .for_each(|(b, sample)| {
                let count = len[b].to_usize().unwrap_or(0).min(l);
                for t in 0..count {
                    for j in 0..w {
                        sample[t * w + j] = g[b * w + j] / len[b];
                    }
                }
            });
        dh
    }
}

impl CustomOp2 for MaskedMean {
    fn name(&self) -> &'static str {
        "masked-mean"
    }

    fn cpu_fwd(
        &self,
        h: &CpuStorage,
        hl: &Layout,
        len: &CpuStorage,
        ll: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match h.dtype() {
            DType::F32 => {
                CpuStorage::F32(self.forward_cpu(contiguous(h, hl)?, contiguous(len, ll)?))
            }
            DType::F64 => {
                CpuStorage::F64(self.forward_cpu(contiguous(h, hl)?, contiguous(len, ll)?))
            }
            dt if is_half(dt) => {
                let out = self.forward_cpu(&widened_values(h, hl)?, contiguous(len, ll)?);
                narrowed(out, dt)?
            }
            dt => bail!("masked_mean: dtype {dt:?} is not fused"),
        };
        Ok((out, Shape::from((self.batch, self.features))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        len: &candle_core::CudaStorage,
        ll: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plan = cuda::forward_plan(self.batch, self.steps, self.features, h.dtype())?;
        let module = crate::cuda::MASKED_MEAN;
        let inputs = [(h, hl), (len, ll)];
        let mut out = crate::cuda::launch_into(h.device(), module, &plan, h.dtype(), &inputs)?;
        Ok((out.remove(0), Shape::from((self.batch, self.features))))
    }

    fn bwd(
        &self,
        h: &Tensor,
        len: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.to_dtype(h.dtype())?.contiguous()?;
        #[cfg(feature = "cuda")]
        if h.device().is_cuda() {
            let plan = cuda::backward_plan(self.batch, self.steps, self.features, h.dtype())?;
            let module = crate::cuda::MASKED_MEAN;
            let mut dh = crate::cuda::launch_tensors_into(
                module,
                &plan,
                h.dtype(),
                &[&g, len],
                &[h.dims()],
            )?;
            return Ok((Some(dh.remove(0)), None));
        }
        let (sg, lg) = g.storage_and_layout();
        let (sl, ll) = len.storage_and_layout();
        let (Storage::Cpu(sg), Storage::Cpu(sl)) = (&*sg, &*sl) else {
            bail!("masked_mean backward: tensors are not all on the CPU")
        };
        let dh = match h.dtype() {
            DType::F32 => Tensor::from_vec(
                self.backward_cpu::<f32>(contiguous(sg, lg)?, contiguous(sl, ll)?),
                h.shape(),
                &Device::Cpu,
            )?,
            DType::F64 => Tensor::from_vec(
                self.backward_cpu::<f64>(contiguous(sg, lg)?, contiguous(sl, ll)?),
                h.shape(),
                &Device::Cpu,
            )?,
            dt if is_half(dt) => narrowed_tensor(
                self.backward_cpu::<f32>(&widened_values(sg, lg)?, contiguous(sl, ll)?),
                h.shape(),
                dt,
            )?,
            dt => bail!("masked_mean backward: dtype {dt:?} is not fused"),
        };
        Ok((Some(dh), None))
    }
}
