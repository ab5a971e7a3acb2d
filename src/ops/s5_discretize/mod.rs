//! S5's parameters to its discretised system in one op, forward and backward, on the CPU and on
//! CUDA (`kernels/s5_discretize.cu`, whose twin is the arithmetic here):
//!
//!   λ = (λ_re, λ_im), λ_re clipped to ≤ −10⁻⁴ with clip_eigs;  Δ = e^{log Δ};
//!   ZOH:       Λ̄ = e^{λΔ},                   k = (Λ̄ − 1) / λ;
//!   bilinear:  Λ̄ = (1 + λΔ/2) / (1 − λΔ/2),  k = Δ / (1 − λΔ/2);
//!   B̄[p, j] = B̃[p, j] · k_p,
//!
//! returned as the scan's gate Λ̄ (P, 2) and B̄ as the (H, 2P) matrix whose row j interleaves
//! (re, im) of B̄[·, j], so that one matmul writes B̄u in the scan's layout. The same formulas
//! in candle ops ([`s5_discretize_reference`]) are some thirty ops forward and a hundred
//! backward; the forward here computes them operation for operation (the same values on the
//! CPU), and the backward is the chain rule written out:
//!
//!   g_B̃ = conj(k) g_B̄,   g_k = Σ_j conj(B̃_j) g_B̄_j,
//!   g_λ = conj(∂Λ̄/∂λ) g_Λ̄ + conj(∂k/∂λ) g_k,   g_Δ = Re(conj(∂Λ̄/∂Δ) g_Λ̄ + conj(∂k/∂Δ) g_k),
//!   ZOH: ∂Λ̄/∂λ = ΔΛ̄, ∂k/∂λ = (ΔΛ̄ − k)/λ, ∂Λ̄/∂Δ = λΛ̄, ∂k/∂Δ = Λ̄;
//!   bilinear (b = 1/(1 − λΔ/2)): ∂Λ̄/∂λ = b²Δ, ∂k/∂λ = b²Δ²/2, ∂Λ̄/∂Δ = b²λ, ∂k/∂Δ = b²,
//!
//! then ∂log Δ = g_Δ Δ, and ∂λ_re = Re g_λ where the clip passes it (half at the bound, as
//! candle's `minimum`). Under candle's autograd, f16/bf16 and other devices use the reference;
//! the entry points for layers by hand ([`s5_discretize_untracked`],
//! [`s5_discretize_backward`]) take f16/bf16 too, computing in f32 and rounding what they
//! store (the f32 op on the parameters cast up, its results cast down: the same bits).

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::value::{contiguous, narrowed_tensor, widened_values, Complex, Value};
use crate::complex::C;

pub mod cuda;

/// Threads per block of the kernels (S5D_THREADS): the backward adds g_k over the channels
/// j ≡ t mod THREADS per thread t, then over the threads in order.
pub const THREADS: usize = 128;

/// How S5 discretises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct S5Discretization {
    pub bilinear: bool,
    pub clip_eigs: bool,
}

/// (Λ̄ as (P, 2), B̄ as the (H, 2P) matrix) from λ_re, λ_im, log Δ (P) and B̃ (P, H, 2).
pub fn s5_discretize(
    lambda_re: &Tensor,
    lambda_im: &Tensor,
    log_step: &Tensor,
    b: &Tensor,
    how: S5Discretization,
) -> Result<(Tensor, Tensor)> {
    let (p, h, _) = b.dims3()?;
    check(lambda_re, lambda_im, log_step, b)?;
    let fused = matches!(b.dtype(), DType::F32 | DType::F64)
        && (b.device().is_cpu() || b.device().is_cuda());
    if !fused {
        return s5_discretize_reference(lambda_re, lambda_im, log_step, b, how);
    }
    let params = Tensor::stack(&[lambda_re, lambda_im, log_step], 0)?;
    let out = params.apply_op2(&b.contiguous()?, S5DiscretizeOp { p, h, how })?;
    split(&out, p, h)
}

/// The forward's packed output as (Λ̄ (P, 2), B̄ (H, 2P)).
fn split(out: &Tensor, p: usize, h: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        out.narrow(0, 0, 2 * p)?.reshape((p, 2))?,
        out.narrow(0, 2 * p, 2 * p * h)?.reshape((h, 2 * p))?,
    ))
}

/// λ_re, λ_im and log Δ of shape (P) for B̃ (P, H, 2), of one dtype and device.
fn check(lambda_re: &Tensor, lambda_im: &Tensor, log_step: &Tensor, b: &Tensor) -> Result<()> {
    let (p, _, two) = b.dims3()?;
    for (name, t) in [
        ("lambda_re", lambda_re),
        ("lambda_im", lambda_im),
        ("log_step", log_step),
    ] {
        if t.dims() != [p] || two != 2 {
            bail!(
                "s5_discretize: {name} has shape {:?} and B {:?}, expected (P) and (P, H, 2)",
                t.dims(),
                b.dims()
            );
        }
        if t.dtype() != b.dtype() || !t.device().same_device(b.device()) {
            bail!("s5_discretize: {name} and B differ in dtype or device");
        }
    }
    Ok(())
}

/// [`s5_discretize`] outside candle's graph (no gradient is tracked), for layers that compute
/// gradients by hand: one launch on the four parameters as they are (f32, f64, f16 and bf16 on
/// the CPU and CUDA).
pub fn s5_discretize_untracked(
    lambda_re: &Tensor,
    lambda_im: &Tensor,
    log_step: &Tensor,
    b: &Tensor,
    how: S5Discretization,
) -> Result<(Tensor, Tensor)> {
    let (p, h, _) = b.dims3()?;
    check(lambda_re, lambda_im, log_step, b)?;
    let out = S5DiscretizeOp { p, h, how }.forward([lambda_re, lambda_im, log_step, b])?;
    split(&out, p, h)
}

/// The backward of [`s5_discretize`] on its own, for layers that compute gradients by hand:
/// (∂λ_re, ∂λ_im, ∂log Δ, ∂B̃) from the gradients of Λ̄ (P, 2) and B̄ (H, 2P) (f32, f64, f16
/// and bf16 on the CPU and CUDA).
pub fn s5_discretize_backward(
    [lambda_re, lambda_im, log_step, b]: [&Tensor; 4],
    how: S5Discretization,
    d_gate: &Tensor,
    d_bmat: &Tensor,
) -> Result<[Tensor; 4]> {
    let (p, h, _) = b.dims3()?;
    check(lambda_re, lambda_im, log_step, b)?;
    if d_gate.elem_count() != 2 * p || d_bmat.elem_count() != 2 * p * h {
        bail!(
            "s5_discretize backward: gradients {:?} and {:?}, expected (P, 2) and (H, 2P)",
            d_gate.dims(),
            d_bmat.dims()
        );
    }
    let op = S5DiscretizeOp { p, h, how };
    let packed = op.backward([lambda_re, lambda_im, log_step, b, d_gate, d_bmat])?;
    let [dlr, dli, dls] = [0, 1, 2].map(|i| packed.narrow(0, i * p, p));
    let db = packed.narrow(0, 3 * p, 2 * p * h)?.reshape(b.dims())?;
    Ok([dlr?, dli?, dls?, db])
}

/// The same in candle ops (any device and float dtype): the tests' reference.
pub fn s5_discretize_reference(
    lambda_re: &Tensor,
    lambda_im: &Tensor,
    log_step: &Tensor,
    b: &Tensor,
    how: S5Discretization,
) -> Result<(Tensor, Tensor)> {
    let (p, h, _) = b.dims3()?;
    let re = if how.clip_eigs {
        lambda_re.minimum(-1e-4)?
    } else {
        lambda_re.clone()
    };
    let lambda = C::new(re, lambda_im.clone());
    let step = log_step.exp()?;
    let b = C::from_pairs(b)?;
    let (lbar, bbar) = if how.bilinear {
        let half = lambda.scale(&(&step * 0.5)?)?;
        let bl = C::one_like(&step)?.sub(&half)?.recip()?;
        (bl.mul(&half.add_real(1.0)?)?, b.mul_col(&bl.scale(&step)?)?)
    } else {
        let lbar = lambda.scale(&step)?.exp()?;
        let coef = lbar.add_real(-1.0)?.div(&lambda)?;
        (lbar.clone(), b.mul_col(&coef)?)
    };
    let b_mat = Tensor::stack(&[&bbar.re, &bbar.im], 2)?
        .transpose(0, 1)?
        .reshape((h, 2 * p))?;
    Ok((lbar.to_pairs()?, b_mat))
}

/// One state's discretisation: λ (clipped), Λ̄, k, b (bilinear), Δ and the clip's slope
/// (`kernels/s5_step.cuh`).
pub(crate) struct Step<F> {
    lam: Complex<F>,
    pub lbar: Complex<F>,
    pub k: Complex<F>,
    bl: Complex<F>,
    dt: F,
    mask: F,
}

fn cx<F>(re: F, im: F) -> Complex<F> {
    Complex { re, im }
}

/// `a` times the real `x`.
fn scale<F: Float>(a: Complex<F>, x: F) -> Complex<F> {
    cx(a.re * x, a.im * x)
}

fn step<F: WithDType + Float>(re: F, im: F, log_dt: F, how: S5Discretization) -> Step<F> {
    step_at(re, im, log_dt.exp(), how)
}

/// The discretisation of one state with the step Δ = `dt`.
pub(crate) fn step_at<F: WithDType + Float>(re: F, im: F, dt: F, how: S5Discretization) -> Step<F> {
    let c = |v: f64| F::from(v).expect("constant");
    let (zero, one) = (F::zero(), F::one());
    let bound = c(-1e-4);
    let (mut re, mut mask) = (re, one);
    if how.clip_eigs {
        mask = if re < bound {
            one
        } else if re == bound {
            c(0.5)
        } else {
            zero
        };
        re = if re < bound { re } else { bound };
    }
    let lam = cx(re, im);
    if how.bilinear {
        let half = scale(lam, dt * c(0.5));
        let bl = cx(one - half.re, zero - half.im).inv();
        let lbar = bl.mul(cx(half.re + one, half.im));
        let k = scale(bl, dt);
        Step {
            lam,
            lbar,
            k,
            bl,
            dt,
            mask,
        }
    } else {
        let (ar, ai) = (re * dt, im * dt);
        let m = ar.exp();
        let lbar = cx(m * ai.cos(), m * ai.sin());
        let k = cx(lbar.re + c(-1.0), lbar.im).mul(lam.inv());
        Step {
            lam,
            lbar,
            k,
            bl: Complex::zero(),
            dt,
            mask,
        }
    }
}

struct S5DiscretizeOp {
    p: usize,
    h: usize,
    how: S5Discretization,
}

impl S5DiscretizeOp {
    fn step_of<F: WithDType + Float>(&self, [re, im, log_dt]: [&[F]; 3], p: usize) -> Step<F> {
        step(re[p], im[p], log_dt[p], self.how)
    }

    /// [Λ̄ (P, 2) | B̄ (H, 2P)] from λ_re, λ_im, log Δ and B̃.
    fn fwd_t<F: WithDType + Float>(&self, params: [&[F]; 3], b: &[F]) -> Vec<F> {
        let (np, h) = (self.p, self.h);
        let mut out = vec![F::zero(); 2 * np + 2 * np * h];
        let steps: Vec<Step<F>> = (0..np).map(|p| self.step_of(params, p)).collect();
        let (gate, bmat) = out.split_at_mut(2 * np);
        for (p, s) in steps.iter().enumerate() {
            Complex::put(gate, p, s.lbar);
        }
        bmat.par_chunks_mut(2 * np)
            .enumerate()
            .for_each(|(j, row)| {
                for (p, s) in steps.iter().enumerate() {
                    Complex::put(row, p, Complex::load(b, p * h + j).mul(s.k));
                }
            });
        out
    }

    /// [∂λ_re | ∂λ_im | ∂log Δ | ∂B̃ (P, H, 2)] from the gradients of Λ̄ (`g`) and B̄ (`gbar`).
    fn bwd_t<F: WithDType + Float>(
        &self,
        params: [&[F]; 3],
        b: &[F],
        g: &[F],
        gbar: &[F],
    ) -> Vec<F> {
        let (np, h) = (self.p, self.h);
        let per_p: Vec<([F; 3], Vec<F>)> = (0..np)
            .into_par_iter()
            .map(|p| {
                let s = self.step_of(params, p);
                let mut db = vec![F::zero(); 2 * h];
                let mut lanes = [Complex::zero(); THREADS];
                for j in 0..h {
                    let gv = Complex::load(gbar, j * np + p);
                    let l = &mut lanes[j % THREADS];
                    *l = l.add(Complex::load(b, p * h + j).conj().mul(gv));
                    Complex::put(&mut db, j, s.k.conj().mul(gv));
                }
                let gk = lanes.iter().fold(Complex::zero(), |a, &l| a.add(l));
                let gl = Complex::load(g, p);
                (param_grads(self.how, &s, gl, gk), db)
            })
            .collect();
        let mut out = vec![F::zero(); 3 * np + 2 * np * h];
        for (p, (d, db)) in per_p.into_iter().enumerate() {
            for (r, v) in d.into_iter().enumerate() {
                out[r * np + p] = v;
            }
            out[3 * np + p * 2 * h..3 * np + (p + 1) * 2 * h].copy_from_slice(&db);
        }
        out
    }
}

/// (∂λ_re, ∂λ_im, ∂log Δ) of one state from g_Λ̄ and g_k (`s5d_param_grads`): ∂log Δ is g_Δ Δ,
/// with Δ the step `s` was taken with.
pub(crate) fn param_grads<F: WithDType + Float>(
    how: S5Discretization,
    s: &Step<F>,
    gl: Complex<F>,
    gk: Complex<F>,
) -> [F; 3] {
    let half = F::from(0.5).expect("constant");
    let (dl_dlam, dk_dlam, dl_ddt, dk_ddt) = if how.bilinear {
        let bl2 = s.bl.mul(s.bl);
        (
            scale(bl2, s.dt),
            scale(bl2, s.dt * s.dt * half),
            bl2.mul(s.lam),
            bl2,
        )
    } else {
        let dl = scale(s.lbar, s.dt);
        let dk = dl.sub(s.k).mul(s.lam.inv());
        (dl, dk, s.lam.mul(s.lbar), s.lbar)
    };
    let a = dl_dlam.conj().mul(gl);
    let c = dk_dlam.conj().mul(gk);
    let g_dt = (dl_ddt.re * gl.re + dl_ddt.im * gl.im) + (dk_ddt.re * gk.re + dk_ddt.im * gk.im);
    [(a.re + c.re) * s.mask, a.im + c.im, g_dt * s.dt]
}

impl CustomOp2 for S5DiscretizeOp {
    fn name(&self) -> &'static str {
        "s5-discretize"
    }

    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<F: WithDType + Float>(op: &S5DiscretizeOp, params: &[F], b: &[F]) -> Result<Vec<F>> {
            let rows: Vec<&[F]> = params.chunks(op.p.max(1)).collect();
            match rows[..] {
                [re, im, log_dt] => Ok(op.fwd_t([re, im, log_dt], b)),
                _ => bail!("s5_discretize: the parameters are not three rows"),
            }
        }
        let out = match sb.dtype() {
            DType::F32 => CpuStorage::F32(run(self, contiguous(sp, lp)?, contiguous(sb, lb)?)?),
            DType::F64 => CpuStorage::F64(run(self, contiguous(sp, lp)?, contiguous(sb, lb)?)?),
            dt => bail!("s5_discretize: dtype {dt:?} is not fused"),
        };
        Ok((out, Shape::from(2 * self.p + 2 * self.p * self.h)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sp: &candle_core::CudaStorage,
        lp: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plan = cuda::forward_plan(self.p, self.h, self.how, sb.dtype())?;
        let module = crate::cuda::S5_DISCRETIZE;
        let Some((start, _)) = lp.contiguous_offsets() else {
            bail!("s5_discretize: the parameters are not contiguous");
        };
        let row = |k: usize| Layout::contiguous_with_offset(self.p, start + k * self.p);
        let [l0, l1, l2] = [row(0), row(1), row(2)];
        let mut out = crate::cuda::launch(
            sb.device(),
            module,
            &plan,
            sb.dtype(),
            &[(sp, &l0), (sp, &l1), (sp, &l2), (sb, lb)],
        )?;
        Ok((out.remove(0), Shape::from(plan.outputs[0])))
    }

    fn bwd(
        &self,
        params: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (p, h) = (self.p, self.h);
        let [re, im, log_dt] = [0, 1, 2].map(|k| params.narrow(0, k, 1));
        let (g_lbar, gbar) = (g.narrow(0, 0, 2 * p)?, g.narrow(0, 2 * p, 2 * p * h)?);
        let packed = self.backward([&re?, &im?, &log_dt?, b, &g_lbar, &gbar])?;
        let np = 3 * self.p;
        Ok((
            Some(packed.narrow(0, 0, np)?.reshape((3, self.p))?),
            Some(
                packed
                    .narrow(0, np, 2 * self.p * self.h)?
                    .reshape(b.dims())?,
            ),
        ))
    }
}

impl S5DiscretizeOp {
    /// The forward's packed output from λ_re, λ_im, log Δ and B̃.
    fn forward(&self, x: [&Tensor; 4]) -> Result<Tensor> {
        self.launch(&x, true)
    }

    /// [∂λ_re | ∂λ_im | ∂log Δ | ∂B̃] in one row, from λ_re, λ_im, log Δ, B̃ and the gradients
    /// of Λ̄ and B̄.
    fn backward(&self, x: [&Tensor; 6]) -> Result<Tensor> {
        self.launch(&x, false)
    }

    /// The kernel (or its CPU twin) on `x` in B̃'s dtype.
    fn launch(&self, x: &[&Tensor], forward: bool) -> Result<Tensor> {
        let (p, h, dtype) = (self.p, self.h, x[3].dtype());
        let x: Vec<Tensor> = x
            .iter()
            .map(|t| t.to_dtype(dtype)?.contiguous())
            .collect::<Result<_>>()?;
        let n = match forward {
            true => 2 * p + 2 * p * h,
            false => 3 * p + 2 * p * h,
        };
        #[cfg(feature = "cuda")]
        if x[3].device().is_cuda() {
            let plan = match forward {
                true => cuda::forward_plan(p, h, self.how, dtype)?,
                false => cuda::backward_plan(p, h, self.how, dtype)?,
            };
            let refs: Vec<&Tensor> = x.iter().collect();
            let module = crate::cuda::S5_DISCRETIZE;
            return Ok(
                crate::cuda::launch_tensors(module, &plan, dtype, &refs, &[&[n]])?.remove(0),
            );
        }
        fn run<F: WithDType + Float>(op: &S5DiscretizeOp, v: &[&[F]], forward: bool) -> Vec<F> {
            let params = [v[0], v[1], v[2]];
            match forward {
                true => op.fwd_t(params, v[3]),
                false => op.bwd_t(params, v[3], v[4], v[5]),
            }
        }
        let guards: Vec<_> = x.iter().map(|t| t.storage_and_layout()).collect();
        let mut held = Vec::with_capacity(guards.len());
        for (s, l) in &guards {
            match &**s {
                Storage::Cpu(s) => held.push((s, *l)),
                _ => bail!("s5_discretize: tensors are not all on the CPU"),
            }
        }
        match dtype {
            DType::F32 => {
                let v: Vec<&[f32]> = held
                    .iter()
                    .map(|(s, l)| contiguous(s, l))
                    .collect::<Result<_>>()?;
                Tensor::from_vec(run(self, &v, forward), n, &Device::Cpu)
            }
            DType::F64 => {
                let v: Vec<&[f64]> = held
                    .iter()
                    .map(|(s, l)| contiguous(s, l))
                    .collect::<Result<_>>()?;
                Tensor::from_vec(run(self, &v, forward), n, &Device::Cpu)
            }
            // The 16-bit values read into f32, the f32 twin, its results rounded: the kernel's
            // arithmetic.
            DType::F16 | DType::BF16 => {
                let wide: Vec<Vec<f32>> = held
                    .iter()
                    .map(|(s, l)| widened_values(s, l))
                    .collect::<Result<_>>()?;
                let v: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
                narrowed_tensor(run(self, &v, forward), n, dtype)
            }
            dt => bail!("s5_discretize: dtype {dt:?} is not fused"),
        }
    }
}
