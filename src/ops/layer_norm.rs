//! LayerNorm over the last dimension with an exact backward, fused on the CPU:
//!
//!   x̂ = (x − μ) / √(σ² + ε),   y = x̂ ⊙ w + b,
//!   ∂x = (ĝ − mean(ĝ) − x̂ ⊙ mean(ĝ ⊙ x̂)) / √(σ² + ε),   ĝ = ∂y ⊙ w,
//!   ∂w = Σ_rows ∂y ⊙ x̂,   ∂b = Σ_rows ∂y.
//!
//! candle-nn's fused LayerNorm has no backward, and the same norm in plain candle ops costs
//! seven passes forward and about fifteen backward over (batch, length, H); this op makes one
//! pass forward and one backward (μ and σ are recomputed from x, nothing is stored). On other
//! devices, and for f16/bf16, [`layer_norm`] composes the norm from candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
    D,
};
use num_traits::{Float, NumAssign};
use rayon::prelude::*;

use super::value::contiguous;

/// Rows per rayon task.
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
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            LayerNormOp { eps },
        )
    } else {
        layer_norm_composed(x, weight, bias, eps)
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
    let mean = row.iter().fold(F::zero(), |s, &v| s + v) / n;
    let var = row
        .iter()
        .fold(F::zero(), |s, &v| s + (v - mean) * (v - mean))
        / n;
    (mean, (var + eps).sqrt().recip())
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

    /// (∂x, ∂w, ∂b) packed as rows × H, then ∂w and ∂b as two more rows.
    fn bwd_t<F: WithDType + Float + NumAssign>(&self, x: &[F], w: &[F], g: &[F]) -> Vec<F> {
        let h = w.len();
        let rows = x.len() / h.max(1);
        let eps = F::from(self.eps).expect("eps");
        let hf = F::from(h).expect("h");
        let mut out = vec![F::zero(); x.len() + 2 * h];
        let (dx, _) = out.split_at_mut(x.len());
        let partials: Vec<(Vec<F>, Vec<F>)> = dx
            .par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(g.par_chunks(h * ROWS_PER_TASK))
            .map(|((dxs, xs), gs)| {
                let (mut dw, mut db) = (vec![F::zero(); h], vec![F::zero(); h]);
                let mut xhat = vec![F::zero(); h];
                for ((dxr, xr), gr) in dxs
                    .chunks_exact_mut(h)
                    .zip(xs.chunks_exact(h))
                    .zip(gs.chunks_exact(h))
                {
                    let (mean, rstd) = moments(xr, eps);
                    let (mut sg, mut sgx) = (F::zero(), F::zero());
                    for i in 0..h {
                        xhat[i] = (xr[i] - mean) * rstd;
                        let gh = gr[i] * w[i];
                        sg += gh;
                        sgx += gh * xhat[i];
                        dw[i] += gr[i] * xhat[i];
                        db[i] += gr[i];
                    }
                    let (mg, mgx) = (sg / hf, sgx / hf);
                    for i in 0..h {
                        dxr[i] = (gr[i] * w[i] - mg - xhat[i] * mgx) * rstd;
                    }
                }
                (dw, db)
            })
            .collect();
        debug_assert_eq!(partials.len(), rows.div_ceil(ROWS_PER_TASK));
        let tail = &mut out[x.len()..];
        for (dw, db) in partials {
            for i in 0..h {
                tail[i] += dw[i];
                tail[h + i] += db[i];
            }
        }
        out
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
            dt => bail!("layer_norm: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, lx.shape().clone()))
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
        let rows = x.elem_count() / h.max(1);
        let g = g.contiguous()?;
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sx), Storage::Cpu(sw), Storage::Cpu(sg)) = (&*sx, &*sw, &*sg) else {
            bail!("layer_norm backward: tensors are not all on the CPU")
        };
        let shape = (rows + 2, h);
        let packed = match x.dtype() {
            DType::F32 => Tensor::from_vec(
                self.bwd_t::<f32>(
                    contiguous(sx, lx)?,
                    contiguous(sw, lw)?,
                    contiguous(sg, lg)?,
                ),
                shape,
                &Device::Cpu,
            )?,
            DType::F64 => Tensor::from_vec(
                self.bwd_t::<f64>(
                    contiguous(sx, lx)?,
                    contiguous(sw, lw)?,
                    contiguous(sg, lg)?,
                ),
                shape,
                &Device::Cpu,
            )?,
            dt => bail!("layer_norm backward: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((
            Some(packed.narrow(0, 0, rows)?.reshape(x.shape())?),
            Some(packed.narrow(0, rows, 1)?.reshape(h)?),
            Some(packed.narrow(0, rows + 1, 1)?.reshape(h)?),
        ))
    }
}
