//! Initialisation: seeded generators, normal and truncated-normal samples, and parameters that
//! start from computed values.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::Rng;

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
