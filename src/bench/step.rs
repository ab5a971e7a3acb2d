//! The benchmark of a whole training step: its time, and what it executes.

use super::*;
use crate::data::dataset::{Batch, Dataset};
use crate::device::parse_device;
use crate::nn::{GradSink, NormKind, Pooling};
use crate::ops::in_place_updates;
use crate::train::config::RunArgs;
use crate::train::dist::World;
use crate::train::optim::{OptimConfig, Optimizer};
use crate::train::precision::Precision;
use crate::train::run::Exec;
use crate::train::trainer::{score, train_batch, Batching};
use candle_core::backprop::GradStore;
use std::collections::HashMap;
use std::sync::Arc;

/// `myo bench step`'s flags: a run's definition (only its shapes are used: no data is read) and
/// where and how to time its step.
#[derive(clap::Args, Debug)]
pub struct StepArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads: the timed step is cut into as many data-parallel shards, as `myo train
    /// --threads` runs it (the other timings and the counts are of one shard).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed samples (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    /// Then run N steps, a forward, a backward and an optimiser step, each after a 200 ms
    /// pause, for a profiler (scripts/cupti-summary.py); on CUDA with the graph, N replays of
    /// the captured step before them.
    #[arg(long, default_value_t = 0)]
    pub profile_steps: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

impl StepArgs {
    /// Resolves the run for its shapes (a task other than the built-in ListOps is not read),
    /// sets up the device and runs the benchmark.
    pub fn run(&self) -> anyhow::Result<StepReport> {
        let r = &self.run;
        let train_only = [
            ("--epochs", r.epochs.is_some()),
            ("--early-stop", r.early_stop.is_some()),
            ("--eval-every", r.eval_every.is_some()),
            ("--monitor", r.monitor.is_some()),
            ("--max-train-samples", r.max_train_samples.is_some()),
            ("--max-eval-samples", r.max_eval_samples.is_some()),
            ("--hub", r.hub),
            ("--save-every", r.save_every > 0),
            ("--accumulate", r.accumulate.is_some()),
            ("--log-every", r.log_every != RunArgs::default().log_every),
        ];
        if let Some((flag, _)) = train_only.iter().find(|(_, given)| *given) {
            anyhow::bail!(
                "{flag} applies to myo train, not to bench step (one step of the model on random \
                 inputs): leave it out"
            );
        }
        let device = parse_device(&self.device)?;
        let exec = Exec::for_process(&device, Some(self.threads))?;
        let mut run = self.run.clone();
        if run.data_dir.is_none() && run.task_name()? != "listops" {
            run.data_dir = Some("(not read)".into());
        }
        let cfg = run.resolve()?;
        cfg.precision.check(&device)?;
        let bench = StepBench {
            precision: cfg.precision,
            len: cfg.task.max_len(),
            model: cfg.model,
            optim: cfg.optim,
            batch: cfg.batch_size,
            shards: exec.shards,
            warmup: self.warmup,
            repeats: self.repeats,
            profile_steps: self.profile_steps,
            cuda_graph: self.run.cuda_graph,
        };
        Ok(bench.run(&device)?)
    }
}

/// A training step of a whole [`SequenceClassifier`] (forward, loss, backward, AdamW) on random
/// inputs of a task's shape, with the part spent in its sequence layers, and the tensor
/// operations each part executes.
#[derive(Debug, Clone)]
pub struct StepBench {
    pub model: ClassifierConfig,
    pub optim: OptimConfig,
    pub batch: usize,
    /// Data-parallel shards of the timed step, each on a thread of its own, as `myo train`
    /// cuts a batch on the CPU ([`Batching::shards`]); 1: the whole batch at once.
    pub shards: usize,
    /// Sequence length (the tree's leaves for Myo).
    pub len: usize,
    pub warmup: usize,
    pub repeats: usize,
    /// After the timings, run this many steps back to back, then one forward, one backward
    /// and one optimiser step, each window of GPU work after 200 ms of idling, for a
    /// profiler's trace (`scripts/cupti-summary.py` reads the four windows). With
    /// `cuda_graph`, a fifth window before them: this many replays of the captured step.
    /// 0: none.
    pub profile_steps: usize,
    /// On CUDA, also capture the step as a CUDA graph ([`StepReport::captured`]).
    pub cuda_graph: bool,
    /// The dtype the step computes in (`myo train --precision`).
    pub precision: Precision,
}

/// What one part of a step executes: tensors made (every candle op's output, views included;
/// on the CPU and on CUDA alike), in-place updates (which make none: the optimiser's) and, on
/// CUDA, launches of our own kernels among them.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OpCount {
    pub tensors: usize,
    pub in_place: usize,
    pub our_launches: Option<u64>,
}

impl OpCount {
    /// The operations: tensors made and in-place updates.
    pub fn ops(&self) -> usize {
        self.tensors + self.in_place
    }
}

/// [`OpCount`]s of a training step's parts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepOps {
    /// Forward pass and loss.
    pub forward: OpCount,
    pub backward: OpCount,
    /// The AdamW step.
    pub optimiser: OpCount,
    /// Forward + backward of one sequence layer alone (included in the two above, once per
    /// layer).
    pub per_layer: OpCount,
}

impl StepOps {
    pub fn total(&self) -> usize {
        self.forward.ops() + self.backward.ops() + self.optimiser.ops()
    }
}

/// What a [`StepBench`] measured, in milliseconds per step.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    pub device: String,
    /// The layer and shape in one line.
    pub shape: String,
    pub config: serde_json::Value,
    /// Forward + loss + backward + AdamW of the whole model.
    pub step: Timing,
    /// The data-parallel shards [`Self::step`] was cut into (CPU threads; 1 elsewhere).
    pub shards: usize,
    /// Forward + backward of one sequence layer alone (on its input shape), times the layers.
    pub layers: Timing,
    /// Forward alone of the whole model.
    pub forward: Timing,
    /// The dtype the step computed in.
    pub precision: Precision,
    /// Memory of one step, MiB: what was held before it (the model, the optimiser's moments,
    /// the batch) and the most it held at once beyond that (activations, gradients, scratch);
    /// on CUDA from the device's memory pool, on the CPU from the heap ([`super::memory`]).
    pub memory: Option<StepMemory>,
    pub ops: StepOps,
    /// The step captured as a CUDA graph and replayed (CUDA only, unless turned off): what
    /// it measured, or why there is no graph.
    pub captured: Option<std::result::Result<Captured, String>>,
}

/// [`StepReport::memory`], in MiB.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepMemory {
    pub held_mib: f64,
    pub peak_mib: f64,
}

/// A reading of candle's process-wide tensor counter: it numbers every tensor it makes
/// (`TensorId`), so two readings differ by the tensors made in between, plus one (the probe).
fn tensors_made() -> Result<usize> {
    let probe = Tensor::zeros((), DType::U8, &Device::Cpu)?;
    let id = format!("{:?}", probe.id());
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .map_err(|_| candle_core::Error::Msg(format!("cannot read a tensor count from {id}")))
}

const MIB: f64 = 1024.0 * 1024.0;

/// Launches of our CUDA kernels so far (`None` without the `cuda` feature or off CUDA).
fn our_launches(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return Some(crate::cuda::launches());
    }
    let _ = device;
    None
}

/// Counts what `f` executes.
fn count<R>(device: &Device, f: impl FnOnce() -> Result<R>) -> Result<(R, OpCount)> {
    let (t0, i0, l0) = (tensors_made()?, in_place_updates(), our_launches(device));
    let r = f()?;
    let (t1, i1, l1) = (tensors_made()?, in_place_updates(), our_launches(device));
    let ops = OpCount {
        tensors: t1 - t0 - 1,
        in_place: (i1 - i0) as usize,
        our_launches: l0.zip(l1).map(|(a, b)| b - a),
    };
    Ok((r, ops))
}

/// The model, its optimiser and a batch of random inputs.
struct Setup {
    model: SequenceClassifier,
    opt: Optimizer,
    /// The random examples, and all of them as one batch.
    data: Dataset,
    batch: Batch,
    step: u64,
    /// The dropout kernels read the step's key from the device's key word (a captured step).
    key_on_device: bool,
    /// The gradients the layers compute by hand (see [`Mode::Train`]).
    sink: GradSink,
}

impl Setup {
    fn forward(&mut self) -> Result<Tensor> {
        self.step += 1;
        let key = DropoutKey {
            seed: 0,
            step: self.step,
            first_row: 0,
            key_on_device: self.key_on_device,
        };
        let mode = Mode::Train(key, None, Some(&self.sink));
        let objective = score(&self.model, &self.batch, mode)?.objective;
        match self.opt.scaler() {
            Some(s) => objective * s.scale,
            None => Ok(objective),
        }
    }

    fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut grads = loss.backward()?;
        self.sink.add_to(&mut grads)?;
        Ok(grads)
    }

    /// The device's part of a step: forward, backward and AdamW on the rows
    /// [`Optimizer::prepare`] wrote.
    fn body(&mut self) -> Result<()> {
        let loss = self.forward()?;
        let grads = self.backward(&loss)?;
        self.opt.launch_with(&grads)?;
        // The logged norm is dropped by the step that made it: kept to the next, a captured
        // step would free memory allocated before its capture.
        self.opt.take_logged();
        Ok(())
    }

    fn step(&mut self) -> Result<()> {
        if self.opt.scaler().is_some() {
            // f16: the step reads back whether the gradients are finite.
            let loss = self.forward()?;
            let grads = self.backward(&loss)?;
            return self.opt.step(&grads);
        }
        self.opt.prepare()?;
        self.body()
    }

    /// The step as `myo train` takes it: the batch cut into `shards` on threads of their own,
    /// their gradients summed, then AdamW.
    fn train_step(&mut self, shards: usize) -> Result<()> {
        let batching = Batching {
            batch_size: self.data.len(),
            pad_to: None,
            bucketed: false,
            longest: None,
            shards,
            accumulate: 1,
            batch_norm: self.model.config().norm == NormKind::Batch,
        };
        let idx: Vec<usize> = (0..self.data.len()).collect();
        let device = self.batch.x.device().clone();
        let world = Arc::new(World::single());
        let (m, opt, data) = (&self.model, &mut self.opt, &self.data);
        train_batch(m, opt, data, batching, 0, &device, &world, &idx).map(drop)
    }
}

impl StepBench {
    /// The model (its parameters drawn afresh; under mixed precision, its compute copy), its
    /// optimiser and random inputs of the task's shape; the model's f32 variables by name.
    fn setup(&self, device: &Device) -> Result<(Setup, HashMap<String, Var>)> {
        let made = |varmap: VarMap, dtype: DType| -> Result<_> {
            let vb = VarBuilder::from_varmap(&varmap, dtype, device);
            let model = SequenceClassifier::new(self.model.clone(), vb)?;
            let vars = varmap.data().lock().expect("varmap").clone();
            Ok((model, vars))
        };
        let (mut model, vars) = made(VarMap::new(), DType::F32)?;
        let mut opt = Optimizer::new(self.optim.clone(), &vars, |n| model.param_group(n))?;
        // On CUDA the step is `myo train`'s captured one, which takes the gradient norm each step.
        opt.log_every(usize::from(device.is_cuda()));
        if self.precision.is_mixed() {
            let (copy, compute) = made(opt.compute_varmap(&vars), self.precision.dtype())?;
            opt.mirror(&vars, &compute, self.precision)?;
            model = copy;
        }
        let data = self.random_data()?;
        let idx: Vec<usize> = (0..data.len()).collect();
        let batch = data.batch(&idx, None, device)?;
        let s = Setup {
            model,
            opt,
            data,
            batch,
            step: 0,
            key_on_device: false,
            sink: GradSink::new(),
        };
        Ok((s, vars))
    }

    /// `batch` random examples of the task's shape: sequences of `len` tokens or feature
    /// vectors (pairs of them for a pair task) with labels, or for regression feature vectors
    /// with targets and intervals of 1 to 3 time units at every step.
    fn random_data(&self) -> Result<Dataset> {
        let (b, len, cpu) = (self.batch, self.len, &Device::Cpu);
        let draw = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
        let labels = || {
            let n = self.model.classes as f32;
            Tensor::rand(0f32, n, b, cpu)?
                .to_dtype(DType::U32)?
                .to_vec1::<u32>()
        };
        let features = match self.model.encoder {
            EncoderConfig::Linear { features } => features,
            EncoderConfig::Frames { side } => side * side,
            EncoderConfig::Embedding { vocab } => {
                let tokens = || -> Result<Vec<Vec<u32>>> {
                    let t = Tensor::rand(0f32, vocab as f32, (b, len), cpu)?;
                    t.to_dtype(DType::U32)?.to_vec2::<u32>()
                };
                return Ok(match self.model.pairs {
                    true => Dataset::Pairs {
                        first: tokens()?,
                        second: tokens()?,
                        labels: labels()?,
                    },
                    false => Dataset::Tokens {
                        seqs: tokens()?,
                        labels: labels()?,
                    },
                });
            }
        };
        let values = draw(Tensor::randn(0f32, 1., (b, len, features), cpu)?)?;
        if self.model.pooling != Pooling::None {
            let labels = labels()?;
            return Ok(Dataset::Real {
                values,
                len,
                features,
                labels,
            });
        }
        let outputs = self.model.classes;
        Ok(Dataset::Series {
            values,
            dt: draw(Tensor::rand(1f32, 3., (b, len), cpu)?)?,
            targets: draw(Tensor::randn(0f32, 1., (b, len, outputs), cpu)?)?,
            len,
            features,
            outputs,
        })
    }

    pub fn run(&self, device: &Device) -> Result<StepReport> {
        let (b, l, h) = (self.batch, self.len, self.model.d_model);
        let (mut s, _) = self.setup(device)?;
        // Shards only on the CPU (Exec::for_process), and at most one per example.
        let shards = self.shards.clamp(1, b);
        let whole = time_median(device, self.warmup, self.repeats, || match shards {
            1 => s.step(),
            n => s.train_step(n),
        })?;
        let forward = time_median(device, self.warmup, self.repeats, || {
            let x = &s.batch;
            s.model
                .forward_timed(&x.x, None, x.dt.as_ref(), Mode::Eval)
                .map(drop)
        })?;
        // One sequence layer on its own input: all tree nodes for Myo over all nodes.
        let width = s.model.positions(l);
        let z = Tensor::randn(0f32, 1., (b, width, h), device)?;
        let z = Var::from_tensor(&z.to_dtype(self.precision.dtype())?)?;
        let one = time_median(device, self.warmup, self.repeats, || {
            s.model
                .layer_forward(0, z.as_tensor(), s.batch.dt.as_ref(), Some(&s.sink))
                .and_then(|out| s.backward(&out))
                .map(drop)
        })?;
        let (_, peak) = super::memory::peak_of(device, || s.step())?;
        let memory = peak.map(|p| StepMemory {
            held_mib: p.before as f64 / MIB,
            peak_mib: p.above as f64 / MIB,
        });
        let times = self.model.layers as f64;
        let layers = Timing {
            median_ms: one.median_ms * times,
            min_ms: one.min_ms * times,
            ..one
        };

        let (loss, fwd) = count(device, || s.forward())?;
        let (grads, bwd) = count(device, || s.backward(&loss))?;
        let ((), opt) = count(device, || s.opt.step(&grads))?;
        let (out, layer_fwd) = count(device, || {
            let dt = s.batch.dt.as_ref();
            s.model.layer_forward(0, z.as_tensor(), dt, Some(&s.sink))
        })?;
        let (_, layer_bwd) = count(device, || s.backward(&out))?;
        let ops = StepOps {
            forward: fwd,
            backward: bwd,
            optimiser: opt,
            per_layer: OpCount {
                tensors: layer_fwd.tensors + layer_bwd.tensors,
                in_place: layer_fwd.in_place + layer_bwd.in_place,
                our_launches: layer_fwd
                    .our_launches
                    .zip(layer_bwd.our_launches)
                    .map(|(a, b)| a + b),
            },
        };
        // Captured first: with a profile, its replays are the first of the profile's windows.
        let captured = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) if self.cuda_graph => Some(
                self.captured(device, dev)
                    .map_err(|e| crate::fail::message(&e.into())),
            ),
            _ => None,
        };
        if self.profile_steps > 0 {
            self.profile(device, &mut s)?;
        }
        Ok(StepReport {
            device: describe(device),
            shape: format!(
                "{}, {} layers, H {h}, batch {b}, length {l} ({width} positions)",
                self.model.layer.summary(),
                self.model.layers
            ),
            config: serde_json::to_value(&self.model).unwrap_or_default(),
            step: whole,
            shards,
            layers,
            forward,
            precision: self.precision,
            memory,
            ops,
            captured,
        })
    }

    /// The step captured as a CUDA graph, timed, and compared with eager steps from the same
    /// parameters and inputs.
    #[cfg(feature = "cuda")]
    fn captured(&self, device: &Device, dev: &candle_core::CudaDevice) -> Result<Captured> {
        use crate::cuda::graph::{prepare_step, StepGraph};
        if self.precision == Precision::F16 {
            candle_core::bail!(
                "f16's loss scaling reads back whether the gradients are finite \
                 every step"
            );
        }
        let (mut eager, from) = self.setup(device)?;
        let (mut replayed, to) = self.setup(device)?;
        for (name, v) in &to {
            v.set(from[name].as_tensor())?;
        }
        replayed.batch = eager.batch.clone();
        // The replays' dropout reads the step from the device (the eager steps' take it by
        // value); the capture's eager run is step 1, each replay the next.
        replayed.key_on_device = true;
        // The eager steps first: their memory is back with the device (the pool releases it
        // when the device synchronises) before the graph maps its own.
        let compared = 5;
        for _ in 0..=compared {
            eager.step()?;
        }
        device.synchronize()?;
        crate::cuda::graph::graph_memory(dev, true)?;
        // The dropout key of a step as Setup::forward makes it, read from the device.
        let key = |step| DropoutKey {
            seed: 0,
            step,
            first_row: 0,
            key_on_device: true,
        };
        let mut at = 1;
        prepare_step(dev, &mut replayed.opt, key(at))?;
        let graph = StepGraph::capture(dev, || replayed.body())?;
        // Each replay the next step: its key and AdamW's rows written, then the graph launched.
        let mut next = || {
            at += 1;
            prepare_step(dev, &mut replayed.opt, key(at))?;
            graph.replay()
        };
        for _ in 0..compared {
            next()?;
        }
        let mut max_difference = 0f64;
        for (name, v) in &to {
            let d = (v.as_tensor() - from[name].as_tensor())?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            max_difference = max_difference.max(d);
        }
        let step = time_median(device, self.warmup, self.repeats, &mut next)?;
        device.synchronize()?;
        if self.profile_steps > 0 {
            pause(device)?;
            for _ in 0..self.profile_steps {
                next()?;
            }
            device.synchronize()?;
        }
        Ok(Captured {
            step,
            nodes: graph.nodes,
            memory: crate::cuda::graph::graph_memory(dev, false)?,
            compared,
            max_difference,
        })
    }

    /// The four windows of eager work a profiler's trace ends with (see `profile_steps`).
    fn profile(&self, device: &Device, s: &mut Setup) -> Result<()> {
        pause(device)?;
        for _ in 0..self.profile_steps {
            s.step()?;
        }
        pause(device)?;
        let loss = s.forward()?;
        pause(device)?;
        let grads = s.backward(&loss)?;
        pause(device)?;
        s.opt.step(&grads)?;
        device.synchronize()
    }
}

/// The idle gap that separates two windows of a profiler's trace.
fn pause(device: &Device) -> Result<()> {
    device.synchronize()?;
    std::thread::sleep(std::time::Duration::from_millis(200));
    Ok(())
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "step  device={}  precision={}  {}",
            self.device, self.precision, self.shape
        )?;
        let sharded = match self.shards {
            1 => String::new(),
            n => format!("; {n} shards on {n} threads, as myo train (the rest: one shard)"),
        };
        for (what, t, how) in [
            ("whole step        ", self.step, sharded.as_str()),
            ("  in the layers   ", self.layers, ""),
            ("forward (eval)    ", self.forward, ""),
        ] {
            writeln!(
                f,
                "  {what}  median {:>7} ms  (min {}, {} samples{how})",
                significant(t.median_ms),
                significant(t.min_ms),
                t.repeats
            )?;
        }
        if let Some(m) = self.memory {
            writeln!(
                f,
                "  memory  {} MiB at the step's peak beyond the {} MiB held before it",
                significant(m.peak_mib),
                significant(m.held_mib)
            )?;
        }
        let o = &self.ops;
        writeln!(
            f,
            "  tensor ops per step  {} = forward + loss {}, backward {}, optimiser {}; one \
             layer's forward + backward {}",
            o.total(),
            o.forward.ops(),
            o.backward.ops(),
            o.optimiser.ops(),
            o.per_layer.ops()
        )?;
        if let (Some(fw), Some(bw), Some(op), Some(la)) = (
            o.forward.our_launches,
            o.backward.our_launches,
            o.optimiser.our_launches,
            o.per_layer.our_launches,
        ) {
            writeln!(
                f,
                "  our kernel launches  {} = forward {fw}, backward {bw}, optimiser {op}; one \
                 layer {la}",
                fw + bw + op
            )?;
        }
        match &self.captured {
            None => {}
            Some(Err(why)) => writeln!(f, "  captured (CUDA graph)  not captured: {why}")?,
            Some(Ok(c)) => {
                let n = c.nodes;
                writeln!(
                    f,
                    "  captured (CUDA graph)  median {:>7} ms ({}× the eager step); graph of {} \
                     kernels, {} copies, {} memsets, {} allocations, {} frees, {} other nodes",
                    significant(c.step.median_ms),
                    significant(self.step.median_ms / c.step.median_ms),
                    n.kernels,
                    n.copies,
                    n.memsets,
                    n.allocations,
                    n.frees,
                    n.other
                )?;
                writeln!(
                    f,
                    "    its allocations ask for {} MiB in all; they held at most {} MiB in use, \
                     {} MiB reserved",
                    significant(n.allocated_bytes as f64 / MIB),
                    significant(c.memory.used_high as f64 / MIB),
                    significant(c.memory.reserved_high as f64 / MIB)
                )?;
                match c.max_difference {
                    0.0 => writeln!(
                        f,
                        "    after {} replays the parameters are the eager steps' to the bit",
                        c.compared
                    )?,
                    d => writeln!(
                        f,
                        "    after {} replays the parameters differ from the eager steps' by up \
                         to {d:e}",
                        c.compared
                    )?,
                }
            }
        }
        Ok(())
    }
}
