//! Training steps captured as CUDA graphs and replayed (`myo train --cuda-graph`, on by default
//! on CUDA). The first full batch of each shape runs eagerly while its step — forward, loss,
//! backward, AdamW — is captured ([`StepGraph::capture`]); each later batch of that shape is
//! copied into the captured step's input buffers and the graph replayed, one launch in place of
//! hundreds. What changes between steps is written before each replay: the batch, AdamW's
//! hyper-parameter rows ([`Optimizer::prepare`]) and the dropout masks' key, of the epoch's seed
//! and the step ([`crate::cuda::set_dropout_key`]), so that the graphs serve every epoch of the
//! run (the caller keeps them: [`super::trainer::StepGraphs`]). Inside the graph the step's
//! loss, correct count and gradient norm are copied into buffers of their own, which the host
//! copies out after each replay, so that the losses stay on the device as eager steps' do.
//!
//! The replayed steps are the eager steps to the bit: the same kernels on the same values
//! (tested on the GPU, `tests/cuda_graph.rs`). A graph whose launches may point to memory since
//! freed (our kernels' workspace replaced by a larger one: [`crate::cuda::generation`]) is
//! captured again. Steps that cannot be replayed the same way every
//! time run eagerly: f16's (its loss scaler decides on the host whether to step), several
//! micro-batches or ranks, and a batch of another size (an epoch's last). A capture that fails
//! (out of device memory, say) leaves its eager step taken and every later step eager.

use candle_core::{CudaDevice, DType, Result, Tensor};

use super::optim::Optimizer;
use super::trainer::{score, PAD_LENGTHS};
use crate::cuda::graph::{prepare_step, StepGraph};
use crate::data::dataset::{Batch, Dataset, Target};
use crate::nn::{DropoutKey, GradSink, Mode, SequenceClassifier};

/// Graphs kept at most: one per batch shape (a task padded per batch has up to
/// [`PAD_LENGTHS`]); batches of further shapes step eagerly.
const MAX_GRAPHS: usize = PAD_LENGTHS;

/// The captured steps of one run, by batch shape.
pub(crate) struct CapturedSteps {
    dev: CudaDevice,
    graphs: Vec<Captured>,
    /// The device's [`crate::cuda::generation`] when the graphs were captured.
    generation: u64,
    /// A capture failed (out of memory, say): every later step is eager.
    failed: bool,
}

/// One batch shape's captured step.
struct Captured {
    /// The shapes of the batch's tensors.
    shape: Vec<Vec<usize>>,
    graph: StepGraph,
    /// The inputs the graph reads, overwritten before each replay.
    batch: Batch,
    /// What the graph writes: the mean loss and the correct count (f64), then, where the
    /// optimiser computed it, the gradient norm; each of shape (1,).
    results: Vec<Tensor>,
}

/// A step's results on the device, as [`super::trainer`] reads an eager step's.
pub(crate) struct StepResults {
    pub loss: Tensor,
    pub correct: Tensor,
    /// The learning rate and gradient norm, at the steps the optimiser keeps.
    pub logged: Option<(f64, Tensor)>,
}

impl CapturedSteps {
    /// Captures on `dev`; the optimiser computes the gradient norm at every step (where it
    /// keeps some), so that every step is the same work.
    pub(crate) fn new(dev: &CudaDevice, opt: &mut Optimizer) -> Self {
        opt.norm_every_step(true);
        CapturedSteps {
            dev: dev.clone(),
            graphs: Vec::new(),
            generation: 0,
            failed: false,
        }
    }

    /// The step of the examples `idx` (a whole batch, one micro-batch, one rank) padded to
    /// `pad`: a replay of its shape's graph, captured first if this shape has none. `None`
    /// when no more graphs are kept: the caller steps eagerly.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &mut self,
        model: &SequenceClassifier,
        opt: &mut Optimizer,
        data: &Dataset,
        pad: Option<usize>,
        seed: u64,
        idx: &[usize],
    ) -> Result<Option<StepResults>> {
        let device = candle_core::Device::Cuda(self.dev.clone());
        let batch = data.batch(idx, pad, &device)?;
        let shape = shapes(&batch);
        // The dropout masks' key, as an eager step's: the seed and the steps taken before it.
        let key = DropoutKey {
            seed,
            step: opt.step_count() as u64,
            first_row: 0,
            key_on_device: true,
        };
        // Graphs that may point to freed memory (a workspace since grown) are captured again.
        if crate::cuda::generation(&self.dev)? != self.generation {
            self.graphs.clear();
        }
        if let Some(c) = self.graphs.iter().find(|c| c.shape == shape) {
            overwrite(&c.batch, &batch)?;
            prepare_step(&self.dev, opt, key)?;
            c.graph.replay()?;
            let out = |i: usize| c.results[i].copy()?.reshape(());
            let logged = match (opt.kept_rate(), c.results.get(2)) {
                (Some(lr), Some(_)) => Some((lr, out(2)?)),
                _ => None,
            };
            return Ok(Some(StepResults {
                loss: out(0)?,
                correct: out(1)?,
                logged,
            }));
        }
        if self.failed || self.graphs.len() == MAX_GRAPHS {
            return Ok(None);
        }
        prepare_step(&self.dev, opt, key)?;
        // The capture runs the step twice: eagerly (this batch's step), then under capture.
        let mut eager: Option<Vec<Tensor>> = None;
        let mut results: Vec<Tensor> = Vec::new();
        let captured = StepGraph::capture(&self.dev, || {
            let out = body(model, opt, &batch, key)?;
            match &eager {
                None => {
                    results = out.iter().map(Tensor::copy).collect::<Result<_>>()?;
                    eager = Some(out);
                }
                Some(_) => {
                    for (to, from) in results.iter().zip(&out) {
                        to.slice_set(from, 0, 0)?;
                    }
                }
            }
            Ok(())
        });
        // A step that failed eagerly is the step's error; one whose capture failed after its
        // eager run was taken, and the steps after it run eagerly.
        let Some(out) = eager else {
            return Err(captured.err().unwrap_or_else(|| {
                candle_core::Error::Msg("internal error: a step captured without running".into())
            }));
        };
        let graph = match captured {
            Ok(graph) => Some(graph),
            Err(e) => {
                eprintln!(
                    "note: the training step could not be captured as a CUDA graph, so every \
                     step runs eagerly: {}",
                    crate::fail::message(&e.into())
                );
                self.failed = true;
                self.graphs.clear();
                None
            }
        };
        let logged = match (opt.kept_rate(), out.get(2)) {
            (Some(lr), Some(norm)) => Some((lr, norm.reshape(())?)),
            _ => None,
        };
        let results_of_step = StepResults {
            loss: out[0].reshape(())?,
            correct: out[1].reshape(())?,
            logged,
        };
        if let Some(graph) = graph {
            // The capture's eager run may have grown the workspace: the older graphs go then.
            let now = crate::cuda::generation(&self.dev)?;
            if now != self.generation {
                self.graphs.clear();
                self.generation = now;
            }
            self.graphs.push(Captured {
                shape,
                graph,
                batch,
                results,
            });
        }
        Ok(Some(results_of_step))
    }
}

/// The device's part of a training step on `batch`, its dropout keyed by `key` read from the
/// device's key word: forward, loss, backward and AdamW on the rows [`Optimizer::prepare`]
/// wrote, the same operations as an eager step of one shard. Returns the mean loss and correct
/// count (f64) and, where computed, the gradient norm, each of shape (1,).
fn body(
    model: &SequenceClassifier,
    opt: &mut Optimizer,
    batch: &Batch,
    key: DropoutKey,
) -> Result<Vec<Tensor>> {
    let sink = GradSink::new();
    let s = score(model, batch, Mode::Train(key, None, Some(&sink)))?;
    // As an eager step of one part: its share of the batch mean is 1.
    let mut grads = (&s.objective * opt.loss_scale())?.backward()?;
    sink.add_to(&mut grads)?;
    opt.launch_with(&grads)?;
    // The norm is read from the buffer the graph writes, not from the optimiser's record.
    opt.take_logged();
    let mut out = vec![
        (s.loss * 1.0)?.to_dtype(DType::F64)?.reshape(1)?,
        s.correct.reshape(1)?,
    ];
    if let Some(norm) = opt.take_last_norm() {
        out.push(norm.reshape(1)?);
    }
    Ok(out)
}

/// The shapes of a batch's tensors (which of them it has included).
fn shapes(b: &Batch) -> Vec<Vec<usize>> {
    let mut out = vec![
        b.x.dims().to_vec(),
        b.lengths.dims().to_vec(),
        target(b).dims().to_vec(),
    ];
    out.extend(b.dt.as_ref().map(|t| t.dims().to_vec()));
    out
}

/// Copies `from`'s tensors into `to`'s, a batch of the same shapes (in stream order, before the
/// replay that reads them).
fn overwrite(to: &Batch, from: &Batch) -> Result<()> {
    let pairs = [
        (&to.x, &from.x),
        (&to.lengths, &from.lengths),
        (target(to), target(from)),
    ];
    for (t, f) in pairs {
        t.slice_set(f, 0, 0)?;
    }
    if let (Some(t), Some(f)) = (&to.dt, &from.dt) {
        t.slice_set(f, 0, 0)?;
    }
    Ok(())
}

/// The batch's labels or values.
fn target(b: &Batch) -> &Tensor {
    match &b.target {
        Target::Labels(y) | Target::Values(y) => y,
    }
}
