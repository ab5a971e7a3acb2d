//! minGRU (Feng et al. 2024; parallel-scan seminar), equivalently GILR (Martin & Cundy 2018)
//! without an impulse activation:
//!
//!   z_t = σ(W_z x_t + b_z),  h̃_t = W_h x_t + b_h (or tanh(…) with `tanh_impulse`, as GILR),
//!   h_t = (1 − z_t) ⊙ h_{t−1} + z_t ⊙ h̃_t,
//!
//! gates from the input only, so the recurrence is [`crate::ops::linear_scan`] with the
//! time-varying gate a_t = 1 − z_t and input b_t = z_t ⊙ h̃_t (h_0 = 0).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::{linear, DenseInit};
use serde::{Deserialize, Serialize};

use crate::ops::{linear_scan, ScanOptions};

/// Configuration of a [`MinGru`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MinGruConfig {
    /// Input features.
    pub d_model: usize,
    /// State (and output) features; the classifier uses `d_model`.
    pub hidden: usize,
    /// GILR's impulse activation τ = tanh instead of minGRU's identity.
    pub tanh_impulse: bool,
    /// Seed of the initialisation.
    pub seed: u64,
}

impl Default for MinGruConfig {
    fn default() -> Self {
        MinGruConfig {
            d_model: 128,
            hidden: 128,
            tanh_impulse: false,
            seed: 0,
        }
    }
}

/// The minGRU layer: (batch, length, d_model) → (batch, length, hidden).
#[derive(Clone, Debug)]
pub struct MinGru {
    cfg: MinGruConfig,
    gate: Linear,
    impulse: Linear,
}

impl MinGru {
    pub fn new(cfg: MinGruConfig, vb: VarBuilder) -> Result<Self> {
        let dense = |name: &str| {
            let (h, seed) = (cfg.hidden, cfg.seed);
            linear(cfg.d_model, h, vb.pp(name), seed, DenseInit::Uniform)
        };
        Ok(MinGru {
            gate: dense("gate")?,
            impulse: dense("impulse")?,
            cfg,
        })
    }

    pub fn config(&self) -> &MinGruConfig {
        &self.cfg
    }
}

impl Module for MinGru {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let z = candle_nn::ops::sigmoid(&self.gate.forward(x)?)?;
        let mut h_tilde = self.impulse.forward(x)?;
        if self.cfg.tanh_impulse {
            h_tilde = h_tilde.tanh()?;
        }
        let a = z.affine(-1.0, 1.0)?;
        linear_scan(&a, &(z * h_tilde)?, None, ScanOptions::default())
    }
}
