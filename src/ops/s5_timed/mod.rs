//! S5's discretisation per sample, for samples taken at irregular times (S5 §6.3), forward and
//! backward as one op each on the CPU and on CUDA (`kernels/s5_timed.cu`, whose twin is the
//! arithmetic here). Sample n (of N = batch × length) is discretised with the step
//! Δ_n = dt_n · e^{log Δ}, so Λ̄ and k vary along the sequence ([`mod@super::s5_discretize`] has the
//! formulas, and shares them with this op):
//!
//!   gate[n, p] = Λ̄(λ_p, Δ_np),   v[n, p] = k(λ_p, Δ_np) · bu[n, p],
//!
//! with bu = B̃u the input projection (N, P) complex and v the scan's input. In candle ops this
//! is dozens of small ops forward and several times as many backward (docs/performance.md counts
//! them per block); the forward here computes them operation for operation (the same values on
//! the CPU). The backward is
//!
//!   ∂bu = conj(k) ∂v,   g_k = conj(bu) ∂v,   (∂λ_re, ∂λ_im, ∂log Δ) = Σ_n (the chain rule of
//!   `s5_discretize` at Δ_np, with ∂log Δ = g_Δ Δ_np),
//!
//! the sums over the samples added in the row layout of [`super::rows`] (one launch, then a
//! small one adding the blocks' partial sums). Neither direction joins candle's graph: the layer
//! that uses them computes its gradients by hand. f32 and f64, P up to 512 (f32) or 256 (f64).

use candle_core::{bail, DType, Device, Result, Storage, Tensor, WithDType};
use num_traits::{Float, NumAssign};
use rayon::prelude::*;

use super::rows::column_sums;
use super::s5_discretize::{param_grads, step_at, Step};
use super::value::{contiguous, Complex, Value};
use super::S5Discretization;

pub mod cuda;

/// Whether the fused op takes `bu` (…, P, 2): f32 or f64, on the CPU or CUDA, P within the
/// backward's shared memory.
pub fn fused(bu: &Tensor) -> Result<bool> {
    let p = bu.dim(bu.rank().saturating_sub(2))?;
    Ok((bu.device().is_cpu() || bu.device().is_cuda()) && cuda::supports(p, bu.dtype()))
}

/// (gate, v), both of `bu`'s shape (…, P, 2), from λ_re, λ_im, log Δ (P), the intervals `dt`
/// (one per sample: the leading dimensions of `bu`) and bu = B̃u. Not tracked by candle's graph.
pub fn s5_timed(
    [lambda_re, lambda_im, log_step]: [&Tensor; 3],
    dt: &Tensor,
    bu: &Tensor,
    how: S5Discretization,
) -> Result<(Tensor, Tensor)> {
    let (n, p) = check([lambda_re, lambda_im, log_step], dt, bu)?;
    let out = launch(&[lambda_re, lambda_im, log_step, dt, bu], p, how, true)?;
    let half = 2 * n * p;
    Ok((
        out[0].narrow(0, 0, half)?.reshape(bu.dims())?,
        out[0].narrow(0, half, half)?.reshape(bu.dims())?,
    ))
}

/// The backward of [`s5_timed`]: (∂bu, [∂λ_re, ∂λ_im, ∂log Δ]) from the gradients of gate and
/// v (both of `bu`'s shape).
pub fn s5_timed_backward(
    [lambda_re, lambda_im, log_step]: [&Tensor; 3],
    dt: &Tensor,
    bu: &Tensor,
    how: S5Discretization,
    d_gate: &Tensor,
    d_v: &Tensor,
) -> Result<(Tensor, [Tensor; 3])> {
    let (_, p) = check([lambda_re, lambda_im, log_step], dt, bu)?;
    if d_gate.dims() != bu.dims() || d_v.dims() != bu.dims() {
        bail!(
            "s5_timed backward: gradients {:?} and {:?} for bu {:?}",
            d_gate.dims(),
            d_v.dims(),
            bu.dims()
        );
    }
    let inputs = [lambda_re, lambda_im, log_step, dt, bu, d_gate, d_v];
    let out = launch(&inputs, p, how, false)?;
    let [dlr, dli, dls] = [0, 1, 2].map(|k| out[1].narrow(0, k * p, p));
    Ok((out[0].reshape(bu.dims())?, [dlr?, dli?, dls?]))
}

/// (N, P) after checking the shapes, dtypes and devices.
fn check(params: [&Tensor; 3], dt: &Tensor, bu: &Tensor) -> Result<(usize, usize)> {
    let dims = bu.dims();
    let (lead, tail) = dims.split_at(dims.len().saturating_sub(2));
    let (n, p) = match tail {
        [p, 2] => (lead.iter().product::<usize>(), *p),
        _ => bail!("s5_timed: bu has shape {dims:?}, expected (…, P, 2)"),
    };
    if dt.dims() != lead {
        bail!(
            "s5_timed: intervals of shape {:?} for bu {dims:?}, expected {lead:?}",
            dt.dims()
        );
    }
    for (name, t) in [("lambda_re", params[0]), ("lambda_im", params[1])]
        .into_iter()
        .chain([("log_step", params[2]), ("dt", dt)])
    {
        if name != "dt" && t.dims() != [p] {
            bail!("s5_timed: {name} has shape {:?}, expected ({p})", t.dims());
        }
        if t.dtype() != bu.dtype() || !t.device().same_device(bu.device()) {
            bail!("s5_timed: {name} and bu differ in dtype or device");
        }
    }
    if !fused(bu)? {
        bail!(
            "s5_timed: {p} states in {:?} on {:?} are not covered (f32 or f64 on the CPU or \
             CUDA, P up to 512 in f32, 256 in f64)",
            bu.dtype(),
            bu.device().location()
        );
    }
    Ok((n, p))
}

/// The kernel (or its CPU twin): the forward's packed [gate | v], or the backward's
/// (∂bu, the 3P sums).
fn launch(x: &[&Tensor], p: usize, how: S5Discretization, forward: bool) -> Result<Vec<Tensor>> {
    let dtype = x[4].dtype();
    let x: Vec<Tensor> = x.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    #[cfg(feature = "cuda")]
    if x[4].device().is_cuda() {
        use crate::cuda::{launch_tensors, S5_TIMED};
        let n = x[3].elem_count();
        let refs: Vec<&Tensor> = x.iter().collect();
        if forward {
            let plan = cuda::forward_plan(n, p, how, dtype)?;
            return launch_tensors(S5_TIMED, &plan, dtype, &refs, &[&[4 * n * p]]);
        }
        let [rows, sums] = cuda::backward_plans(n, p, how, dtype)?;
        let shapes: [&[usize]; 2] = [&[2 * n * p], &[rows.outputs[1]]];
        let mut outs = launch_tensors(S5_TIMED, &rows, dtype, &refs, &shapes)?;
        let part = outs.remove(1);
        let d = launch_tensors(S5_TIMED, &sums, dtype, &[&part], &[&[3 * p]])?.remove(0);
        return Ok(vec![outs.remove(0), d]);
    }
    fn run<F: WithDType + Float + NumAssign + Send + Sync>(
        x: &[Tensor],
        p: usize,
        how: S5Discretization,
        forward: bool,
    ) -> Result<Vec<Tensor>> {
        let guards: Vec<_> = x.iter().map(|t| t.storage_and_layout()).collect();
        let mut v: Vec<&[F]> = Vec::with_capacity(guards.len());
        for (s, l) in &guards {
            match &**s {
                Storage::Cpu(s) => v.push(contiguous(s, l)?),
                _ => bail!("s5_timed: tensors are not all on the CPU"),
            }
        }
        let params = [v[0], v[1], v[2]];
        let cpu = &Device::Cpu;
        if forward {
            let out = forward_cpu(params, v[3], v[4], how);
            let len = out.len();
            return Ok(vec![Tensor::from_vec(out, len, cpu)?]);
        }
        let (dbu, d) = backward_cpu(params, v[3], v[4], how, v[5], v[6]);
        let len = dbu.len();
        Ok(vec![
            Tensor::from_vec(dbu, len, cpu)?,
            Tensor::from_vec(d, 3 * p, cpu)?,
        ])
    }
    match dtype {
        DType::F32 => run::<f32>(&x, p, how, forward),
        DType::F64 => run::<f64>(&x, p, how, forward),
        dt => bail!("s5_timed: dtype {dt:?} is not fused"),
    }
}

/// State p's discretisation at sample n: Δ = dt_n · e^{log Δ_p}.
fn step_of<F: WithDType + Float>(
    [re, im, log_dt]: [&[F]; 3],
    dt: F,
    p: usize,
    how: S5Discretization,
) -> Step<F> {
    step_at(re[p], im[p], dt * log_dt[p].exp(), how)
}

/// The CPU twin of `s5_timed_fwd`: [gate (N, P, 2) | v (N, P, 2)] from λ_re, λ_im, log Δ (P),
/// dt (N) and bu (N, P, 2).
pub fn forward_cpu<F: WithDType + Float + Send + Sync>(
    params: [&[F]; 3],
    dt: &[F],
    bu: &[F],
    how: S5Discretization,
) -> Vec<F> {
    let p = params[0].len();
    let half = bu.len();
    let mut out = vec![F::zero(); 2 * half];
    let (gate, v) = out.split_at_mut(half);
    gate.par_chunks_mut(2 * p.max(1))
        .zip(v.par_chunks_mut(2 * p.max(1)))
        .zip(dt.par_iter())
        .enumerate()
        .for_each(|(n, ((g, v), &d))| {
            for k in 0..p {
                let s = step_of(params, d, k, how);
                Complex::put(g, k, s.lbar);
                Complex::put(v, k, s.k.mul(Complex::load(bu, n * p + k)));
            }
        });
    out
}

/// The CPU twin of `s5_timed_bwd` and `s5_timed_sums`: ∂bu (N, P, 2) and
/// [∂λ_re | ∂λ_im | ∂log Δ] from the gradients of gate (`g_gate`) and v (`g_v`), added in the
/// kernels' order.
pub fn backward_cpu<F: WithDType + Float + NumAssign + Send + Sync>(
    params: [&[F]; 3],
    dt: &[F],
    bu: &[F],
    how: S5Discretization,
    g_gate: &[F],
    g_v: &[F],
) -> (Vec<F>, Vec<F>) {
    let p = params[0].len();
    let mut dbu = vec![F::zero(); bu.len()];
    let sums = column_sums(dt.len(), 2 * p, 3 * p, &mut dbu, |n, out, acc| {
        for k in 0..p {
            let s = step_of(params, dt[n], k, how);
            let e = n * p + k;
            let gv = Complex::load(g_v, e);
            let gk = Complex::load(bu, e).conj().mul(gv);
            Complex::put(out, k, s.k.conj().mul(gv));
            let d = param_grads(how, &s, Complex::load(g_gate, e), gk);
            for (r, d) in d.into_iter().enumerate() {
                acc[r * p + k] += d;
            }
        }
    });
    (dbu, sums)
}
