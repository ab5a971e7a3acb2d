//! candle-nn modules built on the ops: S5 (with its HiPPO-N initialisation), Myo, the 2-D SSM
//! and minGRU, and the sequence classifier that stacks them. Each layer is
//! `Layer::new(config, vb)` with a serialisable config, and implements `Module`.

pub mod batch_norm;
pub mod by_hand;
pub mod classifier;
pub mod frames;
pub mod head;
pub mod hippo;
pub(crate) mod init;
pub mod loss;
pub mod mingru;
pub mod myo;
pub mod s5;
pub mod ssm2d;

pub use batch_norm::{ShardSum, Shards};
pub use by_hand::GradSink;
pub use classifier::{
    Activation, ClassifierConfig, DropoutKey, EncoderConfig, Mode, NormKind, ParamGroup,
    SeqLayerConfig, SequenceClassifier, Timing, BN_MOMENTUM,
};
pub use head::{Decoder, Pooling};
pub use mingru::{MinGru, MinGruConfig};
pub use myo::{Coupling, Myo, MyoConfig, TreeSpec};
pub use s5::{CInit, Discretization, S5Config, S5Groups, S5};
pub use ssm2d::{Ssm2d, Ssm2dConfig};

use candle_core::{Result, Tensor};

pub use init::DenseInit;
pub(crate) use init::{
    embedding, init_param, init_rng, layer_rng, linear, normal_vec, param_with, params,
};

/// `x Wᵀ + b` over the last dimension of `x` (any leading dimensions) for a candle-nn `Linear`:
/// one 2-D matmul and [`crate::ops::channel_add`], whose bias gradient is a single pass of row
/// sums.
pub(crate) fn dense(l: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    let w = l.weight();
    let y = rows(x, |x| x.matmul(&w.t()?))?;
    match l.bias() {
        Some(b) => crate::ops::channel_add(&y, b),
        None => Ok(y),
    }
}

/// `f` of x as (rows, last dimension), its result back in x's leading dimensions (2-D tensors
/// pass as they are).
pub(crate) fn rows(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.rank() == 2 {
        return f(x);
    }
    let mut dims = x.dims().to_vec();
    let k = dims.pop().unwrap_or(1);
    let y = f(&x.reshape((x.elem_count() / k.max(1), k))?)?;
    dims.push(y.dim(1)?);
    y.reshape(dims)
}
