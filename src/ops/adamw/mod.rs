//! One AdamW step of one parameter, in place (`kernels/adamw.cu` on CUDA, its CPU twin here):
//! one launch that updates θ and its moments [m; v] where they are, so that the optimiser's
//! state never moves and a step allocates nothing (a captured step replays on the same
//! buffers):
//!
//!   ĝ = s g,  m' = β₁ m + (1 − β₁) ĝ,  v' = β₂ v + (1 − β₂) ĝ²,
//!   θ' = θ − η (m' / c₁) / (√(v' / c₂) + ε) − η λ θ,  c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
//!
//! with s the gradient-clipping factor (a device scalar) or 1. No gradient flows through it.
//! candle's in-place ops update one tensor each: the moments' op, holding them, runs θ's op
//! inside it, which then holds both.

use std::sync::atomic::{AtomicU64, Ordering};

use std::cell::RefCell;

use candle_core::{
    bail, CpuStorage, DType, Device, InplaceOp1, InplaceOp3, Layout, Result, Tensor,
};
use rayon::prelude::*;

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

/// Values in the row [`AdamwHyper::to_tensor`] makes.
pub const HYPER_LEN: usize = 8;

impl AdamwHyper {
    /// The row the kernels read, [β₁, β₂, c₁, c₂, ε, η, λ, s], as a tensor of `dtype` on
    /// `device` (made once per step and group, and shared by the group's parameters); s is
    /// `scale` (one value of `dtype` on `device`: the clipping factor) or 1.
    pub fn to_tensor(
        &self,
        scale: Option<&Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mut h = vec![
            self.beta1,
            self.beta2,
            self.c1,
            self.c2,
            self.eps,
            self.lr,
            self.weight_decay,
        ];
        if scale.is_none() {
            h.push(1.0);
        }
        let row = Tensor::new(h.as_slice(), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        match scale {
            Some(s) => Tensor::cat(&[&row, &s.reshape(1)?], 0),
            None => Ok(row),
        }
    }
}

/// In-place updates the optimiser has applied in this process (an in-place op makes no new
/// tensor, so tensor counts miss it): one per [`adamw_step`].
static UPDATES: AtomicU64 = AtomicU64::new(0);

/// How many in-place updates [`adamw_step`] has applied so far.
pub fn in_place_updates() -> u64 {
    UPDATES.load(Ordering::Relaxed)
}

/// One step of θ (a contiguous variable) with its moments `moments` = [m; v] (contiguous, of
/// shape (2, θ's shape)) and gradient `g`, both updated in place; `hyper` is an
/// [`AdamwHyper::to_tensor`] row. θ is f32 or f64 and everything is of its dtype and device.
pub fn adamw_step(theta: &Tensor, moments: &Tensor, g: &Tensor, hyper: &Tensor) -> Result<()> {
    let dtype = theta.dtype();
    if !matches!(dtype, DType::F32 | DType::F64) {
        bail!("adamw_step: parameters of dtype {dtype:?} are not supported (f32 or f64)");
    }
    let mut two = vec![2];
    two.extend_from_slice(theta.dims());
    for (what, t, dims) in [
        ("the moments", moments, two.as_slice()),
        ("the gradient", g, theta.dims()),
        ("the hyper-parameter row", hyper, &[HYPER_LEN]),
    ] {
        if t.dims() != dims || t.dtype() != dtype {
            bail!(
                "adamw_step: {what} is {:?} {:?}, expected {dims:?} {dtype:?}",
                t.dims(),
                t.dtype()
            );
        }
    }
    for (what, t) in [("the parameter", theta), ("the moments", moments)] {
        if !t.is_contiguous() {
            bail!("adamw_step: {what} must be contiguous to be updated in place");
        }
    }
    // θ's update runs inside the moments' (which holds their storage): one storage for both
    // would wait on itself.
    let storage = |t: &Tensor| std::ptr::from_ref(&*t.storage_and_layout().0) as usize;
    if storage(theta) == storage(moments) {
        bail!("adamw_step: the parameter and its moments share memory");
    }
    let step = Step {
        theta: theta.clone(),
        n: theta.elem_count(),
    };
    moments.inplace_op3(&g.contiguous()?, hyper, &step)?;
    UPDATES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The step, as an in-place op on [m; v] (inputs: g, the hyper row) that runs [`Apply`] on θ.
struct Step {
    theta: Tensor,
    n: usize,
}

/// The step's update of θ, with the moments' op's operands: [m; v] (held mutably by it), g and
/// the hyper row.
struct Apply<'a, S> {
    n: usize,
    mv: RefCell<(&'a mut S, &'a Layout)>,
    g: (&'a S, &'a Layout),
    h: (&'a S, &'a Layout),
}

/// The contiguous values `l` addresses in `s`.
fn part<'a, F: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [F]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&F::cpu_storage_as_slice(s)?[a..b]),
        None => bail!("adamw_step: an input is not contiguous"),
    }
}

fn part_mut<'a, F>(v: &'a mut [F], l: &Layout) -> Result<&'a mut [F]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&mut v[a..b]),
        None => bail!("adamw_step: the updated tensor is not contiguous"),
    }
}

/// Elements per rayon task of the CPU twins.
const CHUNK: usize = 1 << 14;

/// The CPU twin of `adamw_step`: the same operations in the same order, in F.
fn step_cpu<F: candle_core::WithDType + num_traits::Float + Send + Sync>(
    n: usize,
    theta: &mut [F],
    mv: &mut [F],
    g: &[F],
    h: &[F],
) {
    let (b1, b2, c1, c2, eps, eta, wd, s) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
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

impl InplaceOp3 for Step {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        mv: &mut CpuStorage,
        mvl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        h: &CpuStorage,
        hl: &Layout,
    ) -> Result<()> {
        self.theta.inplace_op1(&Apply {
            n: self.n,
            mv: RefCell::new((mv, mvl)),
            g: (g, gl),
            h: (h, hl),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        mv: &mut candle_core::CudaStorage,
        mvl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        h: &candle_core::CudaStorage,
        hl: &Layout,
    ) -> Result<()> {
        self.theta.inplace_op1(&Apply {
            n: self.n,
            mv: RefCell::new((mv, mvl)),
            g: (g, gl),
            h: (h, hl),
        })
    }
}

impl InplaceOp1 for Apply<'_, CpuStorage> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(&self, theta: &mut CpuStorage, tl: &Layout) -> Result<()> {
        let mut mv = self.mv.borrow_mut();
        let (mv, mvl) = &mut *mv;
        let ((g, gl), (h, hl)) = (self.g, self.h);
        match (theta, &mut **mv) {
            (CpuStorage::F32(t), CpuStorage::F32(mv)) => step_cpu(
                self.n,
                part_mut(t, tl)?,
                part_mut(mv, mvl)?,
                part(g, gl)?,
                part(h, hl)?,
            ),
            (CpuStorage::F64(t), CpuStorage::F64(mv)) => step_cpu(
                self.n,
                part_mut(t, tl)?,
                part_mut(mv, mvl)?,
                part(g, gl)?,
                part(h, hl)?,
            ),
            _ => bail!("adamw_step: only f32 and f64 are supported"),
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl InplaceOp1 for Apply<'_, candle_core::CudaStorage> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("adamw_step: the parameter is on the CPU and its moments on CUDA")
    }

    fn cuda_fwd(&self, theta: &mut candle_core::CudaStorage, tl: &Layout) -> Result<()> {
        use candle_core::backend::BackendStorage;
        let plan = cuda::step_plan(self.n, theta.dtype())?;
        let mut mv = self.mv.borrow_mut();
        let (mv, mvl) = &mut *mv;
        crate::cuda::launch_in_place(
            crate::cuda::ADAMW,
            &plan,
            &mut [(theta, tl), (&mut **mv, mvl)],
            &[self.g, self.h],
        )
    }
}
