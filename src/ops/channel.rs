//! Per-channel bias and scale over the last dimension, with a fused backward on the CPU:
//!
//!   add: y = x + b,   ∂x = g,       ∂b = Σ_rows g;
//!   mul: y = x ⊙ d,   ∂x = g ⊙ d,   ∂d = Σ_rows g ⊙ x.
//!
//! With candle's `broadcast_add`/`broadcast_mul` the parameter's gradient is a reduction over
//! the leading (batch, length) dimensions, which candle's CPU backend walks element by element
//! with strided indexing; here it is one pass of row sums. On other devices, and for f16/bf16,
//! these are candle's broadcast ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
    D,
};
use num_traits::{Float, NumAssign};
use rayon::prelude::*;

use super::value::contiguous;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 128;

/// `x + b` with `b` of shape (H), H the last dimension of `x`.
pub fn channel_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(x, b, Kind::Add)
}

/// `x ⊙ d` with `d` of shape (H), H the last dimension of `x`.
pub fn channel_mul(x: &Tensor, d: &Tensor) -> Result<Tensor> {
    apply(x, d, Kind::Mul)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Add,
    Mul,
}

fn apply(x: &Tensor, p: &Tensor, kind: Kind) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    if p.dims() != [h] {
        bail!(
            "channel_{kind:?}: parameter of shape {:?}, expected ({h}) to match the input's last dimension",
            p.dims()
        );
    }
    let fused = x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::F64)
        && p.dtype() == x.dtype()
        && p.device().is_cpu();
    match (fused, kind) {
        (true, _) => x.contiguous()?.apply_op2(&p.contiguous()?, ChannelOp(kind)),
        (false, Kind::Add) => x.broadcast_add(p),
        (false, Kind::Mul) => x.broadcast_mul(p),
    }
}

struct ChannelOp(Kind);

impl ChannelOp {
    fn fwd_t<F: WithDType + Float + NumAssign>(&self, x: &[F], p: &[F]) -> Vec<F> {
        let h = p.len();
        let mut y = vec![F::zero(); x.len()];
        y.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(ys, xs)| {
                for (yr, xr) in ys.chunks_exact_mut(h).zip(xs.chunks_exact(h)) {
                    for i in 0..h {
                        yr[i] = match self.0 {
                            Kind::Add => xr[i] + p[i],
                            Kind::Mul => xr[i] * p[i],
                        };
                    }
                }
            });
        y
    }

    /// ∂x (only for `Mul`: for `Add` it is g itself) and ∂p.
    fn bwd_t<F: WithDType + Float + NumAssign>(
        &self,
        x: &[F],
        p: &[F],
        g: &[F],
    ) -> (Option<Vec<F>>, Vec<F>) {
        let h = p.len();
        let rows_sum = |parts: Vec<Vec<F>>| {
            parts.into_iter().fold(vec![F::zero(); h], |mut acc, v| {
                acc.iter_mut().zip(v).for_each(|(a, v)| *a += v);
                acc
            })
        };
        match self.0 {
            Kind::Add => {
                let parts = g
                    .par_chunks(h * ROWS_PER_TASK)
                    .map(|gs| {
                        let mut s = vec![F::zero(); h];
                        for gr in gs.chunks_exact(h) {
                            s.iter_mut().zip(gr).for_each(|(s, &g)| *s += g);
                        }
                        s
                    })
                    .collect();
                (None, rows_sum(parts))
            }
            Kind::Mul => {
                let mut dx = vec![F::zero(); x.len()];
                let parts = dx
                    .par_chunks_mut(h * ROWS_PER_TASK)
                    .zip(x.par_chunks(h * ROWS_PER_TASK))
                    .zip(g.par_chunks(h * ROWS_PER_TASK))
                    .map(|((dxs, xs), gs)| {
                        let mut s = vec![F::zero(); h];
                        for ((dxr, xr), gr) in dxs
                            .chunks_exact_mut(h)
                            .zip(xs.chunks_exact(h))
                            .zip(gs.chunks_exact(h))
                        {
                            for i in 0..h {
                                dxr[i] = gr[i] * p[i];
                                s[i] += gr[i] * xr[i];
                            }
                        }
                        s
                    })
                    .collect();
                (Some(dx), rows_sum(parts))
            }
        }
    }

    fn bwd_tensors<F: WithDType + Float + NumAssign>(
        &self,
        x: &Tensor,
        p: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (sx, lx) = x.storage_and_layout();
        let (sp, lp) = p.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sx), Storage::Cpu(sp), Storage::Cpu(sg)) = (&*sx, &*sp, &*sg) else {
            bail!("channel op backward: tensors are not all on the CPU")
        };
        let (dx, dp) = self.bwd_t::<F>(
            contiguous(sx, lx)?,
            contiguous(sp, lp)?,
            contiguous(sg, lg)?,
        );
        let dx = match dx {
            Some(dx) => Tensor::from_vec(dx, x.shape(), &Device::Cpu)?,
            None => g.clone(),
        };
        Ok((
            Some(dx),
            Some(Tensor::from_vec(dp, p.shape(), &Device::Cpu)?),
        ))
    }
}

impl CustomOp2 for ChannelOp {
    fn name(&self) -> &'static str {
        match self.0 {
            Kind::Add => "channel-add",
            Kind::Mul => "channel-mul",
        }
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sp: &CpuStorage,
        lp: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match sx.dtype() {
            DType::F32 => {
                CpuStorage::F32(self.fwd_t::<f32>(contiguous(sx, lx)?, contiguous(sp, lp)?))
            }
            DType::F64 => {
                CpuStorage::F64(self.fwd_t::<f64>(contiguous(sx, lx)?, contiguous(sp, lp)?))
            }
            dt => bail!("channel op: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        p: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        match x.dtype() {
            DType::F32 => self.bwd_tensors::<f32>(x, p, &g),
            DType::F64 => self.bwd_tensors::<f64>(x, p, &g),
            dt => bail!("channel op backward: dtype {dt:?} is not fused on the CPU"),
        }
    }
}
