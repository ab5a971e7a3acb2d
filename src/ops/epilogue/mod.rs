//! A block's epilogue as one op, forward and backward (`kernels/epilogue.cu` on CUDA, its CPU
//! twin here): on y of shape (samples, …, features),
//!
//!   out = r + k ⊙ act(y),   ∂y = (∂out ⊙ k) ⊙ act′(y),   ∂r = ∂out,
//!
//! with act GELU (tanh form, [`crate::ops::gelu()`]) or the identity, r the residual (optional),
//! and k the dropout factor of (sample, feature), shared along the length: s = 1 / (1 − p)
//! where the mask of [`crate::ops::dropout_keep`] keeps the entry, else 0 (1 without dropout).
//! The mask is recomputed from its key where it is needed, never stored. In candle ops this is
//! a GELU, a mask, a broadcast product and a sum, forward and backward; the arithmetic here is
//! theirs in their order, so the CPU results are the same bits.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::dropout::{kept, threshold};
use super::gelu::{slope, value};
use super::value::{
    contiguous, fused_elementwise, is_half, narrowed, narrowed_tensor, widened_values,
};

pub mod cuda;
pub mod gate;

pub use gate::{gate, gate_backward};

/// The activation of an epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Gelu,
    Identity,
}

/// The dropout of an epilogue: the key of its mask (as [`crate::ops::dropout_keep`] takes it:
/// the call's site hash and the first sample's row in the whole batch) and the rate p.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Dropout {
    pub site_hash: u64,
    pub first_row: u64,
    pub p: f64,
    /// On CUDA, the kernels make the site hash themselves from the step's key in the device's
    /// key word (`crate::cuda::set_dropout_key`), so that a step captured in a CUDA graph masks
    /// each replay with its own seed and step; the word must hold the key of the seed and step
    /// `site_hash` was made from. The CPU takes `site_hash`.
    pub key_word: Option<KeyWord>,
}

/// What a kernel makes a dropout call's site hash from with the step's key from the device's
/// key word: the call's site (see `DropoutKey` in `crate::nn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyWord {
    pub site: u64,
}

impl Dropout {
    /// The bound the mask's hash is compared with.
    pub fn threshold(&self) -> u64 {
        threshold(self.p)
    }

    /// s = 1 / (1 − p), rounded to f32 (the factor the layers have always used).
    pub fn scale(&self) -> f64 {
        (1.0 / (1.0 - self.p)) as f32 as f64
    }
}

/// One epilogue call: y's shape as (samples, per_sample elements, of which the last dimension's
/// `features` vary fastest), the activation and the dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Epilogue {
    pub samples: usize,
    pub per_sample: usize,
    pub features: usize,
    pub activation: Activation,
    pub dropout: Option<Dropout>,
}

/// r + k ⊙ act(y) (see the module docs): y of shape (samples, …, features), `residual` of y's
/// shape and dtype, `dropout` with p in [0, 1).
pub fn epilogue(
    y: &Tensor,
    residual: Option<&Tensor>,
    activation: Activation,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let dims = y.dims();
    if dims.len() < 2 {
        bail!("epilogue: the input must have a sample and a feature dimension, got {dims:?}");
    }
    if let Some(r) = residual {
        if r.dims() != dims || r.dtype() != y.dtype() {
            bail!(
                "epilogue: the residual is {:?} {:?}, the input {dims:?} {:?}",
                r.dims(),
                r.dtype(),
                y.dtype()
            );
        }
    }
    if let Some(d) = dropout {
        if !(0.0..1.0).contains(&d.p) {
            bail!("epilogue: the dropout rate must be in [0, 1), got {}", d.p);
        }
    }
    let e = Epilogue::new(dims, activation, dropout);
    let fused = fused_elementwise(y);
    // Nothing to fuse: the identity without dropout is the residual sum (or y).
    let trivial = activation == Activation::Identity && e.dropout.is_none();
    if !fused || trivial {
        return composed(y, residual, &e);
    }
    let y = y.contiguous()?;
    match residual {
        Some(r) => y.apply_op2(&r.contiguous()?, e),
        None => y.apply_op1(e),
    }
}

/// ∂y of [`epilogue`] from the gradient `g` of its output (the residual's is `g` itself), for
/// layers that compute gradients by hand; f32, f64, f16 and bf16 (f16 and bf16 computed in
/// f32).
pub fn epilogue_backward(
    y: &Tensor,
    activation: Activation,
    dropout: Option<Dropout>,
    g: &Tensor,
) -> Result<Tensor> {
    let e = Epilogue::new(y.dims(), activation, dropout);
    if activation == Activation::Identity && e.dropout.is_none() {
        return Ok(g.clone());
    }
    if !fused_elementwise(y) {
        bail!(
            "epilogue backward: {:?} on this device is not fused",
            y.dtype()
        );
    }
    e.dy(&y.contiguous()?, g)
}

impl Epilogue {
    fn new(dims: &[usize], activation: Activation, dropout: Option<Dropout>) -> Self {
        Epilogue {
            samples: dims[0],
            per_sample: dims[1..].iter().product(),
            features: dims[dims.len() - 1],
            activation,
            dropout: dropout.filter(|d| d.p > 0.0),
        }
    }
}

/// The epilogue in candle ops (dtypes and devices without a kernel).
fn composed(y: &Tensor, residual: Option<&Tensor>, e: &Epilogue) -> Result<Tensor> {
    let mut z = match e.activation {
        Activation::Gelu => super::gelu(y)?,
        Activation::Identity => y.clone(),
    };
    if let Some(d) = e.dropout {
        let keep = super::dropout_keep(
            d.site_hash,
            d.first_row,
            e.samples,
            e.features,
            d.p,
            y.dtype(),
            y.device(),
        )?;
        let mut shape = vec![e.samples];
        shape.extend(std::iter::repeat_n(1, y.rank() - 2));
        shape.push(e.features);
        z = z.broadcast_mul(&(keep * d.scale())?.reshape(shape)?)?;
    }
    match residual {
        Some(r) => r + z,
        None => Ok(z),
    }
}

/// Elements per rayon task.
const PER_TASK: usize = 1 << 14;

impl Epilogue {
    /// k per (sample, feature), in F (the CPU twin's table; the kernel hashes per element).
    fn factors<F: Float>(&self) -> Option<Vec<F>> {
        let d = self.dropout?;
        let (bound, s) = (d.threshold(), F::from(d.scale()).expect("a float"));
        let rows =
            (0..self.samples as u64).flat_map(|r| (0..self.features as u64).map(move |f| (r, f)));
        Some(
            rows.map(
                |(r, f)| match kept(d.site_hash, d.first_row + r, f, bound) {
                    true => s,
                    false => F::zero(),
                },
            )
            .collect(),
        )
    }

    /// out[e] = f(e, k at e) over the elements, in parallel.
    fn map<F: WithDType + Float>(&self, f: impl Fn(usize, F) -> F + Sync) -> Vec<F> {
        let k = self.factors::<F>();
        let (per, feat) = (self.per_sample, self.features);
        let mut out = vec![F::zero(); self.samples * per];
        out.par_chunks_mut(PER_TASK)
            .enumerate()
            .for_each(|(c, part)| {
                for (i, o) in part.iter_mut().enumerate() {
                    let e = c * PER_TASK + i;
                    let ke = k
                        .as_ref()
                        .map_or(F::one(), |k| k[e / per * feat + e % feat]);
                    *o = f(e, ke);
                }
            });
        out
    }

    /// The CPU twin of `epilogue_fwd`.
    fn forward_cpu<F: WithDType + Float>(&self, y: &[F], r: Option<&[F]>) -> Vec<F> {
        let gelu = self.activation == Activation::Gelu;
        self.map(|e, k| {
            let z = if gelu { value(y[e]) } else { y[e] } * k;
            r.map_or(z, |r| r[e] + z)
        })
    }

    /// The CPU twin of `epilogue_bwd`.
    fn backward_cpu<F: WithDType + Float>(&self, y: &[F], g: &[F]) -> Vec<F> {
        let gelu = self.activation == Activation::Gelu;
        self.map(|e, k| {
            let gk = g[e] * k;
            if gelu {
                gk * slope(y[e])
            } else {
                gk
            }
        })
    }

    fn cpu(
        &self,
        y: (&CpuStorage, &Layout),
        r: Option<(&CpuStorage, &Layout)>,
    ) -> Result<CpuStorage> {
        fn run<F: WithDType + Float>(
            e: &Epilogue,
            y: (&CpuStorage, &Layout),
            r: Option<(&CpuStorage, &Layout)>,
        ) -> Result<Vec<F>> {
            let r = r.map(|(s, l)| contiguous::<F>(s, l)).transpose()?;
            Ok(e.forward_cpu(contiguous::<F>(y.0, y.1)?, r))
        }
        Ok(match y.0.dtype() {
            DType::F32 => CpuStorage::F32(run(self, y, r)?),
            DType::F64 => CpuStorage::F64(run(self, y, r)?),
            dt if is_half(dt) => {
                let r = r.map(|(s, l)| widened_values(s, l)).transpose()?;
                let y = widened_values(y.0, y.1)?;
                narrowed(self.forward_cpu(&y, r.as_deref()), dt)?
            }
            dt => bail!("epilogue: dtype {dt:?} is not fused on the CPU"),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        y: (&candle_core::CudaStorage, &Layout),
        r: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<candle_core::CudaStorage> {
        let plan = cuda::forward_plan(self, r.is_some(), y.0.dtype())?;
        let mut inputs = vec![y];
        inputs.extend(r);
        let dev = y.0.device();
        let mut out = crate::cuda::launch(dev, crate::cuda::EPILOGUE, &plan, y.0.dtype(), &inputs)?;
        Ok(out.remove(0))
    }

    /// ∂y from y and ∂out.
    fn dy(&self, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        let g = g.to_dtype(y.dtype())?.contiguous()?;
        #[cfg(feature = "cuda")]
        if y.device().is_cuda() {
            let plan = cuda::backward_plan(self, y.dtype())?;
            let mut dy = crate::cuda::launch_tensors(
                crate::cuda::EPILOGUE,
                &plan,
                y.dtype(),
                &[y, &g],
                &[y.dims()],
            )?;
            return Ok(dy.remove(0));
        }
        let (sy, ly) = y.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sy), Storage::Cpu(sg)) = (&*sy, &*sg) else {
            bail!("epilogue backward: tensors are not all on the CPU")
        };
        fn dy<F: WithDType + Float>(
            e: &Epilogue,
            y: &[F],
            g: &[F],
            shape: &Shape,
        ) -> Result<Tensor> {
            Tensor::from_vec(e.backward_cpu(y, g), shape, &Device::Cpu)
        }
        match y.dtype() {
            DType::F32 => dy::<f32>(self, contiguous(sy, ly)?, contiguous(sg, lg)?, y.shape()),
            DType::F64 => dy::<f64>(self, contiguous(sy, ly)?, contiguous(sg, lg)?, y.shape()),
            dt if is_half(dt) => {
                let (y32, g32) = (widened_values(sy, ly)?, widened_values(sg, lg)?);
                narrowed_tensor(self.backward_cpu(&y32, &g32), y.shape(), dt)
            }
            dt => bail!("epilogue backward: dtype {dt:?} is not fused on the CPU"),
        }
    }
}

impl CustomOp1 for Epilogue {
    fn name(&self) -> &'static str {
        "epilogue"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((self.cpu((s, l), None)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((self.cuda((s, l), None)?, l.shape().clone()))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.dy(y, g)?))
    }
}

impl CustomOp2 for Epilogue {
    fn name(&self) -> &'static str {
        "epilogue-residual"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((self.cpu((s1, l1), Some((s2, l2)))?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((self.cuda((s1, l1), Some((s2, l2)))?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        _r: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(self.dy(y, g)?), Some(g.clone())))
    }
}
