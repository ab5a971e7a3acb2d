//! LayerNorm over the last dimension with an exact backward, one fused op forward and one
//! backward on the CPU and on CUDA (`kernels/layer_norm.cu`, whose twin is the arithmetic here):
//!
//!   x̂ = (x − μ) / √(σ² + ε),   y = x̂ ⊙ w + b,
//!   ∂x = (ĝ − mean(ĝ) − x̂ ⊙ mean(ĝ ⊙ x̂)) / √(σ² + ε),   ĝ = ∂y ⊙ w,
//!   ∂w = Σ_rows ∂y ⊙ x̂,   ∂b = Σ_rows ∂y.
//!
//! candle-nn's fused LayerNorm has no backward, and the same norm in plain candle ops costs
//! seven passes forward and about fifteen backward over (batch, length, H); this op makes one
//! pass forward and one backward (μ and σ are recomputed from x, nothing is stored; the
//! backward's column sums ∂w, ∂b add one small launch on CUDA). Sums follow the row layout of
//! [`super::rows`]. f16/bf16 rows are normalised in f32 (the kernels and twins load them into
//! f32 and round what they store; where the fused op does not take them, they are cast to f32
//! and back); on other devices, and for rows too wide for the kernel's shared memory (see
//! [`cuda::supports`]), [`layer_norm`] composes the norm from candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
    D,
};
use num_traits::{Float, NumAssign};
use rayon::prelude::*;

use super::rows::{add_lanes, column_sums, lane_sum, LANES};
use super::value::{contiguous, is_half, narrowed, narrowed_tensor, widened_values};

pub mod cuda;

/// Rows per rayon task of the forward.
const ROWS_PER_TASK: usize = 64;

/// `(x − mean) / sqrt(var + eps) * weight + bias` over the last dimension of `x`; `weight` and
/// `bias` have shape (H), H the last dimension of `x`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [h] {
            bail!(
                "layer_norm: {name} has shape {:?}, expected ({h}) to match the input's last dimension",
                t.dims()
            );
        }
        if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
            bail!("layer_norm: {name} differs from the input in dtype or device");
        }
    }
    if fused(x)? {
        x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            LayerNormOp { eps },
        )
    } else if is_half(x.dtype()) {
        // Half-precision rows are normalised in f32: their statistics need its precision.
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        layer_norm(&f32(x)?, &f32(weight)?, &f32(bias)?, eps)?.to_dtype(x.dtype())
    } else {
        layer_norm_composed(x, weight, bias, eps)
    }
}

/// Whether [`layer_norm`] on `x` is the fused op (else candle ops).
pub fn fused(x: &Tensor) -> Result<bool> {
    super::rows::fused_rows(x, cuda::supports)
}

/// The backward of the fused [`layer_norm`] on its own, for layers that compute gradients by
/// hand: (∂x, ∂weight, ∂bias) from ∂y = `g`.
pub fn layer_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    g: &Tensor,
) -> Result<[Tensor; 3]> {
    if !fused(x)? {
        bail!(
            "layer_norm backward: the fused op does not cover {:?} on this device",
            x.dtype()
        );
    }
    let op = LayerNormOp { eps };
    match op.bwd(&x.contiguous()?, weight, bias, x, g)? {
        (Some(dx), Some(dw), Some(db)) => Ok([dx, dw, db]),
        _ => bail!("layer_norm backward: a gradient is missing"),
    }
}

/// The same norm in plain candle ops (any device, any float dtype); also the tests' reference.
pub fn layer_norm_composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

struct LayerNormOp {
    eps: f64,
}

/// Mean and 1/√(var + eps) of one row (two passes: no cancellation).
#[inline(always)]
fn moments<F: Float>(row: &[F], eps: F) -> (F, F) {
    let n = F::from(row.len()).expect("row length");
    let mean = lane_sum(row.len(), |i| row[i]) / n;
    let var = lane_sum(row.len(), |i| (row[i] - mean) * (row[i] - mean)) / n;
    (mean, F::one() / (var + eps).sqrt())
}

impl LayerNormOp {
    fn fwd_t<F: WithDType + Float + NumAssign>(&self, x: &[F], w: &[F], b: &[F]) -> Vec<F> {
        let h = w.len();
        let eps = F::from(self.eps).expect("eps");
        let mut y = vec![F::zero(); x.len()];
        y.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(ys, xs)| {
                for (yr, xr) in ys.chunks_exact_mut(h).zip(xs.chunks_exact(h)) {
                    let (mean, rstd) = moments(xr, eps);
                    for i in 0..h {
                        yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
                    }
                }
            });
        y
    }

    /// (∂x, ∂w, ∂b).
    fn bwd_t<F: WithDType + Float + NumAssign>(&self, x: &[F], w: &[F], g: &[F]) -> [Vec<F>; 3] {
        let h = w.len();
        let rows = x.len() / h.max(1);
        let eps = F::from(self.eps).expect("eps");
        let hf = F::from(h).expect("h");
        let mut dx = vec![F::zero(); x.len()];
        let mut dw = column_sums(rows, h, 2 * h, &mut dx, |r, dxr, acc| {
            let (xr, gr) = (&x[r * h..(r + 1) * h], &g[r * h..(r + 1) * h]);
            let (mean, rstd) = moments(xr, eps);
            let (dw, db) = acc.split_at_mut(h);
            // One pass as in the kernel: the lanes' sums of ĝ and ĝ ⊙ x̂, and ∂w, ∂b.
            let (mut sg, mut sgx) = ([F::zero(); LANES], [F::zero(); LANES]);
            for i in 0..h {
                let (xh, gh) = ((xr[i] - mean) * rstd, gr[i] * w[i]);
                sg[i % LANES] += gh;
                sgx[i % LANES] += gh * xh;
                dw[i] += gr[i] * xh;
                db[i] += gr[i];
            }
            let (mg, mgx) = (add_lanes(&sg) / hf, add_lanes(&sgx) / hf);
            for i in 0..h {
                dxr[i] = (gr[i] * w[i] - mg - (xr[i] - mean) * rstd * mgx) * rstd;
            }
        });
        let db = dw.split_off(h);
        [dx, dw, db]
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match sx.dtype() {
            DType::F32 => CpuStorage::F32(self.fwd_t::<f32>(
                contiguous(sx, lx)?,
                contiguous(sw, lw)?,
                contiguous(sb, lb)?,
            )),
            DType::F64 => CpuStorage::F64(self.fwd_t::<f64>(
                contiguous(sx, lx)?,
                contiguous(sw, lw)?,
                contiguous(sb, lb)?,
            )),
            dt if is_half(dt) => {
                let [x, w, b] = [(sx, lx), (sw, lw), (sb, lb)].map(|(s, l)| widened_values(s, l));
                narrowed(self.fwd_t::<f32>(&x?, &w?, &b?), dt)?
            }
            dt => bail!("layer_norm: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let h = lw.shape().elem_count();
        let rows = lx.shape().elem_count() / h.max(1);
        let plan = cuda::forward_plan(rows, h, self.eps, sx.dtype())?;
        let inputs = [(sx, lx), (sw, lw), (sb, lb)];
        let dev = sx.device();
        let mut y = crate::cuda::launch(dev, crate::cuda::LAYER_NORM, &plan, sx.dtype(), &inputs)?;
        Ok((y.remove(0), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let h = w.dim(0)?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            use crate::cuda::{launch_tensors, LAYER_NORM};
            let rows = x.elem_count() / h.max(1);
            let [rows_plan, sums] = cuda::backward_plans(rows, h, self.eps, x.dtype())?;
            let g = g.to_dtype(x.dtype())?;
            let part_shape = [rows_plan.outputs[1]];
            let mut dx_part = launch_tensors(
                LAYER_NORM,
                &rows_plan,
                x.dtype(),
                &[x, w, &g],
                &[x.dims(), &part_shape],
            )?;
            let part = dx_part.pop().expect("two outputs");
            let dwb = launch_tensors(LAYER_NORM, &sums, x.dtype(), &[&part], &[&[2, h]])?;
            return Ok((dx_part.pop(), Some(dwb[0].get(0)?), Some(dwb[0].get(1)?)));
        }
        let g = g.contiguous()?;
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sx), Storage::Cpu(sw), Storage::Cpu(sg)) = (&*sx, &*sw, &*sg) else {
            bail!("layer_norm backward: tensors are not all on the CPU")
        };
        // Three tensors, not one packed buffer and views of it: each view is an op of the step.
        fn tensors<F: WithDType>(parts: [Vec<F>; 3], x: &Tensor, h: usize) -> Result<[Tensor; 3]> {
            let [dx, dw, db] = parts;
            Ok([
                Tensor::from_vec(dx, x.shape(), &Device::Cpu)?,
                Tensor::from_vec(dw, h, &Device::Cpu)?,
                Tensor::from_vec(db, h, &Device::Cpu)?,
            ])
        }
        let [dx, dw, db] = match x.dtype() {
            DType::F32 => tensors(
                self.bwd_t::<f32>(
                    contiguous(sx, lx)?,
                    contiguous(sw, lw)?,
                    contiguous(sg, lg)?,
                ),
                x,
                h,
            )?,
            DType::F64 => tensors(
                self.bwd_t::<f64>(
                    contiguous(sx, lx)?,
                    contiguous(sw, lw)?,
                    contiguous(sg, lg)?,
                ),
                x,
                h,
            )?,
            dt if is_half(dt) => {
                let [x32, w32, g32] =
                    [(sx, lx), (sw, lw), (sg, lg)].map(|(s, l)| widened_values(s, l));
                let [dx, dw, db] = self.bwd_t::<f32>(&x32?, &w32?, &g32?);
                [
                    narrowed_tensor(dx, x.shape(), dt)?,
                    narrowed_tensor(dw, h, dt)?,
                    narrowed_tensor(db, h, dt)?,
                ]
            }
            dt => bail!("layer_norm backward: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((Some(dx), Some(dw), Some(db)))
    }
}
