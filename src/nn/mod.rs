//! candle-nn modules built on the ops: S5 (with its HiPPO-N initialisation), Myo, the 2-D SSM
//! and minGRU, and the sequence classifier that stacks them. Each layer is
//! `Layer::new(config, vb)` with a serialisable config, and implements `Module`.

pub mod classifier;
pub mod hippo;
pub mod mingru;
pub mod myo;
pub mod s5;
pub mod ssm2d;

pub use classifier::{
    Activation, ClassifierConfig, DropoutKey, EncoderConfig, Mode, NormKind, Pooling,
    SeqLayerConfig, SequenceClassifier, BN_MOMENTUM,
};
pub use mingru::{MinGru, MinGruConfig};
pub use myo::{Coupling, Myo, MyoConfig, TreeSpec};
pub use s5::{CInit, Discretization, S5Config, S5};
pub use ssm2d::{Ssm2d, Ssm2dConfig};

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// A parameter that starts from a computed value (HiPPO eigenvalues, an initialisation drawn
/// from a seeded generator): created with `init` when the variable builder does not have it
/// yet, and taken as stored when it does (a loaded checkpoint, or a second call).
pub(crate) fn param_with(vb: &VarBuilder, name: &str, init: Tensor) -> Result<Tensor> {
    if vb.contains_tensor(name) {
        return vb.get(init.shape(), name);
    }
    let t = vb.get_with_hints(init.shape(), name, candle_nn::Init::Const(0.))?;
    t.slice_set(&init.to_dtype(t.dtype())?.to_device(t.device())?, 0, 0)?;
    Ok(t)
}

/// A generator for the initial values of the parameters under `vb`'s path, from `seed`: every
/// path gets its own stream, so a model's initialisation depends on its seed alone (candle's
/// CPU generator cannot be seeded).
pub(crate) fn init_rng(seed: u64, vb: &VarBuilder) -> rand::rngs::StdRng {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    vb.prefix().hash(&mut h);
    rand::SeedableRng::seed_from_u64(seed ^ h.finish())
}

/// `n` samples of N(0, std²) (Box–Muller).
pub(crate) fn normal_vec(rng: &mut rand::rngs::StdRng, n: usize, std: f64) -> Vec<f64> {
    use rand::Rng;
    (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
            std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .collect()
}

/// A linear layer initialised as PyTorch and candle do, U(±1/√fan_in) for weight and bias, from
/// a seeded generator.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
    seed: u64,
) -> Result<candle_nn::Linear> {
    use rand::Rng;
    let mut rng = init_rng(seed, &vb);
    let bound = 1.0 / (in_dim as f64).sqrt();
    let mut uniform =
        |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-bound..bound)).collect() };
    let cpu = candle_core::Device::Cpu;
    let w = param_with(
        &vb,
        "weight",
        Tensor::from_vec(uniform(out_dim * in_dim), (out_dim, in_dim), &cpu)?,
    )?;
    let b = param_with(
        &vb,
        "bias",
        Tensor::from_vec(uniform(out_dim), out_dim, &cpu)?,
    )?;
    Ok(candle_nn::Linear::new(w, Some(b)))
}

/// `x Wᵀ + b` over the last dimension of `x` (any leading dimensions) for a candle-nn `Linear`:
/// one 2-D matmul and [`crate::ops::channel_add`], whose bias gradient is a single pass of row
/// sums.
pub(crate) fn dense(l: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    let w = l.weight();
    let mut dims = x.dims().to_vec();
    let k = dims.pop().unwrap_or(1);
    let rows = x.elem_count() / k.max(1);
    let y = x.reshape((rows, k))?.matmul(&w.t()?)?;
    let y = match l.bias() {
        Some(b) => crate::ops::channel_add(&y, b)?,
        None => y,
    };
    dims.push(w.dim(0)?);
    y.reshape(dims)
}

/// An embedding initialised N(0, 1) from a seeded generator.
pub(crate) fn embedding(
    vocab: usize,
    dim: usize,
    vb: VarBuilder,
    seed: u64,
) -> Result<candle_nn::Embedding> {
    let mut rng = init_rng(seed, &vb);
    let w = param_with(
        &vb,
        "weight",
        Tensor::from_vec(
            normal_vec(&mut rng, vocab * dim, 1.0),
            (vocab, dim),
            &candle_core::Device::Cpu,
        )?,
    )?;
    Ok(candle_nn::Embedding::new(w, dim))
}

/// Complex tensors as (re, im) pairs of real tensors of one shape.
pub mod complex {
    use candle_core::{Result, Tensor};

    #[derive(Clone, Debug)]
    pub struct C {
        pub re: Tensor,
        pub im: Tensor,
    }

    impl C {
        pub fn new(re: Tensor, im: Tensor) -> Self {
            C { re, im }
        }
        pub fn one_like(t: &Tensor) -> Result<Self> {
            Ok(C::new(t.ones_like()?, t.zeros_like()?))
        }
        pub fn add_real(&self, x: f64) -> Result<Self> {
            Ok(C::new((&self.re + x)?, self.im.clone()))
        }
        pub fn sub(&self, o: &C) -> Result<Self> {
            Ok(C::new((&self.re - &o.re)?, (&self.im - &o.im)?))
        }
        /// Multiplication by a real tensor of the same shape.
        pub fn scale(&self, s: &Tensor) -> Result<Self> {
            Ok(C::new((&self.re * s)?, (&self.im * s)?))
        }
        pub fn mul(&self, o: &C) -> Result<Self> {
            Ok(C::new(
                ((&self.re * &o.re)? - (&self.im * &o.im)?)?,
                ((&self.re * &o.im)? + (&self.im * &o.re)?)?,
            ))
        }
        pub fn recip(&self) -> Result<Self> {
            let n = (self.re.sqr()? + self.im.sqr()?)?;
            Ok(C::new((&self.re / &n)?, (self.im.neg()? / &n)?))
        }
        pub fn div(&self, o: &C) -> Result<Self> {
            self.mul(&o.recip()?)
        }
        pub fn exp(&self) -> Result<Self> {
            let m = self.re.exp()?;
            Ok(C::new((&m * self.im.cos()?)?, (&m * self.im.sin()?)?))
        }
        /// Row p of a (P, H) matrix times element p of a (P) vector.
        pub fn mul_col(&self, v: &C) -> Result<Self> {
            let (vr, vi) = (v.re.unsqueeze(1)?, v.im.unsqueeze(1)?);
            Ok(C::new(
                (self.re.broadcast_mul(&vr)? - self.im.broadcast_mul(&vi)?)?,
                (self.re.broadcast_mul(&vi)? + self.im.broadcast_mul(&vr)?)?,
            ))
        }
    }
}
