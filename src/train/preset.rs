//! The reference's hyper-parameters per task (`myo train --preset TASK`): S5's Table 11
//! (Smith et al., Appendix G.2) and its LRA run scripts (docs/reference.md) — depth, width H, latent
//! size P, HiPPO blocks J, dropout, learning rates, batch size, epochs, weight decay, and the
//! task-specific choices of G.3 (C initialisation, activation, post-norm for psMNIST, causal
//! models for sMNIST/psMNIST and the pendulum, LayerNorm, post-norm and S5's step range for the
//! pendulum). Myo
//! takes the same settings with heads = P (Myosotis §5).
//! zMNIST and zCIFAR use the sMNIST and sCIFAR settings (Morton order only changes the input).

use crate::nn::{Activation, CInit, Decoder, DenseInit, NormKind, S5Groups};

/// One task's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    pub layers: usize,
    pub d_model: usize,
    /// S5 latent size P (Myo heads).
    pub state: usize,
    /// HiPPO-N blocks J.
    pub blocks: usize,
    pub dropout: f64,
    /// Global learning rate (lr_factor × ssm_lr).
    pub lr: f64,
    pub ssm_lr: f64,
    pub batch_size: usize,
    pub epochs: usize,
    pub weight_decay: f64,
    pub bidirectional: bool,
    pub c_init: CInit,
    pub activation: Activation,
    pub clip_eigs: bool,
    pub norm: NormKind,
    /// BatchNorm's running-average decay (`bn_momentum`).
    pub bn_momentum: f64,
    pub prenorm: bool,
    /// Linear warm-up length in epochs (the reference's `warmup_end`).
    pub warmup_epochs: usize,
    /// The lower end of S5's initial step range [dt_min, 0.1].
    pub dt_min: f64,
    /// S5's Δ learns with the regular group (the reference's `dt_global`).
    pub dt_global: bool,
    /// S5's B̃ and C̃ groups (the reference's `opt_config`).
    pub groups: S5Groups,
    /// A regression's decoder.
    pub decoder: Decoder,
    /// How the dense and convolution layers start.
    pub dense_init: DenseInit,
}

/// The preset of `task`, or `None` for an unknown name.
pub fn preset(task: &str) -> Option<Preset> {
    // (layers, H, P, J, dropout, lr, ssm_lr, batch, epochs, wd)
    type Row = (usize, usize, usize, usize, f64, f64, f64, usize, usize, f64);
    let base = |r: Row| Preset {
        layers: r.0,
        d_model: r.1,
        state: r.2,
        blocks: r.3,
        dropout: r.4,
        lr: r.5,
        ssm_lr: r.6,
        batch_size: r.7,
        epochs: r.8,
        weight_decay: r.9,
        bidirectional: true,
        c_init: CInit::TruncStandardNormal,
        activation: Activation::HalfGlu1,
        clip_eigs: false,
        norm: NormKind::Batch,
        bn_momentum: crate::nn::BN_MOMENTUM,
        prenorm: true,
        warmup_epochs: 1,
        dt_min: 0.001,
        dt_global: false,
        groups: S5Groups::Standard,
        decoder: Decoder::Linear,
        dense_init: DenseInit::Uniform,
    };
    let image: Row = (6, 512, 384, 3, 0.1, 0.0045, 0.001, 50, 250, 0.07);
    let p = match task {
        // The groups of B̃ and C̃ follow the reference's scripts (G.3.1, G.3.4, G.3.6, G.3.7).
        "listops" => Preset {
            groups: S5Groups::BFastAndCDecay,
            c_init: CInit::LecunNormal,
            activation: Activation::HalfGlu2,
            ..base((8, 128, 16, 8, 0.0, 0.003, 0.001, 50, 40, 0.04))
        },
        // Text and Retrieval: the reference's scripts learn Δ with the regular group.
        "text" => Preset {
            c_init: CInit::LecunNormal,
            activation: Activation::HalfGlu2,
            warmup_epochs: 0,
            dt_global: true,
            ..base((6, 256, 192, 12, 0.1, 0.004, 0.001, 50, 35, 0.07))
        },
        "retrieval" => Preset {
            dt_global: true,
            ..base((6, 128, 256, 16, 0.0, 0.002, 0.001, 32, 20, 0.05))
        },
        "pathfinder" => Preset {
            bn_momentum: 0.9,
            ..base((6, 192, 256, 8, 0.05, 0.0045, 0.0009, 64, 200, 0.03))
        },
        "pathx" => Preset {
            groups: S5Groups::BAndCDecay,
            c_init: CInit::ComplexNormal,
            ..base((6, 128, 256, 16, 0.0, 0.0018, 0.0006, 32, 75, 0.06))
        },
        "lra-image" | "scifar" | "zcifar" => Preset {
            groups: S5Groups::BFastAndCDecay,
            c_init: CInit::LecunNormal,
            clip_eigs: true,
            ..base(image)
        },
        "smnist" | "zmnist" => Preset {
            bidirectional: false,
            ..base((4, 96, 128, 1, 0.1, 0.008, 0.002, 50, 150, 0.01))
        },
        "psmnist" => Preset {
            bidirectional: false,
            prenorm: false,
            ..base((4, 128, 128, 2, 0.15, 0.004, 0.001, 50, 150, 0.01))
        },
        "speech" => Preset {
            groups: S5Groups::NoBcDecay,
            ..base((6, 96, 128, 16, 0.1, 0.008, 0.002, 16, 40, 0.04))
        },
        // The reference's pendulum script: half_glu2, a step range from 0.01, and its model's
        // Gaussian decoders (G.3.8) and Flax's initialisation of its dense and convolution layers.
        "pendulum" => Preset {
            bidirectional: false,
            decoder: Decoder::Gaussian,
            dense_init: DenseInit::Lecun,
            activation: Activation::HalfGlu2,
            dt_min: 0.01,
            norm: NormKind::Layer,
            prenorm: false,
            ..base((4, 30, 16, 8, 0.0, 0.012, 0.003, 32, 100, 0.0))
        },
        _ => return None,
    };
    Some(p)
}

/// The tasks that have a preset.
pub const TASKS: [&str; 13] = [
    "listops",
    "text",
    "retrieval",
    "pathfinder",
    "pathx",
    "lra-image",
    "scifar",
    "zcifar",
    "smnist",
    "zmnist",
    "psmnist",
    "speech",
    "pendulum",
];
