//! The flags of a run (`myo train`, `myo bench step`): [`RunArgs`], which
//! [`RunArgs::resolve`] turns into a [`RunConfig`](super::config::RunConfig).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser, ValueEnum};

use super::config::Monitor;
use super::precision::Precision;
use super::preset;
use crate::data::task::TreeShape;
use crate::nn::*;

/// The sequence layer of the classifier's blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ModelKind {
    /// S5: a diagonal complex state-space layer run by a parallel scan.
    #[default]
    S5,
    /// Myo: T_G⁻¹ over a tree on the sequence (Myosotis).
    Myo,
    /// minGRU: a gated linear recurrence.
    Mingru,
    /// The 2-D SSM over the image grid (raster-ordered image tasks).
    Ssm2d,
}

/// The flags of a run (`myo train`, `myo bench step`): those that define it ([`RunConfig`](super::config::RunConfig)),
/// and how often it logs and saves, which `--resume` carries over too; `None` takes the
/// preset's or the task's value, else the quick default named in the help.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// The sequence layer.
    #[arg(long, value_enum, default_value_t)]
    pub model: ModelKind,
    /// listops (generated unless --data-dir has basic_{train,val,test}.tsv), or with
    /// --data-dir: smnist, psmnist, zmnist (MNIST IDX), scifar, zcifar, lra-image (CIFAR-10
    /// binary), pathfinder, pathx (LRA folders), text (the IMDB folder aclImdb), retrieval (the
    /// LRA release's new_aan_pairs.*.tsv), speech (the Speech Commands folder), pendulum
    /// (pend_regression.npz, a regression at every step). [default: the --preset's task, else
    /// listops]
    #[arg(long)]
    pub task: Option<String>,
    /// The folder of the task's files (see --task).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// MNIST / CIFAR-10 tasks: fetch the data from the Hugging Face Hub (ylecun/mnist,
    /// uoft-cs/cifar10) into its cache instead of reading --data-dir; honours HF_HOME,
    /// HF_ENDPOINT and HF_HUB_OFFLINE.
    #[arg(long, conflicts_with = "data_dir")]
    pub hub: bool,
    /// Start from the reference's hyper-parameters for this task (S5 Table 11 and run scripts:
    /// listops, text, retrieval, pathfinder, pathx, lra-image, scifar, zcifar, smnist, zmnist,
    /// psmnist, speech, pendulum); the flags below override it. Without a preset the defaults are a small, quick model.
    #[arg(long)]
    pub preset: Option<String>,
    /// Passes over the training split. [default: 10]
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Examples per batch (the global batch, over all threads and ranks); an optimiser step
    /// takes --accumulate of them. [default: 32]
    #[arg(long, visible_alias = "batch")]
    pub batch_size: Option<usize>,
    /// Batches per optimiser step, taken one after the other with their gradients added: the
    /// step of a batch --accumulate times larger in the memory of one (BatchNorm normalises
    /// each batch by its own statistics). [default: 1]
    #[arg(long, value_name = "N")]
    pub accumulate: Option<usize>,
    /// The dtype the forward and backward passes compute in: f32, or bf16 / f16 with the
    /// parameters and AdamW's moments kept in f32 (f16 with dynamic loss scaling).
    #[arg(long, value_enum, default_value_t)]
    pub precision: Precision,
    /// Seeds the initialisation, the shuffling and dropout (and the generated ListOps).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Width H. [default: 64]
    #[arg(long)]
    pub d_model: Option<usize>,
    /// S5 latent size P; 2-D SSM states per axis. [default: 32]
    #[arg(long)]
    pub state_size: Option<usize>,
    /// Sequence-layer blocks. [default: 2]
    #[arg(long)]
    pub layers: Option<usize>,
    /// Myo heads. [default: the state size]
    #[arg(long)]
    pub heads: Option<usize>,
    /// Myo block size d (1: scalar complex heads). [default: 1]
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Myo's tree: quad (image tasks in Morton order), K-ary (e.g. 2-ary, 4-ary), arities per
    /// level K1,K2,… (the last repeated up to the root; 4,7,4,7 follows the rows of a 28 × 28
    /// image in raster order) or chain (Myo as a state-space model). [default: the task's: quad for zmnist and zcifar, 2-ary for
    /// listops and pathx, 4-ary for the other images]
    #[arg(long)]
    pub tree: Option<TreeShape>,
    /// Myo: how the couplings enter T_G: skew (the paper's solve: I + skew-Hermitian, B
    /// unbounded), hermitian (C = B†, diagonally dominant: |B| < 1/(1 + children)) or free (C
    /// its own parameter, dominant). [default: skew]
    #[arg(long, value_enum)]
    pub coupling: Option<Coupling>,
    /// Myo, skew coupling: the range LOW:HIGH of the heads' initial |B|. [default: the task's:
    /// 0.3:30 for smnist, else 0.1:10]
    #[arg(long)]
    pub coupling_init: Option<String>,
    /// Myo, skew coupling: start every coupling of a head with the same phase instead of one
    /// that grows with the node's offset in its parent (siblings then start interchangeable).
    #[arg(long)]
    pub uniform_phase: bool,
    /// Myo: couplings per BFS level instead of per node.
    #[arg(long)]
    pub per_level: bool,
    /// Myo: run the blocks over all tree nodes in BFS order (paper §3.2), so the virtual nodes
    /// carry features from layer to layer; false: over the leaves, with learned constant inputs
    /// at the virtual nodes (a quarter fewer positions on a 4-ary tree, half on a binary one;
    /// 1.7 and 1.9 points lower on sMNIST and zMNIST: docs/experiments.md). [default: true]
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub all_nodes: Option<bool>,
    /// S5 HiPPO-N blocks J. [default: state size / 8]
    #[arg(long)]
    pub blocks: Option<usize>,
    /// S5: also scan in reverse. [default: false for smnist and psmnist (causal, as S5), else
    /// true]
    #[arg(long)]
    pub bidirectional: Option<bool>,
    /// S5: how the continuous system is discretised. [default: zoh]
    #[arg(long, value_enum)]
    pub discretization: Option<Discretization>,
    /// S5 on series sampled at irregular times (--task pendulum): continuous (each step
    /// discretised with its own interval), drop (the steps taken as equally spaced) or append
    /// (the frame encoder reads each interval as one more feature). [default: continuous]
    #[arg(long, value_enum)]
    pub timing: Option<Timing>,
    /// S5: the range [MIN, MAX] of the initial steps Δ, log-uniform. [default: 0.001 (0.01 for
    /// the pendulum preset)]
    #[arg(long)]
    pub dt_min: Option<f64>,
    /// S5: the upper end of the initial steps' range. [default: 0.1]
    #[arg(long)]
    pub dt_max: Option<f64>,
    /// S5: Δ learns at the global learning rate with weight decay, not with the SSM
    /// parameters. [default: true for the text and retrieval presets, else false]
    #[arg(long)]
    pub dt_global: Option<bool>,
    /// S5: the optimiser groups of B̃ and C̃ (the reference's opt_config): standard (B̃ at the
    /// SSM learning rate without weight decay, C̃ and D at the global one with it),
    /// b_and_c_decay (B̃ also decayed), b_fast_and_c_decay (B̃ with C̃), no_bc_decay (B̃, C̃ and D
    /// with the SSM parameters). [default: the preset's, else standard]
    #[arg(long, value_enum)]
    pub s5_groups: Option<S5Groups>,
    /// S5: C's initialisation. [default: trunc_standard_normal]
    #[arg(long, value_enum)]
    pub c_init: Option<CInit>,
    /// S5: clamp Re(λ) ≤ −1e-4.
    #[arg(long)]
    pub clip_eigs: Option<bool>,
    /// 2-D SSM: scan directions, 1, 2 or 4. [default: 4]
    #[arg(long)]
    pub directions: Option<usize>,
    /// The blocks' normalisation. [default: layer; presets: batch]
    #[arg(long, value_enum)]
    pub norm: Option<NormKind>,
    /// Normalise after the residual instead of before the layer.
    #[arg(long)]
    pub postnorm: Option<bool>,
    /// BatchNorm's running-average decay m (running = m·running + (1−m)·batch).
    /// [default: 0.95; pathfinder preset: 0.9]
    #[arg(long)]
    pub bn_momentum: Option<f64>,
    /// The blocks' activation after the sequence layer. [default: half_glu2]
    #[arg(long, value_enum)]
    pub activation: Option<Activation>,
    /// How the sequence becomes one vector for the classifier: mean, last, root (Myo) or top:K
    /// (Myo: the mean over the top K BFS levels, paper §3.2); none for a regression at every
    /// step (pendulum). [default: none for pendulum; root for Myo (the paper's classification
    /// node; on zMNIST it learned twice as fast as mean pooling), mean otherwise]
    #[arg(long)]
    pub pooling: Option<Pooling>,
    /// A regression's readout at every step: linear (trained by the mean squared error) or
    /// gaussian (a mean and a variance per output, trained by their negative log-likelihood, as
    /// S5 on the pendulum); the mean squared error of the mean is what is reported and
    /// monitored either way. [default: gaussian with the pendulum preset, else linear]
    #[arg(long, value_enum)]
    pub decoder: Option<Decoder>,
    /// How the encoder's, the GLUs' and the decoder's dense (and convolution) layers start:
    /// uniform (PyTorch's U(±1/√fan_in), bias too) or lecun (Flax's, as the S5 reference: a
    /// truncated normal of variance 1/fan_in, bias zero). [default: lecun with the pendulum
    /// preset, else uniform]
    #[arg(long, value_enum)]
    pub dense_init: Option<DenseInit>,
    /// Dropout rate after each block's activation (one mask across time). [default: 0]
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Learning rate of the SSM parameters. [default: 0.003]
    #[arg(long)]
    pub ssm_lr: Option<f64>,
    /// Learning rate of the other parameters. [default: 3 x --ssm-lr]
    #[arg(long)]
    pub lr: Option<f64>,
    /// AdamW's weight decay of the non-SSM parameters. [default: 0.04]
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Linear warm-up steps. [default: 50; presets: one epoch]
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Clip the global gradient norm to this value. [default: no clipping]
    #[arg(long)]
    pub clip: Option<f64>,
    /// Stop once the validation result (--monitor) has not improved in PATIENCE evaluations:
    /// epochs, or with --eval-every also those within epochs. [default: never]
    #[arg(long, value_name = "PATIENCE")]
    pub early_stop: Option<usize>,
    /// Also evaluate on the validation split every STEPS optimiser steps within an epoch (the
    /// best checkpoint and --early-stop then count these evaluations too). [default: at the end
    /// of each epoch only]
    #[arg(long, value_name = "STEPS")]
    pub eval_every: Option<usize>,
    /// The validation result that makes the best checkpoint and that --early-stop watches:
    /// the highest accuracy or the lowest loss. [default: accuracy; loss (the mean squared
    /// error) for pendulum]
    #[arg(long, value_enum)]
    pub monitor: Option<Monitor>,
    /// Train on the first N examples of the training split only. [default: all]
    #[arg(long, value_name = "N")]
    pub max_train_samples: Option<usize>,
    /// Validate and test on the first N examples of those splits only. [default: all]
    #[arg(long, value_name = "N")]
    pub max_eval_samples: Option<usize>,
    /// Optimiser steps between step records in metrics.jsonl (loss, accuracy, learning rate,
    /// gradient norm, samples/s); 0: none.
    #[arg(long, value_name = "STEPS", default_value_t = 50)]
    pub log_every: usize,
    /// Also write last.safetensors every STEPS optimiser steps within an epoch: a run killed
    /// mid-epoch resumes from there, exactly as from the end of an epoch. [default: at the end
    /// of each epoch only]
    #[arg(
        long,
        value_name = "STEPS",
        default_value_t = 0,
        hide_default_value = true
    )]
    pub save_every: usize,
    /// On CUDA, capture the training step as a CUDA graph (one per batch shape) and replay it,
    /// so that the GPU does not wait on the host between kernels; the same steps to the bit.
    /// Steps with f16, --accumulate or several ranks run eagerly. false: every step eagerly.
    /// (`myo bench step` times the captured step beside the eager one.)
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graph: bool,
}

/// Run flags parsed alone; a flag given twice takes its last value (an earlier run's flags come
/// first, those given now after them).
#[derive(Parser)]
#[command(no_binary_name = true, args_override_self = true)]
struct Flags {
    #[command(flatten)]
    args: RunArgs,
}

impl Default for RunArgs {
    /// The defaults of `myo train` with no flags.
    fn default() -> Self {
        Flags::parse_from(std::iter::empty::<String>()).args
    }
}

impl RunArgs {
    /// The flags of a command line, e.g. `["--task", "zmnist", "--model", "myo"]`.
    pub fn from_flags<I: IntoIterator<Item = T>, T: Into<std::ffi::OsString> + Clone>(
        flags: I,
    ) -> Result<Self> {
        Ok(Flags::try_parse_from(flags)?.args)
    }

    /// The task's name: `--task`, else the preset's task, else listops. A preset is one task's
    /// settings, so a preset of another task is refused.
    pub fn task_name(&self) -> Result<&str> {
        match (&self.task, &self.preset) {
            (Some(t), Some(p)) if t != p => bail!(
                "--preset {p} holds task {p}'s settings, not --task {t}'s{}",
                if preset::TASKS.contains(&t.as_str()) {
                    format!(" (use --preset {t})")
                } else {
                    String::new()
                }
            ),
            (Some(t), _) => Ok(t),
            (None, Some(p)) => Ok(p),
            (None, None) => Ok("listops"),
        }
    }
}
