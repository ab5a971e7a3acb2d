//! What the classifier reads out of its last block: the [`Pooling`] of the steps (or of Myo's
//! tree nodes) and the head that maps the pooled features to class scores — a linear
//! decoder, or for pairs of sequences encoded apart the features [u, v, u ⊙ v, u − v] of the
//! two (Tay et al. 2021, LRA's Retrieval) through Dense(4H → H), GELU, Dense(H → classes), as
//! S5's reference decoder for that task; for a regression at every step, a linear readout or a
//! Gaussian's mean and variance ([`Decoder`]).

use candle_core::{Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::init::DenseInit;
use super::{dense, linear};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Pooling {
    /// Mean over the valid (unpadded) steps.
    Mean,
    /// The last valid step.
    Last,
    /// Myo: the root node's output of the last block.
    Root,
    /// Myo: the mean over the top `k` BFS levels of the last block (k = 1 is the root; §3.2).
    TopLevels { k: usize },
    /// None: the decoder reads every step, and the model regresses (batch, length, outputs).
    None,
}

impl std::fmt::Display for Pooling {
    /// As the flag `--pooling` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pooling::Mean => f.write_str("mean"),
            Pooling::Last => f.write_str("last"),
            Pooling::Root => f.write_str("root"),
            Pooling::TopLevels { k } => write!(f, "top:{k}"),
            Pooling::None => f.write_str("none"),
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = String;

    /// `mean`, `last`, `root`, `top:K` (K ≥ 1) or `none`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "mean" => Pooling::Mean,
            "last" => Pooling::Last,
            "root" => Pooling::Root,
            "none" => Pooling::None,
            _ => match s.strip_prefix("top:").map(str::parse) {
                Some(Ok(k)) if k >= 1 => Pooling::TopLevels { k },
                _ => {
                    return Err(format!(
                        "'{s}': expected mean, last, root, top:K with K ≥ 1, or none"
                    ))
                }
            },
        })
    }
}

/// What a regression at every step reads out of the last block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Decoder {
    /// A Linear readout of the outputs, trained by their mean squared error.
    #[default]
    Linear,
    /// A Gaussian per output, trained by its negative log-likelihood (S5 Appendix G.3.8, after
    /// CRU): a mean and a variance decoder, each Dense(H → 30) → tanh → Dense(30 → outputs),
    /// the variance through elu + 1. The model outputs [mean, variance] at every step.
    Gaussian,
}

/// The hidden width of the Gaussian decoders (CRU's).
const GAUSSIAN_HIDDEN: usize = 30;

/// The head: (rows, H) pooled features → (examples, classes) scores, or at every step
/// (batch, length, H) → (batch, length, outputs) (a Gaussian's: 2 × outputs).
pub(crate) enum Head {
    Linear(Linear),
    /// Pairs: Dense(4H → H) → GELU before the decoder.
    Pairs {
        pair: Linear,
        decoder: Linear,
    },
    /// Two small MLPs, for the mean and the variance.
    Gaussian {
        mean: [Linear; 2],
        var: [Linear; 2],
    },
}

impl Head {
    /// `pairs`: the rows come as two halves, the first and the second sequence of each pair.
    pub(crate) fn new(
        h: usize,
        classes: usize,
        pairs: bool,
        decoder: Decoder,
        vb: VarBuilder,
        (seed, init): (u64, DenseInit),
    ) -> Result<Self> {
        let at = vb.pp("decoder");
        let mlp = |name: &str| -> Result<[Linear; 2]> {
            Ok([
                linear(h, GAUSSIAN_HIDDEN, at.pp(name).pp("0"), seed, init)?,
                linear(GAUSSIAN_HIDDEN, classes, at.pp(name).pp("1"), seed, init)?,
            ])
        };
        Ok(match (pairs, decoder) {
            (true, Decoder::Gaussian) => {
                candle_core::bail!(
                    "pairs of sequences are classified: a Gaussian decoder does not apply"
                )
            }
            (true, Decoder::Linear) => Head::Pairs {
                pair: linear(4 * h, h, vb.pp("pair"), seed, init)?,
                decoder: linear(h, classes, at, seed, init)?,
            },
            (false, Decoder::Linear) => Head::Linear(linear(h, classes, at, seed, init)?),
            (false, Decoder::Gaussian) => Head::Gaussian {
                mean: mlp("mean")?,
                var: mlp("var")?,
            },
        })
    }

    /// The scores of `x`: for pairs, of the pairs its two halves of rows make.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Head::Linear(decoder) => dense(decoder, x),
            Head::Pairs { pair, decoder } => {
                let rows = x.dim(0)?;
                if rows % 2 != 0 {
                    candle_core::bail!(
                        "{rows} sequences do not make pairs: a pair batch holds 2 per example"
                    );
                }
                let (u, v) = (x.narrow(0, 0, rows / 2)?, x.narrow(0, rows / 2, rows / 2)?);
                let features = Tensor::cat(&[&u, &v, &(&u * &v)?, &(&u - &v)?], D::Minus1)?;
                dense(decoder, &crate::ops::gelu(&dense(pair, &features)?)?)
            }
            Head::Gaussian { mean, var } => {
                let mlp = |l: &[Linear; 2]| dense(&l[1], &dense(&l[0], x)?.tanh()?);
                let v = mlp(var)?;
                // elu(v) + 1: exp(v) below 0, v + 1 above.
                let v = (v.minimum(0f64)?.exp()? + v.relu()?)?;
                Tensor::cat(&[&mlp(mean)?, &v], D::Minus1)
            }
        }
    }
}
