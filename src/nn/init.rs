//! Initialisation: seeded generators, normal and truncated-normal samples, and parameters that
//! start from computed values.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::Rng;

/// The parameters `params` (name, shape) under `vb`, taken before any initial value is computed,
/// and whether they are new. New ones start at zero: the caller computes their initial values
/// and sets them with [`init_param`]. Stored ones (a checkpoint's builder, which checks each
/// name and shape against its file here; or a second call) keep their values, and the caller
/// computes nothing: a configuration read from a file sizes no work before its tensors agree.
pub(crate) fn params<const N: usize>(
    vb: &VarBuilder,
    params: [(&str, &[usize]); N],
) -> Result<([Tensor; N], bool)> {
    let fresh = !params.iter().any(|(name, _)| vb.contains_tensor(name));
    let mut out = Vec::with_capacity(N);
    for (name, shape) in params {
        out.push(vb.get_with_hints(shape, name, candle_nn::Init::Const(0.))?);
    }
    let out: [Tensor; N] = out.try_into().expect("one tensor per parameter");
    Ok((out, fresh))
}

/// Sets the new parameter `param` (from [`params`]) to `values`, row-major in its shape.
pub(crate) fn init_param(param: &Tensor, values: Vec<f64>) -> Result<()> {
    let init = Tensor::from_vec(values, param.shape(), &candle_core::Device::Cpu)?;
    param.slice_set(
        &init.to_dtype(param.dtype())?.to_device(param.device())?,
        0,
        0,
    )
}

/// A parameter that starts from computed values ([`params`] and [`init_param`] for one):
/// `init` runs only when the parameter is new.
pub(crate) fn param_with(
    vb: &VarBuilder,
    name: &str,
    shape: &[usize],
    init: impl FnOnce() -> Vec<f64>,
) -> Result<Tensor> {
    let ([param], fresh) = params(vb, [(name, shape)])?;
    if fresh {
        init_param(&param, init())?;
    }
    Ok(param)
}

/// The generators of initial values; candle's CPU generator cannot be seeded, so every initial
/// value is drawn here from a seed. Two kinds: a stream per variable path ([`init_rng`]: the
/// small modules — linear layers, embeddings, the 2-D SSM), and one stream per layer
/// ([`layer_rng`]: S5 and Myo, whose constructors draw all their values in a fixed order from
/// the layer's seed, which the classifier makes distinct per block).
pub(crate) fn layer_rng(seed: u64, stream: u64) -> StdRng {
    rand::SeedableRng::seed_from_u64(seed ^ stream)
}

/// A generator for the initial values of the parameters under `vb`'s path, from `seed`: every
/// path gets its own stream, so a model's initialisation depends on its seed alone.
pub(crate) fn init_rng(seed: u64, vb: &VarBuilder) -> rand::rngs::StdRng {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    vb.prefix().hash(&mut h);
    rand::SeedableRng::seed_from_u64(seed ^ h.finish())
}

/// `n` samples of N(0, std²).
pub(crate) fn normal_vec(rng: &mut StdRng, n: usize, std: f64) -> Vec<f64> {
    (0..n).map(|_| std * normal(rng)).collect()
}

/// How dense and convolution layers start.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum DenseInit {
    /// PyTorch's and candle's: weight and bias U(±1/√fan_in).
    #[default]
    Uniform,
    /// Flax's, which the S5 reference uses: weight lecun_normal (a normal truncated at ±2σ,
    /// variance 1/fan_in), bias zero.
    Lecun,
}

impl DenseInit {
    /// `n` weights of a layer with `fan_in` inputs.
    pub(crate) fn weights(self, rng: &mut StdRng, n: usize, fan_in: usize) -> Vec<f64> {
        match self {
            DenseInit::Uniform => {
                let bound = 1.0 / (fan_in as f64).sqrt();
                (0..n).map(|_| rng.random_range(-bound..bound)).collect()
            }
            DenseInit::Lecun => (0..n).map(|_| trunc_normal(rng, fan_in)).collect(),
        }
    }

    /// `n` biases of a layer with `fan_in` inputs (drawn after its weights).
    pub(crate) fn biases(self, rng: &mut StdRng, n: usize, fan_in: usize) -> Vec<f64> {
        match self {
            DenseInit::Uniform => self.weights(rng, n, fan_in),
            DenseInit::Lecun => vec![0.0; n],
        }
    }
}

/// A linear layer started as `init` says, from a seeded generator.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
    seed: u64,
    init: DenseInit,
) -> Result<candle_nn::Linear> {
    let mut rng = init_rng(seed, &vb);
    let w = param_with(&vb, "weight", &[out_dim, in_dim], || {
        init.weights(&mut rng, out_dim.saturating_mul(in_dim), in_dim)
    })?;
    let b = param_with(&vb, "bias", &[out_dim], || {
        init.biases(&mut rng, out_dim, in_dim)
    })?;
    Ok(candle_nn::Linear::new(w, Some(b)))
}

/// An embedding initialised N(0, 1) from a seeded generator.
pub(crate) fn embedding(
    vocab: usize,
    dim: usize,
    vb: VarBuilder,
    seed: u64,
) -> Result<candle_nn::Embedding> {
    let mut rng = init_rng(seed, &vb);
    let w = param_with(&vb, "weight", &[vocab, dim], || {
        normal_vec(&mut rng, vocab.saturating_mul(dim), 1.0)
    })?;
    Ok(candle_nn::Embedding::new(w, dim))
}

/// A truncated normal sample (±2) scaled as jax's `variance_scaling(1, fan_in, truncated)`.
pub(crate) fn trunc_normal(rng: &mut StdRng, fan_in: usize) -> f64 {
    let std = (1.0 / fan_in as f64).sqrt() / 0.879_625_661_034_239_8;
    loop {
        let z = normal(rng);
        if z.abs() <= 2.0 {
            return z * std;
        }
    }
}

/// A standard normal sample (Box–Muller).
pub(crate) fn normal(rng: &mut StdRng) -> f64 {
    let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
