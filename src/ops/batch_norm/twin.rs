//! The CPU twins of `kernels/batch_norm.cu`: the kernels' arithmetic in their order, in the
//! statistics' type F. f16/bf16 operands are read into f32 first (as the kernels' `to_acc`
//! reads each value; a whole slice at a time, which the CPU converts in SIMD lanes) and the
//! rows' results rounded back (`store_s`).

use std::ops::AddAssign;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

use crate::ops::rows::column_sums;
use crate::ops::value::{contiguous, is_half, narrowed_tensor, widened_values, Elem, Load, Store};

/// Elements per rayon task of the element-wise passes.
const PER_TASK: usize = 1 << 14;

/// The kernel a twin follows, with its inputs in the launch plan's order.
#[derive(Clone, Copy)]
pub(super) enum Twin {
    /// `batch_norm_stats` with `batch_norm_sums`: Σ_rows x. Inputs x.
    Sums,
    /// The same of (x − μ)². Inputs x, μ.
    Centred,
    /// `batch_norm_apply`. Inputs x, μ, σ², γ, β.
    Apply,
    /// `batch_norm_bwd_stats` with `batch_norm_pair`: ∂γ, ∂β. Inputs x, μ, σ², ∂y.
    BackwardStats,
    /// `batch_norm_bwd`. Inputs x, μ, σ², γ, ∂y, ∂γ, ∂β, n.
    Backward,
}

/// 1 / √(σ² + ε), as the kernels compute it per element.
#[inline(always)]
fn rstd<F: Float>(var: F, eps: F) -> F {
    F::one() / (var + eps).sqrt()
}

impl Twin {
    /// The twin on `inputs` (CPU tensors; the first the rows, x): its outputs, statistics (H)
    /// in the statistics' dtype, rows shaped like x and of its dtype.
    pub(super) fn run(self, inputs: &[&Tensor], eps: f64) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let ts: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_>>()?;
        let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
        // Half-precision operands in f32, contiguous from 0.
        let mut wide = Vec::with_capacity(guards.len());
        for (s, l) in &guards {
            let Storage::Cpu(s) = &**s else {
                bail!("batch_norm: tensors are not all on the CPU")
            };
            wide.push(match is_half(s.dtype()) {
                true => Some((
                    CpuStorage::F32(widened_values(s, l)?),
                    Layout::contiguous(l.shape()),
                )),
                false => None,
            });
        }
        let mut v = Vec::with_capacity(guards.len());
        for ((s, l), w) in guards.iter().zip(&wide) {
            v.push(match (w, &**s) {
                (Some((s, l)), _) => (s, l),
                (None, Storage::Cpu(s)) => (s, *l),
                _ => unreachable!("on the CPU, checked above"),
            });
        }
        let dims = x.dims();
        match x.dtype() {
            DType::F32 => self.typed::<f32>(&v, dims, eps, plain),
            DType::F64 => self.typed::<f64>(&v, dims, eps, plain),
            dt if is_half(dt) => {
                let rounded = |y, shape: &[usize]| narrowed_tensor(y, shape, dt);
                self.typed::<f32>(&v, dims, eps, rounded)
            }
            dt => bail!("batch_norm: dtype {dt:?} is not fused on the CPU"),
        }
    }

    /// The twin on operands of F; `rows` stores an output of the rows' shape.
    fn typed<F: Elem + Float + AddAssign>(
        self,
        v: &[(&CpuStorage, &Layout)],
        shape: &[usize],
        eps: f64,
        rows_out: impl Fn(Vec<F>, &[usize]) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let h = *shape.last().expect("rows");
        let rows = |k: usize| contiguous::<F>(v[k].0, v[k].1);
        let stats = rows;
        let eps = F::from(eps).expect("eps");
        let column = |s: Vec<F>| Tensor::from_vec(s, h, &Device::Cpu);
        Ok(match self {
            Twin::Sums | Twin::Centred => {
                let x = rows(0)?;
                let mean = match self {
                    Twin::Centred => Some(stats(1)?),
                    _ => None,
                };
                let sums = column_sums(x.len() / h, h, h, &mut [], |r, _, acc| {
                    let xr = &x[r * h..(r + 1) * h];
                    match mean {
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
                });
                vec![column(sums)?]
            }
            Twin::Apply => {
                let (x, m, var, w, b) = (rows(0)?, stats(1)?, stats(2)?, rows(3)?, rows(4)?);
                let y = elementwise(x.len(), h, |e, i| {
                    (x[e] - m[i]) * (w[i] * rstd(var[i], eps)) + b[i]
                });
                vec![rows_out(y, shape)?]
            }
            Twin::BackwardStats => {
                let (x, m, var, g) = (rows(0)?, stats(1)?, stats(2)?, rows(3)?);
                let mut dw = column_sums(x.len() / h, h, 2 * h, &mut [], |r, _, acc| {
                    for i in 0..h {
                        let e = r * h + i;
                        let xh = (x[e] - m[i]) * rstd(var[i], eps);
                        acc[i] += g[e] * xh;
                        acc[h + i] += g[e];
                    }
                });
                let db = dw.split_off(h);
                vec![column(dw)?, column(db)?]
            }
            Twin::Backward => {
                let (x, m, var, w, g) = (rows(0)?, stats(1)?, stats(2)?, rows(3)?, rows(4)?);
                let (dw, db, n) = (stats(5)?, stats(6)?, stats(7)?[0]);
                let dx = elementwise(x.len(), h, |e, i| {
                    let k = rstd(var[i], eps);
                    let xh = (x[e] - m[i]) * k;
                    let mean_part = (db[i] + xh * dw[i]) / n;
                    w[i] * k * (g[e] - mean_part)
                });
                vec![rows_out(dx, shape)?]
            }
        })
    }
}

/// Rows computed in their own dtype, as they are.
fn plain<F: WithDType>(y: Vec<F>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(y, shape, &Device::Cpu)
}

/// `f(e, i)` for each of `n` elements e of rows of `h` (i the column), in rayon tasks of
/// [`PER_TASK`] elements (the kernels' one thread per element).
fn elementwise<F: Float + Send>(
    n: usize,
    h: usize,
    f: impl Fn(usize, usize) -> F + Sync,
) -> Vec<F> {
    let mut out = vec![F::zero(); n];
    out.par_chunks_mut(PER_TASK)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                let e = c * PER_TASK + j;
                *o = f(e, e % h);
            }
        });
    out
}

/// The twin of `batch_norm_running`: targets (running mean, running variance) of one dtype,
/// inputs (μ, σ², n) of the statistics' dtype.
pub(super) fn running(
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
    decay: f64,
) -> Result<()> {
    let [(rm, lm), (rv, lv)] = targets else {
        bail!("internal error: batch_norm running updates two tensors")
    };
    if rm.dtype() != rv.dtype() {
        bail!("batch_norm running: the running averages are of two dtypes");
    }
    let targets = [(&mut **rm, *lm), (&mut **rv, *lv)];
    match targets[0].0.dtype() {
        DType::F32 => running_typed::<f32, f32>(targets, inputs, decay),
        DType::F64 => running_typed::<f64, f64>(targets, inputs, decay),
        DType::F16 => running_typed::<f16, f32>(targets, inputs, decay),
        DType::BF16 => running_typed::<bf16, f32>(targets, inputs, decay),
        dt => bail!("batch_norm running: dtype {dt:?} is not fused on the CPU"),
    }
}

fn running_typed<T, F>(
    [(rm, lm), (rv, lv)]: [(&mut CpuStorage, &Layout); 2],
    inputs: &[(&CpuStorage, &Layout)],
    decay: f64,
) -> Result<()>
where
    T: Load<F> + Store<F>,
    F: Elem + Float,
{
    fn part<'a, T: Elem>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [T]> {
        match (l.contiguous_offsets(), T::values_mut(s)) {
            (Some((a, b)), Some(v)) => Ok(&mut v[a..b]),
            _ => bail!("batch_norm running: a running average is not contiguous"),
        }
    }
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
    for (r, &m) in part::<T>(rm, lm)?.iter_mut().zip(mean) {
        *r = T::store(r.load() * keep + m * take);
    }
    for (r, &v) in part::<T>(rv, lv)?.iter_mut().zip(var) {
        *r = T::store(r.load() * keep + v * unbiased * take);
    }
    Ok(())
}
