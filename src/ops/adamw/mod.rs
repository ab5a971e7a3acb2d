//! One AdamW step of many parameters, in place (`kernels/adamw.cu` on CUDA, its CPU twin
//! here): one launch per [`cuda::SEGMENTS`] parameters updates θ and its moments [m; v] where
//! they are, so that the optimiser's state never moves and a step allocates nothing (a
//! captured step replays on the same buffers):
//!
//!   ĝ = s g,  m' = β₁ m + (1 − β₁) ĝ,  v' = β₂ v + (1 − β₂) ĝ²,
//!   θ' = θ − η (m' / c₁) / (√(v' / c₂) + ε) − η λ θ,  c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
//!
//! with s the gradient-clipping factor (a device scalar) or 1, and each parameter's
//! hyper-parameters a row of a device table (its group's). Under mixed precision the f32
//! parameters read the gradients of their f16/bf16 compute copies (or f32 sums of them) and
//! write θ' rounded into the copies, where a cast of each gradient before the step and of each
//! parameter after it took two ops per parameter. No gradient flows through it.

use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::ops::in_place::{count_updates, with_targets, Held};
use crate::ops::value::{Elem, Load, Store};

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
    /// The gradient, of θ's shape: of θ's dtype, or of `copy`'s.
    pub grad: &'a Tensor,
    /// The row of the hyper-parameter table.
    pub group: usize,
    /// Under mixed precision, θ's f16/bf16 compute copy (contiguous): set to θ' rounded to
    /// nearest even, as a cast after the step would.
    pub copy: Option<&'a Tensor>,
}

/// The dtypes of one [`adamw_step`]: the parameters', the gradients' and the compute copies'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepDtypes {
    pub param: DType,
    pub grad: DType,
    pub copy: Option<DType>,
}

impl StepDtypes {
    /// The kernel of these dtypes: `adamw_step_<param>` (f32 or f64, no copy),
    /// `adamw_step_<half>` (f32 parameters, f16/bf16 gradients and copies) or
    /// `adamw_step_wide_<half>` (f32 parameters and gradients, f16/bf16 copies).
    pub fn kernel(&self) -> Result<String> {
        use crate::ops::value::is_half;
        let (stem, dtype) = match (self.param, self.grad, self.copy) {
            (DType::F32 | DType::F64, g, None) if g == self.param => ("adamw_step", g),
            (DType::F32, g, Some(c)) if is_half(g) && c == g => ("adamw_step", g),
            (DType::F32, DType::F32, Some(c)) if is_half(c) => ("adamw_step_wide", c),
            (p, g, c) => bail!(
                "adamw_step: {p:?} parameters with {g:?} gradients and compute copies {c:?} \
                 (f32 or f64 alone; f32 with f16/bf16 copies and gradients of either)"
            ),
        };
        crate::ops::plan::kernel_name(stem, dtype, false)
    }
}

/// One step of `params`, all of one device and of the same [`StepDtypes`] (parameters f32 or
/// f64): θ and [m; v] updated in place, and θ's compute copy where given, with the
/// hyper-parameters of `hyper` ([`AdamwHyper::table`], of the parameters' dtype) and the
/// gradients scaled by `scale` (one value of that dtype, the clipping factor) if given.
pub fn adamw_step(params: &[AdamwParam], hyper: &Tensor, scale: Option<&Tensor>) -> Result<()> {
    let Some(first) = params.first() else {
        return Ok(());
    };
    let dtypes = StepDtypes {
        param: first.theta.dtype(),
        grad: first.grad.dtype(),
        copy: first.copy.map(|c| c.dtype()),
    };
    dtypes.kernel()?;
    let dtype = dtypes.param;
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
        let dims = p.theta.dims();
        let mut operands = vec![
            ("parameter", p.theta, dims, dtype),
            ("moments", p.moments, two.as_slice(), dtype),
            ("gradient", p.grad, dims, dtypes.grad),
        ];
        match (p.copy, dtypes.copy) {
            (Some(c), Some(cdt)) => operands.push(("compute copy", c, dims, cdt)),
            (None, None) => {}
            _ => bail!("adamw_step: parameter {k} has a compute copy where the first has not, or the reverse"),
        }
        for (what, t, dims, dt) in operands {
            if t.dims() != dims || t.dtype() != dt {
                bail!(
                    "adamw_step: parameter {k}'s {what} is {:?} {:?}, expected {dims:?} {dt:?}",
                    t.dims(),
                    t.dtype()
                );
            }
        }
        for (what, t) in [
            ("parameter", Some(p.theta)),
            ("moments", Some(p.moments)),
            ("compute copy", p.copy),
        ] {
            if t.is_some_and(|t| !t.is_contiguous()) {
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
        .chain(params.iter().filter_map(|p| p.copy))
        .collect();
    let mut inputs: Vec<&Tensor> = grads.iter().chain([hyper]).collect();
    inputs.extend(scale);
    let sizes: Vec<usize> = params.iter().map(|p| p.theta.elem_count()).collect();
    let group: Vec<usize> = params.iter().map(|p| p.group).collect();
    with_targets("adamw_step", &targets, &inputs, &mut |held| match held {
        Held::Cpu {
            mut targets,
            inputs,
        } => step_cpu(dtypes, &sizes, &group, &mut targets, &inputs),
        #[cfg(feature = "cuda")]
        Held::Cuda {
            mut targets,
            inputs,
        } => {
            for plan in cuda::step_plans(&sizes, &group, dtypes, scale.is_some())? {
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

fn part_mut<'a, F: Elem>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [F]> {
    match (l.contiguous_offsets(), F::values_mut(s)) {
        (Some((a, b)), Some(v)) => Ok(&mut v[a..b]),
        (None, _) => bail!("adamw_step: an updated tensor is not contiguous"),
        (_, None) => bail!("adamw_step: an updated tensor is not of the dtype it should be"),
    }
}

/// The CPU twin: with N parameters, `targets` are θ₀ … θ_{N−1}, their moments, then their
/// compute copies if any; `inputs` the gradients, the hyper-parameter table and perhaps the
/// scale.
fn step_cpu(
    dtypes: StepDtypes,
    sizes: &[usize],
    groups: &[usize],
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
) -> Result<()> {
    match (dtypes.param, dtypes.grad, dtypes.copy) {
        (DType::F64, _, _) => step_typed::<f64, f64, f64>(sizes, groups, targets, inputs),
        (_, DType::F32, None) => step_typed::<f32, f32, f32>(sizes, groups, targets, inputs),
        (_, DType::F16, _) => step_typed::<f32, f16, f16>(sizes, groups, targets, inputs),
        (_, DType::BF16, _) => step_typed::<f32, bf16, bf16>(sizes, groups, targets, inputs),
        (_, _, Some(DType::F16)) => step_typed::<f32, f32, f16>(sizes, groups, targets, inputs),
        (_, _, Some(DType::BF16)) => step_typed::<f32, f32, bf16>(sizes, groups, targets, inputs),
        _ => bail!("adamw_step: dtypes {dtypes:?} (checked before)"),
    }
}

fn step_typed<F, G, C>(
    sizes: &[usize],
    groups: &[usize],
    targets: &mut [(&mut CpuStorage, &Layout)],
    inputs: &[(&CpuStorage, &Layout)],
) -> Result<()>
where
    F: Elem + num_traits::Float,
    G: Load<F>,
    C: Store<F>,
{
    let n = sizes.len();
    let hyper: &[F] = part(inputs[n].0, inputs[n].1)?;
    let s = match inputs.get(n + 1) {
        Some(&(st, l)) => part::<F>(st, l)?[0],
        None => F::one(),
    };
    let (thetas, rest) = targets.split_at_mut(n);
    let (moments, copies) = rest.split_at_mut(n);
    for p in 0..n {
        let h = &hyper[groups[p] * HYPER_LEN..(groups[p] + 1) * HYPER_LEN];
        let (t, tl) = &mut thetas[p];
        let (mv, mvl) = &mut moments[p];
        let (g, gl) = inputs[p];
        let copy = match copies.get_mut(p) {
            Some((c, cl)) => Some(part_mut::<C>(c, cl)?),
            None => None,
        };
        step_one(
            sizes[p],
            part_mut(t, tl)?,
            part_mut(mv, mvl)?,
            part::<G>(g, gl)?,
            copy,
            h,
            s,
        );
    }
    Ok(())
}

/// Elements per rayon task of the CPU twin.
const CHUNK: usize = 1 << 14;

/// One parameter's step: the kernel's operations in its order, in F.
fn step_one<F, G, C>(
    n: usize,
    theta: &mut [F],
    mv: &mut [F],
    g: &[G],
    copy: Option<&mut [C]>,
    h: &[F],
    s: F,
) where
    F: Elem + num_traits::Float,
    G: Load<F>,
    C: Store<F>,
{
    let (b1, b2, c1, c2, eps, eta, wd) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    let (m, v) = mv.split_at_mut(n);
    let task = |theta: &mut [F], m: &mut [F], v: &mut [F], g: &[G], mut copy: Option<&mut [C]>| {
        for k in 0..theta.len() {
            let gs = g[k].load() * s;
            let mk = b1 * m[k] + (F::one() - b1) * gs;
            let vk = b2 * v[k] + (F::one() - b2) * (gs * gs);
            m[k] = mk;
            v[k] = vk;
            let update = (mk / c1) / ((vk / c2).sqrt() + eps);
            let th = theta[k];
            let next = (th - eta * update) - eta * wd * th;
            theta[k] = next;
            if let Some(c) = copy.as_deref_mut() {
                c[k] = C::store(next);
            }
        }
    };
    let parts = theta
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK));
    match copy {
        Some(c) => parts
            .zip(c.par_chunks_mut(CHUNK))
            .for_each(|((((t, m), v), g), c)| task(t, m, v, g, Some(c))),
        None => parts.for_each(|(((t, m), v), g)| task(t, m, v, g, None)),
    }
}
