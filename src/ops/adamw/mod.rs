//! One AdamW step of many parameters, in place (`kernels/adamw.cu` on CUDA, its CPU twin
//! here): one launch per [`cuda::SEGMENTS`] parameters updates θ and its moments [m; v] where
//! they are, so that the optimiser's state never moves and a step allocates nothing (a
//! captured step replays on the same buffers):
//!
//!   ĝ = s g,  m' = β₁ m + (1 − β₁) ĝ,  v' = β₂ v + (1 − β₂) ĝ²,
//!   θ' = θ − η (m' / c₁) / (√(v' / c₂) + ε) − η λ θ,  c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
//!
//! with s the gradient-clipping factor (a device scalar) or 1, and each parameter's
//! hyper-parameters a row of a device table (its group's). No gradient flows through it.

use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::ops::in_place::{count_updates, with_targets, Held};

pub mod cuda;

/// The hyper-parameters of one step of one parameter group, in the kernel's order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwHyper {
    pub beta1: f64,
    pub beta2: f64,
    /// 1 − β₁ᵗ at step t (1-based).
    pub c1: f64,
    /// 1 − β₂ᵗ.
    pub c2: f64,
    pub eps: f64,
    /// The learning rate η of this step.
    pub lr: f64,
    /// The weight decay λ.
    pub weight_decay: f64,
}

/// Values in a row of [`AdamwHyper::table`].
pub const HYPER_LEN: usize = 7;

impl AdamwHyper {
    /// The row the kernels read: [β₁, β₂, c₁, c₂, ε, η, λ].
    pub fn row(&self) -> [f64; HYPER_LEN] {
        [
            self.beta1,
            self.beta2,
            self.c1,
            self.c2,
            self.eps,
            self.lr,
            self.weight_decay,
        ]
    }

    /// The rows of `groups` as one (groups, [`HYPER_LEN`]) tensor of `dtype` (f32 or f64) on
    /// `device`, made in one op.
    pub fn table(groups: &[AdamwHyper], dtype: DType, device: &Device) -> Result<Tensor> {
        let rows: Vec<f64> = groups.iter().flat_map(AdamwHyper::row).collect();
        let shape = (groups.len(), HYPER_LEN);
        match dtype {
            DType::F64 => Tensor::from_vec(rows, shape, device),
            DType::F32 => Tensor::from_vec(
                rows.into_iter().map(|v| v as f32).collect::<Vec<_>>(),
                shape,
                device,
            ),
            dt => bail!("adamw: parameters of dtype {dt:?} are not supported (f32 or f64)"),
        }
    }
}

impl AdamwHyper {
    /// Writes the rows of `groups` into `table` (made by [`AdamwHyper::table`] for as many
    /// groups) where it is: a copy from the host, outside any captured CUDA graph (on CUDA
    /// candle's stream, in its order).
    pub fn fill(table: &Tensor, groups: &[AdamwHyper]) -> Result<()> {
        if table.dims() != [groups.len(), HYPER_LEN] || !table.is_contiguous() {
            bail!(
                "adamw: a table of {:?} cannot take {} groups' rows",
                table.dims(),
                groups.len()
            );
        }
        let rows: Vec<f64> = groups.iter().flat_map(AdamwHyper::row).collect();
        let narrow: Vec<f32> = rows.iter().map(|&v| v as f32).collect();
        with_targets(
            "adamw: the hyper-parameter table",
            &[table],
            &[],
            &mut |held| {
                match held {
                    Held::Cpu { mut targets, .. } => {
                        let (s, l) = &mut targets[0];
                        match table.dtype() {
                            DType::F32 => part_mut::<f32>(s, l)?.copy_from_slice(&narrow),
                            DType::F64 => part_mut::<f64>(s, l)?.copy_from_slice(&rows),
                            dt => bail!("adamw: a table of dtype {dt:?}"),
                        }
                        Ok(())
                    }
                    #[cfg(feature = "cuda")]
                    Held::Cuda { mut targets, .. } => {
                        use candle_core::backend::BackendStorage;
                        use candle_core::cuda_backend::WrapErr;
                        let (s, l) = &mut targets[0];
                        let Some((a, b)) = l.contiguous_offsets() else {
                            bail!("adamw: the hyper-parameter table is not contiguous")
                        };
                        // The stream's own copy: candle's would keep every step's rows in its
                        // cache of uploads for captured graphs.
                        let stream = s.device().cuda_stream();
                        match table.dtype() {
                            DType::F32 => {
                                let mut dst = s.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
                                stream.memcpy_htod(&narrow, &mut dst).w()
                            }
                            DType::F64 => {
                                let mut dst = s.as_cuda_slice_mut::<f64>()?.slice_mut(a..b);
                                stream.memcpy_htod(&rows, &mut dst).w()
                            }
                            dt => bail!("adamw: a table of dtype {dt:?}"),
                        }
                    }
                }
            },
        )?;
        count_updates(1);
        Ok(())
    }
}

/// One parameter of an [`adamw_step`].
#[derive(Clone, Copy, Debug)]
pub struct AdamwParam<'a> {
    /// θ, contiguous: updated in place.
    pub theta: &'a Tensor,
    /// [m; v], contiguous, of shape (2, θ's shape): updated in place.
    pub moments: &'a Tensor,
    /// The gradient, of θ's shape.
    pub grad: &'a Tensor,
    /// The row of the hyper-parameter table.
    pub group: usize,
}

/// One step of `params`, all of one dtype (f32 or f64) and device: θ and [m; v] updated in
/// place, with the hyper-parameters of `hyper` ([`AdamwHyper::table`]) and the gradients
/// scaled by `scale` (one value, the clipping factor) if given.
pub fn adamw_step(params: &[AdamwParam], hyper: &Tensor, scale: Option<&Tensor>) -> Result<()> {
    let Some(first) = params.first() else {
        return Ok(());
    };
    let dtype = first.theta.dtype();
    if !matches!(dtype, DType::F32 | DType::F64) {
        bail!("adamw_step: parameters of dtype {dtype:?} are not supported (f32 or f64)");
    }
    let groups = hyper.dims2().map(|d| d.0).unwrap_or(0);
    if hyper.dims() != [groups, HYPER_LEN] || hyper.dtype() != dtype {
        bail!(
            "adamw_step: the hyper-parameter table is {:?} {:?}, expected (groups, {HYPER_LEN}) \
             {dtype:?}",
            hyper.dims(),
            hyper.dtype()
        );
    }
    if let Some(s) = scale.filter(|s| s.elem_count() != 1 || s.dtype() != dtype) {
        bail!(
            "adamw_step: the scale is {:?} {:?}, expected one {dtype:?} value",
            s.dims(),
            s.dtype()
        );
    }
    let mut grads = Vec::with_capacity(params.len());
    for (k, p) in params.iter().enumerate() {
        let mut two = vec![2];
        two.extend_from_slice(p.theta.dims());
        for (what, t, dims) in [
            ("parameter", p.theta, p.theta.dims()),
            ("moments", p.moments, two.as_slice()),
            ("gradient", p.grad, p.theta.dims()),
        ] {
            if t.dims() != dims || t.dtype() != dtype {
                bail!(
                    "adamw_step: parameter {k}'s {what} is {:?} {:?}, expected {dims:?} {dtype:?}",
                    t.dims(),
                    t.dtype()
                );
            }
        }
        for (what, t) in [("parameter", p.theta), ("moments", p.moments)] {
            if !t.is_contiguous() {
                bail!(
                    "adamw_step: parameter {k}'s {what} must be contiguous to be updated in place"
                );
            }
        }
        if p.group >= groups {
            bail!(
                "adamw_step: parameter {k} is in group {}, the table has {groups}",
                p.group
            );
        }
        grads.push(p.grad.contiguous()?);
    }
    let targets: Vec<&Tensor> = params
        .iter()
        .map(|p| p.theta)
        .chain(params.iter().map(|p| p.moments))
        .collect();
    let mut inputs: Vec<&Tensor> = grads.iter().chain([hyper]).collect();
    inputs.extend(scale);
    let sizes: Vec<usize> = params.iter().map(|p| p.theta.elem_count()).collect();
    let group: Vec<usize> = params.iter().map(|p| p.group).collect();
    with_targets("adamw_step", &targets, &inputs, &mut |held| match held {
        Held::Cpu {
            mut targets,
            inputs,
        } => step_cpu(&sizes, &group, &mut targets, &inputs),
        #[cfg(feature = "cuda")]
        Held::Cuda {
            mut targets,
            inputs,
        } => {
            for plan in cuda::step_plans(&sizes, &group, dtype, scale.is_some())? {
                crate::cuda::launch_in_place(crate::cuda::ADAMW, &plan, &mut targets, &inputs)?;
            }
            Ok(())
        }
    })?;
    // One launch per cuda::SEGMENTS parameters.
    count_updates(sizes.len().div_ceil(cuda::SEGMENTS) as u64);
    Ok(())
}

/// The contiguous values `l` addresses in `s`.
fn part<'a, F: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [F]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&F::cpu_storage_as_slice(s)?[a..b]),
        None => bail!("adamw_step: an input is not contiguous"),
    }
}

/// The element types of the CPU twin.
trait Elem: candle_core::WithDType + num_traits::Float + Send + Sync {
    fn values_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    fn values_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for f64 {
    fn values_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
}

fn part_mut<'a, F: Elem>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [F]> {
    match (l.contiguous_offsets(), F::values_mut(s)) {
        (Some((a, b)), Some(v)) => Ok(&mut v[a..b]),
        (None, _) => bail!("adamw_step: an updated tensor is not contiguous"),
        (_, None) => bail!("adamw_step: an updated tensor is not of the parameters' dtype"),
    }
}

/// The CPU twin: with N parameters, `targets` are θ₀ … θ_{N−1} then their moments, `inputs`
/// the gradients, the hyper-parameter table and perhaps the scale.
fn step_cpu(
    sizes: &[usize],
    groups: &[usize],
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
) -> Result<()> {
    match inputs[sizes.len()].0 {
        CpuStorage::F32(_) => step_typed::<f32>(sizes, groups, targets, inputs),
        CpuStorage::F64(_) => step_typed::<f64>(sizes, groups, targets, inputs),
        _ => bail!("adamw_step: only f32 and f64 are supported"),
    }
}

fn step_typed<F: Elem>(
    sizes: &[usize],
    groups: &[usize],
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
) -> Result<()> {
    let n = sizes.len();
    let hyper: &[F] = part(inputs[n].0, inputs[n].1)?;
    let s = match inputs.get(n + 1) {
        Some(&(st, l)) => part::<F>(st, l)?[0],
        None => F::one(),
    };
    let (thetas, moments) = targets.split_at_mut(n);
    for p in 0..n {
        let h = &hyper[groups[p] * HYPER_LEN..(groups[p] + 1) * HYPER_LEN];
        let (t, tl) = &mut thetas[p];
        let (mv, mvl) = &mut moments[p];
        let (g, gl) = inputs[p];
        step_one(
            sizes[p],
            part_mut(t, tl)?,
            part_mut(mv, mvl)?,
            part(g, gl)?,
            h,
            s,
        );
    }
    Ok(())
}

/// Elements per rayon task of the CPU twin.
const CHUNK: usize = 1 << 14;

/// One parameter's step: the kernel's operations in its order, in F.
fn step_one<F: num_traits::Float + Send + Sync>(
    n: usize,
    theta: &mut [F],
    mv: &mut [F],
    g: &[F],
    h: &[F],
    s: F,
) {
    let (b1, b2, c1, c2, eps, eta, wd) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    let (m, v) = mv.split_at_mut(n);
    theta
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((theta, m), v), g)| {
            for k in 0..theta.len() {
                let gs = g[k] * s;
                let mk = b1 * m[k] + (F::one() - b1) * gs;
                let vk = b2 * v[k] + (F::one() - b2) * (gs * gs);
                m[k] = mk;
                v[k] = vk;
                let update = (mk / c1) / ((vk / c2).sqrt() + eps);
                let th = theta[k];
                theta[k] = (th - eta * update) - eta * wd * th;
            }
        });
}
