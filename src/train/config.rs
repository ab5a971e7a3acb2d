//! What defines a run ([`RunConfig`]), and how the flags of `myo train` resolve into one
//! ([`RunArgs::resolve`]): each setting comes from its flag, else the `--preset`, else the task
//! (Myo's tree, S5's direction, the encoder, the classes), else the quick defaults of a small
//! model that trains in minutes on a CPU.

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

pub use super::args::{ModelKind, RunArgs};
use super::optim::OptimConfig;
use super::precision::Precision;
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
    /// The dtype the training step computes in (the parameters stay f32).
    #[serde(default)]
    pub precision: Precision,
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
        if (model.pooling == Pooling::None) != task.regression() {
            bail!(
                "the model's pooling {} does not suit task {}, which {}",
                model.pooling,
                task.name,
                match task.regression() {
                    true => "regresses at every step (pooling none)",
                    false => "classifies sequences",
                }
            );
        }
        if model.pairs != task.pairs() {
            bail!(
                "the model reads {}, task {} has {}",
                ["one sequence per example", "pairs of sequences"][model.pairs as usize],
                task.name,
                ["one sequence per example", "pairs of sequences"][task.pairs() as usize]
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
            bucketed: true,
            longest: None,
            shards: shards.max(1),
            accumulate: if training { self.accumulate.max(1) } else { 1 },
            batch_norm: training && self.model.norm == NormKind::Batch,
        }
    }
}

impl RunArgs {
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
        let dt_min = pickf(self.dt_min, |p| p.dt_min, S5Config::default().dt_min);
        let dt_max = self.dt_max.unwrap_or(S5Config::default().dt_max);
        if !(dt_min > 0.0 && dt_min < dt_max && dt_max.is_finite()) {
            bail!("--dt-min {dt_min}, --dt-max {dt_max}: expected 0 < MIN < MAX < ∞");
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
                dt_min,
                dt_max,
                dt_global: self.dt_global.or(p.map(|p| p.dt_global)).unwrap_or(false),
                groups: self.s5_groups.or(p.map(|p| p.groups)).unwrap_or_default(),
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
        let regression = task.regression();
        let pooling = match self.pooling {
            Some(Pooling::None) if !regression => bail!(
                "--pooling none regresses at every step; task {} classifies sequences",
                task.name
            ),
            Some(p) if regression && p != Pooling::None => bail!(
                "--pooling {p}: task {} regresses at every step (--pooling none)",
                task.name
            ),
            Some(pooling) => pooling,
            None if regression => Pooling::None,
            None if self.model == ModelKind::Myo => Pooling::Root,
            None => Pooling::Mean,
        };
        let timing = match (self.timing, regression) {
            (Some(_), false) => bail!(
                "--timing applies to series sampled at irregular times (--task pendulum), not \
                 task {}",
                task.name
            ),
            (Some(t), true) => t,
            (None, true) if self.model == ModelKind::S5 => Timing::Continuous,
            (None, _) => Timing::Drop,
        };
        let monitor = match (self.monitor, regression) {
            (Some(Monitor::Accuracy), true) => bail!(
                "--monitor accuracy: task {} regresses values, it has a loss (the mean squared \
                 error) and no accuracy",
                task.name
            ),
            (Some(m), _) => m,
            (None, true) => Monitor::Loss,
            (None, false) => Monitor::Accuracy,
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
                timing,
                pairs: task.pairs(),
                decoder: match (self.decoder, regression) {
                    (Some(_), false) => bail!(
                        "--decoder applies to a regression at every step (--task pendulum), not \
                         task {}",
                        task.name
                    ),
                    (d, _) => d.or(p.map(|p| p.decoder)).unwrap_or_default(),
                },
                seed: self.seed,
                dense_init: self
                    .dense_init
                    .or(p.map(|p| p.dense_init))
                    .unwrap_or_default(),
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
            monitor,
            accumulate: match self.accumulate {
                Some(0) => bail!("--accumulate 0: expected at least 1 batch per step"),
                n => n.unwrap_or(1),
            },
            precision: self.precision,
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
        let flags: [(&str, bool, &[ModelKind]); 20] = [
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
            ("--dt-min", self.dt_min.is_some(), &[S5]),
            ("--dt-max", self.dt_max.is_some(), &[S5]),
            ("--dt-global", self.dt_global.is_some(), &[S5]),
            ("--s5-groups", self.s5_groups.is_some(), &[S5]),
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
            None if matches!(task.input, Input::Text { .. }) => bail!(
                "--task {} needs --data-dir: the IMDB folder (aclImdb, with train/ and test/)",
                task.name
            ),
            None if task.pairs() => bail!(
                "--task {} needs --data-dir: the LRA release's folder of {}",
                task.name,
                crate::data::text::AAN_FILES.join(", ")
            ),
            None if task.regression() => bail!(
                "--task {} needs --data-dir: a folder holding {} (write one with `myo data \
                 pendulum`)",
                task.name,
                crate::data::pendulum::FILE
            ),
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
