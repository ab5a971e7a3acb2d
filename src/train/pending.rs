//! A training batch's results as the step leaves them on the device ([`Pending`]), and as
//! they are read back ([`BatchRecord`]).

use candle_core::{Device, Result, Tensor};

use super::precision::LossScaler;
use super::trainer::internal;

/// Per-batch results still on the device: (step, batch size, mean loss, correct count, and at
/// the steps the optimiser keeps, its learning rate and gradient norm), the tensors f64
/// scalars. Reading them waits for the device, so training reads them in groups.
#[derive(Default)]
pub(crate) struct Pending(Vec<PendingBatch>);

struct PendingBatch {
    /// When the host finished queueing the step.
    queued: std::time::Instant,
    step: usize,
    samples: usize,
    loss: Tensor,
    correct: Tensor,
    logged: Option<(f64, Tensor)>,
    scaler: Option<LossScaler>,
}

/// A training batch's results, read back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchRecord {
    /// When the host finished queueing the step (on CUDA the device may finish it later).
    pub queued: std::time::Instant,
    /// The optimiser step it took (1-based).
    pub step: usize,
    pub samples: usize,
    /// Mean loss over the batch.
    pub loss: f64,
    pub correct: usize,
    /// At the steps the optimiser keeps ([`super::optim::Optimizer::log_every`]): the regular group's
    /// learning rate and the global gradient norm before clipping.
    pub logged: Option<(f64, f64)>,
    /// Under f16, the loss scaler after the step.
    pub scaler: Option<LossScaler>,
}

impl Pending {
    /// Adds the results of step `step` (1-based), detached from the graph that made them (which
    /// would otherwise keep the batch's activations alive until the read).
    pub(crate) fn push(&mut self, step: usize, n: usize, loss: &Tensor, correct: &Tensor) {
        self.0.push(PendingBatch {
            queued: std::time::Instant::now(),
            step,
            samples: n,
            loss: loss.detach(),
            correct: correct.detach(),
            logged: None,
            scaler: None,
        });
    }

    /// Adds the learning rate and gradient norm of the last step pushed.
    pub(crate) fn log(&mut self, lr: f64, norm: Tensor) {
        if let Some(last) = self.0.last_mut() {
            last.logged = Some((lr, norm));
        }
    }

    /// Adds the loss scaler's state after the last step pushed.
    pub(crate) fn scaled(&mut self, scaler: Option<LossScaler>) {
        if let Some(last) = self.0.last_mut() {
            last.scaler = scaler;
        }
    }

    /// Reads every pending result back in one transfer and empties the list. With them comes
    /// the tree solves' pivot status on `device` (which the same synchronisation makes free),
    /// for the caller to report after any non-finite loss: a loss that diverged is the cause
    /// of the singular pivots that follow it.
    pub(crate) fn read(&mut self, device: &Device) -> Result<(Vec<BatchRecord>, Result<()>)> {
        if self.0.is_empty() {
            return Ok((Vec::new(), Ok(())));
        }
        let values: Vec<&Tensor> = self
            .0
            .iter()
            .flat_map(|b| {
                [
                    Some(&b.loss),
                    Some(&b.correct),
                    b.logged.as_ref().map(|g| &g.1),
                ]
            })
            .flatten()
            .collect();
        let host = Tensor::stack(&values, 0)?.to_vec1::<f64>()?;
        let pivots = crate::ops::check_pivots(device);
        let mut at = host.iter().copied();
        let mut next = || {
            at.next()
                .ok_or_else(|| internal("fewer results than pending"))
        };
        let mut out = Vec::with_capacity(self.0.len());
        for b in &self.0 {
            let (loss, correct) = (next()?, next()? as usize);
            let logged = match &b.logged {
                Some((lr, _)) => Some((*lr, next()?)),
                None => None,
            };
            out.push(BatchRecord {
                queued: b.queued,
                step: b.step,
                samples: b.samples,
                loss,
                correct,
                logged,
                scaler: b.scaler,
            });
        }
        self.0.clear();
        Ok((out, pivots))
    }
}
