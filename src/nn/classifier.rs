//! The sequence classifier of the S5 reference (`seq_model.py`, `layers.py`), with the sequence
//! layer chosen among S5, Myo, the 2-D SSM and minGRU:
//!
//!   encoder (Linear for real inputs, Embedding for tokens, the frame encoder for images)
//!   → N × block [pre-norm → layer → activation → dropout → + residual]
//!               (or post-norm: layer → activation → dropout → + residual → norm)
//!   → pooling (mean over valid steps, last valid step, or the Myo poolings) → head (a Linear
//!   decoder; for pairs of sequences, their pair features and an MLP) → log-softmax;
//!   or, without pooling (regression), the Linear decoder at every step.
//!
//! Series sampled at irregular times carry each step's interval since the one before; the
//! model's [`Timing`] says what it does with them (S5 §6.3 and its ablations).
//!
//! Norms: BatchNorm with the reference's running-average decay (`bn_momentum`, 0.95 by
//! default), or LayerNorm. Dropout draws one mask per (sample, feature), shared across time,
//! from a counter-based hash keyed by [`DropoutKey`], so a run with dropout is reproducible
//! (resumed or sharded alike). [`Mode`] switches dropout and BatchNorm's batch statistics.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

mod block;
mod mode;
mod tail;

use mode::dropout;
pub use mode::{DropoutKey, Mode};
use tail::Pool;

use super::batch_norm::{BatchNorm, Shards};
use super::by_hand::GradSink;
use crate::ops::epilogue::{epilogue, Activation as EpilogueAct, Dropout};

use super::frames::{FrameEncoder, FrameEncoderConfig};
use super::head::{Decoder, Head, Pooling};
use super::init::DenseInit;
use super::{
    dense, embedding, linear, MinGru, MinGruConfig, Myo, MyoConfig, S5Config, Ssm2d, Ssm2dConfig,
    S5,
};

/// The sequence layer of every block (each block gets its own seed: config seed + block index).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SeqLayerConfig {
    S5(S5Config),
    Myo(MyoConfig),
    Ssm2d(Ssm2dConfig),
    MinGru(MinGruConfig),
}

impl SeqLayerConfig {
    /// The layer in a few words, e.g. "S5 P 32 bidirectional".
    pub fn summary(&self) -> String {
        match self {
            SeqLayerConfig::S5(c) => {
                let direction = if c.bidirectional {
                    " bidirectional"
                } else {
                    ""
                };
                format!("S5 P {}{direction}", c.state)
            }
            SeqLayerConfig::Myo(c) => format!(
                "Myo heads {} d {} {:?} over {}",
                c.heads,
                c.block,
                c.coupling,
                if c.all_nodes {
                    "all nodes"
                } else {
                    "the leaves"
                }
            ),
            SeqLayerConfig::Ssm2d(_) => "2-D SSM".into(),
            SeqLayerConfig::MinGru(_) => "minGRU".into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EncoderConfig {
    /// Real inputs (batch, length, features).
    Linear { features: usize },
    /// Token ids (batch, length), u32.
    Embedding { vocab: usize },
    /// Grey side × side frames (batch, length, side²) through [`FrameEncoder`].
    Frames { side: usize },
}

impl std::fmt::Display for EncoderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncoderConfig::Linear { features: 1 } => f.write_str("1 feature per step"),
            EncoderConfig::Linear { features } => write!(f, "{features} features per step"),
            EncoderConfig::Embedding { vocab } => write!(f, "tokens of a {vocab}-word vocabulary"),
            EncoderConfig::Frames { side } => write!(f, "{side} x {side} frames"),
        }
    }
}

/// What the model does with the time intervals of irregularly sampled series.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Timing {
    /// S5 discretises each step with its own interval, Δ·dt_k (S5 §6.3).
    Continuous,
    /// The steps are taken as equally spaced, dt ≡ 1, whatever their times (S5-drop).
    #[default]
    Drop,
    /// The frame encoder reads each interval as one more feature, the steps equally spaced
    /// (S5-append).
    Append,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum NormKind {
    Batch,
    Layer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Activation {
    /// GELU, then W₁z ⊙ σ(W₂z).
    FullGlu,
    /// GELU, then z ⊙ σ(W₂z).
    HalfGlu1,
    /// y ⊙ σ(W₂ GELU(y)): GELU only on the gate input.
    HalfGlu2,
    Gelu,
}

/// Configuration of a [`SequenceClassifier`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassifierConfig {
    pub encoder: EncoderConfig,
    /// Width H of every block.
    pub d_model: usize,
    pub layers: usize,
    pub layer: SeqLayerConfig,
    pub norm: NormKind,
    pub prenorm: bool,
    pub activation: Activation,
    pub dropout: f64,
    pub pooling: Pooling,
    /// Classes, or with no pooling the outputs regressed at every step.
    pub classes: usize,
    /// What the blocks do with the time intervals of series.
    #[serde(default)]
    pub timing: Timing,
    /// Each example is a pair of sequences, encoded apart by the same blocks and pooled: the
    /// batch's first half of rows holds the first sequences, its second half the second ones,
    /// and the head reads [u, v, u ⊙ v, u − v] (LRA's Retrieval).
    #[serde(default)]
    pub pairs: bool,
    /// A regression's decoder (pooling none).
    #[serde(default)]
    pub decoder: Decoder,
    /// Seed of the encoder, GLU and decoder initialisation (the layers have their own).
    #[serde(default)]
    pub seed: u64,
    /// How the encoder's, the GLUs' and the decoder's dense layers start.
    #[serde(default)]
    pub dense_init: DenseInit,
    /// BatchNorm's running averages: running = m · running + (1 − m) · batch, with m this
    /// (the reference's `bn_momentum`; its default 0.95, 0.9 for Pathfinder).
    #[serde(default = "default_bn_momentum")]
    pub bn_momentum: f64,
}

/// The reference's BatchNorm momentum.
pub const BN_MOMENTUM: f64 = 0.95;

fn default_bn_momentum() -> f64 {
    BN_MOMENTUM
}

enum Layer {
    S5(S5),
    Myo(Myo),
    Ssm2d(Ssm2d),
    MinGru(MinGru),
}

impl Layer {
    /// The optimiser group of the parameter `name` (relative to the layer).
    fn param_group(&self, name: &str) -> ParamGroup {
        let ssm = match self {
            Layer::S5(l) => return l.param_group(name),
            Layer::Myo(_) => Myo::SSM_PARAMS.contains(&name),
            Layer::Ssm2d(_) => Ssm2d::is_ssm_param(name),
            Layer::MinGru(_) => false,
        };
        if ssm {
            ParamGroup::Ssm
        } else {
            ParamGroup::Regular
        }
    }

    /// The layer on `x`, each step discretised with its interval in `dt` when given (S5).
    fn forward(&self, x: &Tensor, dt: Option<&Tensor>, sink: Option<&GradSink>) -> Result<Tensor> {
        match self {
            Layer::S5(l) => match (dt, sink) {
                (Some(dt), Some(sink)) => l.forward_timed_by_hand(x, dt, sink),
                (Some(dt), None) => l.forward_timed(x, dt),
                (None, Some(sink)) => l.forward_by_hand(x, sink),
                (None, None) => l.forward(x),
            },
            Layer::Myo(l) => match sink {
                Some(sink) => l.forward_by_hand(x, sink),
                None => l.forward(x),
            },
            Layer::Ssm2d(l) => l.forward(x),
            Layer::MinGru(l) => l.forward(x),
        }
    }
}

/// LayerNorm's ε.
const LN_EPS: f64 = 1e-5;

/// LayerNorm over the last dimension ([`crate::ops::layer_norm`]): candle-nn's fused LayerNorm
/// runs without a backward pass (no gradient reaches its input or its scale and shift), which
/// would stop training behind every norm.
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    /// Both detached once (aliases that the optimiser's in-place steps update too).
    detached: [Tensor; 2],
}

impl LayerNorm {
    fn new(h: usize, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(h, "weight", candle_nn::Init::Const(1.))?;
        let bias = vb.get_with_hints(h, "bias", candle_nn::Init::Const(0.))?;
        Ok(LayerNorm {
            detached: [weight.detach(), bias.detach()],
            weight,
            bias,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::ops::layer_norm(x, &self.weight, &self.bias, LN_EPS)
    }
}

enum Norm {
    Batch(BatchNorm),
    Layer(LayerNorm),
}

impl Norm {
    /// (batch, length, H) normalised over H (BatchNorm: statistics over batch and length).
    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        match (self, mode) {
            (Norm::Batch(n), Mode::Train(_, shards, _)) => n.forward_train(x, shards),
            (Norm::Batch(n), Mode::Eval) => n.forward_eval(x),
            (Norm::Layer(n), _) => n.forward(x),
        }
    }
}

struct Block {
    norm: Norm,
    layer: Layer,
    out1: Option<Linear>,
    out2: Option<Linear>,
    /// out1 and out2 as the block by hand uses them.
    dense: [Option<block::Dense>; 2],
}

/// The optimiser's groups (S5's reference): the SSM parameters and the norms' learn at `ssm_lr`
/// without weight decay, the others at `lr` with it; BatchNorm's running averages are not
/// learned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGroup {
    Ssm,
    Regular,
    /// At `ssm_lr` with weight decay (S5's B̃ under [`super::s5::S5Groups::BAndCDecay`]).
    SsmDecayed,
    Frozen,
}

pub struct SequenceClassifier {
    cfg: ClassifierConfig,
    encoder: Encoder,
    blocks: Vec<Block>,
    head: Head,
    /// The head's dense layers as the tail by hand uses them.
    head_dense: Option<tail::HeadDense>,
    /// The dtype of its parameters, which real inputs are cast to.
    dtype: DType,
}

enum Encoder {
    Linear(Linear),
    Embedding(Embedding),
    Frames(FrameEncoder),
}

impl SequenceClassifier {
    pub fn new(cfg: ClassifierConfig, vb: VarBuilder) -> Result<Self> {
        let (h, init) = (cfg.d_model, cfg.dense_init);
        if matches!(cfg.pooling, Pooling::Root | Pooling::TopLevels { .. })
            && !matches!(cfg.layer, SeqLayerConfig::Myo(_))
        {
            candle_core::bail!(
                "pooling {} needs Myo layers (it pools tree nodes)",
                cfg.pooling
            );
        }
        let encoder = match cfg.encoder {
            EncoderConfig::Linear { features } => {
                Encoder::Linear(linear(features, h, vb.pp("encoder"), cfg.seed, init)?)
            }
            EncoderConfig::Embedding { vocab } => {
                Encoder::Embedding(embedding(vocab, h, vb.pp("encoder"), cfg.seed)?)
            }
            EncoderConfig::Frames { side } => Encoder::Frames(FrameEncoder::new(
                FrameEncoderConfig {
                    side,
                    d_model: h,
                    seed: cfg.seed,
                    append_dt: cfg.timing == Timing::Append,
                    init,
                },
                vb.pp("encoder"),
            )?),
        };
        if cfg.decoder == Decoder::Gaussian && cfg.pooling != Pooling::None {
            candle_core::bail!(
                "a Gaussian decoder regresses at every step (pooling none), not with pooling {}",
                cfg.pooling
            );
        }
        if cfg.pairs && cfg.pooling == Pooling::None {
            candle_core::bail!("pairs of sequences are classified: pooling none does not apply");
        }
        if cfg.timing == Timing::Continuous && !matches!(cfg.layer, SeqLayerConfig::S5(_)) {
            candle_core::bail!("timing continuous needs S5 layers (they discretise each step)");
        }
        if let (Timing::Continuous, SeqLayerConfig::S5(c)) = (cfg.timing, &cfg.layer) {
            if c.bidirectional {
                candle_core::bail!(
                    "timing continuous needs causal S5 layers: the reverse scan would need the \
                     intervals after each step"
                );
            }
        }
        if cfg.timing == Timing::Append && !matches!(cfg.encoder, EncoderConfig::Frames { .. }) {
            candle_core::bail!("timing append needs the frame encoder (it appends the intervals)");
        }
        let mut blocks = Vec::new();
        for i in 0..cfg.layers {
            let vb = vb.pp(format!("layers.{i}"));
            let norm = match cfg.norm {
                NormKind::Batch => Norm::Batch(BatchNorm::new(h, cfg.bn_momentum, vb.pp("norm"))?),
                NormKind::Layer => Norm::Layer(LayerNorm::new(h, vb.pp("norm"))?),
            };
            let seed = |s: u64| s.wrapping_add(i as u64);
            let layer = match &cfg.layer {
                SeqLayerConfig::S5(c) => Layer::S5(S5::new(
                    S5Config {
                        d_model: h,
                        seed: seed(c.seed),
                        ..c.clone()
                    },
                    vb.pp("ssm"),
                )?),
                SeqLayerConfig::Myo(c) => Layer::Myo(Myo::new(
                    MyoConfig {
                        d_model: h,
                        seed: seed(c.seed),
                        ..c.clone()
                    },
                    vb.pp("ssm"),
                )?),
                SeqLayerConfig::Ssm2d(c) => Layer::Ssm2d(Ssm2d::new(
                    Ssm2dConfig {
                        d_model: h,
                        seed: seed(c.seed),
                        ..c.clone()
                    },
                    vb.pp("ssm"),
                )?),
                SeqLayerConfig::MinGru(c) => Layer::MinGru(MinGru::new(
                    MinGruConfig {
                        d_model: h,
                        hidden: h,
                        seed: seed(c.seed),
                        ..c.clone()
                    },
                    vb.pp("ssm"),
                )?),
            };
            let (out1, out2) = match cfg.activation {
                Activation::FullGlu => (
                    Some(linear(h, h, vb.pp("out1"), cfg.seed, init)?),
                    Some(linear(h, h, vb.pp("out2"), cfg.seed, init)?),
                ),
                Activation::HalfGlu1 | Activation::HalfGlu2 => {
                    (None, Some(linear(h, h, vb.pp("out2"), cfg.seed, init)?))
                }
                Activation::Gelu => (None, None),
            };
            let [d1, d2] = [&out1, &out2].map(|l| l.as_ref().map(block::Dense::new).transpose());
            blocks.push(Block {
                norm,
                layer,
                dense: [d1?, d2?],
                out1,
                out2,
            });
        }
        let head = Head::new(
            h,
            cfg.classes,
            cfg.pairs,
            cfg.decoder,
            vb.clone(),
            (cfg.seed, init),
        )?;
        Ok(SequenceClassifier {
            dtype: vb.dtype(),
            head_dense: Self::head_dense(&head)?,
            head,
            encoder,
            blocks,
            cfg,
        })
    }

    /// The optimiser group of the parameter called `name` in the model's variable map: each
    /// sequence layer says which of its parameters are SSM parameters.
    pub fn param_group(&self, name: &str) -> ParamGroup {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            return ParamGroup::Frozen;
        }
        let in_block = name.strip_prefix("layers.").and_then(|rest| {
            let (i, within) = rest.split_once('.')?;
            Some((self.blocks.get(i.parse::<usize>().ok()?)?, within))
        });
        match in_block {
            Some((_, within)) if within.starts_with("norm.") => ParamGroup::Ssm,
            Some((block, within)) => match within.strip_prefix("ssm.") {
                Some(p) => block.layer.param_group(p),
                None => ParamGroup::Regular,
            },
            None => ParamGroup::Regular,
        }
    }

    pub fn config(&self) -> &ClassifierConfig {
        &self.cfg
    }

    /// The positions the blocks run over for inputs of `len` steps: all tree nodes for Myo
    /// layers over all nodes, else `len`.
    pub fn positions(&self, len: usize) -> usize {
        self.node_tree().map_or(len, |t| t.len())
    }

    /// The tree whose nodes the blocks run over, when the layers are Myo over all nodes.
    fn node_tree(&self) -> Option<&crate::tree::Tree> {
        match self.blocks.first().map(|b| &b.layer) {
            Some(Layer::Myo(m)) if m.config().all_nodes => Some(m.tree()),
            _ => None,
        }
    }

    /// Block `i`'s sequence layer alone on (batch, positions, H), by hand where it can be with a
    /// sink (see [`Mode::Train`]); `dt` (batch, positions): the steps' intervals, which the
    /// layer takes when the model's timing is continuous.
    pub fn layer_forward(
        &self,
        i: usize,
        x: &Tensor,
        dt: Option<&Tensor>,
        sink: Option<&GradSink>,
    ) -> Result<Tensor> {
        let dt = dt.filter(|_| self.cfg.timing == Timing::Continuous);
        match self.blocks.get(i) {
            Some(block) => block.layer.forward(x, dt, sink),
            None => candle_core::bail!("no block {i} in a {}-block model", self.blocks.len()),
        }
    }

    /// Block `i`'s output from its layer's output y: `residual` + its activation of y with the
    /// activation's dropouts (sites 3i, 3i + 1), each GELU → dropout (→ residual) one fused op
    /// ([`epilogue`]); no residual for the pooled tree nodes.
    fn activate(
        &self,
        i: usize,
        block: &Block,
        y: &Tensor,
        residual: Option<&Tensor>,
        mode: Mode,
    ) -> Result<Tensor> {
        let drop = |k: u64| dropout(self.cfg.dropout, mode, 3 * i as u64 + k);
        if self.cfg.activation == Activation::Gelu {
            return epilogue(y, residual, EpilogueAct::Gelu, drop(0));
        }
        let sig = |l: &Option<Linear>, x: &Tensor| {
            candle_nn::ops::sigmoid(&dense(l.as_ref().expect("gate"), x)?)
        };
        let z = epilogue(y, None, EpilogueAct::Gelu, drop(0))?;
        let gated = match self.cfg.activation {
            Activation::FullGlu => {
                (dense(block.out1.as_ref().expect("out1"), &z)? * sig(&block.out2, &z)?)?
            }
            Activation::HalfGlu1 => (&z * sig(&block.out2, &z)?)?,
            _ => (y * sig(&block.out2, &z)?)?,
        };
        epilogue(&gated, residual, EpilogueAct::Identity, drop(1))
    }

    /// Log-probabilities (batch, classes), or without pooling the outputs at every step (batch,
    /// length, outputs; a Gaussian decoder's means then variances, 2 × outputs). `lengths` (batch, u32) marks the valid steps of padded sequences for
    /// mean and last pooling (all steps when `None`).
    pub fn forward(&self, x: &Tensor, lengths: Option<&Tensor>, mode: Mode) -> Result<Tensor> {
        self.forward_timed(x, lengths, None, mode)
    }

    /// [`Self::forward`] on series whose steps lie `dt` (batch, length) apart, which the model
    /// uses as its [`Timing`] says; the timings other than `drop` need them.
    pub fn forward_timed(
        &self,
        x: &Tensor,
        lengths: Option<&Tensor>,
        dt: Option<&Tensor>,
        mode: Mode,
    ) -> Result<Tensor> {
        let out = self.logits_timed(x, lengths, dt, mode)?;
        match self.cfg.pooling {
            Pooling::None => Ok(out),
            _ => candle_nn::ops::log_softmax(&out, D::Minus1),
        }
    }

    /// [`Self::forward_timed`] before the log-softmax: the head's output.
    pub fn logits_timed(
        &self,
        x: &Tensor,
        lengths: Option<&Tensor>,
        dt: Option<&Tensor>,
        mode: Mode,
    ) -> Result<Tensor> {
        self.run(x, lengths, dt, mode, true)
    }

    /// What the head reads: the pooled features (rows of `x`, H), or without pooling the last
    /// block's output at every step (batch, length, H).
    pub fn features(&self, x: &Tensor, lengths: Option<&Tensor>, mode: Mode) -> Result<Tensor> {
        self.features_timed(x, lengths, None, mode)
    }

    /// [`Self::features`] of series whose steps lie `dt` apart.
    pub fn features_timed(
        &self,
        x: &Tensor,
        lengths: Option<&Tensor>,
        dt: Option<&Tensor>,
        mode: Mode,
    ) -> Result<Tensor> {
        self.run(x, lengths, dt, mode, false)
    }

    /// The features, then the head's output if `head`.
    fn run(
        &self,
        x: &Tensor,
        lengths: Option<&Tensor>,
        dt: Option<&Tensor>,
        mode: Mode,
        head: bool,
    ) -> Result<Tensor> {
        if dt.is_none() && self.cfg.timing != Timing::Drop {
            candle_core::bail!(
                "the model's timing is {:?}: it needs the steps' time intervals",
                self.cfg.timing
            );
        }
        // Real inputs and intervals in the parameters' dtype (a model in f16 reads f32 data).
        let cast = |t: &Tensor| match t.dtype().is_float() && t.dtype() != self.dtype {
            true => t.to_dtype(self.dtype),
            false => Ok(t.clone()),
        };
        let (x, dt) = (&cast(x)?, dt.map(cast).transpose()?);
        let dt = dt.as_ref();
        let mut h = match &self.encoder {
            Encoder::Linear(l) => dense(l, x)?,
            Encoder::Embedding(e) => crate::ops::embedding(e.embeddings(), x)?,
            Encoder::Frames(f) => {
                let dt = dt.filter(|_| f.appends_dt());
                match mode.sink() {
                    Some(sink) => f.forward_by_hand(x, dt, sink)?,
                    None => f.forward_timed(x, dt)?,
                }
            }
        };
        let layer_dt = dt.filter(|_| self.cfg.timing == Timing::Continuous);
        let node_pooling = matches!(self.cfg.pooling, Pooling::Root | Pooling::TopLevels { .. });
        // Myo layers over all tree nodes: the virtual nodes start from zero features (their
        // first layer's learned inputs) and are carried from block to block like the leaves.
        let tree = self.node_tree();
        let steps = h.dim(1)?;
        if let Some(tree) = tree.filter(|t| t.len() > steps) {
            let (b, len, hdim) = h.dims3()?;
            let virt = Tensor::zeros((b, tree.len() - len, hdim), h.dtype(), h.device())?;
            h = Tensor::cat(&[h, virt], 1)?;
        }
        // Over all tree nodes, the last block of a node pooling computes the pooled nodes alone
        // (unless a post-norm BatchNorm takes its statistics over all of them): `offset` is
        // then the first node h holds.
        let pooled_from = match &tree {
            Some(t) if node_pooling && self.pooled_nodes_alone() => {
                tail::first_pooled(t, self.cfg.pooling)
            }
            _ => 0,
        };
        let mut offset = 0;
        for (i, block) in self.blocks.iter().enumerate() {
            let from = if i + 1 == self.blocks.len() {
                pooled_from
            } else {
                0
            };
            if let Some(sink) = mode.sink() {
                if let Some(out) =
                    self.block_by_hand((i, block), &h, (from, layer_dt), mode, sink)?
                {
                    (h, offset) = (out, from);
                    continue;
                }
            }
            let z = if self.cfg.prenorm {
                block.norm.forward(&h, mode)?
            } else {
                h.clone()
            };
            if let (true, true, Layer::Myo(m), None) = (
                node_pooling,
                i + 1 == self.blocks.len(),
                &block.layer,
                &tree,
            ) {
                // The last block's output is its tree nodes, pooled.
                let pooled = self.pool_nodes(i, m, &z, block, mode)?;
                return self.tail(&pooled, None, head, mode);
            }
            let (y, residual) = match (&block.layer, from) {
                (Layer::Myo(m), f) if f > 0 => (
                    m.forward_nodes(&z, f)?,
                    h.narrow(1, f, h.dim(1)? - f)?.contiguous()?,
                ),
                (layer, _) => (layer.forward(&z, layer_dt, mode.sink())?, h.clone()),
            };
            h = self.activate(i, block, &y, Some(&residual), mode)?;
            offset = from;
            if !self.cfg.prenorm {
                h = block.norm.forward(&h, mode)?;
            }
        }
        let (h, pool) = match &tree {
            _ if self.cfg.pooling == Pooling::None => (h.narrow(1, 0, steps)?, None),
            Some(tree) if node_pooling => {
                let first = tail::first_pooled(tree, self.cfg.pooling) - offset;
                (h, Some(Pool::Nodes { first }))
            }
            Some(_) => {
                let h = h.narrow(1, 0, steps)?;
                let pool = self.pool_steps(&h, lengths)?;
                (h, Some(pool))
            }
            None => {
                let pool = self.pool_steps(&h, lengths)?;
                (h, Some(pool))
            }
        };
        self.tail(&h, pool, head, mode)
    }
}
