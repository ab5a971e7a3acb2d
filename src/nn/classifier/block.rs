//! A block (norm → layer → activation → dropout → residual) as one node of candle's graph with
//! its backward written out ([`crate::nn::by_hand`]), for blocks whose layer has a backward by
//! hand (S5, and Myo's default form). With x the block's input, pre-norm z = N(x) (post-norm
//! z = x), y = layer(z), and the activation's output o = x + k₁ ⊙ a(y) (then N(o) post-norm),
//! N LayerNorm or BatchNorm (its backward: [`BatchNormBackward`]):
//!
//! * GELU: a = GELU(y) with its dropout k₀, one epilogue;
//! * the GLUs: g = GELU(y) ⊙ k₀, s = σ(W₂g + b₂), a = f ⊙ s with f = W₁g + b₁ | g | y (full,
//!   half 1, half 2), so that ∂f = ∂a ⊙ s, ∂s = ∂a ⊙ f, ∂(W₂g + b₂) = ∂s ⊙ s(1 − s); ∂g
//!   collects W₂ᵀ of it and W₁ᵀ ∂f (full) or ∂f (half 1); half 2 adds ∂f to ∂y instead.
//!
//! The residual's gradient is the output's: ∂x = ∂o + Nᵀ(∂z) pre-norm, ∂o + ∂z post-norm.

use candle_core::{Result, Tensor};
use candle_nn::Linear;

use super::{dropout, Activation, Block, Layer, Mode, Norm, SequenceClassifier, LN_EPS};
use crate::nn::batch_norm::BatchNormBackward;
use crate::nn::by_hand::{by_hand, Backward, GradSink};
use crate::nn::S5;
use crate::ops::epilogue::{
    epilogue, epilogue_backward, gate, gate_backward, Activation as EpilogueAct, Dropout,
};
use crate::ops::{channel_add, channel_add_backward, gemm, layer_norm, layer_norm_backward, Mat};

/// A dense layer's parameters (the gradients' keys) and their values detached once (aliases
/// that the optimiser's in-place steps update too).
#[derive(Clone)]
pub(super) struct Dense {
    vars: [Tensor; 2],
    detached: Linear,
}

impl Dense {
    pub(super) fn new(l: &Linear) -> Result<Self> {
        let Some(b) = l.bias() else {
            candle_core::bail!("a block's dense layer has no bias");
        };
        Ok(Dense {
            vars: [l.weight().clone(), b.clone()],
            detached: Linear::new(l.weight().detach(), Some(b.detach())),
        })
    }

    /// y = x Wᵀ + b over the last dimension, on the detached values.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        channel_add(&self.product(x)?, self.bias()?)
    }

    /// x Wᵀ over the last dimension, without the bias (detached values).
    fn product(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.detached.weight();
        let mut dims = x.dims().to_vec();
        dims.pop();
        dims.push(w.dim(0)?);
        gemm(&Mat::rows(x)?, &Mat::rows(w)?.t(), dims)
    }

    /// The bias, detached.
    fn bias(&self) -> Result<&Tensor> {
        match self.detached.bias() {
            Some(b) => Ok(b),
            None => candle_core::bail!("a block's dense layer has no bias"),
        }
    }

    /// The weight (the variable).
    pub(super) fn weight(&self) -> &Tensor {
        &self.vars[0]
    }

    /// ∂x of y = x Wᵀ + b over the last dimension, from ∂y; ∂W and ∂b go to `params`.
    pub(super) fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        params: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let (xm, dym) = (Mat::rows(x)?, Mat::rows(dy)?);
        let [w, b] = &self.vars;
        let (n_out, n_in) = w.dims2()?;
        params.push((w.clone(), gemm(&dym.clone().t(), &xm, (n_out, n_in))?));
        params.push((b.clone(), channel_add_backward(self.bias()?, dy)?));
        gemm(&dym, &Mat::rows(self.detached.weight())?, x.dims())
    }
}

/// The activation's forward values.
enum Act {
    /// GELU with the dropout k₀.
    Gelu(Option<Dropout>),
    Glu {
        kind: Activation,
        /// GELU(y) ⊙ k₀ and the dropout k₀.
        g: Tensor,
        drop0: Option<Dropout>,
        /// The gate σ(W₂g + b₂).
        s: Tensor,
        /// The factor of the gate: W₁g + b₁, g or y.
        f: Tensor,
        /// The dropout k₁ of the gated product.
        drop1: Option<Dropout>,
        out1: Option<Dense>,
        out2: Dense,
    },
}

/// A norm's forward values.
enum NormPass {
    Layer {
        input: Tensor,
        /// (weight, bias), then their detached values.
        vars: [Tensor; 2],
        detached: [Tensor; 2],
    },
    Batch(BatchNormBackward),
}

impl NormPass {
    /// The block's norm on `x` (detached), by hand.
    fn forward(norm: &Norm, x: &Tensor, mode: Mode) -> Result<(Tensor, Self)> {
        match norm {
            Norm::Layer(ln) => {
                let detached = ln.detached.clone();
                let y = layer_norm(x, &detached[0], &detached[1], LN_EPS)?;
                let vars = [ln.weight.clone(), ln.bias.clone()];
                let input = x.clone();
                Ok((
                    y,
                    NormPass::Layer {
                        input,
                        vars,
                        detached,
                    },
                ))
            }
            Norm::Batch(bn) => {
                let shards = match mode {
                    Mode::Train(_, shards, _) => shards,
                    Mode::Eval => None,
                };
                let (y, back) = bn.forward_by_hand(x, shards)?;
                Ok((y, NormPass::Batch(back)))
            }
        }
    }

    /// ∂ of the norm's input from its output's `g`; the scale's and shift's go to `params`.
    fn backward(&self, g: &Tensor, params: &mut Vec<(Tensor, Tensor)>) -> Result<Tensor> {
        match self {
            NormPass::Layer {
                input,
                vars: [w, b],
                detached: [wd, bd],
            } => {
                let [dx, dw, db] = layer_norm_backward(input, wd, bd, LN_EPS, g)?;
                params.push((w.clone(), dw));
                params.push((b.clone(), db));
                Ok(dx)
            }
            NormPass::Batch(back) => back.backward(g, params),
        }
    }
}

/// What the block's forward kept.
struct BlockBackward {
    /// The norm before the layer (pre-norm) or after the residual (post-norm).
    pre: Option<NormPass>,
    post: Option<NormPass>,
    layer: Box<dyn Backward>,
    /// The layer's output.
    y: Tensor,
    act: Act,
    /// The first position with an output (the last block of a node pooling computes the
    /// pooled nodes alone): the residual's gradient is zero before it.
    from: usize,
}

impl Act {
    /// ∂y of the activation from ∂o, y the layer's output; the dense layers' gradients go to
    /// `params`.
    fn backward(
        &self,
        y: &Tensor,
        d_o: &Tensor,
        params: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let Act::Glu {
            kind,
            g,
            drop0,
            s,
            f,
            drop1,
            out1,
            out2,
        } = self
        else {
            let Act::Gelu(drop0) = self else {
                unreachable!("Act has two kinds")
            };
            return epilogue_backward(y, EpilogueAct::Gelu, *drop0, d_o);
        };
        let [df, dz] = gate_backward(f, s, *drop1, d_o)?;
        let mut dg = out2.backward(g, &dz, params)?;
        let mut direct = None;
        match (kind, out1) {
            (Activation::FullGlu, Some(out1)) => dg = (dg + out1.backward(g, &df, params)?)?,
            (Activation::HalfGlu1, _) => dg = (dg + df)?,
            _ => direct = Some(df),
        }
        let dy = epilogue_backward(y, EpilogueAct::Gelu, *drop0, &dg)?;
        match direct {
            Some(df) => dy + df,
            None => Ok(dy),
        }
    }
}

impl Backward for BlockBackward {
    fn backward(&self, dout: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let mut params = vec![];
        let d_o = match &self.post {
            Some(norm) => norm.backward(dout, &mut params)?,
            None => dout.clone(),
        };
        let dy = self.act.backward(&self.y, &d_o, &mut params)?;
        let (dz, layer_params) = self.layer.backward(&dy)?;
        params.extend(layer_params);
        let dz = match &self.pre {
            Some(norm) => norm.backward(&dz, &mut params)?,
            None => dz,
        };
        let d_o = match self.from {
            0 => d_o,
            f => d_o.pad_with_zeros(1, f, 0)?,
        };
        Ok(((dz + d_o)?, params))
    }
}

impl SequenceClassifier {
    /// Block `i` on `h` as one node with its backward by hand, where it has one (a block
    /// around an S5 layer, with intervals `dt` per step or without, or Myo's default form, in
    /// every float dtype): `None` otherwise. Its output covers the positions `from..` (a Myo layer's
    /// nodes; 0 for all).
    pub(super) fn block_by_hand(
        &self,
        (i, block): (usize, &Block),
        h: &Tensor,
        (from, dt): (usize, Option<&Tensor>),
        mode: Mode,
        sink: &GradSink,
    ) -> Result<Option<Tensor>> {
        let covered = match (&block.layer, dt) {
            (Layer::S5(_), None) => S5::has_backward_by_hand(h),
            (Layer::S5(s5), Some(dt)) => S5::has_backward_by_hand(h) && s5.covers_timed(h, dt)?,
            (Layer::Myo(m), None) => m.has_backward_by_hand(h),
            _ => false,
        };
        if !covered {
            return Ok(None);
        }
        // The block's own ops (epilogue, gate, channel bias, LayerNorm) are fused in every float
        // dtype; BatchNorm by hand normalises f16 and bf16 rows in f32.
        let anchor = match &block.norm {
            Norm::Layer(ln) if crate::ops::layer_norm::fused(h)? => &ln.weight,
            Norm::Batch(bn) => bn.weight(),
            Norm::Layer(_) => return Ok(None),
        };
        let x = h.detach();
        let (z, pre) = match self.cfg.prenorm {
            true => {
                let (z, pass) = NormPass::forward(&block.norm, &x, mode)?;
                (z, Some(pass))
            }
            false => (x.clone(), None),
        };
        let run = match &block.layer {
            Layer::S5(s5) if from == 0 => s5.run_by_hand(&z, dt)?,
            Layer::Myo(m) => m.run_nodes_by_hand(&z, from)?,
            _ => None,
        };
        let Some((y, layer)) = run else {
            candle_core::bail!("block {i}: its layer has no backward by hand");
        };
        let x = match from {
            0 => x,
            f => x.narrow(1, f, x.dim(1)? - f)?.contiguous()?,
        };
        let drop = |k: u64| dropout(self.cfg.dropout, mode, 3 * i as u64 + k);
        let (o, act) = match self.cfg.activation {
            Activation::Gelu => (
                epilogue(&y, Some(&x), EpilogueAct::Gelu, drop(0))?,
                Act::Gelu(drop(0)),
            ),
            kind => {
                let [out1, out2] = block.dense.clone();
                let Some(out2) = out2 else {
                    candle_core::bail!("block {i}: a gated activation without its gate");
                };
                let g = epilogue(&y, None, EpilogueAct::Gelu, drop(0))?;
                let z = out2.product(&g)?;
                let f = match (&out1, kind) {
                    (Some(out1), Activation::FullGlu) => out1.forward(&g)?,
                    (_, Activation::HalfGlu1) => g.clone(),
                    _ => y.clone(),
                };
                let [o, s] = gate(&f, &z, out2.bias()?, Some(&x), drop(1))?;
                let act = Act::Glu {
                    kind,
                    g,
                    drop0: drop(0),
                    s,
                    f,
                    drop1: drop(1),
                    out1,
                    out2,
                };
                (o, act)
            }
        };
        let (out, post) = match self.cfg.prenorm {
            true => (o, None),
            false => {
                let (out, pass) = NormPass::forward(&block.norm, &o, mode)?;
                (out, Some(pass))
            }
        };
        let back = BlockBackward {
            pre,
            post,
            layer,
            y,
            act,
            from,
        };
        by_hand(h, &out, anchor, Box::new(back), sink).map(Some)
    }
}
