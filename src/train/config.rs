//! What defines a run ([`RunConfig`]), and how the flags of `myo train` resolve into one
//! ([`RunArgs::resolve`]): each setting comes from its flag, else the `--preset`, else the task
//! (Myo's tree, S5's direction, the encoder, the classes), else the quick defaults of a small
//! model that trains in minutes on a CPU.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use super::optim::OptimConfig;
use super::preset::{self, Preset};
use super::trainer::{Batching, Evaluation};
use crate::data::task::{self, DataSource, Generated, Input, Order, Task, TreeShape};
use crate::nn::*;

/// Everything that defines a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub task: Task,
    pub data: DataSource,
    pub model: ClassifierConfig,
    pub optim: OptimConfig,
    pub epochs: usize,
    pub batch_size: usize,
    pub seed: u64,
    pub max_train_samples: Option<usize>,
    pub max_eval_samples: Option<usize>,
    /// Warm-up in epochs (the reference's `warmup_end`), replacing `optim.warmup_steps`.
    #[serde(default)]
    pub warmup_epochs: Option<usize>,
    /// Stop once the validation result ([`RunConfig::monitor`]) has not improved for this many
    /// evaluations (epochs, without `eval_every`).
    #[serde(default)]
    pub early_stop: Option<usize>,
    /// Also evaluate on the validation split every this many optimiser steps within an epoch.
    #[serde(default)]
    pub eval_every: Option<usize>,
    /// What makes a validation result the best: the best checkpoint and early stopping follow it.
    #[serde(default)]
    pub monitor: Monitor,
    /// Micro-batches of `batch_size` per optimiser step, their gradients added.
    #[serde(default = "one")]
    pub accumulate: usize,
}

fn one() -> usize {
    1
}

/// What makes a validation result better than another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Monitor {
    /// A higher accuracy.
    #[default]
    Accuracy,
    /// A lower loss.
    Loss,
}

impl Monitor {
    /// Whether the validation result `val` improves on `best`.
    pub fn improves(self, val: Evaluation, best: Evaluation) -> bool {
        match self {
            Monitor::Accuracy => val.accuracy > best.accuracy,
            Monitor::Loss => val.loss < best.loss,
        }
    }
}

impl RunConfig {
    /// Checks that the model reads the task's sequences as the task describes them (the
    /// encoder, the classes, Myo's tree, the 2-D SSM's grid), at most [`task::MAX_LEN`] long:
    /// sizes that no tensor of a checkpoint stores, so a config read from a file is checked
    /// here before a model is built by them.
    pub fn check_model(&self) -> Result<()> {
        let (task, model) = (&self.task, &self.model);
        let len = task.max_len();
        if len > task::MAX_LEN {
            bail!(
                "task {}: sequences of {len} steps; at most {} are supported",
                task.name,
                task::MAX_LEN
            );
        }
        if model.encoder != task.encoder() {
            bail!(
                "the model's encoder reads {}, not task {}'s inputs ({})",
                model.encoder,
                task.name,
                task.encoder()
            );
        }
        if model.classes != task.classes {
            bail!(
                "the model has {} classes, task {} has {}",
                model.classes,
                task.name,
                task.classes
            );
        }
        match &model.layer {
            SeqLayerConfig::Myo(m) if m.tree != task.tree_spec()? => bail!(
                "the model's tree, a {}, is not task {}'s ({})",
                m.tree,
                task.name,
                task.tree_spec()?
            ),
            SeqLayerConfig::Ssm2d(s) => match task.pixels() {
                Some(p) if (s.height, s.width) == (p.side, p.side) => {}
                _ => bail!(
                    "the 2-D SSM's {} x {} grid is not task {}'s images",
                    s.height,
                    s.width,
                    task.name
                ),
            },
            _ => {}
        }
        Ok(())
    }

    /// How batches are cut; `shards` data-parallel parts in training.
    pub fn batching(&self, shards: usize, training: bool) -> Batching {
        // Myo needs every sequence on the tree's leaves, or on every node of a chain.
        let pad_to = match &self.model.layer {
            SeqLayerConfig::Myo(m) => m.tree.build().ok().map(|t| match m.tree {
                TreeSpec::Chain { len } => len,
                _ => t.leaves(),
            }),
            _ => None,
        };
        Batching {
            batch_size: self.batch_size,
            pad_to,
            shards: shards.max(1),
            accumulate: if training { self.accumulate.max(1) } else { 1 },
            batch_norm: training && self.model.norm == NormKind::Batch,
        }
    }
}

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

/// The flags of a run (`myo train`, `myo bench step`): those that define it ([`RunConfig`]),
/// and how often it logs and saves, which `--resume` carries over too; `None` takes the
/// preset's or the task's value, else the quick default named in the help.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// The sequence layer.
    #[arg(long, value_enum, default_value_t)]
    pub model: ModelKind,
    /// listops (generated unless --data-dir has basic_{train,val,test}.tsv), or with
    /// --data-dir: smnist, psmnist, zmnist (MNIST IDX), scifar, zcifar, lra-image (CIFAR-10
    /// binary), pathfinder, pathx (LRA folders). [default: the --preset's task, else listops]
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
    /// listops, pathfinder, pathx, lra-image, scifar, zcifar, smnist, zmnist, psmnist); the
    /// flags below override it. Without a preset the defaults are a small, quick model.
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
    /// How the sequence becomes one vector for the classifier: mean, last, root (Myo) or top:K (Myo: the mean over the top K BFS levels, paper §3.2).
    /// [default: root for Myo (the paper's classification node; on zMNIST it learned twice as
    /// fast as mean pooling), mean otherwise]
    #[arg(long)]
    pub pooling: Option<Pooling>,
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
    /// the highest accuracy or the lowest loss. [default: accuracy]
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

    /// The run these flags describe: flags over the preset over the task over the quick
    /// defaults.
    pub fn resolve(&self) -> Result<RunConfig> {
        let preset = match &self.preset {
            Some(p) => Some(preset::preset(p).with_context(|| {
                format!("--preset {p}: expected one of {}", preset::TASKS.join(", "))
            })?),
            None => None,
        };
        self.refuse_ignored(preset.as_ref())?;
        let p = preset.as_ref();
        let pick = |flag: Option<usize>, from: fn(&Preset) -> usize, quick: usize| {
            flag.or(p.map(from)).unwrap_or(quick)
        };
        let pickf = |flag: Option<f64>, from: fn(&Preset) -> f64, quick: f64| {
            flag.or(p.map(from)).unwrap_or(quick)
        };
        let d_model = pick(self.d_model, |p| p.d_model, 64);
        let state = pick(self.state_size, |p| p.state, 32);
        let layers = pick(self.layers, |p| p.layers, 2);
        let epochs = pick(self.epochs, |p| p.epochs, 10);
        let batch_size = pick(self.batch_size, |p| p.batch_size, 32);
        let dropout = pickf(self.dropout, |p| p.dropout, 0.0);
        let bn_momentum = pickf(self.bn_momentum, |p| p.bn_momentum, BN_MOMENTUM);
        let ssm_lr = pickf(self.ssm_lr, |p| p.ssm_lr, 0.003);
        let lr = self.lr.or(p.map(|p| p.lr)).unwrap_or(3.0 * ssm_lr);
        let weight_decay = pickf(self.weight_decay, |p| p.weight_decay, 0.04);
        for (name, v) in [
            ("--d-model", d_model),
            ("--state-size", state),
            ("--layers", layers),
            ("--epochs", epochs),
            ("--batch-size", batch_size),
            ("--heads", self.heads.unwrap_or(1)),
            ("--block-size", self.block_size.unwrap_or(1)),
            ("--blocks", self.blocks.unwrap_or(1)),
            ("--max-train-samples", self.max_train_samples.unwrap_or(1)),
            ("--max-eval-samples", self.max_eval_samples.unwrap_or(1)),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1");
            }
        }
        if let Some(j) = self.blocks.filter(|j| !state.is_multiple_of(*j)) {
            bail!("--blocks {j}: the state size {state} must be a multiple of the blocks");
        }
        if let Some(d) = self.directions.filter(|d| ![1, 2, 4].contains(d)) {
            bail!("--directions {d}: expected 1, 2 or 4");
        }
        if !(0.0..1.0).contains(&dropout) {
            bail!("--dropout {dropout}: expected a rate in [0, 1)");
        }
        if !(0.0..1.0).contains(&bn_momentum) {
            bail!("--bn-momentum {bn_momentum}: expected a decay in [0, 1)");
        }
        let (mut task, data) = self.task_and_data()?;
        if let Some(tree) = &self.tree {
            task.tree = tree.clone();
        }
        let bidirectional = self
            .bidirectional
            .or(p.map(|p| p.bidirectional))
            .unwrap_or(!task.causal);
        let layer = match self.model {
            ModelKind::S5 => SeqLayerConfig::S5(S5Config {
                d_model,
                state,
                blocks: self
                    .blocks
                    .or(p.map(|p| p.blocks))
                    .unwrap_or((state / 8).max(1)),
                bidirectional,
                c_init: self
                    .c_init
                    .or(p.map(|p| p.c_init))
                    .unwrap_or(CInit::TruncStandardNormal),
                clip_eigs: self.clip_eigs.or(p.map(|p| p.clip_eigs)).unwrap_or(false),
                discretization: self.discretization.unwrap_or(Discretization::Zoh),
                seed: self.seed,
                ..S5Config::default()
            }),
            ModelKind::Myo => {
                let defaults =
                    MyoConfig::new(d_model, self.heads.unwrap_or(state), task.tree_spec()?);
                SeqLayerConfig::Myo(MyoConfig {
                    per_level: self.per_level,
                    coupling: self.coupling.unwrap_or(Coupling::Skew),
                    coupling_init: match &self.coupling_init {
                        None => task.coupling_init.unwrap_or(defaults.coupling_init),
                        Some(r) => parse_range(r).with_context(|| {
                            format!("--coupling-init {r}: expected LOW:HIGH with 0 < LOW ≤ HIGH")
                        })?,
                    },
                    position_phase: !self.uniform_phase,
                    all_nodes: match (self.all_nodes, task.tree == TreeShape::Chain) {
                        (Some(false), true) => bail!(
                            "--all-nodes false: a chain has one leaf, so the sequence sits on \
                             every node of it"
                        ),
                        (a, _) => a.unwrap_or(true),
                    },
                    block: self.block_size.unwrap_or(1),
                    seed: self.seed,
                    ..defaults
                })
            }
            ModelKind::Mingru => SeqLayerConfig::MinGru(MinGruConfig {
                d_model,
                hidden: d_model,
                tanh_impulse: false,
                seed: self.seed,
            }),
            ModelKind::Ssm2d => {
                let side = match task.pixels() {
                    Some(px) if px.order == Order::Raster => px.side,
                    _ => bail!(
                        "--model ssm2d runs on the image grid: it needs an image task in raster \
                         order (smnist, scifar, lra-image, pathfinder, pathx), not {}",
                        task.name
                    ),
                };
                SeqLayerConfig::Ssm2d(Ssm2dConfig {
                    d_model,
                    state,
                    height: side,
                    width: side,
                    directions: self.directions.unwrap_or(4),
                    seed: self.seed,
                })
            }
        };
        let pooling = match self.pooling {
            Some(pooling) => pooling,
            None if self.model == ModelKind::Myo => Pooling::Root,
            None => Pooling::Mean,
        };
        let cfg = RunConfig {
            model: ClassifierConfig {
                encoder: task.encoder(),
                d_model,
                layers,
                layer,
                norm: self.norm.or(p.map(|p| p.norm)).unwrap_or(NormKind::Layer),
                prenorm: !self.postnorm.unwrap_or(p.is_some_and(|p| !p.prenorm)),
                activation: self
                    .activation
                    .or(p.map(|p| p.activation))
                    .unwrap_or(Activation::HalfGlu2),
                dropout,
                pooling,
                classes: task.classes,
                seed: self.seed,
                bn_momentum,
            },
            optim: OptimConfig {
                lr,
                ssm_lr,
                lr_min: 0.0,
                weight_decay,
                warmup_steps: self.warmup_steps.unwrap_or(50),
                total_steps: 0,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                clip: self.clip,
            },
            epochs,
            batch_size,
            seed: self.seed,
            max_train_samples: self.max_train_samples,
            max_eval_samples: self.max_eval_samples,
            // Presets warm up over one epoch, as the reference's warmup_end = 1.
            early_stop: match self.early_stop {
                Some(0) => bail!("--early-stop 0: the patience is at least 1 evaluation"),
                patience => patience,
            },
            eval_every: match self.eval_every {
                Some(0) => bail!("--eval-every 0: expected a number of steps ≥ 1"),
                steps => steps,
            },
            monitor: self.monitor.unwrap_or_default(),
            accumulate: match self.accumulate {
                Some(0) => bail!("--accumulate 0: expected at least 1 batch per step"),
                n => n.unwrap_or(1),
            },
            warmup_epochs: match (self.warmup_steps, p) {
                (None, Some(p)) => Some(p.warmup_epochs),
                _ => None,
            },
            task,
            data,
        };
        cfg.optim.check()?;
        cfg.check_model()?;
        Ok(cfg)
    }

    /// Refuses a flag that the chosen model would ignore, naming it and the models it is for.
    fn refuse_ignored(&self, preset: Option<&Preset>) -> Result<()> {
        use ModelKind::*;
        let flags: [(&str, bool, &[ModelKind]); 16] = [
            ("--heads", self.heads.is_some(), &[Myo]),
            ("--block-size", self.block_size.is_some(), &[Myo]),
            ("--tree", self.tree.is_some(), &[Myo]),
            ("--coupling", self.coupling.is_some(), &[Myo]),
            ("--coupling-init", self.coupling_init.is_some(), &[Myo]),
            ("--uniform-phase", self.uniform_phase, &[Myo]),
            ("--per-level", self.per_level, &[Myo]),
            ("--all-nodes", self.all_nodes.is_some(), &[Myo]),
            ("--blocks", self.blocks.is_some(), &[S5]),
            ("--bidirectional", self.bidirectional.is_some(), &[S5]),
            ("--discretization", self.discretization.is_some(), &[S5]),
            ("--c-init", self.c_init.is_some(), &[S5]),
            ("--clip-eigs", self.clip_eigs.is_some(), &[S5]),
            ("--directions", self.directions.is_some(), &[Ssm2d]),
            ("--state-size", self.state_size.is_some(), &[S5, Myo, Ssm2d]),
            (
                "--pooling root or top:K",
                matches!(
                    self.pooling,
                    Some(Pooling::Root | Pooling::TopLevels { .. })
                ),
                &[Myo],
            ),
        ];
        let name = |m: &ModelKind| m.to_possible_value().map(|v| v.get_name().to_string());
        for (flag, given, models) in flags {
            if given && !models.contains(&self.model) {
                let names: Vec<String> = models.iter().filter_map(name).collect();
                bail!(
                    "{flag} applies to --model {}, not {}: leave it out",
                    names.join(" or "),
                    name(&self.model).unwrap_or_default()
                );
            }
        }
        let norm = self
            .norm
            .or(preset.map(|p| p.norm))
            .unwrap_or(NormKind::Layer);
        if self.bn_momentum.is_some() && norm != NormKind::Batch {
            bail!("--bn-momentum applies to --norm batch: leave it out");
        }
        Ok(())
    }

    /// The task and where its data comes from.
    fn task_and_data(&self) -> Result<(Task, DataSource)> {
        let mut task = task::find(self.task_name()?)?;
        let listops = matches!(task.input, Input::Listops { .. });
        let data = match &self.data_dir {
            Some(dir) => DataSource::Dir { dir: dir.clone() },
            None if self.hub => {
                if task.hub_dataset().is_none() {
                    bail!(
                        "--hub serves the MNIST and CIFAR-10 tasks (smnist, psmnist, zmnist, \
                         scifar, zcifar, lra-image); --task {} reads --data-dir{}",
                        task.name,
                        if listops {
                            " or the built-in generator"
                        } else {
                            ""
                        }
                    );
                }
                DataSource::Hub
            }
            None if listops => {
                let generated = Generated::quick(self.seed);
                task.input = Input::Listops {
                    max_len: generated.max_length,
                };
                DataSource::Generated(generated)
            }
            None => bail!(
                "--task {} needs --data-dir (or --hub for MNIST and CIFAR-10): MNIST IDX files \
                 (train-images-idx3-ubyte, …), CIFAR-10 binary files (data_batch_1.bin, …) or \
                 the LRA Pathfinder folder (pathfinder32/curv_contour_length_14 with metadata/ \
                 and imgs/)",
                task.name
            ),
        };
        Ok((task, data))
    }
}

/// `LOW:HIGH` with 0 < LOW ≤ HIGH < ∞.
fn parse_range(r: &str) -> Option<[f64; 2]> {
    let (lo, hi) = r.split_once(':')?;
    let range: [f64; 2] = [lo.parse().ok()?, hi.parse().ok()?];
    let [lo, hi] = range;
    (lo > 0.0 && lo <= hi && hi.is_finite()).then_some(range)
}
