//! The model's tail: the pooling of the last block's output and the head. In training with a
//! sink (see [`Mode::Train`]), a mean pooling and a linear head run as one node of candle's graph
//! whose backward is written out ([`crate::nn::by_hand`]): with p the pooled features and
//! logits = p Wᵀ + b,
//!
//!   ∂W = ∂logitsᵀ p,  ∂b = Σ_rows ∂logits,  ∂p = ∂logits W,
//!
//! and ∂h spreads ∂p evenly over the positions each mean read. A Gaussian decoder at every
//! step (no pooling) is one such node too ([`GaussianBackward`]).

use candle_core::{DType, Result, Tensor, D};
use candle_nn::Linear;

use super::block::Dense;
use super::{Block, Mode, NormKind, Pooling, SequenceClassifier};
use crate::nn::by_hand::{by_hand, Backward};
use crate::nn::head::Head;
use crate::nn::Myo;
use crate::ops::{masked_mean, masked_mean_backward};
use crate::tree::Tree;

/// How the positions of (batch, positions, H) are pooled into (batch, H).
#[derive(Clone)]
pub(super) enum Pool {
    /// The mean over each sample's first `lengths[b]` positions (checked; u32, or the
    /// features' dtype).
    Mean(Tensor),
    /// Each sample's position `lengths[b]` − 1.
    Last(Tensor),
    /// The mean over the tree nodes `first..` (the top levels; the root alone when it is the
    /// last node).
    Nodes { first: usize },
}

/// The first node that a root or top-levels pooling reads.
pub(super) fn first_pooled(tree: &Tree, pooling: Pooling) -> usize {
    let k = match pooling {
        Pooling::TopLevels { k } => k.clamp(1, tree.levels()),
        _ => 1,
    };
    tree.level(tree.levels() - k).start
}

impl Pool {
    fn apply(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Pool::Mean(lengths) => masked_mean(h, lengths),
            Pool::Last(lengths) => {
                let (b, _, features) = h.dims3()?;
                let one = Tensor::ones(1, DType::U32, h.device())?;
                let idx = lengths
                    .broadcast_sub(&one)?
                    .reshape((b, 1, 1))?
                    .broadcast_as((b, 1, features))?
                    .contiguous()?;
                h.gather(&idx, 1)?.squeeze(1)
            }
            Pool::Nodes { first } => h.narrow(1, *first, h.dim(1)? - first)?.mean(1),
        }
    }
}

impl SequenceClassifier {
    /// Whether a node pooling's last block computes the pooled nodes alone past its layer:
    /// not with a post-norm BatchNorm, which takes its statistics over all of them.
    pub(super) fn pooled_nodes_alone(&self) -> bool {
        self.cfg.prenorm || self.cfg.norm == NormKind::Layer
    }

    /// The Myo poolings (§3.2): the root, or the mean over the top k BFS levels, of the last
    /// block's node outputs after its activation (and its norm, post-norm; internal nodes have
    /// no residual input): (batch, H).
    pub(super) fn pool_nodes(
        &self,
        i: usize,
        m: &Myo,
        z: &Tensor,
        block: &Block,
        mode: Mode,
    ) -> Result<Tensor> {
        let tree = m.tree();
        let first = first_pooled(tree, self.cfg.pooling);
        if self.pooled_nodes_alone() {
            let mut nodes = self.activate(i, block, &m.forward_nodes(z, first)?, None, mode)?;
            if !self.cfg.prenorm {
                nodes = block.norm.forward(&nodes, mode)?;
            }
            return nodes.mean(1);
        }
        let nodes = self.activate(i, block, &m.forward_nodes(z, 0)?, None, mode)?;
        let nodes = block.norm.forward(&nodes, mode)?;
        nodes.narrow(1, first, tree.len() - first)?.mean(1)
    }

    /// A step pooling (mean or last) of h (batch, L, H) over `lengths`. The lengths stay on
    /// their device; on the CPU, where reading them is free, they are checked to lie in 1..=L
    /// (the trainer's batches are checked where they are made).
    pub(super) fn pool_steps(&self, h: &Tensor, lengths: Option<&Tensor>) -> Result<Pool> {
        let (b, l, _) = h.dims3()?;
        let lengths = match lengths {
            Some(t) => t.to_dtype(DType::U32)?,
            None => Tensor::full(l as u32, b, h.device())?,
        };
        if lengths.device().is_cpu() {
            let lens: Vec<u32> = lengths.to_vec1()?;
            if let Some((i, n)) = lens
                .iter()
                .enumerate()
                .find(|(_, &n)| n == 0 || n as usize > l)
            {
                candle_core::bail!(
                    "sequence length {n} of sample {i} is not in 1..={l} (the padded length)"
                );
            }
        }
        Ok(match self.cfg.pooling {
            Pooling::Last => Pool::Last(lengths),
            _ => Pool::Mean(lengths),
        })
    }

    /// `h` pooled by `pool` (as it is without one), then the head's output if `head`: by hand
    /// where the mode has a sink, the pooling is a mean and the head linear.
    pub(super) fn tail(
        &self,
        h: &Tensor,
        pool: Option<Pool>,
        head: bool,
        mode: Mode,
    ) -> Result<Tensor> {
        let fused = matches!(
            h.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) && (h.device().is_cpu() || h.device().is_cuda());
        match (head, fused, mode.sink(), &self.head_dense, &pool) {
            (
                true,
                true,
                Some(sink),
                Some(HeadDense::Linear(dense)),
                Some(pool @ (Pool::Mean(_) | Pool::Nodes { .. })),
            ) => {
                let x = h.detach();
                // The lengths in the mean's compute dtype once (f32 for f16/bf16 h), for the
                // forward and the backward.
                let len_dtype = crate::ops::acc_dtype(x.dtype());
                let pool = match pool {
                    Pool::Mean(lengths) => Pool::Mean(lengths.to_dtype(len_dtype)?),
                    // The mean over all positions: the fused op, one kernel each way.
                    Pool::Nodes { first: 0 } => {
                        let (b, n, _) = x.dims3()?;
                        let all = Tensor::full(n as f32, b, x.device())?;
                        Pool::Mean(all.to_dtype(len_dtype)?)
                    }
                    pool => pool.clone(),
                };
                let pooled = pool.apply(&x)?;
                let logits = dense.forward(&pooled)?;
                let back = TailBackward {
                    x,
                    pool,
                    pooled,
                    dense: dense.clone(),
                };
                return by_hand(h, &logits, dense.weight(), Box::new(back), sink);
            }
            (true, true, Some(sink), Some(HeadDense::Gaussian(mlps)), None) => {
                let (out, back) = GaussianBackward::forward(mlps, &h.detach())?;
                let anchor = mlps[0][0].weight();
                return by_hand(h, &out, anchor, Box::new(back), sink);
            }
            _ => {}
        }
        let pooled = match pool {
            Some(pool) => pool.apply(h)?,
            None => h.clone(),
        };
        match head {
            true => self.head.forward(&pooled),
            false => Ok(pooled),
        }
    }

    /// The head's dense layers as the tail by hand uses them.
    pub(super) fn head_dense(head: &Head) -> Result<Option<HeadDense>> {
        Ok(match head {
            Head::Linear(l) => Some(HeadDense::Linear(Dense::new(l)?)),
            Head::Gaussian { mean, var } => {
                let pair = |[a, b]: &[Linear; 2]| -> Result<[Dense; 2]> {
                    Ok([Dense::new(a)?, Dense::new(b)?])
                };
                Some(HeadDense::Gaussian([pair(mean)?, pair(var)?]))
            }
            Head::Pairs { .. } => None,
        })
    }
}

/// The head's dense layers, for the tail by hand.
pub(super) enum HeadDense {
    Linear(Dense),
    /// The mean's and the variance's decoders, Dense(H → 30) → tanh → Dense(30 → outputs).
    Gaussian([[Dense; 2]; 2]),
}

/// What the tail's forward kept.
struct TailBackward {
    /// The last block's output, detached.
    x: Tensor,
    pool: Pool,
    pooled: Tensor,
    dense: Dense,
}

impl Backward for TailBackward {
    fn backward(&self, dlogits: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let mut params = vec![];
        let dp = self.dense.backward(&self.pooled, dlogits, &mut params)?;
        let dx = match &self.pool {
            Pool::Mean(lengths) => masked_mean_backward(&self.x, lengths, &dp)?,
            Pool::Nodes { first } => {
                let (b, n, features) = self.x.dims3()?;
                let k = n - first;
                let spread = (&dp / k as f64)?
                    .unsqueeze(1)?
                    .broadcast_as((b, k, features))?;
                let zeros = Tensor::zeros((b, *first, features), dp.dtype(), dp.device())?;
                Tensor::cat(&[&zeros, &spread], 1)?
            }
            Pool::Last(_) => candle_core::bail!("the tail by hand has no last pooling"),
        };
        Ok((dx, params))
    }
}

/// The Gaussian decoder's forward ([`Head::Gaussian`]) on detached values, and its backward:
/// per decoder ∂a = ∂t ⊙ (1 − t²) through t = tanh(a), and through the variance's
/// elu(o) + 1 = exp(min(o, 0)) + relu(o) ∂o = ∂v ⊙ exp(min(o, 0)) (1 for o ≥ 0).
struct GaussianBackward {
    x: Tensor,
    mlps: [[Dense; 2]; 2],
    /// Each decoder's hidden features, tanh(a).
    hidden: [Tensor; 2],
    /// exp(min(o, 0)) of the variance decoder's output o.
    slope: Tensor,
}

impl GaussianBackward {
    /// [mean, variance] at every step of x (batch, length, H), and what the backward reads.
    fn forward(mlps: &[[Dense; 2]; 2], x: &Tensor) -> Result<(Tensor, Self)> {
        let mut hidden = vec![];
        let mut outs = vec![];
        for [first, second] in mlps {
            let t = first.forward(x)?.tanh()?;
            outs.push(second.forward(&t)?);
            hidden.push(t);
        }
        let slope = outs[1].minimum(0f64)?.exp()?;
        let var = (&slope + outs[1].relu()?)?;
        let out = Tensor::cat(&[&outs[0], &var], D::Minus1)?;
        let back = GaussianBackward {
            x: x.clone(),
            mlps: mlps.clone(),
            hidden: hidden.try_into().expect("two"),
            slope,
        };
        Ok((out, back))
    }
}

impl Backward for GaussianBackward {
    fn backward(&self, dout: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let k = self.slope.dim(D::Minus1)?;
        let dmean = dout.narrow(D::Minus1, 0, k)?;
        let dvar = (dout.narrow(D::Minus1, k, k)? * &self.slope)?;
        let mut params = vec![];
        let mut dx: Option<Tensor> = None;
        for (([first, second], t), d) in self.mlps.iter().zip(&self.hidden).zip([dmean, dvar]) {
            let dt = second.backward(t, &d.contiguous()?, &mut params)?;
            let da = (dt * t.sqr()?.affine(-1.0, 1.0)?)?;
            let d = first.backward(&self.x, &da, &mut params)?;
            dx = Some(match dx {
                Some(sum) => (sum + d)?,
                None => d,
            });
        }
        Ok((dx.expect("two decoders"), params))
    }
}
