//! The frame encoder of the pendulum benchmark (S5 Appendix G.3.8, after Schirmer et al. 2022):
//! every frame of a sequence, a side × side grey image, becomes H features through
//!
//!   conv 12@5×5 (padding 2) → ReLU → max-pool 2 → conv 12@3×3 (stride 2, padding 1) → ReLU
//!   → max-pool 2 → dense 30 → ReLU → dense H,
//!
//! initialised as PyTorch does (weights and biases U(±1/√fan_in)), from the model's seed.
//! Parameters: `conv1`, `conv2`, `dense1`, `dense2`, each `weight` and `bias`.

use candle_core::{bail, Module, Result, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, Linear, VarBuilder};
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::init::{init_rng, linear, param_with};

const CHANNELS: usize = 12;
const HIDDEN: usize = 30;

/// Configuration of a [`FrameEncoder`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameEncoderConfig {
    /// Side of the square frames (24 in the benchmark).
    pub side: usize,
    /// Features out per frame (H).
    pub d_model: usize,
    pub seed: u64,
}

impl FrameEncoderConfig {
    /// The side of the feature maps after the second pooling, or an error for frames too small
    /// to reach it.
    fn pooled_side(&self) -> Result<usize> {
        let first = self.side / 2;
        let second = (first + 2).saturating_sub(3) / 2 + 1;
        match (self.side, second / 2) {
            (s, p) if s >= 8 && p >= 1 => Ok(p),
            (s, _) => bail!("frame encoder: frames of side {s}; at least 8 are needed"),
        }
    }
}

/// The frame encoder: (batch, length, side²) → (batch, length, H).
#[derive(Clone, Debug)]
pub struct FrameEncoder {
    cfg: FrameEncoderConfig,
    conv1: Conv2d,
    conv2: Conv2d,
    dense1: Linear,
    dense2: Linear,
}

impl FrameEncoder {
    pub fn new(cfg: FrameEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let pooled = cfg.pooled_side()?;
        if cfg.d_model == 0 {
            bail!("frame encoder: d_model must be positive");
        }
        let seed = cfg.seed;
        Ok(FrameEncoder {
            conv1: conv(1, 5, 2, 1, vb.pp("conv1"), seed)?,
            conv2: conv(CHANNELS, 3, 1, 2, vb.pp("conv2"), seed)?,
            dense1: linear(CHANNELS * pooled * pooled, HIDDEN, vb.pp("dense1"), seed)?,
            dense2: linear(HIDDEN, cfg.d_model, vb.pp("dense2"), seed)?,
            cfg,
        })
    }
}

/// A convolution of `in_c` channels to [`CHANNELS`] with a `k` × `k` kernel, initialised as
/// PyTorch does, U(±1/√(in_c·k²)) for weight and bias.
fn conv(
    in_c: usize,
    k: usize,
    padding: usize,
    stride: usize,
    vb: VarBuilder,
    seed: u64,
) -> Result<Conv2d> {
    let mut rng = init_rng(seed, &vb);
    let bound = 1.0 / ((in_c * k * k) as f64).sqrt();
    let mut uniform =
        |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-bound..bound)).collect() };
    let w = param_with(&vb, "weight", &[CHANNELS, in_c, k, k], || {
        uniform(CHANNELS * in_c * k * k)
    })?;
    let b = param_with(&vb, "bias", &[CHANNELS], || uniform(CHANNELS))?;
    let how = Conv2dConfig {
        padding,
        stride,
        ..Conv2dConfig::default()
    };
    Ok(Conv2d::new(w, Some(b), how))
}

impl Module for FrameEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, len, pixels) = x.dims3()?;
        let side = self.cfg.side;
        if pixels != side * side {
            bail!("frame encoder: frames of {pixels} pixels, expected {side} × {side}");
        }
        let x = x.reshape((batch * len, 1, side, side))?;
        let x = self.conv1.forward(&x)?.relu()?.max_pool2d(2)?;
        let x = self.conv2.forward(&x)?.relu()?.max_pool2d(2)?;
        let x = self.dense1.forward(&x.flatten_from(1)?)?.relu()?;
        self.dense2
            .forward(&x)?
            .reshape((batch, len, self.cfg.d_model))
    }
}
