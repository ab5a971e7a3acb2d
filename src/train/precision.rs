//! Mixed precision (`--precision`): the parameters and AdamW's moments stay f32 (the master
//! copy, which checkpoints hold), and a second copy of the model in f16 or bf16 runs the
//! forward and backward passes. AdamW's kernel reads the compute copy's gradients in their
//! dtype (or their f32 sums over a batch's parts) and writes each stepped master parameter,
//! rounded, into the compute copy, which shares the BatchNorm running averages (f32, updated by
//! the forward pass) with the master ([`super::optim::Optimizer::mirror`]).
//!
//! f16's range is narrow (largest 65,504, smallest normal 6.1e-5), so its gradients are those
//! of the loss times a scale ([`LossScaler`], as PyTorch's `GradScaler`): a step whose scaled
//! gradients are not all finite is skipped and the scale halved; after
//! [`LossScaler::GROWTH_INTERVAL`] clean steps it doubles. bf16 has f32's range and needs none.

use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

/// The dtype a training step computes in.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Whether it trains a compute copy beside the f32 master.
    pub fn is_mixed(self) -> bool {
        self != Precision::F32
    }

    /// Refuses bf16 on a CUDA device older than compute capability 8.0 (a V100), or with a
    /// build for one: candle builds its bf16 arithmetic for 8.0 and later only. f16 is such a
    /// card's mixed precision.
    pub fn check(self, device: &Device) -> Result<()> {
        if self != Precision::Bf16 {
            return Ok(());
        }
        match crate::device::compute_capability(device)? {
            Some((major, minor)) if major < 8 => candle_core::bail!(
                "--precision bf16: the GPU is compute capability {major}.{minor}, and bf16 \
                 needs 8.0 or later (A100, H100); use --precision f16"
            ),
            #[cfg(feature = "cuda")]
            Some(_) if (1..80).contains(&crate::cuda::built_for()) => candle_core::bail!(
                "--precision bf16: this build's CUDA kernels are for compute capability {:.1}, \
                 which has no bf16 arithmetic; use --precision f16, or a build for 8.0 or later",
                crate::cuda::built_for() as f64 / 10.0
            ),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

/// Dynamic loss scaling: the objective is multiplied by `scale` before the backward pass, and
/// the gradients divided by it in the optimiser step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub clean: usize,
    /// Steps skipped so far for gradients that were not finite.
    pub skipped: usize,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: Self::INITIAL,
            clean: 0,
            skipped: 0,
        }
    }
}

impl LossScaler {
    /// PyTorch's defaults: 2¹⁶, doubled after 2,000 clean steps.
    pub const INITIAL: f64 = 65536.0;
    pub const GROWTH_INTERVAL: usize = 2000;

    /// Records a step whose scaled gradients were `finite` (or not, and skipped).
    pub fn update(&mut self, finite: bool) {
        if finite {
            self.clean += 1;
            if self.clean == Self::GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.clean = 0;
            }
        } else {
            self.scale *= 0.5;
            self.clean = 0;
            self.skipped += 1;
        }
    }

    /// As a checkpoint tensor: [scale, clean, skipped], f64.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::new(
            &[self.scale, self.clean as f64, self.skipped as f64],
            device,
        )
    }

    pub fn from_tensor(t: &Tensor) -> Result<Self> {
        let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        match v[..] {
            [scale, clean, skipped] if scale > 0.0 && scale.is_finite() => Ok(LossScaler {
                scale,
                clean: clean as usize,
                skipped: skipped as usize,
            }),
            _ => candle_core::bail!(
                "the loss scaler's state {v:?} is not [scale > 0, clean, skipped]"
            ),
        }
    }
}
