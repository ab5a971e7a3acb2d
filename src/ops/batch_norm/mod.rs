//! BatchNorm's training pass over the rows of (…, H), its statistics over the whole batch, as
//! fused ops without autograd, for the backward written out in `crate::nn::batch_norm`
//! (`kernels/batch_norm.cu` on CUDA, its CPU twin here). With n the rows of the whole batch,
//! μ = Σx / n, σ² = Σ(x − μ)² / n, k = 1 / √(σ² + ε) and x̂ = (x − μ) k:
//!
//! * [`column_stats`]: Σ_rows x, or Σ_rows (x − μ)² (the caller adds them over the batch's
//!   shards and divides by n);
//! * [`batch_norm_apply`]: y = (x − μ) (γ k) + β;
//! * [`batch_norm_backward_stats`]: ∂γ = Σ_rows ∂y ⊙ x̂ and ∂β = Σ_rows ∂y of these rows;
//! * [`batch_norm_backward`]: ∂x = γ k (∂y − (∂β + x̂ ∂γ) / n), ∂γ and ∂β those of the whole
//!   batch (μ and σ² depend on every row, so every row's ∂y reaches every ∂x);
//! * [`batch_norm_running`]: the running averages of μ and of the unbiased σ², in place.
//!
//! In candle ops the forward is about thirty ops (the centred copy, its square, the sums, the
//! scale's square root and reciprocal, a product and a sum per row) and the backward about
//! twenty; here each is one launch, or two where partial column sums are added (the row
//! layout of [`super::rows`], the same order of additions on both devices). Where the kernels
//! do not apply (f16/bf16, rows wider than [`cuda::supports`] takes, other devices) the same
//! formulas run as candle ops.

use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Storage, Tensor, WithDType, D};
use num_traits::Float;
use rayon::prelude::*;

use super::in_place::{count_updates, with_targets, Held};
use super::rows::column_sums;
use super::value::contiguous;

pub mod cuda;

/// Elements per rayon task of the element-wise passes.
const PER_TASK: usize = 1 << 14;

/// Whether the fused ops take `x`: f32 or f64 on the CPU, and on CUDA rows the kernels take.
pub fn fused(x: &Tensor) -> Result<bool> {
    super::rows::fused_rows(x, cuda::supports)
}

/// The width H of `x`'s rows, after checking that every per-column tensor is (H) and that
/// all share `x`'s dtype and device.
fn check(op: &str, x: &Tensor, columns: &[(&str, &Tensor)]) -> Result<usize> {
    let h = x.dim(D::Minus1)?;
    if h == 0 || x.rank() < 2 {
        bail!(
            "{op}: the input must be rows of at least one channel, got {:?}",
            x.dims()
        );
    }
    for (name, t) in columns {
        if t.dims() != [h] {
            bail!("{op}: {name} has shape {:?}, expected ({h})", t.dims());
        }
        if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
            bail!("{op}: {name} is not of the input's dtype and device");
        }
    }
    Ok(h)
}

/// Checks that `t` has the shape and dtype of `like`.
fn same_shape(op: &str, name: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if t.dims() != like.dims() || t.dtype() != like.dtype() {
        bail!(
            "{op}: {name} {:?} {:?} does not match the input {:?} {:?}",
            t.dims(),
            t.dtype(),
            like.dims(),
            like.dtype()
        );
    }
    Ok(())
}

/// Runs `f` on the contiguous CPU values of `ts` (all of dtype `F`).
fn on_cpu<F: WithDType, R>(ts: &[&Tensor], f: impl FnOnce(&[&[F]]) -> R) -> Result<R> {
    let ts: Vec<Tensor> = ts.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(guards.len());
    for (s, l) in &guards {
        let Storage::Cpu(s) = &**s else {
            bail!("batch_norm: tensors are not all on the CPU")
        };
        slices.push(contiguous::<F>(s, l)?);
    }
    Ok(f(&slices))
}

/// Σ_rows x (`mean` none) or Σ_rows (x − μ)²: (H).
pub fn column_stats(x: &Tensor, mean: Option<&Tensor>) -> Result<Tensor> {
    let op = "batch_norm column stats";
    let h = match mean {
        Some(m) => check(op, x, &[("the mean", m)])?,
        None => check(op, x, &[])?,
    };
    let rows = x.elem_count() / h;
    if !fused(x)? {
        let x2 = x.reshape((rows, h))?;
        return match mean {
            Some(m) => x2.broadcast_sub(m)?.sqr()?.sum(0),
            None => x2.sum(0),
        };
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, BATCH_NORM};
        let [stats, sums] = cuda::stats_plans(rows, h, mean.is_some(), x.dtype())?;
        let inputs: Vec<&Tensor> = std::iter::once(x).chain(mean).collect();
        let part = launch_tensors(BATCH_NORM, &stats, x.dtype(), &inputs, &[&stats.outputs])?;
        return Ok(launch_tensors(BATCH_NORM, &sums, x.dtype(), &[&part[0]], &[&[h]])?.remove(0));
    }
    fn twin<F: WithDType + Float>(v: &[&[F]], h: usize) -> Vec<F> {
        let x = v[0];
        let rows = x.len() / h;
        column_sums(rows, h, h, &mut [], |r, _, acc| {
            let xr = &x[r * h..(r + 1) * h];
            match v.get(1) {
                Some(m) => {
                    for i in 0..h {
                        let d = xr[i] - m[i];
                        acc[i] += d * d;
                    }
                }
                None => {
                    for i in 0..h {
                        acc[i] += xr[i];
                    }
                }
            }
        })
    }
    let inputs: Vec<&Tensor> = std::iter::once(x).chain(mean).collect();
    match x.dtype() {
        DType::F32 => Tensor::from_vec(on_cpu(&inputs, |v| twin::<f32>(v, h))?, h, &Device::Cpu),
        DType::F64 => Tensor::from_vec(on_cpu(&inputs, |v| twin::<f64>(v, h))?, h, &Device::Cpu),
        dt => bail!("{op}: dtype {dt:?} is not fused on the CPU"),
    }
}

/// 1 / √(σ² + ε), as the kernels compute it per element.
#[inline(always)]
fn rstd<F: Float>(var: F, eps: F) -> F {
    F::one() / (var + eps).sqrt()
}

/// k = 1 / √(σ² + ε) and x̂ = (x − μ) k as candle ops (the fallback's).
fn composed_normalised(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let k = (var + eps)?.sqrt()?.recip()?;
    let xh = x.broadcast_sub(mean)?.broadcast_mul(&k)?;
    Ok((k, xh))
}

/// y = (x − μ) (γ / √(σ² + ε)) + β over the rows of `x`.
pub fn batch_norm_apply(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let op = "batch_norm apply";
    let columns = [
        ("the mean", mean),
        ("the variance", var),
        ("the weight", weight),
        ("the bias", bias),
    ];
    check(op, x, &columns)?;
    if !fused(x)? {
        let k = (var + eps)?.sqrt()?.recip()?;
        return x
            .broadcast_sub(mean)?
            .broadcast_mul(&(weight * k)?)?
            .broadcast_add(bias);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, BATCH_NORM};
        let plan = cuda::apply_plan(x.elem_count(), mean.elem_count(), eps, x.dtype())?;
        let inputs = [x, mean, var, weight, bias];
        return Ok(launch_tensors(BATCH_NORM, &plan, x.dtype(), &inputs, &[x.dims()])?.remove(0));
    }
    Elementwise::Apply.on_cpu(op, x, &[x, mean, var, weight, bias], eps)
}

/// (∂γ, ∂β) = (Σ_rows ∂y ⊙ x̂, Σ_rows ∂y) over the rows of `x` alone (a shard's part).
pub fn batch_norm_backward_stats(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<[Tensor; 2]> {
    let op = "batch_norm backward stats";
    let h = check(op, x, &[("the mean", mean), ("the variance", var)])?;
    same_shape(op, "∂y", dy, x)?;
    let rows = x.elem_count() / h;
    if !fused(x)? {
        let (_, xh) = composed_normalised(x, mean, var, eps)?;
        let dy2 = dy.reshape((rows, h))?;
        let dw = (xh.reshape((rows, h))? * &dy2)?.sum(0)?;
        return Ok([dw, dy2.sum(0)?]);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, BATCH_NORM};
        let [stats, pair] = cuda::backward_stats_plans(rows, h, eps, x.dtype())?;
        let part = launch_tensors(
            BATCH_NORM,
            &stats,
            x.dtype(),
            &[x, mean, var, dy],
            &[&stats.outputs],
        )?;
        let mut sums = launch_tensors(BATCH_NORM, &pair, x.dtype(), &[&part[0]], &[&[h], &[h]])?;
        let db = sums.pop().expect("two outputs");
        return Ok([sums.pop().expect("two outputs"), db]);
    }
    fn twin<F: WithDType + Float>(v: &[&[F]], h: usize, eps: f64) -> [Vec<F>; 2] {
        let [x, m, var, g] = [v[0], v[1], v[2], v[3]];
        let eps = F::from(eps).expect("eps");
        let mut dw = column_sums(x.len() / h, h, 2 * h, &mut [], |r, _, acc| {
            for i in 0..h {
                let e = r * h + i;
                let xh = (x[e] - m[i]) * rstd(var[i], eps);
                acc[i] += g[e] * xh;
                acc[h + i] += g[e];
            }
        });
        let db = dw.split_off(h);
        [dw, db]
    }
    fn tensors<F: WithDType>([dw, db]: [Vec<F>; 2], h: usize) -> Result<[Tensor; 2]> {
        Ok([
            Tensor::from_vec(dw, h, &Device::Cpu)?,
            Tensor::from_vec(db, h, &Device::Cpu)?,
        ])
    }
    let inputs = [x, mean, var, dy];
    match x.dtype() {
        DType::F32 => tensors(on_cpu(&inputs, |v| twin::<f32>(v, h, eps))?, h),
        DType::F64 => tensors(on_cpu(&inputs, |v| twin::<f64>(v, h, eps))?, h),
        dt => bail!("{op}: dtype {dt:?} is not fused on the CPU"),
    }
}

/// ∂x = γ k (∂y − (∂β + x̂ ∂γ) / n) over the rows of `x`, with `dweight` (∂γ), `dbias` (∂β)
/// and `count` (n, one value) those of the whole batch.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    dweight: &Tensor,
    dbias: &Tensor,
    count: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let op = "batch_norm backward";
    let columns = [
        ("the mean", mean),
        ("the variance", var),
        ("the weight", weight),
        ("∂weight", dweight),
        ("∂bias", dbias),
    ];
    check(op, x, &columns)?;
    same_shape(op, "∂y", dy, x)?;
    if count.dims() != [1] || count.dtype() != x.dtype() {
        bail!(
            "{op}: the row count must be one value of the input's dtype, got {:?}",
            count.dims()
        );
    }
    if !fused(x)? {
        let (k, xh) = composed_normalised(x, mean, var, eps)?;
        let mean_part = xh
            .broadcast_mul(dweight)?
            .broadcast_add(dbias)?
            .broadcast_div(count)?;
        return (dy - mean_part)?.broadcast_mul(&(weight * k)?);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, BATCH_NORM};
        let plan = cuda::backward_plan(x.elem_count(), mean.elem_count(), eps, x.dtype())?;
        let inputs = [x, mean, var, weight, dy, dweight, dbias, count];
        return Ok(launch_tensors(BATCH_NORM, &plan, x.dtype(), &inputs, &[x.dims()])?.remove(0));
    }
    let inputs = [x, mean, var, weight, dy, dweight, dbias, count];
    Elementwise::Backward.on_cpu(op, x, &inputs, eps)
}

/// The element-wise kernels' CPU twins.
#[derive(Clone, Copy)]
enum Elementwise {
    Apply,
    Backward,
}

impl Elementwise {
    /// Element `e` (column `i`) of the output, from the inputs `v` in the launch plan's order.
    #[inline(always)]
    fn at<F: Float>(self, v: &[&[F]], e: usize, i: usize, eps: F) -> F {
        let (x, m, k) = (v[0][e], v[1][i], rstd(v[2][i], eps));
        match self {
            Elementwise::Apply => (x - m) * (v[3][i] * k) + v[4][i],
            Elementwise::Backward => {
                let [w, g, dw, db, rows] = [v[3][i], v[4][e], v[5][i], v[6][i], v[7][0]];
                let xh = (x - m) * k;
                let mean_part = (db + xh * dw) / rows;
                w * k * (g - mean_part)
            }
        }
    }

    /// The output over `x`'s elements, shaped like `x`.
    fn on_cpu(self, op: &str, x: &Tensor, inputs: &[&Tensor], eps: f64) -> Result<Tensor> {
        fn run<F: WithDType + Float>(kind: Elementwise, v: &[&[F]], eps: f64) -> Vec<F> {
            let h = v[1].len();
            let eps = F::from(eps).expect("eps");
            let mut out = vec![F::zero(); v[0].len()];
            out.par_chunks_mut(PER_TASK)
                .enumerate()
                .for_each(|(c, chunk)| {
                    for (j, o) in chunk.iter_mut().enumerate() {
                        let e = c * PER_TASK + j;
                        *o = kind.at(v, e, e % h, eps);
                    }
                });
            out
        }
        match x.dtype() {
            DType::F32 => Tensor::from_vec(
                on_cpu(inputs, |v| run::<f32>(self, v, eps))?,
                x.shape(),
                &Device::Cpu,
            ),
            DType::F64 => Tensor::from_vec(
                on_cpu(inputs, |v| run::<f64>(self, v, eps))?,
                x.shape(),
                &Device::Cpu,
            ),
            dt => bail!("{op}: dtype {dt:?} is not fused on the CPU"),
        }
    }
}

/// BatchNorm's running averages, updated in place in one launch: with m the decay and n the
/// rows of the whole batch (a (1) tensor, which stays on the device),
/// running_mean ← running_mean·m + μ·(1 − m) and
/// running_var ← running_var·m + (σ²·n/(n − 1))·(1 − m), the unbiased variance that
/// candle-nn's BatchNorm keeps. The operations are those of the same update in candle ops, in
/// their order, so the averages are the same to the bit on the CPU.
pub fn batch_norm_running(
    [running_mean, running_var]: [&Tensor; 2],
    mean: &Tensor,
    var: &Tensor,
    n: &Tensor,
    decay: f64,
) -> Result<()> {
    let op = "batch_norm running";
    if mean.rank() != 1 || n.dims() != [1] || n.dtype() != mean.dtype() {
        bail!(
            "{op}: the mean must be (H) and the row count (1) of its dtype, got {:?} and {:?}",
            mean.dims(),
            n.dims()
        );
    }
    same_shape(op, "the running mean", running_mean, mean)?;
    same_shape(op, "the running variance", running_var, mean)?;
    same_shape(op, "the variance", var, mean)?;
    let (mean, var, n) = (mean.contiguous()?, var.contiguous()?, n.contiguous()?);
    let targets = [running_mean, running_var];
    with_targets(op, &targets, &[&mean, &var, &n], &mut |held| match held {
        Held::Cpu {
            mut targets,
            inputs,
        } => running_on_cpu(&mut targets, &inputs, decay),
        #[cfg(feature = "cuda")]
        Held::Cuda {
            mut targets,
            inputs,
        } => {
            let plan = cuda::running_plan(mean.elem_count(), decay, mean.dtype())?;
            crate::cuda::launch_in_place(crate::cuda::BATCH_NORM, &plan, &mut targets, &inputs)
        }
    })?;
    count_updates(1);
    Ok(())
}

/// The CPU twin of `batch_norm_running`: targets (running mean, running variance), inputs
/// (μ, σ², n).
fn running_on_cpu(
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
    decay: f64,
) -> Result<()> {
    fn update<F: WithDType + Float>(
        [rm, rv]: [&mut [F]; 2],
        inputs: &[(&CpuStorage, &Layout)],
        decay: f64,
    ) -> Result<()> {
        let (mean, var) = (
            contiguous::<F>(inputs[0].0, inputs[0].1)?,
            contiguous::<F>(inputs[1].0, inputs[1].1)?,
        );
        let n = contiguous::<F>(inputs[2].0, inputs[2].1)?[0];
        let (keep, take) = (
            F::from(decay).expect("m"),
            F::from(1.0 - decay).expect("1 − m"),
        );
        // A single value has no unbiased variance: its σ² (0) is kept as it is.
        let unbiased = if n > F::one() {
            n / (n - F::one())
        } else {
            F::one()
        };
        for (r, &m) in rm.iter_mut().zip(mean) {
            *r = *r * keep + m * take;
        }
        for (r, &v) in rv.iter_mut().zip(var) {
            *r = *r * keep + v * unbiased * take;
        }
        Ok(())
    }
    fn part<'a, F>(v: &'a mut [F], l: &Layout) -> Result<&'a mut [F]> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(&mut v[a..b]),
            None => bail!("batch_norm running: a running average is not contiguous"),
        }
    }
    let [(rm, lm), (rv, lv)] = targets else {
        bail!("internal error: batch_norm running updates two tensors")
    };
    match (&mut **rm, &mut **rv) {
        (CpuStorage::F32(a), CpuStorage::F32(b)) => {
            update([part(a, lm)?, part(b, lv)?], inputs, decay)
        }
        (CpuStorage::F64(a), CpuStorage::F64(b)) => {
            update([part(a, lm)?, part(b, lv)?], inputs, decay)
        }
        _ => bail!("batch_norm running: the running averages must be f32 or f64"),
    }
}
