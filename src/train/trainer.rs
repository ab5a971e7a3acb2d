//! The training loop: shuffled mini-batches, the classifier's log-likelihood (or, for
//! regression, the mean squared error), AdamW steps, and evaluation (loss, and accuracy for
//! classification) over a split.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, D};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

pub use super::batching::{Batching, PAD_LENGTHS};
use super::dist::{part, World};
use super::optim::Optimizer;
pub use super::pending::BatchRecord;
use super::pending::Pending;
use super::shards::{RankSum, ThreadGroup};
use crate::data::dataset::{Batch, Dataset, Target};
use crate::nn::loss::{gaussian_nll, log_softmax_nll};
use crate::nn::{Decoder, DropoutKey, GradSink, Mode, SequenceClassifier, Shards};

/// Runs `f(offset, part)` on `idx` cut into up to `shards` contiguous, nearly equal parts
/// (`offset`: the part's first position in `idx`), in parallel; results in part order.
fn sharded<T: Send>(
    idx: &[usize],
    shards: usize,
    f: impl Fn(usize, &[usize]) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let k = shards.clamp(1, idx.len().max(1));
    if k == 1 {
        return Ok(vec![f(0, idx)?]);
    }
    let parts: Vec<(usize, &[usize])> = (0..k)
        .map(|i| {
            let r = part(idx.len(), i, k);
            (r.start, &idx[r])
        })
        .collect();
    parts
        .into_par_iter()
        .map(|(at, part)| f(at, part))
        .collect()
}

/// As [`sharded`], with each part on a thread of its own, all at the same time, so that the
/// parts can meet at the sums of a [`ThreadGroup`]: `f` also gets its part's handle.
fn sharded_together<T: Send>(
    idx: &[usize],
    shards: usize,
    f: impl Fn(usize, &[usize], Option<&Shards>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let k = shards.clamp(1, idx.len().max(1));
    if k == 1 {
        return Ok(vec![f(0, idx, None)?]);
    }
    let group = ThreadGroup::new(k);
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..k)
            .map(|i| {
                let (r, shard, group, f) = (part(idx.len(), i, k), group.shard(i), &group, &f);
                scope.spawn(move || {
                    // A shard that fails or panics releases the others from their sums
                    // (the scope waits for every thread before a panic goes on).
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        f(r.start, &idx[r], Some(&shard))
                    }));
                    if !matches!(out, Ok(Ok(_))) {
                        group.fail(i);
                    }
                    out.unwrap_or_else(|p| std::panic::resume_unwind(p))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    // The first shard that failed has the error; the others only stopped for it.
    if let Some(first) = group.failed() {
        let mut results = results;
        return match results.swap_remove(first) {
            Err(e) => Err(e),
            Ok(_) => Err(internal("a shard marked failed returned a result")),
        };
    }
    results.into_iter().collect()
}

/// One training step on the batch `idx`: in `batching.accumulate` micro-batches taken in turn,
/// each cut across the ranks (this rank's part of it) and again into the process's shards, whose
/// gradients add up to the whole batch's; then the optimiser step (across ranks). Returns the
/// batch's mean loss and correct count, summed over the ranks, on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_batch(
    model: &SequenceClassifier,
    opt: &mut Optimizer,
    data: &Dataset,
    batching: Batching,
    seed: u64,
    device: &Device,
    world: &Arc<World>,
    idx: &[usize],
) -> Result<(Tensor, Tensor)> {
    // One padding for the whole batch, as without micro-batches.
    let pad = batching.padding(data, idx);
    let step = opt.step_count() as u64;
    let loss_scale = opt.loss_scale();
    let master: &Optimizer = opt;
    // This rank's part of the micro-batch `micro` of `idx`, in shards: each shard's (loss,
    // correct count, gradients); none where the rank holds no part of it.
    let micro_batch = |micro: std::ops::Range<usize>| -> Result<Vec<(Tensor, Tensor, GradStore)>> {
        let cut = part(micro.len(), world.rank(), world.size());
        if cut.is_empty() {
            return Ok(vec![]);
        }
        let mine = micro.start + cut.start..micro.start + cut.end;
        let shard = |at: usize, part: &[usize], shards: Option<&Shards>| {
            let batch = data.batch(part, pad, device)?;
            let key = DropoutKey {
                seed,
                step,
                first_row: (mine.start + at) as u64,
                key_on_device: false,
            };
            let sink = GradSink::new();
            let s = score(model, &batch, Mode::Train(key, shards, Some(&sink)))?;
            // This shard's share of the batch mean (times f16's loss scale).
            let share = part.len() as f64 / idx.len() as f64;
            let mut grads = (&s.objective * (share * loss_scale))?.backward()?;
            sink.add_to(&mut grads)?;
            Ok(((s.loss * share)?.to_dtype(DType::F64)?, s.correct, grads))
        };
        let mine_idx = &idx[mine.clone()];
        let parts = match (batching.batch_norm, world.size()) {
            (false, _) => sharded(mine_idx, batching.shards, |at, part| shard(at, part, None))?,
            (true, 1) => sharded_together(mine_idx, batching.shards, shard)?,
            // MPI is called from the main thread alone: one shard per rank.
            (true, _) => {
                let ranks: Shards = Arc::new(RankSum {
                    world: world.clone(),
                    ranks: micro.len().min(world.size()),
                });
                vec![shard(0, mine_idx, Some(&ranks))?]
            }
        };
        Ok(parts)
    };
    // Each shard's parts summed over the micro-batches first, then the shards in order: the
    // order in which ranks (one shard each) sum theirs, so that N ranks give, to the bit, one
    // process of N shards.
    let micro = batching.accumulate.clamp(1, idx.len().max(1));
    let mut by_shard: Vec<Vec<(Tensor, Tensor, GradStore)>> = vec![];
    for m in 0..micro {
        for (s, p) in micro_batch(part(idx.len(), m, micro))?
            .into_iter()
            .enumerate()
        {
            match by_shard.get_mut(s) {
                Some(parts) => parts.push(p),
                None => by_shard.push(vec![p]),
            }
        }
    }
    let by_shard: Vec<_> = by_shard
        .into_iter()
        .map(|p| sum_parts(p, master))
        .collect::<Result<_>>()?;
    let local = match by_shard.is_empty() {
        true => None,
        false => Some(sum_parts(by_shard, master)?),
    };
    let (value, right) = if world.size() == 1 {
        let (value, right, grads) =
            local.ok_or_else(|| internal("the only rank has no part of the batch"))?;
        opt.step(&grads)?;
        (value, right)
    } else {
        // The ranks that hold part of some micro-batch.
        let ranks = idx.len().div_ceil(micro).min(world.size());
        opt.step_across(local.as_ref().map(|l| &l.2), world, ranks)?;
        let mine = match &local {
            Some((v, r, _)) => Tensor::stack(&[v, r], 0)?,
            None => Tensor::zeros(2, DType::F64, device)?,
        };
        let sum = if world.sums_on_device() {
            world
                .device_sum(&mine)
                .map_err(collective)?
                .ok_or_else(|| internal("no device collective"))?
        } else {
            let mine = mine.to_vec1::<f64>()?;
            let sum = world.sum_in_rank_order(&mine, ranks).map_err(collective)?;
            Tensor::new(sum, device)?
        };
        (sum.get(0)?, sum.get(1)?)
    };
    Ok((value, right))
}

/// The sum of parts' (loss, correct count, gradients), in order.
fn sum_parts(
    parts: Vec<(Tensor, Tensor, GradStore)>,
    opt: &Optimizer,
) -> Result<(Tensor, Tensor, GradStore)> {
    // Under mixed precision the compute copy's gradients are summed in f32; one part's go to
    // the optimiser as they are (its kernel reads them in their dtype).
    let many = parts.len() > 1;
    let mut parts = parts.into_iter();
    let (mut value, mut right, mut grads) = parts
        .next()
        .ok_or_else(|| internal("a batch part without shards"))?;
    if many {
        opt.grads_to_f32(&mut grads)?;
    }
    for (v, c, mut g) in parts {
        value = (value + v)?;
        right = (right + c)?;
        opt.grads_to_f32(&mut g)?;
        grads.extend(g)?;
    }
    Ok((value, right, grads))
}

/// A step's mean loss and correct count on the device, and at the steps the optimiser keeps
/// its learning rate and gradient norm.
type StepOut = (Tensor, Tensor, Option<(f64, Tensor)>);

/// Steps captured as CUDA graphs, where they can be replayed as they are: on CUDA, one
/// process, one micro-batch per step, not f16.
#[cfg(feature = "cuda")]
fn captured_steps(
    device: &Device,
    batching: Batching,
    world: &World,
    opt: &mut Optimizer,
) -> Option<super::captured::CapturedSteps> {
    match device {
        Device::Cuda(dev)
            if world.size() == 1 && batching.accumulate <= 1 && opt.scaler().is_none() =>
        {
            Some(super::captured::CapturedSteps::new(dev, opt))
        }
        _ => None,
    }
}

/// The training steps of a run captured as CUDA graphs (`src/train/captured.rs`), kept from one
/// part of an epoch to the next and from epoch to epoch: a run captures each batch shape's step
/// once. Holds nothing without the `cuda` feature or off CUDA.
#[derive(Default)]
pub struct StepGraphs {
    #[cfg(feature = "cuda")]
    captured: std::cell::RefCell<Option<super::captured::CapturedSteps>>,
}

/// Shards are host threads, and on CUDA candle gives each host thread its own stream: our
/// kernels' shared workspace and status word assume one stream per device. A CUDA device
/// trains one shard per process (several GPUs: several ranks).
fn one_shard_on_cuda(device: &Device, batching: Batching) -> Result<()> {
    if device.is_cuda() && batching.shards > 1 {
        candle_core::bail!(
            "{} shards per batch on a CUDA device: a CUDA device takes one shard per process \
             (use one rank per GPU for data parallelism)",
            batching.shards
        );
    }
    Ok(())
}

/// An error for a broken invariant of training (a bug), in place of a panic: under several
/// ranks an error ends them all, a panic would leave the others waiting.
pub(crate) fn internal(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("internal error: {what}"))
}

/// A model's results on a batch, on the device.
pub struct Score {
    /// What training minimises: the mean loss, or for a Gaussian decoder the mean negative
    /// log-likelihood.
    pub objective: Tensor,
    /// The mean loss reported: the labels' negative log-likelihood, or for values the mean
    /// squared error of the (mean) prediction.
    pub loss: Tensor,
    /// The rows whose argmax is the label (an f64 scalar; 0 for values).
    pub correct: Tensor,
}

/// The model's [`Score`] on `batch`: for labels, their negative log-likelihood (objective and
/// loss alike) and the correct predictions; for values at every step, the mean squared error
/// over steps and outputs, and with a Gaussian decoder the objective its negative
/// log-likelihood, 0.5 Σ_outputs (ln σ² + (μ − y)²/σ² + ln 2π) averaged over examples and steps
/// (σ² at least 1e-6, as S5's and CRU's).
pub fn score(model: &SequenceClassifier, batch: &Batch, mode: Mode) -> Result<Score> {
    let out = model.logits_timed(&batch.x, Some(&batch.lengths), batch.dt.as_ref(), mode)?;
    // The loss of a model computing in f16 or bf16 is taken in f32.
    let out = crate::ops::widened(&out)?;
    match &batch.target {
        Target::Labels(y) => {
            if out.rank() != 2 {
                candle_core::bail!(
                    "the model outputs {:?} per batch, not one row of classes per example",
                    out.dims()
                );
            }
            let nll = log_softmax_nll(&out, y, mode.sink().is_some())?;
            let (loss, correct) = (nll.loss, nll.correct);
            Ok(Score {
                objective: loss.clone(),
                loss,
                correct,
            })
        }
        Target::Values(y) => {
            let gaussian = model.config().decoder == Decoder::Gaussian;
            let k = y.dim(D::Minus1)?;
            let want = [&y.dims()[..y.rank() - 1], &[k * (1 + gaussian as usize)]].concat();
            if out.dims() != want {
                candle_core::bail!(
                    "the model outputs {:?}, the targets are {:?} (batch, steps, outputs){}",
                    out.dims(),
                    y.dims(),
                    if gaussian {
                        " and a Gaussian's mean and variance per output"
                    } else {
                        ""
                    }
                );
            }
            let (objective, loss) = match gaussian {
                false => {
                    let loss = (out.narrow(D::Minus1, 0, k)? - y)?.sqr()?.mean_all()?;
                    (loss.clone(), loss)
                }
                true => {
                    let nll = gaussian_nll(&out, y, mode.sink().is_some())?;
                    (nll.objective, nll.mse)
                }
            };
            Ok(Score {
                objective,
                loss,
                correct: Tensor::zeros((), DType::F64, y.device())?,
            })
        }
    }
}

/// Loss and accuracy over a split (for regression the loss is the mean squared error, and there
/// is no accuracy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: Option<f64>,
}

impl Evaluation {
    /// The mean squared error, for regression.
    pub fn mse(&self) -> Option<f64> {
        self.accuracy.is_none().then_some(self.loss)
    }

    /// The result in a few words: "loss 0.1234 acc 0.9651", or "mse 3.41e-3".
    pub fn brief(&self) -> String {
        match self.accuracy {
            Some(a) => format!("loss {:.4} acc {a:.4}", self.loss),
            None => format!("mse {:.3e}", self.loss),
        }
    }
}

/// Mean loss and accuracy of `model` (eval mode) over `data`, each rank of `world` evaluating
/// its part of every batch; the results are read back once, at the end.
pub fn evaluate(
    model: &SequenceClassifier,
    data: &Dataset,
    batching: Batching,
    device: &Device,
    world: &World,
) -> Result<Evaluation> {
    let batching = batching.over(data);
    one_shard_on_cuda(device, batching)?;
    let mut pending = Pending::default();
    let order: Vec<usize> = (0..data.len()).collect();
    for idx in order.chunks(batching.batch_size.max(1)) {
        let pad = batching.padding(data, idx);
        let mine = &idx[part(idx.len(), world.rank(), world.size())];
        if mine.is_empty() {
            continue;
        }
        let parts = sharded(mine, batching.shards, |_, part| {
            let s = score(model, &data.batch(part, pad, device)?, Mode::Eval)?;
            Ok((
                part.len(),
                (s.loss.to_dtype(DType::F64)? * part.len() as f64)?,
                s.correct,
            ))
        })?;
        for (n, loss, correct) in &parts {
            pending.push(0, *n, loss, correct);
        }
    }
    let (mut loss, mut correct) = (0.0, 0.0);
    let (results, pivots) = pending.read(device)?;
    pivots?;
    for r in results {
        loss += r.loss;
        correct += r.correct as f64;
    }
    let [loss, correct] = world
        .sum_in_rank_order(&[loss, correct], world.size())
        .map_err(collective)?[..]
    else {
        unreachable!("two sums")
    };
    let n = data.len().max(1) as f64;
    Ok(Evaluation {
        loss: loss / n,
        accuracy: (!data.is_regression()).then_some(correct / n),
    })
}

/// A collective's error as candle's.
fn collective(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

/// Batches between read-backs of the training loss on `device`: every batch on the CPU (where
/// reading costs nothing), every 25th on CUDA, so that the host queues steps ahead of the GPU.
pub fn report_interval(device: &Device) -> usize {
    if device.is_cpu() {
        1
    } else {
        25
    }
}

/// One epoch of training: examples shuffled with `seed`, one optimiser step per batch (the
/// loss is the batch mean, however the batch is sharded); dropout masks are keyed by `seed`,
/// the optimiser step and the row in the batch (see [`DropoutKey`]). With several ranks in
/// `world`, each computes its part of every batch ([`part`]) and all take the step of the whole
/// batch ([`Optimizer::step_across`]).
///
/// The losses and correct counts stay on the device and are read back every `report_every`
/// batches and at the end of the epoch; `on_batch` then sees each batch's record, in order. A
/// non-finite loss, or a singular pivot in a tree solve, stops the epoch with an error at that
/// read (naming the step of the first non-finite loss). Returns the mean training loss and
/// accuracy.
#[allow(clippy::too_many_arguments)]
pub fn train_epoch(
    model: &SequenceClassifier,
    opt: &mut Optimizer,
    data: &Dataset,
    batching: Batching,
    seed: u64,
    device: &Device,
    report_every: usize,
    world: &Arc<World>,
    on_batch: impl FnMut(&BatchRecord),
) -> Result<Evaluation> {
    let epoch = Epoch {
        model,
        data,
        batching,
        seed,
        device,
        report_every,
        world,
        graphs: None,
    };
    let mut so_far = EpochSoFar::default();
    epoch.train(opt, &mut so_far, epoch.batches(), on_batch)?;
    Ok(so_far.evaluation(data))
}

/// How far an epoch has trained: its first `batches` batches, the sum of their mean losses
/// weighted by their sizes, and their correct predictions. A mid-epoch checkpoint keeps it, and
/// the epoch continues from it as if it had never stopped (the same order, dropout and sums).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochSoFar {
    pub batches: usize,
    pub loss_sum: f64,
    pub correct: usize,
}

impl EpochSoFar {
    /// Mean loss and accuracy over an epoch of `data`.
    pub fn evaluation(&self, data: &Dataset) -> Evaluation {
        let n = data.len().max(1) as f64;
        Evaluation {
            loss: self.loss_sum / n,
            accuracy: (!data.is_regression()).then_some(self.correct as f64 / n),
        }
    }
}

/// An epoch of training, as [`train_epoch`] describes, that can be trained in parts.
pub struct Epoch<'a> {
    pub model: &'a SequenceClassifier,
    pub data: &'a Dataset,
    pub batching: Batching,
    /// Shuffles the examples and keys dropout.
    pub seed: u64,
    pub device: &'a Device,
    /// Batches between read-backs of the losses ([`report_interval`]).
    pub report_every: usize,
    pub world: &'a Arc<World>,
    /// On CUDA, replay the steps captured as CUDA graphs where they can be (see
    /// `src/train/captured.rs`): one process, one micro-batch, not f16, whole batches; the
    /// graphs are kept here for later parts and epochs. `None`: every step eager.
    pub graphs: Option<&'a StepGraphs>,
}

impl Epoch<'_> {
    /// The number of batches (optimiser steps) in the epoch.
    pub fn batches(&self) -> usize {
        self.data.len().div_ceil(self.batching.step_size())
    }

    /// Trains the epoch's batches from `so_far.batches` up to (not including) `until`, adding
    /// them to `so_far`; the losses are read back by the last of them, so that the model then
    /// is the one of the step reached.
    pub fn train(
        &self,
        opt: &mut Optimizer,
        so_far: &mut EpochSoFar,
        until: usize,
        mut on_batch: impl FnMut(&BatchRecord),
    ) -> Result<()> {
        let Epoch {
            model,
            data,
            batching,
            seed,
            device,
            report_every,
            world,
            graphs,
        } = *self;
        let batching = batching.over(data);
        one_shard_on_cuda(device, batching)?;
        // Ranks sum BatchNorm's statistics in the forward pass: each must hold part of every
        // batch (a rank with none would skip the forward pass, and the collectives would
        // mismatch).
        let (ranks, size) = (world.size(), batching.batch_size.max(1));
        let short = data.len() % size;
        let too_small = if data.len().min(size) < ranks {
            Some(("every batch holds", data.len().min(size)))
        } else if short > 0 && short < ranks {
            Some(("the last batch of an epoch holds", short))
        } else {
            None
        };
        if batching.batch_norm && ranks > 1 && batching.accumulate > 1 {
            candle_core::bail!(
                "--accumulate with BatchNorm across ranks is not supported: use LayerNorm, or \
                 one rank"
            );
        }
        if let (true, Some((which, n))) = (batching.batch_norm && ranks > 1, too_small) {
            candle_core::bail!(
                "BatchNorm across {ranks} ranks needs at least {ranks} examples in every batch, \
                 but {which} {n} ({} training examples in batches of {size}): choose another \
                 --batch-size or --max-train-samples, or fewer ranks",
                data.len()
            );
        }
        let mut order: Vec<usize> = (0..data.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let mut pending = Pending::default();
        let mut report = |pending: &mut Pending, so_far: &mut EpochSoFar| -> Result<()> {
            // The sums on the GPUs first, with the ranks' deadline: a read would wait without
            // one.
            world.wait_for_devices().map_err(collective)?;
            let (results, pivots) = pending.read(device)?;
            for r in results {
                if !r.loss.is_finite() {
                    candle_core::bail!(
                        "the training loss is {} at step {}; stopping (the last good checkpoint \
                         is kept)",
                        r.loss,
                        r.step
                    );
                }
                so_far.batches += 1;
                so_far.loss_sum += r.loss * r.samples as f64;
                so_far.correct += r.correct;
                on_batch(&r);
            }
            pivots
        };
        let until = until.min(self.batches());
        let batches = order
            .chunks(batching.step_size())
            .enumerate()
            .take(until)
            .skip(so_far.batches);
        #[cfg(feature = "cuda")]
        let mut kept = graphs.map(|g| g.captured.borrow_mut());
        #[cfg(feature = "cuda")]
        let mut captured = match kept.as_deref_mut() {
            Some(slot) => {
                if slot.is_none() {
                    *slot = captured_steps(device, batching, world, opt);
                }
                slot.as_mut()
            }
            None => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = graphs;
        for (b, idx) in batches {
            // A whole batch's step replayed from its captured graph, where there is one.
            #[cfg(feature = "cuda")]
            let replayed: Option<Result<StepOut>> = match &mut captured {
                Some(c) if idx.len() == batching.batch_size => {
                    let pad = batching.padding(data, idx);
                    c.step(model, opt, data, pad, seed, idx)
                        .transpose()
                        .map(|r| r.map(|r| (r.loss, r.correct, r.logged)))
                }
                _ => None,
            };
            #[cfg(not(feature = "cuda"))]
            let replayed: Option<Result<StepOut>> = None;
            let step_result = match replayed {
                Some(r) => r,
                None => train_batch(model, opt, data, batching, seed, device, world, idx)
                    .map(|(value, right)| (value, right, opt.take_logged())),
            };
            let (value, right, logged) = match step_result {
                Ok(r) => r,
                // A step that fails after a non-finite loss (a singular pivot from the diverged
                // parameters, say) is reported as that loss.
                Err(e) => {
                    report(&mut pending, so_far)?;
                    return Err(e);
                }
            };
            pending.push(opt.step_count(), idx.len(), &value, &right);
            if let Some((lr, norm)) = logged {
                pending.log(lr, norm);
            }
            pending.scaled(opt.scaler());
            if (b + 1) % report_every.max(1) == 0 || b + 1 == until {
                report(&mut pending, so_far)?;
            }
        }
        Ok(())
    }
}
