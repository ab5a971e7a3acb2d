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
//! do not apply (rows wider than [`cuda::supports`] takes, other devices) the same formulas
//! run as candle ops ([`composed`]).
//!
//! Rows, γ and β are of the input's dtype; the statistics (μ, σ², n, ∂γ and ∂β of the whole
//! batch) and the running averages the model keeps of [`stats_dtype`] (the running averages
//! may be of the rows' dtype too): f32 for f16 and bf16 rows, whose sums over batch × length
//! rows would overflow f16 (and whose n need not be exact in it). Half rows are read into f32
//! and what is stored in half rounded, so they give the bits of their f32 copy normalised and
//! rounded, without the copy.

use candle_core::{bail, DType, Result, Tensor, D};

use super::in_place::{count_updates, with_targets, Held};

pub mod composed;
pub mod cuda;
mod twin;

use twin::Twin;

/// Whether the fused ops take `x`: f32 or f64 on the CPU, and on CUDA rows the kernels take.
pub fn fused(x: &Tensor) -> Result<bool> {
    super::rows::fused_rows(x, cuda::supports)
}

/// The dtype of the statistics of rows stored in `dtype`: f64 for f64, f32 otherwise.
pub fn stats_dtype(dtype: DType) -> DType {
    super::value::acc_dtype(dtype)
}

/// The width H of `x`'s rows, after checking that every per-column tensor is (H) and on `x`'s
/// device, the `params` of `x`'s dtype and the `stats` of [`stats_dtype`].
fn check(
    op: &str,
    x: &Tensor,
    stats: &[(&str, &Tensor)],
    params: &[(&str, &Tensor)],
) -> Result<usize> {
    let h = x.dim(D::Minus1)?;
    if h == 0 || x.rank() < 2 {
        bail!(
            "{op}: the input must be rows of at least one channel, got {:?}",
            x.dims()
        );
    }
    let kinds = [(stats, stats_dtype(x.dtype())), (params, x.dtype())];
    for (columns, dtype) in kinds {
        for (name, t) in columns {
            if t.dims() != [h] {
                bail!("{op}: {name} has shape {:?}, expected ({h})", t.dims());
            }
            if t.dtype() != dtype || !t.device().same_device(x.device()) {
                bail!(
                    "{op}: {name} is {:?}, expected {dtype:?} on the device of the {:?} input",
                    t.dtype(),
                    x.dtype()
                );
            }
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

/// Σ_rows x (`mean` none) or Σ_rows (x − μ)²: (H), statistics.
pub fn column_stats(x: &Tensor, mean: Option<&Tensor>) -> Result<Tensor> {
    let op = "batch_norm column stats";
    match mean {
        Some(m) => check(op, x, &[("the mean", m)], &[])?,
        None => check(op, x, &[], &[])?,
    };
    if !fused(x)? {
        return composed::column_stats(x, mean);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, launch_tensors_into, BATCH_NORM};
        let (h, s) = (x.dim(D::Minus1)?, stats_dtype(x.dtype()));
        let rows = x.elem_count() / h;
        let [stats, sums] = cuda::stats_plans(rows, h, mean.is_some(), x.dtype())?;
        let inputs: Vec<&Tensor> = std::iter::once(x).chain(mean).collect();
        let part = launch_tensors_into(BATCH_NORM, &stats, s, &inputs, &[&stats.outputs])?;
        return Ok(launch_tensors(BATCH_NORM, &sums, s, &[&part[0]], &[&[h]])?.remove(0));
    }
    let twin = if mean.is_some() {
        Twin::Centred
    } else {
        Twin::Sums
    };
    let inputs: Vec<&Tensor> = std::iter::once(x).chain(mean).collect();
    Ok(twin.run(&inputs, 0.0)?.remove(0))
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
    let stats = [("the mean", mean), ("the variance", var)];
    check(op, x, &stats, &[("the weight", weight), ("the bias", bias)])?;
    if !fused(x)? {
        return composed::apply(x, mean, var, weight, bias, eps);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors_into, BATCH_NORM};
        let plan = cuda::apply_plan(x.elem_count(), mean.elem_count(), eps, x.dtype())?;
        let inputs = [x, mean, var, weight, bias];
        let y = launch_tensors_into(BATCH_NORM, &plan, x.dtype(), &inputs, &[x.dims()])?;
        return Ok(y.into_iter().next().expect("one output"));
    }
    Ok(Twin::Apply
        .run(&[x, mean, var, weight, bias], eps)?
        .remove(0))
}

/// (∂γ, ∂β) = (Σ_rows ∂y ⊙ x̂, Σ_rows ∂y) over the rows of `x` alone (a shard's part),
/// statistics.
pub fn batch_norm_backward_stats(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<[Tensor; 2]> {
    let op = "batch_norm backward stats";
    check(op, x, &[("the mean", mean), ("the variance", var)], &[])?;
    same_shape(op, "∂y", dy, x)?;
    if !fused(x)? {
        return composed::backward_stats(x, mean, var, dy, eps);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors, launch_tensors_into, BATCH_NORM};
        let (h, s) = (x.dim(D::Minus1)?, stats_dtype(x.dtype()));
        let rows = x.elem_count() / h;
        let [stats, pair] = cuda::backward_stats_plans(rows, h, eps, x.dtype())?;
        let inputs = [x, mean, var, dy];
        let part = launch_tensors_into(BATCH_NORM, &stats, s, &inputs, &[&stats.outputs])?;
        let mut sums = launch_tensors(BATCH_NORM, &pair, s, &[&part[0]], &[&[h], &[h]])?;
        let db = sums.pop().expect("two outputs");
        return Ok([sums.pop().expect("two outputs"), db]);
    }
    let [dw, db]: [Tensor; 2] = Twin::BackwardStats
        .run(&[x, mean, var, dy], eps)?
        .try_into()
        .expect("two outputs");
    Ok([dw, db])
}

/// ∂x = γ k (∂y − (∂β + x̂ ∂γ) / n) over the rows of `x`, with `dweight` (∂γ), `dbias` (∂β)
/// and `count` (n, one value) those of the whole batch, statistics.
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
    let stats = [
        ("the mean", mean),
        ("the variance", var),
        ("∂weight", dweight),
        ("∂bias", dbias),
    ];
    check(op, x, &stats, &[("the weight", weight)])?;
    same_shape(op, "∂y", dy, x)?;
    if count.dims() != [1] || count.dtype() != stats_dtype(x.dtype()) {
        bail!(
            "{op}: the row count must be one value of the statistics' dtype, got {:?} {:?}",
            count.dims(),
            count.dtype()
        );
    }
    if !fused(x)? {
        return composed::backward(x, mean, var, weight, dy, [dweight, dbias], count, eps);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{launch_tensors_into, BATCH_NORM};
        let plan = cuda::backward_plan(x.elem_count(), mean.elem_count(), eps, x.dtype())?;
        let inputs = [x, mean, var, weight, dy, dweight, dbias, count];
        let dx = launch_tensors_into(BATCH_NORM, &plan, x.dtype(), &inputs, &[x.dims()])?;
        return Ok(dx.into_iter().next().expect("one output"));
    }
    let inputs = [x, mean, var, weight, dy, dweight, dbias, count];
    Ok(Twin::Backward.run(&inputs, eps)?.remove(0))
}

/// BatchNorm's running averages (of the statistics' dtype, or of the rows'), updated in place
/// in one launch from statistics: with m the decay and n the rows of the whole batch (a (1)
/// tensor, which stays on the device),
/// running_mean ← running_mean·m + μ·(1 − m) and
/// running_var ← running_var·m + (σ²·n/(n − 1))·(1 − m), the unbiased variance that
/// candle-nn's BatchNorm keeps. The operations are those of the same update in candle ops, in
/// their order, so the averages are the same to the bit on the CPU (f16/bf16 averages: the
/// update of their f32 values, rounded).
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
    same_shape(op, "the variance", var, mean)?;
    same_shape(op, "the running variance", running_var, running_mean)?;
    if running_mean.dims() != mean.dims() || stats_dtype(running_mean.dtype()) != mean.dtype() {
        bail!(
            "{op}: the running mean {:?} {:?} does not match the statistics {:?} {:?}",
            running_mean.dims(),
            running_mean.dtype(),
            mean.dims(),
            mean.dtype()
        );
    }
    let (mean, var, n) = (mean.contiguous()?, var.contiguous()?, n.contiguous()?);
    let targets = [running_mean, running_var];
    with_targets(op, &targets, &[&mean, &var, &n], &mut |held| match held {
        Held::Cpu {
            mut targets,
            inputs,
        } => twin::running(&mut targets, &inputs, decay),
        #[cfg(feature = "cuda")]
        Held::Cuda {
            mut targets,
            inputs,
        } => {
            let plan = cuda::running_plan(mean.elem_count(), decay, running_mean.dtype())?;
            crate::cuda::launch_in_place(crate::cuda::BATCH_NORM, &plan, &mut targets, &inputs)
        }
    })?;
    count_updates(1);
    Ok(())
}
