//! The frame encoder of the pendulum benchmark (S5 Appendix G.3.8, after Schirmer et al. 2022):
//! every frame of a sequence, a side × side grey image, becomes H features through
//!
//!   conv 12@5×5 (padding 2) → ReLU → max-pool 2 → conv 12@3×3 (stride 2, padding 1) → ReLU
//!   → max-pool 2 → dense 30 → ReLU → dense H,
//!
//! started as the model's [`DenseInit`] says, from its seed.
//! With `append_dt` (S5-append, S5 Appendix F.3) each frame's interval since the one before
//! joins the 30 hidden features, so that the last dense layer reads 31.
//! Parameters: `conv1`, `conv2`, `dense1`, `dense2`, each `weight` and `bias`.

use candle_core::{bail, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::init::{init_rng, linear, param_with, DenseInit};
use crate::ops::RowGather;

mod backward;

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
    /// Append each frame's time interval to its hidden features (S5-append).
    #[serde(default)]
    pub append_dt: bool,
    /// How the convolutions and dense layers start.
    #[serde(default)]
    pub init: DenseInit,
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
    conv1: ConvPool,
    conv2: ConvPool,
    dense1: Linear,
    dense2: Linear,
}

impl FrameEncoder {
    pub fn new(cfg: FrameEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let pooled = cfg.pooled_side()?;
        if cfg.d_model == 0 {
            bail!("frame encoder: d_model must be positive");
        }
        let (seed, init) = (cfg.seed, cfg.init);
        let side = cfg.side;
        Ok(FrameEncoder {
            conv1: ConvPool::new([1, 5, 2, 1, side], vb.pp("conv1"), seed, init)?,
            conv2: ConvPool::new([CHANNELS, 3, 1, 2, side / 2], vb.pp("conv2"), seed, init)?,
            dense1: linear(
                CHANNELS * pooled * pooled,
                HIDDEN,
                vb.pp("dense1"),
                seed,
                init,
            )?,
            dense2: linear(
                HIDDEN + usize::from(cfg.append_dt),
                cfg.d_model,
                vb.pp("dense2"),
                seed,
                init,
            )?,
            cfg,
        })
    }

    /// Whether the encoder reads the frames' intervals too.
    pub fn appends_dt(&self) -> bool {
        self.cfg.append_dt
    }

    /// (batch, length, side²) frames, with their intervals `dt` (batch, length) when the
    /// encoder appends them, → (batch, length, H).
    pub fn forward_timed(&self, x: &Tensor, dt: Option<&Tensor>) -> Result<Tensor> {
        Ok(self.run(x, dt, &self.weights(false), false)?.out)
    }

    /// The parameters as they are (`detached` false) or detached from candle's graph.
    fn weights(&self, detached: bool) -> Weights {
        let t = |t: &Tensor| match detached {
            true => t.detach(),
            false => t.clone(),
        };
        let conv = |c: &ConvPool| [t(&c.weight), t(&c.bias)];
        let dense = |l: &Linear| Linear::new(t(l.weight()), l.bias().map(t));
        Weights {
            conv: [conv(&self.conv1), conv(&self.conv2)],
            dense: [dense(&self.dense1), dense(&self.dense2)],
        }
    }

    /// The forward on the parameters `w`; with `keep`, what the backward by hand reads is
    /// kept (else each convolution's intermediates go as soon as the next has its input).
    fn run(&self, x: &Tensor, dt: Option<&Tensor>, w: &Weights, keep: bool) -> Result<Pass> {
        let (batch, len, pixels) = x.dims3()?;
        let side = self.cfg.side;
        if pixels != side * side {
            bail!("frame encoder: frames of {pixels} pixels, expected {side} × {side}");
        }
        // Batch last: (1, side, side, frames).
        let n = batch * len;
        let x = x
            .reshape((n, side * side))?
            .t()?
            .reshape((1, side, side, n))?;
        let [[w1, b1], [w2, b2]] = &w.conv;
        let conv1 = self.conv1.run(&x, w1, b1)?;
        let maps1 = conv1.out.clone();
        let conv1 = keep.then_some(conv1);
        let conv2 = self.conv2.run(&maps1, w2, b2)?;
        let maps = conv2.out.clone();
        // Each frame's maps flattened as PyTorch's (channels, height, width).
        let x = maps.reshape(((), n))?.t()?;
        let hidden = w.dense[0].forward(&x)?;
        let mut x = hidden.relu()?;
        match (self.cfg.append_dt, dt) {
            (false, _) => {}
            (true, Some(dt)) => {
                let dt = dt.to_dtype(x.dtype())?.reshape((batch * len, 1))?;
                x = Tensor::cat(&[&x, &dt], 1)?;
            }
            (true, None) => bail!("frame encoder: appending time intervals needs them"),
        }
        let out = w.dense[1]
            .forward(&x)?
            .reshape((batch, len, self.cfg.d_model))?;
        Ok(Pass {
            conv: conv1.map(|c| [c, conv2]),
            maps,
            hidden,
            read: x,
            out,
        })
    }
}

/// The encoder's parameters: each convolution's weight and bias, the dense layers.
struct Weights {
    conv: [[Tensor; 2]; 2],
    dense: [Linear; 2],
}

/// What the encoder's forward computed.
struct Pass {
    /// Kept for the backward by hand.
    conv: Option<[ConvPass; 2]>,
    /// The second convolution's output (CHANNELS, pooled, pooled, frames).
    maps: Tensor,
    /// The first dense layer's output before its ReLU (frames, 30).
    hidden: Tensor,
    /// What the last dense layer read (frames, 30, or 31 with the intervals).
    read: Tensor,
    /// (batch, length, H).
    out: Tensor,
}

impl Module for FrameEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_timed(x, None)
    }
}

/// A convolution of `in_c` channels to [`CHANNELS`] with a `k` × `k` kernel, then ReLU and
/// 2 × 2 max-pooling (an odd last row and column dropped, as PyTorch's floor mode does), on
/// maps of a fixed side laid out batch-last, (channels, side, side, n): one matrix product of
/// the kernel and the zero-padded input's patches at the four corners of every pooling
/// window, gathered by a fixed index (im2col) as rows of n contiguous values; then the maximum
/// of the four, plus the bias, through the ReLU (which commutes with the maximum). Candle's own
/// conv2d would also take the gradient of its input, frames included, by a transposed
/// convolution that dominates a training step. The kernel is stored as PyTorch's (out, in, k,
/// k), with fan-in in_c·k².
#[derive(Clone, Debug)]
struct ConvPool {
    weight: Tensor,
    bias: Tensor,
    /// For each (channel, ky, kx) of a patch, each corner of a pooling window and each window,
    /// the row of the padded input flattened as (channel, row, column): a fixed gather, whose
    /// gradient adds each input row's few patch rows (`ops::RowGather`).
    index: RowGather,
    k: usize,
    in_c: usize,
    side: usize,
    padding: usize,
    /// Side of the pooled output.
    pooled: usize,
}

impl ConvPool {
    /// `shape`: input channels, kernel side, padding, stride and input side.
    fn new(shape: [usize; 5], vb: VarBuilder, seed: u64, init: DenseInit) -> Result<ConvPool> {
        let [in_c, k, padding, stride, side] = shape;
        let mut rng = init_rng(seed, &vb);
        let fan_in = in_c * k * k;
        let weight = param_with(&vb, "weight", &[CHANNELS, in_c, k, k], || {
            init.weights(&mut rng, CHANNELS * fan_in, fan_in)
        })?;
        let bias = param_with(&vb, "bias", &[CHANNELS], || {
            init.biases(&mut rng, CHANNELS, fan_in)
        })?;
        let padded = side + 2 * padding;
        let convolved = (padded - k) / stride + 1;
        let pooled = convolved / 2;
        let mut index = Vec::with_capacity(in_c * k * k * 4 * pooled * pooled);
        for c in 0..in_c {
            for ky in 0..k {
                for kx in 0..k {
                    for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                        for wy in 0..pooled {
                            for wx in 0..pooled {
                                let (oy, ox) = (2 * wy + dy, 2 * wx + dx);
                                let (y, x) = (oy * stride + ky, ox * stride + kx);
                                index.push(((c * padded + y) * padded + x) as u32);
                            }
                        }
                    }
                }
            }
        }
        let index = RowGather::new(index, in_c * padded * padded, vb.device())?;
        Ok(ConvPool {
            weight,
            bias,
            index,
            k,
            in_c,
            side,
            padding,
            pooled,
        })
    }

    /// (in_c, side, side, n) → (CHANNELS, pooled, pooled, n) with this `weight` and `bias`.
    fn run(&self, x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<ConvPass> {
        let (n, p, c) = (x.dim(3)?, self.padding, self.in_c);
        if x.dims() != [c, self.side, self.side, n] {
            bail!(
                "frame encoder: maps of {:?}, expected ({c}, {s}, {s}, n)",
                x.dims(),
                s = self.side
            );
        }
        let padded = self.side + 2 * p;
        let x = x
            .pad_with_zeros(1, p, p)?
            .pad_with_zeros(2, p, p)?
            .reshape((c * padded * padded, n))?;
        let (cols, cells) = (self.k * self.k * c, self.pooled * self.pooled);
        let patches = self.index.forward(&x)?.reshape((cols, 4 * cells * n))?;
        let corners = weight
            .reshape((CHANNELS, cols))?
            .matmul(&patches)?
            .reshape((CHANNELS, 4, cells * n))?;
        let max = corners.max_keepdim(1)?;
        let pre = max.broadcast_add(&bias.reshape((CHANNELS, 1, 1))?)?;
        let out = pre
            .relu()?
            .reshape((CHANNELS, self.pooled, self.pooled, n))?;
        Ok(ConvPass {
            patches,
            corners,
            max,
            pre,
            out,
        })
    }
}

/// What a [`ConvPool`]'s forward computed.
struct ConvPass {
    /// The gathered patches (in_c · k², 4 · cells · n).
    patches: Tensor,
    /// The products at the pooling windows' four corners (CHANNELS, 4, cells · n).
    corners: Tensor,
    /// Their maximum (CHANNELS, 1, cells · n).
    max: Tensor,
    /// The maximum plus the bias, before the ReLU.
    pre: Tensor,
    /// (CHANNELS, pooled, pooled, n).
    out: Tensor,
}
