//! Per-channel bias and scale over the last dimension, one fused op forward and one backward
//! on the CPU and on CUDA (`kernels/channel.cu`, whose twin is the arithmetic here):
//!
//!   add: y = x + b,   ∂x = g,       ∂b = Σ_rows g;
//!   mul: y = x ⊙ d,   ∂x = g ⊙ d,   ∂d = Σ_rows g ⊙ x.
//!
//! With candle's `broadcast_add`/`broadcast_mul` the parameter's gradient is a reduction over
//! the leading (batch, length) dimensions, which candle's CPU backend walks element by element
//! with strided indexing, and on CUDA it is several launches; here it is one pass of row sums
//! in the row layout of [`super::rows`] (plus one small launch adding the blocks' partial sums
//! on CUDA). f16 and bf16 compute in f32 and round what they store. On other devices, and for
//! rows too wide for the kernel's shared memory (see [`cuda::supports`]), these are candle's
//! broadcast ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
    D,
};
use num_traits::{Float, NumAssign};
use rayon::prelude::*;

use super::rows::column_sums;
use super::value::{contiguous, is_half, narrowed, narrowed_tensor, widened_values};

pub mod cuda;

/// Rows per rayon task of the forward.
const ROWS_PER_TASK: usize = 128;

/// `x + b` with `b` of shape (H), H the last dimension of `x`.
pub fn channel_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(x, b, Kind::Add)
}

/// `x ⊙ d` with `d` of shape (H), H the last dimension of `x`.
pub fn channel_mul(x: &Tensor, d: &Tensor) -> Result<Tensor> {
    apply(x, d, Kind::Mul)
}

/// The backward of [`channel_mul`] on its own, for layers that compute gradients by hand:
/// (∂x, ∂d) from ∂y = `g`.
pub fn channel_mul_backward(x: &Tensor, d: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    if !fused(x, d)? {
        let h = x.dim(D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        let dd = (g * x)?.reshape((rows, h))?.sum(0)?;
        return Ok((g.broadcast_mul(d)?, dd));
    }
    match ChannelOp(Kind::Mul).bwd(&x.contiguous()?, d, x, g)? {
        (Some(dx), Some(dd)) => Ok((dx, dd)),
        _ => bail!("channel_mul backward: a gradient is missing"),
    }
}

/// The backward of [`channel_add`] on its own: ∂b = Σ_rows `g` (∂x is `g` itself), the sum over
/// every dimension of ∂y but the last. One op where a candle sum is a reduction and a reshape.
pub fn channel_add_backward(b: &Tensor, g: &Tensor) -> Result<Tensor> {
    let h = g.dim(D::Minus1)?;
    if b.dims() != [h] {
        bail!(
            "channel_add backward: parameter of shape {:?} for ∂y of shape {:?}",
            b.dims(),
            g.dims()
        );
    }
    if !fused(g, b)? {
        return g.reshape((g.elem_count() / h.max(1), h))?.sum(0);
    }
    let g = g.contiguous()?;
    match ChannelOp(Kind::Add).bwd(&g, b, &g, &g)? {
        (_, Some(db)) => Ok(db),
        _ => bail!("channel_add backward: a gradient is missing"),
    }
}

/// Whether the channel ops on `x` with the parameter `p` are the fused op (else candle's).
fn fused(x: &Tensor, p: &Tensor) -> Result<bool> {
    Ok(p.dtype() == x.dtype()
        && p.device().same_device(x.device())
        && super::rows::fused_rows(x, cuda::supports)?)
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
    match (fused(x, p)?, kind) {
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
        let rows = x.len() / h.max(1);
        match self.0 {
            Kind::Add => {
                let dp = column_sums(rows, h, h, &mut [], |r, _, acc| {
                    for (a, &g) in acc.iter_mut().zip(&g[r * h..(r + 1) * h]) {
                        *a += g;
                    }
                });
                (None, dp)
            }
            Kind::Mul => {
                let mut dx = vec![F::zero(); x.len()];
                let dp = column_sums(rows, h, h, &mut dx, |r, dxr, acc| {
                    let (xr, gr) = (&x[r * h..(r + 1) * h], &g[r * h..(r + 1) * h]);
                    for i in 0..h {
                        acc[i] += gr[i] * xr[i];
                        dxr[i] = gr[i] * p[i];
                    }
                });
                (Some(dx), dp)
            }
        }
    }

    /// The CPU twin's backward on tensors of any float dtype (f16 and bf16 widened to f32 and
    /// the results rounded back, as the kernels compute).
    fn bwd_tensors(&self, x: &Tensor, p: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (sx, lx) = x.storage_and_layout();
        let (sp, lp) = p.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sx), Storage::Cpu(sp), Storage::Cpu(sg)) = (&*sx, &*sp, &*sg) else {
            bail!("channel op backward: tensors are not all on the CPU")
        };
        let cpu = [(sx, lx), (sp, lp), (sg, lg)];
        /// The twin in F on the operands as stored.
        fn run<F: WithDType + Float + NumAssign>(
            op: &ChannelOp,
            [(sx, lx), (sp, lp), (sg, lg)]: [(&CpuStorage, &Layout); 3],
            x: &Tensor,
            p: &Tensor,
            g: &Tensor,
        ) -> Result<(Tensor, Tensor)> {
            let (dx, dp) = op.bwd_t::<F>(
                contiguous(sx, lx)?,
                contiguous(sp, lp)?,
                contiguous(sg, lg)?,
            );
            let dx = match dx {
                Some(dx) => Tensor::from_vec(dx, x.shape(), &Device::Cpu)?,
                None => g.clone(),
            };
            Ok((dx, Tensor::from_vec(dp, p.shape(), &Device::Cpu)?))
        }
        match x.dtype() {
            DType::F32 => run::<f32>(self, cpu, x, p, g),
            DType::F64 => run::<f64>(self, cpu, x, p, g),
            dt if is_half(dt) => {
                let [x32, p32, g32] = cpu.map(|(s, l)| widened_values(s, l));
                let (dx, dp) = self.bwd_t::<f32>(&x32?, &p32?, &g32?);
                let dx = match dx {
                    Some(dx) => narrowed_tensor(dx, x.shape(), dt)?,
                    None => g.clone(),
                };
                Ok((dx, narrowed_tensor(dp, p.shape(), dt)?))
            }
            dt => bail!("channel op backward: dtype {dt:?} is not fused on the CPU"),
        }
    }
}

#[cfg(feature = "cuda")]
impl ChannelOp {
    /// The backward's two launches: ∂x (mul) with the blocks' partial sums of ∂p, then ∂p.
    fn cuda_bwd(
        &self,
        x: &Tensor,
        p: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        use crate::cuda::{launch_tensors, CHANNEL};
        let h = p.elem_count();
        let mul = self.0 == Kind::Mul;
        let [rows_plan, sums] = cuda::backward_plans(x.elem_count() / h, h, mul, x.dtype())?;
        let part_shape = [*rows_plan.outputs.last().expect("partials")];
        let shapes: Vec<&[usize]> = match mul {
            true => vec![x.dims(), &part_shape],
            false => vec![&part_shape],
        };
        let mut outs = launch_tensors(CHANNEL, &rows_plan, x.dtype(), &[x, p, g], &shapes)?;
        let part = outs.pop().expect("partials");
        let dp = launch_tensors(CHANNEL, &sums, x.dtype(), &[&part], &[p.dims()])?.remove(0);
        let dx = match outs.pop() {
            Some(dx) => dx,
            None => g.clone(),
        };
        Ok((Some(dx), Some(dp)))
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
            dt if is_half(dt) => {
                let (x, p) = (widened_values(sx, lx)?, widened_values(sp, lp)?);
                narrowed(self.fwd_t::<f32>(&x, &p), dt)?
            }
            dt => bail!("channel op: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sp: &candle_core::CudaStorage,
        lp: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, h) = (lx.shape().elem_count(), lp.shape().elem_count());
        let plan = cuda::forward_plan(n, h, self.0 == Kind::Mul, sx.dtype())?;
        let inputs = [(sx, lx), (sp, lp)];
        let mut y = crate::cuda::launch(
            sx.device(),
            crate::cuda::CHANNEL,
            &plan,
            sx.dtype(),
            &inputs,
        )?;
        Ok((y.remove(0), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        p: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return self.cuda_bwd(x, p, &g.to_dtype(x.dtype())?);
        }
        let (dx, dp) = self.bwd_tensors(x, p, &g.contiguous()?)?;
        Ok((Some(dx), Some(dp)))
    }
}
