//! The fused ops' formulas as candle ops, where the kernels do not apply (rows wider than
//! [`super::cuda::supports`] takes, devices other than the CPU and CUDA), with the fused ops'
//! dtypes: half-precision rows computed in f32 (the statistics' dtype,
//! [`super::stats_dtype`]), what is stored in the rows' dtype cast back.

use candle_core::{Result, Tensor, D};

use crate::ops::value::widened;

/// `x` as (rows, H) in the statistics' dtype.
fn rows(x: &Tensor) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    widened(x)?.reshape((x.elem_count() / h, h))
}

/// k = 1 / √(σ² + ε) and x̂ = (x − μ) k, as (rows, H) in the statistics' dtype.
fn normalised(x: &Tensor, mean: &Tensor, var: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let k = (var + eps)?.sqrt()?.recip()?;
    let xh = rows(x)?.broadcast_sub(mean)?.broadcast_mul(&k)?;
    Ok((k, xh))
}

/// [`super::column_stats`].
pub fn column_stats(x: &Tensor, mean: Option<&Tensor>) -> Result<Tensor> {
    match mean {
        Some(m) => rows(x)?.broadcast_sub(m)?.sqr()?.sum(0),
        None => rows(x)?.sum(0),
    }
}

/// [`super::batch_norm_apply`]: (x − μ) (γ k) + β.
pub fn apply(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let k = (var + eps)?.sqrt()?.recip()?;
    rows(x)?
        .broadcast_sub(mean)?
        .broadcast_mul(&(widened(weight)? * k)?)?
        .broadcast_add(&widened(bias)?)?
        .reshape(x.shape())?
        .to_dtype(x.dtype())
}

/// [`super::batch_norm_backward_stats`].
pub fn backward_stats(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<[Tensor; 2]> {
    let (_, xh) = normalised(x, mean, var, eps)?;
    let dy = rows(dy)?;
    Ok([(xh * &dy)?.sum(0)?, dy.sum(0)?])
}

/// [`super::batch_norm_backward`], `[dweight, dbias]` of the whole batch.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    [dweight, dbias]: [&Tensor; 2],
    count: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let (k, xh) = normalised(x, mean, var, eps)?;
    let mean_part = xh
        .broadcast_mul(dweight)?
        .broadcast_add(dbias)?
        .broadcast_div(count)?;
    (rows(dy)? - mean_part)?
        .broadcast_mul(&(widened(weight)? * k)?)?
        .reshape(x.shape())?
        .to_dtype(x.dtype())
}
