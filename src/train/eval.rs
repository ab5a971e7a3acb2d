//! A checkpoint on its task's test split (`myo eval`), at the rate it was trained at or, for
//! audio, at a lower one without retraining.

use std::path::Path;

use anyhow::{bail, Result};

use super::checkpoint;
use super::config::RunConfig;
use super::precision::Precision;
use super::run::{checkpoint_model_in, Exec};
use super::trainer::evaluate;
use crate::data::speech;
use crate::data::task::{DataSource, Input};
use crate::nn::SeqLayerConfig;

/// A checkpoint's loss and accuracy (classification) on its task's test split, and how many
/// examples it saw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TestScore {
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub examples: usize,
}

/// Loss and accuracy of the checkpoint at `path` on its task's whole test split, or on its
/// first `max_samples` examples, read from its own data source or from `data_dir` when given
/// (the test split alone is read where it has files of its own: [`Task::load_test`]).
///
/// [`Task::load_test`]: crate::data::task::Task::load_test
pub fn eval_checkpoint(
    path: &Path,
    data_dir: Option<&Path>,
    max_samples: Option<usize>,
    exec: &Exec,
) -> Result<TestScore> {
    eval_checkpoint_at(path, data_dir, max_samples, None, Precision::F32, exec)
}

/// [`eval_checkpoint`], for audio at `rate` Hz when given, a rate that divides the recordings'
/// by k: the test clips are decimated (every k-th sample) and every S5 layer's Δ multiplied by
/// k, so that the continuous-time system the model learned runs at the new rate without
/// retraining (S5 §6.2, Table 2's 8 kHz column). The model computes in `precision` (its
/// parameters cast from the checkpoint's f32).
pub fn eval_checkpoint_at(
    path: &Path,
    data_dir: Option<&Path>,
    max_samples: Option<usize>,
    rate: Option<u32>,
    precision: Precision,
    exec: &Exec,
) -> Result<TestScore> {
    let device = &exec.device;
    precision.check(device)?;
    let ck = checkpoint::read::<RunConfig>(path)?;
    let mut cfg = ck.config;
    if let Some(dir) = data_dir {
        cfg.data = DataSource::Dir {
            dir: dir.to_path_buf(),
        };
    }
    let k = match rate {
        None => 1,
        Some(r) => {
            if !matches!(cfg.task.input, Input::Audio { .. }) {
                bail!("--rate {r}: task {} is not audio", cfg.task.name);
            }
            if r == 0 || !speech::RATE.is_multiple_of(r) {
                bail!(
                    "--rate {r}: expected a rate that divides {} Hz",
                    speech::RATE
                );
            }
            if !matches!(cfg.model.layer, SeqLayerConfig::S5(_)) {
                bail!(
                    "--rate rescales S5's time step Δ; the checkpoint's layers are {}",
                    cfg.model.layer.summary()
                );
            }
            (speech::RATE / r) as usize
        }
    };
    let mut tensors = ck.tensors;
    if k > 1 {
        // Δ = exp(log_step): Δ·k is log_step + ln k.
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("ssm.log_step") {
                *t = (&*t + (k as f64).ln())?;
            }
        }
    }
    let (_, model) = checkpoint_model_in(&tensors, &cfg, path, device, precision.dtype())?;
    let test = cfg.task.load_test(&cfg.data)?;
    let test = match max_samples {
        Some(0) => bail!("--max-samples 0: evaluating needs at least one example"),
        Some(n) => test.truncated(n),
        None => test,
    };
    if test.is_empty() {
        bail!("the test split of task {} is empty", cfg.task.name);
    }
    let test = match k {
        1 => test,
        k => speech::decimated(&test, k)?,
    };
    let e = evaluate(
        &model,
        &test,
        cfg.batching(exec.shards, false),
        device,
        &exec.world,
    )?;
    Ok(TestScore {
        loss: e.loss,
        accuracy: e.accuracy,
        examples: test.len(),
    })
}
