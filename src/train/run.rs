//! A training run as `myo train` performs it: data, model, optimiser, the epoch loop,
//! metrics and checkpoints in an output folder, resumable.
//!
//! Output folder:
//! * `config.json` — the [`RunConfig`] (also in every checkpoint's metadata);
//! * `metrics.jsonl` — one JSON object per evaluation: `epoch`, `split`, `loss`, `accuracy`,
//!   `step`, `seconds`;
//! * `last.safetensors` after every epoch — the model, and for `--resume` the optimiser's
//!   moments and the run's progress, in one atomic write, so a run killed at any moment resumes
//!   from its last complete epoch — and `best.safetensors` at the best validation accuracy.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use super::checkpoint;
use super::optim::{OptimConfig, Optimizer};
use super::pause;
use super::trainer::{evaluate, report_interval, train_epoch, Batching, Dataset, Evaluation};
use crate::data::listops::{self, ListOpsConfig};
use crate::nn::{ClassifierConfig, SeqLayerConfig, SequenceClassifier};

/// Where a run's data comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TaskConfig {
    /// ListOps from the built-in generator (the embedded default task).
    ListopsGenerated {
        train: usize,
        val: usize,
        test: usize,
        max_depth: usize,
        max_args: usize,
        min_length: usize,
        max_length: usize,
        seed: u64,
    },
    /// ListOps from LRA TSV files `basic_{train,val,test}.tsv` in `dir`.
    ListopsTsv { dir: PathBuf },
    /// An image benchmark as a pixel sequence (see [`ImageTask`]), from the files in `dir`.
    Image { task: ImageTask, dir: PathBuf },
    /// MNIST or CIFAR-10 tasks from the Hugging Face Hub (`--hub`; see [`crate::data::hub`]).
    ImageHub { task: ImageTask },
}

/// The image tasks: which dataset, how its pixels are normalised, and their order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ImageTask {
    /// MNIST, raster order.
    Smnist,
    /// MNIST, a fixed random permutation of the pixels (seed 92).
    Psmnist,
    /// MNIST, Morton order (its Myo tree: the 28 × 28 quad tree).
    Zmnist,
    /// CIFAR-10 RGB (3 channels, S5's normalisation), raster order.
    Scifar,
    /// CIFAR-10 RGB, Morton order.
    Zcifar,
    /// CIFAR-10 greyscale (LRA's normalisation), raster order.
    LraImage,
    /// LRA Pathfinder, 32 × 32 greyscale, raster order, 2 classes.
    Pathfinder,
    /// LRA Path-X, 128 × 128 greyscale, raster order, 2 classes.
    Pathx,
}

impl ImageTask {
    pub fn parse(name: &str) -> Option<ImageTask> {
        Some(match name {
            "smnist" => ImageTask::Smnist,
            "psmnist" => ImageTask::Psmnist,
            "zmnist" => ImageTask::Zmnist,
            "scifar" => ImageTask::Scifar,
            "zcifar" => ImageTask::Zcifar,
            "lra-image" => ImageTask::LraImage,
            "pathfinder" => ImageTask::Pathfinder,
            "pathx" => ImageTask::Pathx,
            _ => return None,
        })
    }

    fn mnist(self) -> bool {
        matches!(
            self,
            ImageTask::Smnist | ImageTask::Psmnist | ImageTask::Zmnist
        )
    }

    /// Image side and input features per pixel.
    pub fn shape(self) -> (usize, usize) {
        match self {
            ImageTask::Smnist | ImageTask::Psmnist | ImageTask::Zmnist => (28, 1),
            ImageTask::Scifar | ImageTask::Zcifar => (32, 3),
            ImageTask::LraImage | ImageTask::Pathfinder => (32, 1),
            ImageTask::Pathx => (128, 1),
        }
    }

    /// Number of classes.
    pub fn classes(self) -> usize {
        match self {
            ImageTask::Pathfinder | ImageTask::Pathx => 2,
            _ => 10,
        }
    }

    fn pathfinder(self) -> bool {
        matches!(self, ImageTask::Pathfinder | ImageTask::Pathx)
    }

    /// True when the pixels are in Morton order (the quad tree fits them).
    pub fn morton(self) -> bool {
        matches!(self, ImageTask::Zmnist | ImageTask::Zcifar)
    }

    /// Pixel order: sequence position → row-major pixel index.
    fn order(self) -> Vec<usize> {
        let (side, _) = self.shape();
        match self {
            ImageTask::Zmnist | ImageTask::Zcifar => {
                crate::tree::Ordering::morton(side, side)
                    .expect("valid side")
                    .perm
            }
            ImageTask::Psmnist => {
                use rand::seq::SliceRandom;
                let mut p: Vec<usize> = (0..side * side).collect();
                p.shuffle(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(92));
                p
            }
            _ => (0..side * side).collect(),
        }
    }

    /// The images as normalised pixel sequences.
    fn to_dataset(self, set: &crate::data::images::ImageSet, idx: &[usize]) -> Dataset {
        let (side, features) = self.shape();
        let order = self.order();
        let (mean, std): (Vec<f32>, Vec<f32>) = match self {
            _ if self.mnist() => (vec![0.1307], vec![0.3081]),
            ImageTask::LraImage => (vec![122.6 / 255.0], vec![61.0 / 255.0]),
            _ if self.pathfinder() => (vec![0.5], vec![0.5]),
            _ => (vec![0.4914, 0.4822, 0.4465], vec![0.247, 0.243, 0.261]),
        };
        let mut values = Vec::with_capacity(idx.len() * side * side * features);
        for &i in idx {
            let img = set.image(i);
            for &px in &order {
                let p = &img[px * set.channels..(px + 1) * set.channels];
                if self == ImageTask::LraImage {
                    let grey = 0.2989 * p[0] as f32 + 0.5870 * p[1] as f32 + 0.1140 * p[2] as f32;
                    values.push((grey / 255.0 - mean[0]) / std[0]);
                } else {
                    for c in 0..features {
                        values.push((p[c] as f32 / 255.0 - mean[c]) / std[c]);
                    }
                }
            }
        }
        Dataset::Real {
            values,
            len: side * side,
            features,
            labels: idx.iter().map(|&i| set.labels[i] as u32).collect(),
        }
    }

    /// Train (90% of the training images), validation (the other 10%, drawn with seed 42, as
    /// the reference) and test splits; Pathfinder and Path-X have one set of images, split
    /// 80/10/10 at random with seed 42 (as S5; the permutation is ours, not torch's).
    fn load(self, dir: &Path) -> Result<[Dataset; 3]> {
        use crate::data::images::{read_cifar10, read_mnist, CIFAR_TEST, CIFAR_TRAIN};
        use rand::seq::SliceRandom;
        if self.pathfinder() {
            use crate::data::pathfinder::{locate, read_pathfinder};
            let side = self.shape().0;
            let all = read_pathfinder(&locate(dir, side)?, side)?;
            let mut idx: Vec<usize> = (0..all.len()).collect();
            idx.shuffle(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(42));
            let (n_val, n_test) = (all.len() / 10, all.len() / 10);
            let (val, rest) = idx.split_at(n_val);
            let (test, train) = rest.split_at(n_test);
            return Ok([
                self.to_dataset(&all, train),
                self.to_dataset(&all, val),
                self.to_dataset(&all, test),
            ]);
        }
        let (train, test) = if self.mnist() {
            (read_mnist(dir, "train")?, read_mnist(dir, "t10k")?)
        } else {
            (
                read_cifar10(dir, &CIFAR_TRAIN)?,
                read_cifar10(dir, &CIFAR_TEST)?,
            )
        };
        Ok(self.split(&train, &test))
    }

    /// The dataset `--hub` fetches for this task, if any.
    pub fn hub_dataset(self) -> Option<crate::data::hub::HubDataset> {
        use crate::data::hub::HubDataset;
        match self {
            _ if self.mnist() => Some(HubDataset::Mnist),
            _ if self.pathfinder() => None,
            _ => Some(HubDataset::Cifar10),
        }
    }

    /// The splits from the Hub (see [`crate::data::hub::Hub::from_env`]).
    fn load_hub(self) -> Result<[Dataset; 3]> {
        let Some(dataset) = self.hub_dataset() else {
            anyhow::bail!(
                "--hub serves MNIST and CIFAR-10 only; {self:?} needs --data-dir (the LRA release)"
            );
        };
        let (train, test) = crate::data::hub::Hub::from_env().load(dataset)?;
        Ok(self.split(&train, &test))
    }

    /// Train (90% of `train`), validation (the other 10%, drawn with seed 42) and `test`.
    fn split(
        self,
        train: &crate::data::images::ImageSet,
        test: &crate::data::images::ImageSet,
    ) -> [Dataset; 3] {
        use rand::seq::SliceRandom;
        let mut idx: Vec<usize> = (0..train.len()).collect();
        idx.shuffle(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(42));
        let n_val = train.len() / 10;
        let (val_idx, train_idx) = idx.split_at(n_val);
        let all_test: Vec<usize> = (0..test.len()).collect();
        [
            self.to_dataset(train, train_idx),
            self.to_dataset(train, val_idx),
            self.to_dataset(test, &all_test),
        ]
    }
}

impl TaskConfig {
    /// The longest token sequence the task can produce (with EOS): the padding for Myo trees.
    pub fn max_tokens(&self) -> usize {
        match self {
            TaskConfig::ListopsGenerated { max_length, .. } => *max_length,
            TaskConfig::ListopsTsv { .. } => 2048,
            TaskConfig::Image { task, .. } | TaskConfig::ImageHub { task } => {
                task.shape().0 * task.shape().0
            }
        }
    }

    /// The train, validation and test splits.
    pub fn load(&self) -> Result<[Dataset; 3]> {
        let to_set = |examples: Vec<listops::Example>| Dataset::Tokens {
            seqs: examples
                .iter()
                .map(|e| listops::tokenize(&e.source))
                .collect(),
            labels: examples.iter().map(|e| e.label as u32).collect(),
        };
        match self {
            TaskConfig::ListopsGenerated {
                train,
                val,
                test,
                max_depth,
                max_args,
                min_length,
                max_length,
                seed,
            } => {
                let mut out = vec![];
                for (k, n) in [*train, *val, *test].into_iter().enumerate() {
                    // max_length counts tokens with EOS, so expressions stay one shorter
                    let cfg = ListOpsConfig {
                        max_depth: *max_depth,
                        max_args: *max_args,
                        min_length: *min_length,
                        max_length: max_length - 1,
                        seed: seed + k as u64,
                    };
                    let ex = listops::generate(&cfg, n)?
                        .iter()
                        .map(|e| listops::Example {
                            source: e.to_lra_string(),
                            label: e.value(),
                        })
                        .collect();
                    out.push(to_set(ex));
                }
                Ok(out.try_into().expect("three splits"))
            }
            TaskConfig::ListopsTsv { dir } => {
                let read =
                    |s: &str| listops::read_tsv(&dir.join(format!("basic_{s}.tsv"))).map(to_set);
                Ok([read("train")?, read("val")?, read("test")?])
            }
            TaskConfig::Image { task, dir } => task.load(dir),
            TaskConfig::ImageHub { task } => task.load_hub(),
        }
    }
}

/// Everything that defines a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub task: TaskConfig,
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
}

impl RunConfig {
    /// How batches are cut; `shards` data-parallel parts in training only without BatchNorm
    /// (whose batch statistics and running averages need the whole batch in one pass).
    fn batching(&self, shards: usize, training: bool) -> Batching {
        // Myo needs every sequence on the tree's leaves.
        let pad_to = match &self.model.layer {
            SeqLayerConfig::Myo(m) => m.tree.build().ok().map(|t| t.leaves()),
            _ => None,
        };
        let batch_norm = self.model.norm == crate::nn::NormKind::Batch;
        Batching {
            batch_size: self.batch_size,
            pad_to,
            shards: if training && batch_norm {
                1
            } else {
                shards.max(1)
            },
        }
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub epochs: usize,
    pub steps: usize,
    pub best_epoch: usize,
    pub best_val_accuracy: f64,
    /// Test accuracy of the best-validation model.
    pub test_accuracy: f64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Progress {
    epoch: usize,
    best_epoch: usize,
    best_val: f64,
    test_at_best: f64,
    /// Wall time so far: kept in `metrics.jsonl`, not in the checkpoint, whose bytes then
    /// depend on the training alone.
    #[serde(skip)]
    seconds: f64,
}

const PROGRESS_KEY: &str = "myosotis.progress";

fn frozen(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

fn build(model: &ClassifierConfig, device: &Device) -> Result<(VarMap, SequenceClassifier)> {
    let varmap = VarMap::new();
    let m = SequenceClassifier::new(
        model.clone(),
        VarBuilder::from_varmap(&varmap, DType::F32, device),
    )?;
    Ok((varmap, m))
}

fn vars(varmap: &VarMap) -> HashMap<String, candle_core::Var> {
    varmap
        .data()
        .lock()
        .expect("varmap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn append_metric(out: &Path, value: serde_json::Value) -> Result<()> {
    let path = out.join("metrics.jsonl");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{value}").with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Removes the temporary files that a run killed while writing leaves in `out` (a checkpoint's
/// `.NAME.PID.tmp`, `.metrics.jsonl.tmp`): they never hold anything the run still needs.
fn remove_stale_temporaries(out: &Path) -> Result<()> {
    let entries = std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = RUN_FILES
            .iter()
            .any(|f| name.starts_with(&format!(".{f}.")) && name.ends_with(".tmp"));
        if ours {
            std::fs::remove_file(entry.path())
                .with_context(|| format!("removing {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Keeps the records of `metrics.jsonl` up to epoch `epochs` (those a resumed run has in its
/// checkpoint), rewritten atomically; returns the wall time of the last one kept.
fn keep_metrics_until(out: &Path, epochs: usize) -> Result<f64> {
    let path = out.join("metrics.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(0.0);
    };
    let mut seconds = 0.0f64;
    let kept: String = text
        .lines()
        .filter(|l| {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                return false;
            };
            let keep = v["epoch"].as_u64().is_some_and(|e| e as usize <= epochs);
            if keep {
                seconds = seconds.max(v["seconds"].as_f64().unwrap_or(0.0));
            }
            keep
        })
        .map(|l| format!("{l}\n"))
        .collect();
    if kept.len() == text.len() {
        return Ok(seconds);
    }
    let tmp = out.join(".metrics.jsonl.tmp");
    std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(seconds)
}

/// Where and how a run executes; not part of the run's definition (a run resumed with other
/// settings is the same run, up to floating-point summation order).
#[derive(Clone, Debug)]
pub struct Exec {
    pub device: Device,
    /// Data-parallel shards per training batch (see [`Batching::shards`]).
    pub shards: usize,
}

impl Exec {
    /// One shard on `device`.
    pub fn on(device: &Device) -> Self {
        Exec {
            device: device.clone(),
            shards: 1,
        }
    }
}

/// What [`train`] reports while it runs (for progress bars and logs).
#[derive(Clone, Debug)]
pub enum Event {
    /// An epoch (1-based) of `batches` batches over `samples` examples begins.
    EpochStart {
        epoch: usize,
        epochs: usize,
        samples: usize,
        batches: usize,
    },
    /// A training batch: its size, mean loss and number of correct predictions.
    Batch {
        samples: usize,
        loss: f64,
        correct: usize,
    },
    /// Evaluation of a split ("val", "test") begins.
    Evaluating { split: &'static str },
    /// An epoch ended (`test` when validation improved), `seconds` since the run began.
    EpochEnd {
        epoch: usize,
        train: Evaluation,
        val: Evaluation,
        test: Option<Evaluation>,
        seconds: f64,
    },
}

/// How [`train`] treats what `out` already holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// A new run: `out` must not hold one already (its files are not mixed with another run's).
    New,
    /// Continue the run in `out` from its `last.safetensors`.
    Resume,
    /// A new run that first deletes the run files `out` holds.
    Replace,
}

/// The files of a run in its output folder.
const RUN_FILES: [&str; 5] = [
    "config.json",
    "metrics.jsonl",
    "curves.svg",
    "best.safetensors",
    "last.safetensors",
];

/// Trains `cfg` into `out`, started as `start` says. `on_event` sees the run's progress
/// ([`Event`]).
pub fn train(
    cfg: &RunConfig,
    out: &Path,
    exec: &Exec,
    start: Start,
    mut on_event: impl FnMut(Event),
) -> Result<Summary> {
    let device = &exec.device;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let held: Vec<&str> = RUN_FILES
        .into_iter()
        .filter(|f| out.join(f).exists())
        .collect();
    match start {
        Start::New if !held.is_empty() => bail!(
            "{} already holds a run ({}): continue it with --resume, replace it with \
             --overwrite, or choose another --out",
            out.display(),
            held.join(", ")
        ),
        Start::Replace => {
            for f in held {
                std::fs::remove_file(out.join(f))
                    .with_context(|| format!("removing {}", out.join(f).display()))?;
            }
        }
        _ => {}
    }
    let resume = start == Start::Resume;
    remove_stale_temporaries(out)?;
    let [train_set, val_set, test_set] = cfg.task.load()?;
    let cut = |d: Dataset, n: Option<usize>| match n {
        Some(n) => d.truncated(n),
        None => d,
    };
    let train_set = cut(train_set, cfg.max_train_samples);
    let (val_set, test_set) = (
        cut(val_set, cfg.max_eval_samples),
        cut(test_set, cfg.max_eval_samples),
    );
    if train_set.is_empty() || val_set.is_empty() || test_set.is_empty() {
        bail!(
            "a split is empty ({} / {} / {} examples)",
            train_set.len(),
            val_set.len(),
            test_set.len()
        );
    }
    let (varmap, model) = build(&cfg.model, device)?;
    let steps_per_epoch = train_set.len().div_ceil(cfg.batch_size.max(1));
    let optim_cfg = OptimConfig {
        total_steps: cfg.epochs * steps_per_epoch,
        warmup_steps: cfg
            .warmup_epochs
            .map_or(cfg.optim.warmup_steps, |e| e * steps_per_epoch),
        ..cfg.optim.clone()
    };
    let mut opt = Optimizer::new(optim_cfg, &vars(&varmap), frozen)?;
    let mut progress = Progress::default();
    let (last, best) = (out.join("last.safetensors"), out.join("best.safetensors"));
    if resume {
        let ck = checkpoint::read::<RunConfig>(&last)
            .context("--resume needs a previous run's last.safetensors")?;
        if ck.config != *cfg {
            bail!(
                "--resume: {} was written by a run with a different configuration",
                last.display()
            );
        }
        checkpoint::load_into(&varmap, &ck.tensors, &last)?;
        let json = ck.metadata.get(PROGRESS_KEY).with_context(|| {
            format!(
                "--resume: {} has no training progress (a `best` checkpoint, or one written \
                 before checkpoints held it)",
                last.display()
            )
        })?;
        progress = serde_json::from_str(json)
            .with_context(|| format!("{}: the progress record does not parse", last.display()))?;
        opt.load_state(&ck.optimizer)
            .with_context(|| format!("--resume: {}", last.display()))?;
        // Records of an epoch that did not reach its checkpoint are dropped: it runs again.
        progress.seconds = keep_metrics_until(out, progress.epoch)?;
    } else {
        std::fs::write(out.join("config.json"), serde_json::to_string_pretty(cfg)?)?;
    }
    let (train_batching, eval_batching) = (
        cfg.batching(exec.shards, true),
        cfg.batching(exec.shards, false),
    );
    let start = Instant::now() - std::time::Duration::from_secs_f64(progress.seconds);
    for epoch in progress.epoch..cfg.epochs {
        pause::set_epoch(epoch + 1);
        on_event(Event::EpochStart {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            samples: train_set.len(),
            batches: steps_per_epoch,
        });
        let tr = train_epoch(
            &model,
            &mut opt,
            &train_set,
            train_batching,
            cfg.seed.wrapping_add(epoch as u64),
            device,
            report_interval(device),
            |samples, loss, correct| {
                on_event(Event::Batch {
                    samples,
                    loss,
                    correct,
                })
            },
        )?;
        on_event(Event::Evaluating { split: "val" });
        let val = evaluate(&model, &val_set, eval_batching, device)?;
        let mut seconds = start.elapsed().as_secs_f64();
        for (split, e) in [("train", tr), ("val", val)] {
            append_metric(
                out,
                serde_json::json!({"epoch": epoch + 1, "split": split, "loss": e.loss, "accuracy": e.accuracy, "step": opt.step_count(), "seconds": seconds}),
            )?;
        }
        pause::point("metrics");
        let mut test = None;
        if epoch == 0 || val.accuracy > progress.best_val {
            on_event(Event::Evaluating { split: "test" });
            let t = evaluate(&model, &test_set, eval_batching, device)?;
            seconds = start.elapsed().as_secs_f64();
            append_metric(
                out,
                serde_json::json!({"epoch": epoch + 1, "split": "test", "loss": t.loss, "accuracy": t.accuracy, "step": opt.step_count(), "seconds": seconds}),
            )?;
            progress.best_val = val.accuracy;
            progress.best_epoch = epoch + 1;
            progress.test_at_best = t.accuracy;
            pause::point("test metrics");
            checkpoint::save(&varmap, cfg, &best)?;
            test = Some(t);
        }
        pause::point("last");
        progress.epoch = epoch + 1;
        progress.seconds = seconds;
        let meta = [(PROGRESS_KEY, serde_json::to_string(&progress)?)];
        checkpoint::save_resumable(&varmap, cfg, &opt.state()?, &meta, &last)?;
        on_event(Event::EpochEnd {
            epoch: epoch + 1,
            train: tr,
            val,
            test,
            seconds,
        });
    }
    // The curves are a convenience: a failure to draw them does not fail the run.
    if let Err(e) = super::plot::curves(&out.join("metrics.jsonl"), &out.join("curves.svg")) {
        tracing::warn!("{e:#}");
    }
    Ok(Summary {
        epochs: progress.epoch,
        steps: opt.step_count(),
        best_epoch: progress.best_epoch,
        best_val_accuracy: progress.best_val,
        test_accuracy: progress.test_at_best,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Loss and accuracy of the checkpoint at `path` on its task's test split (or `data_dir`'s
/// TSV files when given).
pub fn eval_checkpoint(path: &Path, data_dir: Option<&Path>, exec: &Exec) -> Result<Evaluation> {
    let device = &exec.device;
    let ck = checkpoint::read::<RunConfig>(path)?;
    let mut cfg = ck.config;
    if let Some(dir) = data_dir {
        cfg.task = match cfg.task {
            TaskConfig::Image { task, .. } | TaskConfig::ImageHub { task } => TaskConfig::Image {
                task,
                dir: dir.to_path_buf(),
            },
            _ => TaskConfig::ListopsTsv {
                dir: dir.to_path_buf(),
            },
        };
    }
    let (varmap, model) = build(&cfg.model, device)?;
    checkpoint::load_into(&varmap, &ck.tensors, path)?;
    let [_, _, test] = cfg.task.load()?;
    let test = match cfg.max_eval_samples {
        Some(n) => test.truncated(n),
        None => test,
    };
    Ok(evaluate(
        &model,
        &test,
        cfg.batching(exec.shards, false),
        device,
    )?)
}
