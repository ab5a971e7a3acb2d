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
    Activation, ClassifierConfig, EncoderConfig, NormKind, Pooling, SeqLayerConfig,
    SequenceClassifier,
};
pub use mingru::{MinGru, MinGruConfig};
pub use myo::{Myo, MyoConfig, TreeSpec};
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
