//! Complex tensors as a pair of real tensors (re, im), the one complex arithmetic on tensors in
//! the crate: the layers' discretisations and the plain-candle references of the ops, which
//! store complex values with a trailing dimension of 2 ([`C::from_pairs`], [`C::to_pairs`]).
//! Operations broadcast. (The CPU twins of the kernels compute on scalars:
//! [`crate::ops`]'s `Value`.)

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

    /// The complex values of `t`, whose last dimension (of size 2) holds (re, im).
    pub fn from_pairs(t: &Tensor) -> Result<Self> {
        let last = t.rank() - 1;
        Ok(C::new(
            t.narrow(last, 0, 1)?.squeeze(last)?,
            t.narrow(last, 1, 1)?.squeeze(last)?,
        ))
    }

    /// The values with a trailing dimension of 2 holding (re, im).
    pub fn to_pairs(&self) -> Result<Tensor> {
        Tensor::stack(&[&self.re, &self.im], self.re.rank())
    }

    pub fn one_like(t: &Tensor) -> Result<Self> {
        Ok(C::new(t.ones_like()?, t.zeros_like()?))
    }

    pub fn add_real(&self, x: f64) -> Result<Self> {
        Ok(C::new((&self.re + x)?, self.im.clone()))
    }

    pub fn sub(&self, o: &C) -> Result<Self> {
        Ok(C::new(
            self.re.broadcast_sub(&o.re)?,
            self.im.broadcast_sub(&o.im)?,
        ))
    }

    /// Multiplication by a real tensor.
    pub fn scale(&self, s: &Tensor) -> Result<Self> {
        Ok(C::new(self.re.broadcast_mul(s)?, self.im.broadcast_mul(s)?))
    }

    pub fn mul(&self, o: &C) -> Result<Self> {
        Ok(C::new(
            (self.re.broadcast_mul(&o.re)? - self.im.broadcast_mul(&o.im)?)?,
            (self.re.broadcast_mul(&o.im)? + self.im.broadcast_mul(&o.re)?)?,
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
        self.mul(&C::new(v.re.unsqueeze(1)?, v.im.unsqueeze(1)?))
    }
}
