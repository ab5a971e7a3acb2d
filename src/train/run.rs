//! A training run as `myo train` performs it: data, model, optimiser, the epoch loop,
//! metrics and checkpoints in an output folder, resumable.
//!
//! The output folder and its files: [`RunDir`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use super::checkpoint::{self, MetricRecord, RunDir};
use super::config::RunConfig;
use super::dist::World;
pub use super::eval::{eval_checkpoint, eval_checkpoint_at, TestScore};
use super::optim::{OptimConfig, Optimizer};
use super::pause;
use super::progress::{Event, RunInfo};
use super::start::{data_digest, resumable, with_environment};
use super::trainer::{
    evaluate, report_interval, Batching, Epoch, EpochSoFar, Evaluation, StepGraphs,
};
use crate::data::dataset::Dataset;
use crate::nn::{ClassifierConfig, SequenceClassifier};

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub epochs: usize,
    pub steps: usize,
    /// The epoch and step of the best validation result.
    pub best_epoch: usize,
    pub best_step: usize,
    /// The best validation result (accuracy: classification only) and the test result of its
    /// model.
    pub best_val_accuracy: Option<f64>,
    pub best_val_loss: f64,
    pub test_accuracy: Option<f64>,
    pub test_loss: f64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Progress {
    /// Epochs completed.
    epoch: usize,
    /// How far the epoch under way has trained (at a mid-epoch checkpoint).
    #[serde(default)]
    within: EpochSoFar,
    /// The best validation result so far: its epoch (0: none yet) and step, its accuracy (0 in
    /// regression) and loss, and the test accuracy and loss of its model (the best checkpoint).
    best_epoch: usize,
    #[serde(default)]
    best_step: usize,
    best_val: f64,
    #[serde(default)]
    best_val_loss: f64,
    test_at_best: f64,
    #[serde(default)]
    test_loss_at_best: f64,
    /// Evaluations since the best one (for `--early-stop`).
    #[serde(default)]
    since_best: usize,
    /// The digest of the run's data (its three splits' examples and labels), which a resumed
    /// run must match; absent in checkpoints of earlier versions.
    #[serde(default)]
    data: Option<String>,
    /// Wall time so far: kept in `metrics.jsonl`, not in the checkpoint, whose bytes then
    /// depend on the training alone.
    #[serde(skip)]
    seconds: f64,
}

impl Progress {
    /// The epoch (1-based) the run is in, or last completed between epochs.
    fn current_epoch(&self) -> usize {
        self.epoch + usize::from(self.within.batches > 0)
    }
}

const PROGRESS_KEY: &str = "myosotis.progress";

fn build(model: &ClassifierConfig, device: &Device) -> Result<(VarMap, SequenceClassifier)> {
    let varmap = VarMap::new();
    let m = SequenceClassifier::new(
        model.clone(),
        VarBuilder::from_varmap(&varmap, DType::F32, device),
    )?;
    Ok((varmap, m))
}

/// The model of the checkpoint at `path` whose config is `cfg` and tensors `tensors` (from
/// [`checkpoint::read`]), on `device`: the config is checked against its task
/// ([`RunConfig::check_model`]) and the model built from the stored tensors
/// ([`checkpoint::build_from`]), so that nothing is sized by the config before the file agrees.
pub fn checkpoint_model(
    tensors: &HashMap<String, candle_core::Tensor>,
    cfg: &RunConfig,
    path: &Path,
    device: &Device,
) -> Result<(VarMap, SequenceClassifier)> {
    checkpoint_model_in(tensors, cfg, path, device, DType::F32)
}

/// [`checkpoint_model`] with its parameters in `dtype` (cast from the file's f32).
pub fn checkpoint_model_in(
    tensors: &HashMap<String, candle_core::Tensor>,
    cfg: &RunConfig,
    path: &Path,
    device: &Device,
    dtype: DType,
) -> Result<(VarMap, SequenceClassifier)> {
    cfg.check_model()
        .with_context(|| format!("{}: the config in its metadata", path.display()))?;
    checkpoint::build_from(tensors, path, device, dtype, |vb| {
        SequenceClassifier::new(cfg.model.clone(), vb)
    })
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

/// Where and how a run executes; not part of the run's definition (a run resumed with other
/// settings is the same run, up to floating-point summation order).
#[derive(Clone, Debug)]
pub struct Exec {
    pub device: Device,
    /// Data-parallel shards per training batch (see [`super::trainer::Batching::shards`]).
    pub shards: usize,
    /// The ranks training together ([`World::single`] for one process).
    pub world: Arc<World>,
    /// The command line that started the run, recorded in its `config.json`.
    pub origin: Origin,
    /// Optimiser steps between step records in `metrics.jsonl` (0: none).
    pub log_every: usize,
    /// Optimiser steps between mid-epoch checkpoints (`last.safetensors`, resumable as those
    /// at the ends of epochs; 0: none).
    pub save_every: usize,
    /// On CUDA, replay training steps captured as CUDA graphs ([`Epoch::graphs`]).
    pub cuda_graph: bool,
}

/// The command line a run was started from: the whole of it, and the run flags it gave (with
/// those of the run it resumed or took its config from before them), which `--resume` and
/// `--config` read back. Empty for a run started from code.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Origin {
    pub command_line: Vec<String>,
    pub flags: Option<Vec<String>>,
}

impl Exec {
    /// One shard on `device`.
    pub fn on(device: &Device) -> Self {
        Exec {
            device: device.clone(),
            shards: 1,
            world: Arc::new(World::single()),
            origin: Origin::default(),
            log_every: 0,
            save_every: 0,
            cuda_graph: false,
        }
    }

    /// How a process trains on `device`: on the CPU, `threads` data-parallel shards per batch
    /// (default RAYON_NUM_THREADS, else every core), each running candle's ops single-threaded;
    /// elsewhere one shard. Sets up rayon's global pool and candle's thread count, so call it
    /// once, before any other thread starts.
    ///
    /// Measured on a 2-core machine (S5 and Myo, 4 layers, d_model 64, batch 32 of MNIST): two
    /// single-threaded shards take 0.6x the time of one shard whose ops use both cores, as
    /// candle's per-op parallelism (a barrier pool for element-wise ops, rayon inside gemm)
    /// leaves cores idle between small ops.
    pub fn for_process(device: &Device, threads: Option<usize>) -> Result<Self> {
        if !device.is_cpu() {
            return Ok(Exec::on(device));
        }
        let from_env = std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse().ok());
        let n = threads
            .or(from_env)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        // Our own ops (and the shards) run on rayon's global pool of `n` threads; candle reads
        // its thread count from these variables when it first needs it, which is after this.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
        // SAFETY (of the environment write): no other thread reads the environment here;
        // rayon's workers do not, and candle has not started its pools yet.
        std::env::set_var("RAYON_NUM_THREADS", "1");
        std::env::set_var("CANDLE_NUM_THREADS", "1");
        Ok(Exec {
            device: device.clone(),
            shards: n,
            world: Arc::new(World::single()),
            origin: Origin::default(),
            log_every: 0,
            save_every: 0,
            cuda_graph: false,
        })
    }

    /// This execution as one rank of `world`.
    pub fn in_world(self, world: Arc<World>) -> Self {
        Exec { world, ..self }
    }

    /// This execution, started by `origin`'s command line.
    pub fn started_by(self, origin: Origin) -> Self {
        Exec { origin, ..self }
    }
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

/// Trains `cfg` into `out`, started as `start` says. `on_event` sees the run's progress
/// ([`Event`]).
pub fn train(
    cfg: &RunConfig,
    out: &Path,
    exec: &Exec,
    start: Start,
    mut on_event: impl FnMut(Event),
) -> Result<Summary> {
    let (device, world) = (&exec.device, exec.world.as_ref());
    // Rank 0 alone touches the run's folder and shows progress.
    let root = world.is_root();
    let mut on_event = |e: Event| {
        if root {
            on_event(e)
        }
    };
    let run = RunDir::at(out);
    let resume = start == Start::Resume;
    let held = run.held();
    if root && start == Start::New && !held.is_empty() {
        bail!(
            "{} already holds a run ({}): continue it with --resume, replace it with \
             --overwrite, or choose another --out",
            out.display(),
            held.join(", ")
        );
    }
    cfg.precision.check(device)?;
    let [train_set, val_set, test_set] = cfg.task.load(&cfg.data)?;
    let regression = train_set.is_regression();
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
    let steps_per_epoch = train_set
        .len()
        .div_ceil(cfg.batching(exec.shards, true).step_size());
    let optim_cfg = OptimConfig {
        total_steps: cfg.epochs * steps_per_epoch,
        warmup_steps: cfg
            .warmup_epochs
            .map_or(cfg.optim.warmup_steps, |e| e * steps_per_epoch),
        ..cfg.optim.clone()
    };
    let mut opt = Optimizer::new(optim_cfg, &vars(&varmap), |n| model.param_group(n))?;
    // Rank 0 keeps the run's records, the others take its progress.
    let data = match root {
        true => data_digest(&[&train_set, &val_set, &test_set]),
        false => String::new(),
    };
    let mut progress = Progress {
        data: Some(data.clone()),
        ..Progress::default()
    };
    if resume && root {
        let last = run.last();
        let ck = checkpoint::read::<RunConfig>(&last)
            .context("--resume needs a previous run's last.safetensors")?;
        let json = ck.metadata.get(PROGRESS_KEY).with_context(|| {
            format!(
                "--resume: {} has no training progress (a `best` checkpoint, or one written \
                 before checkpoints held it)",
                last.display()
            )
        })?;
        progress = serde_json::from_str(json)
            .with_context(|| format!("{}: the progress record does not parse", last.display()))?;
        let done = (progress.epoch, progress.within.batches);
        resumable(&ck.config, cfg, done, progress.data.as_deref(), &data)
            .with_context(|| format!("--resume: {}", last.display()))?;
        progress.data = Some(data);
        checkpoint::load_into(&varmap, &ck.tensors, &last)?;
        opt.load_state(&ck.optimizer)
            .with_context(|| format!("--resume: {}", last.display()))?;
        // Records made after the checkpoint are dropped: that part of the run trains again.
        progress.seconds = run.keep_metrics_until(opt.step_count())?;
    }
    // The folder is made, or an earlier run in it replaced, only once the run can start: a
    // start that fails leaves no empty folder and no lost run.
    if root {
        if start == Start::Replace {
            run.remove_run()?;
        }
        RunDir::create(out)?;
        run.remove_stale_temporaries()?;
        run.write_config(&with_environment(cfg, exec)?)?;
    }
    world.use_device(device)?;
    if world.size() > 1 {
        // Every rank starts from rank 0's model, optimiser state and progress.
        share_root_state(world, &varmap, &mut opt, &mut progress)?;
    }
    // Under mixed precision a copy of the model in the compute dtype trains and evaluates.
    let model = match cfg.precision.is_mixed() {
        false => model,
        true => {
            let compute = opt.compute_varmap(&vars(&varmap));
            let vb = VarBuilder::from_varmap(&compute, cfg.precision.dtype(), device);
            let copy = SequenceClassifier::new(cfg.model.clone(), vb)?;
            opt.mirror(&vars(&varmap), &vars(&compute), cfg.precision)?;
            copy
        }
    };
    on_event(Event::Start(RunInfo {
        model: format!(
            "{} layers of {}, width {}{}",
            cfg.model.layers,
            cfg.model.layer.summary(),
            cfg.model.d_model,
            match cfg.precision.is_mixed() {
                true => format!(", computing in {}", cfg.precision),
                false => String::new(),
            }
        ),
        parameters: vars(&varmap).values().map(|v| v.elem_count()).sum(),
        device: crate::device::describe(device),
        threads: exec.shards,
        ranks: world.size(),
        task: cfg.task.name.clone(),
        splits: [train_set.len(), val_set.len(), test_set.len()],
        out: out.to_path_buf(),
        resumed_at: opt.step_count(),
    }));
    let started = Instant::now() - std::time::Duration::from_secs_f64(progress.seconds);
    opt.log_every(exec.log_every);
    let mut r = Running {
        cfg,
        root,
        run,
        varmap,
        model,
        opt,
        progress,
        sets: [val_set, test_set],
        batching: cfg.batching(exec.shards, false),
        exec,
        started,
    };
    // Since the last step record: (its time, the samples trained).
    let mut since_log = (started.elapsed().as_secs_f64(), 0usize);
    let mut log_failed = None;
    // The steps captured as CUDA graphs, replayed in every later part and epoch.
    let graphs = StepGraphs::default();
    'run: while r.progress.epoch < cfg.epochs {
        // Also when a run that stopped early is resumed.
        if let Some(patience) = cfg.early_stop.filter(|&p| r.progress.since_best >= p) {
            on_event(Event::StoppedEarly {
                epoch: r.progress.current_epoch(),
                step: r.opt.step_count(),
                best_epoch: r.progress.best_epoch,
                best_step: r.progress.best_step,
                patience,
            });
            break;
        }
        let epoch = r.progress.epoch + 1;
        pause::set_epoch(epoch);
        let so_far = r.progress.within;
        on_event(Event::EpochStart {
            epoch,
            epochs: cfg.epochs,
            samples: train_set.len(),
            batches: steps_per_epoch,
            trained: (so_far.batches * cfg.batching(1, true).step_size()).min(train_set.len()),
            so_far,
        });
        // Train to each step of a mid-epoch evaluation or checkpoint, then to the epoch's end.
        loop {
            let step = r.opt.step_count();
            let to_next = [cfg.eval_every.unwrap_or(0), exec.save_every]
                .into_iter()
                .filter(|&n| n > 0)
                .map(|n| n - step % n)
                .min();
            let part = Epoch {
                model: &r.model,
                data: &train_set,
                batching: cfg.batching(exec.shards, true),
                seed: cfg.seed.wrapping_add(epoch as u64 - 1),
                device,
                report_every: report_interval(device),
                world: &exec.world,
                graphs: exec.cuda_graph.then_some(&graphs),
            };
            let until = to_next.map_or(usize::MAX, |n| r.progress.within.batches + n);
            part.train(&mut r.opt, &mut r.progress.within, until, |b| {
                on_event(Event::Batch {
                    samples: b.samples,
                    loss: b.loss,
                    correct: (!regression).then_some(b.correct),
                });
                since_log.1 += b.samples;
                let scaler = b.scaler;
                if let (Some((lr, grad_norm)), true) = (b.logged, root) {
                    // Timed when queued: records read back together keep their own times.
                    let seconds = b.queued.saturating_duration_since(started).as_secs_f64();
                    let rate = since_log.1 as f64 / (seconds - since_log.0).max(1e-9);
                    let step = MetricRecord {
                        epoch,
                        split: "step".into(),
                        loss: b.loss,
                        accuracy: (!regression)
                            .then_some(b.correct as f64 / b.samples.max(1) as f64),
                        mse: regression.then_some(b.loss),
                        step: b.step,
                        seconds,
                        lr: Some(lr),
                        grad_norm: Some(grad_norm),
                        samples_per_s: Some(rate),
                        loss_scale: scaler.map(|s| s.scale),
                        skipped_steps: scaler.map(|s| s.skipped),
                    };
                    if let Err(e) = r.run.append_metric(&step) {
                        log_failed.get_or_insert(e);
                    }
                    since_log = (seconds, 0);
                }
            })?;
            if let Some(e) = log_failed.take() {
                return Err(e);
            }
            if r.progress.within.batches == steps_per_epoch {
                break;
            }
            let step = r.opt.step_count();
            let mut save = exec.save_every > 0 && step.is_multiple_of(exec.save_every);
            let mut stop = false;
            if cfg.eval_every.is_some_and(|n| step.is_multiple_of(n)) {
                let (val, test) = r.validate(None, &mut on_event)?;
                on_event(Event::Evaluated {
                    epoch,
                    step,
                    val,
                    test,
                });
                // A run that stops here keeps its state there.
                stop = cfg.early_stop.is_some_and(|p| r.progress.since_best >= p);
                save |= stop;
            }
            if save {
                r.save_last()?;
            }
            if stop {
                continue 'run;
            }
        }
        let train = r.progress.within.evaluation(&train_set);
        let (val, test) = r.validate(Some(train), &mut on_event)?;
        (r.progress.epoch, r.progress.within) = (epoch, EpochSoFar::default());
        r.save_last()?;
        on_event(Event::EpochEnd {
            epoch,
            epochs: cfg.epochs,
            train,
            val,
            test,
            seconds: started.elapsed().as_secs_f64(),
        });
    }
    // The curves are a convenience: a failure to draw them does not fail the run.
    if root {
        if let Err(e) = super::plot::curves(&r.run.metrics(), &r.run.curves()) {
            tracing::warn!("{e:#}");
        }
    }
    world.barrier()?;
    Ok(Summary {
        epochs: r.progress.epoch,
        steps: r.opt.step_count(),
        best_epoch: r.progress.best_epoch,
        best_step: r.progress.best_step,
        best_val_accuracy: (!regression).then_some(r.progress.best_val),
        best_val_loss: r.progress.best_val_loss,
        test_accuracy: (!regression).then_some(r.progress.test_at_best),
        test_loss: r.progress.test_loss_at_best,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A run under way: its model and optimiser, where it stands, and where it writes.
struct Running<'a> {
    cfg: &'a RunConfig,
    exec: &'a Exec,
    /// Rank 0, which alone writes the run's files.
    root: bool,
    run: RunDir,
    varmap: VarMap,
    model: SequenceClassifier,
    opt: Optimizer,
    progress: Progress,
    /// The validation and test splits, and their batches.
    sets: [Dataset; 2],
    batching: Batching,
    started: Instant,
}

impl Running<'_> {
    /// Evaluates the validation split at the step reached and records it (after the epoch's
    /// training result `train` at the end of an epoch). When it is the best so far
    /// ([`Monitor`](super::config::Monitor)), also the test split, and saves the best
    /// checkpoint. A non-finite loss stops the run.
    fn validate(
        &mut self,
        train: Option<Evaluation>,
        on_event: &mut impl FnMut(Event),
    ) -> Result<(Evaluation, Option<Evaluation>)> {
        let (epoch, step) = (self.progress.current_epoch(), self.opt.step_count());
        let (device, world) = (&self.exec.device, self.exec.world.as_ref());
        let [val_set, test_set] = &self.sets;
        let when = match train {
            Some(_) => format!("after epoch {epoch}"),
            None => format!("at step {step}"),
        };
        let record = |split: &str, e: Evaluation, started: Instant| MetricRecord {
            epoch,
            split: split.into(),
            loss: e.loss,
            accuracy: e.accuracy,
            mse: e.mse(),
            step,
            seconds: started.elapsed().as_secs_f64(),
            ..MetricRecord::default()
        };
        on_event(Event::Evaluating { split: "val" });
        let val = evaluate(&self.model, val_set, self.batching, device, world)?;
        if self.root {
            if let Some(train) = train {
                let scaler = self.opt.scaler();
                let train = MetricRecord {
                    loss_scale: scaler.map(|s| s.scale),
                    skipped_steps: scaler.map(|s| s.skipped),
                    ..record("train", train, self.started)
                };
                self.run.append_metric(&train)?;
            }
            self.run.append_metric(&record("val", val, self.started))?;
        }
        pause::point("metrics");
        finite("validation", val.loss, &when)?;
        let p = &mut self.progress;
        let best = Evaluation {
            loss: p.best_val_loss,
            accuracy: val.accuracy.map(|_| p.best_val),
        };
        if p.best_epoch > 0 && !self.cfg.monitor.improves(val, best) {
            p.since_best += 1;
            return Ok((val, None));
        }
        on_event(Event::Evaluating { split: "test" });
        let test = evaluate(&self.model, test_set, self.batching, device, world)?;
        if self.root {
            self.run
                .append_metric(&record("test", test, self.started))?;
        }
        finite("test", test.loss, &when)?;
        (p.best_epoch, p.best_step, p.since_best) = (epoch, step, 0);
        (p.best_val, p.best_val_loss) = (val.accuracy.unwrap_or(0.0), val.loss);
        (p.test_at_best, p.test_loss_at_best) = (test.accuracy.unwrap_or(0.0), test.loss);
        pause::point("test metrics");
        if self.root {
            checkpoint::save(&self.varmap, self.cfg, &self.run.best())?;
        }
        Ok((val, Some(test)))
    }

    /// Writes `last.safetensors`: the model, the optimiser's state and the run's progress.
    fn save_last(&mut self) -> Result<()> {
        pause::point("last");
        let meta = [(PROGRESS_KEY, serde_json::to_string(&self.progress)?)];
        if self.root {
            let state = self.opt.state()?;
            checkpoint::save_resumable(&self.varmap, self.cfg, &state, &meta, &self.run.last())?;
        }
        Ok(())
    }
}

/// Stops the run at a non-finite evaluation loss, as at a non-finite training loss: a model
/// that diverged is never the best one, and the last good checkpoint stays.
fn finite(split: &str, loss: f64, when: &str) -> Result<()> {
    if !loss.is_finite() {
        bail!("the {split} loss is {loss} {when}; stopping (the last good checkpoint is kept)");
    }
    Ok(())
}

/// Rank 0's variables, optimiser state and progress on every rank of `world`.
fn share_root_state(
    world: &World,
    varmap: &VarMap,
    opt: &mut Optimizer,
    progress: &mut Progress,
) -> Result<()> {
    let vars = vars(varmap);
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let values: Vec<_> = names.iter().map(|n| vars[*n].as_tensor().clone()).collect();
    for (name, t) in names.iter().zip(world.broadcast_tensors(&values)?) {
        vars[*name].set(&t)?;
    }
    let state = opt.state()?;
    let tensors: Vec<_> = state.iter().map(|(_, t)| t.clone()).collect();
    let shared = world.broadcast_tensors(&tensors)?;
    opt.load_state(&state.iter().map(|(n, _)| n.clone()).zip(shared).collect())?;
    let mut json = serde_json::to_vec(progress)?;
    world.broadcast_bytes(&mut json)?;
    let seconds = progress.seconds;
    *progress = serde_json::from_slice(&json)?;
    // Wall time is not in the record: rank 0's, from its metrics.
    progress.seconds = seconds;
    Ok(())
}
