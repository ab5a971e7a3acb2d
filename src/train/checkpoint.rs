//! Model checkpoints as safetensors files, and the other files of a run's folder ([`RunDir`]).
//!
//! * Tensor names mirror the module tree (`layers.3.ssm.lambda_re`): they are the names of the
//!   model's `VarMap`, as given by the `VarBuilder` prefixes. Python's `safetensors` package
//!   opens the files as they are.
//! * The full model config is JSON in the file's metadata under [`CONFIG_KEY`], so a checkpoint
//!   rebuilds its model with nothing else.
//! * Writes are atomic: a temporary file in the same folder, then a rename, so an interrupted
//!   save never leaves a truncated checkpoint in place of a good one.
//! * Loading checks the file against the model: a missing, extra or mis-shaped tensor, a file
//!   that is not safetensors, or one without a config is an error naming the file and tensor.
//!   A model built from a file's config ([`build_from`]) takes each parameter's shape from the
//!   file before computing anything for it, so a config cannot size what the file lacks.
//! * A run's `last.safetensors` also holds what resuming needs, so that one rename commits it
//!   all: the optimiser's state as tensors named [`OPTIMIZER_PREFIX`]`…` (set apart by
//!   [`read`]; a model never loads them) and more metadata (the run's progress).
//! * The same tensors and metadata always give the same bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Metadata key of the model config (JSON).
pub const CONFIG_KEY: &str = "myosotis.config";
/// Metadata key of the checkpoint format version.
pub const FORMAT_KEY: &str = "myosotis.format";
/// Format 2: a run's config holds its whole task description and its data source.
pub const FORMAT: &str = "2";

/// Names of the optimiser's tensors in a resumable checkpoint start with this (model variables
/// never contain a `/`).
pub const OPTIMIZER_PREFIX: &str = "optimizer/";

/// Saves every variable of `varmap` and `config` (as JSON metadata) to `path`, atomically.
pub fn save<C: Serialize>(varmap: &VarMap, config: &C, path: &Path) -> Result<()> {
    save_resumable(varmap, config, &[], &[], path)
}

/// [`save`] with the optimiser's state (stored under [`OPTIMIZER_PREFIX`]) and more metadata
/// entries, in the same file and the same atomic write.
pub fn save_resumable<C: Serialize>(
    varmap: &VarMap,
    config: &C,
    optimizer: &[(String, Tensor)],
    metadata: &[(&str, String)],
    path: &Path,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = {
        let data = varmap.data().lock().expect("varmap lock");
        let mut named: Vec<(String, Tensor)> = data
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_device(&Device::Cpu)?)))
            .collect::<candle_core::Result<_>>()?;
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    for (name, t) in optimizer {
        tensors.push((
            format!("{OPTIMIZER_PREFIX}{name}"),
            t.to_device(&Device::Cpu)?,
        ));
    }
    write_checkpoint(&tensors, config, metadata, path)
}

/// Saves named tensors and `config` to `path`, atomically (temporary file, then rename).
pub fn save_tensors<C: Serialize>(
    tensors: &[(String, Tensor)],
    config: &C,
    path: &Path,
) -> Result<()> {
    write_checkpoint(tensors, config, &[], path)
}

/// Named tensors, `config` and the format (plus `extra` metadata) to `path`, atomically.
fn write_checkpoint<C: Serialize>(
    tensors: &[(String, Tensor)],
    config: &C,
    extra: &[(&str, String)],
    path: &Path,
) -> Result<()> {
    let config = serde_json::to_string(config).context("serialising the model config")?;
    let mut metadata = HashMap::from([
        (CONFIG_KEY.to_string(), config),
        (FORMAT_KEY.to_string(), FORMAT.to_string()),
    ]);
    metadata.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    write_safetensors(tensors, metadata, path)
}

/// Writes named tensors and metadata to the safetensors file `path` atomically (see
/// [`write_atomic`]), the same tensors and metadata always as the same bytes.
pub(crate) fn write_safetensors(
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
    path: &Path,
) -> Result<()> {
    let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
    let bytes = safetensors::serialize(named, Some(metadata))
        .map_err(anyhow::Error::from)
        .and_then(canonical_header)
        .with_context(|| format!("writing {}", path.display()))?;
    write_atomic(path, &bytes)
}

/// Writes `bytes` to `path` atomically: a temporary file `.NAME.PID.tmp` in the same folder,
/// then a rename, so that `path` holds either its old or its new content whenever the process
/// dies; the temporary file is removed when the write fails. Every file of a run is written
/// this way.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("path {} has no file name", path.display()))?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = super::pause::fail_point(&format!("write {name}"))
        .map_err(anyhow::Error::from)
        .and_then(|_| Ok(std::fs::write(&tmp, bytes)?))
        .with_context(|| format!("writing {}", path.display()));
    if written.is_ok() {
        super::pause::point(&format!("rename {name}"));
    }
    if let Err(e) = written.and_then(|_| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}

/// The safetensors file `bytes` with its JSON header's keys (tensor names, and the metadata's
/// keys inside `__metadata__`) in sorted order, so that the same tensors and metadata always give
/// the same bytes: the writer emits the metadata in a hash map's order, which varies from run to
/// run. Sorting keeps the header's length, so the data offsets and the padding stand.
fn canonical_header(mut bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = || anyhow::anyhow!("internal error: the safetensors writer produced no header");
    let n = u64::from_le_bytes(bytes.get(..8).ok_or_else(bad)?.try_into()?) as usize;
    let header = bytes.get(8..8 + n).ok_or_else(bad)?;
    // serde_json's maps are ordered by key.
    let value: serde_json::Value = serde_json::from_slice(header)?;
    let sorted = serde_json::to_vec(&value)?;
    if sorted.len() > n {
        bail!("internal error: the sorted safetensors header grew");
    }
    bytes[8..8 + sorted.len()].copy_from_slice(&sorted);
    bytes[8 + sorted.len()..8 + n].fill(b' ');
    Ok(bytes)
}

/// A checkpoint read from disk: its config and tensors (on the CPU).
pub struct Checkpoint<C> {
    pub config: C,
    /// The model's tensors.
    pub tensors: HashMap<String, Tensor>,
    /// The optimiser's state, by name without [`OPTIMIZER_PREFIX`] (empty but in a run's
    /// `last.safetensors`).
    pub optimizer: HashMap<String, Tensor>,
    /// Every metadata entry, the config's included.
    pub metadata: HashMap<String, String>,
}

/// Reads the config of the checkpoint at `path` (to rebuild its model).
pub fn read<C: DeserializeOwned>(path: &Path) -> Result<Checkpoint<C>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read checkpoint {}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
    match meta.metadata().as_ref().and_then(|m| m.get(FORMAT_KEY)) {
        Some(f) if f == FORMAT => {}
        Some(f) => bail!(
            "{}: checkpoint format {f}, this version of myosotis reads format {FORMAT} (retrain, \
             or use the version that wrote it)",
            path.display()
        ),
        None if meta
            .metadata()
            .as_ref()
            .is_some_and(|m| m.contains_key(CONFIG_KEY)) =>
        {
            bail!(
            "{}: no checkpoint format (metadata key '{FORMAT_KEY}'); written by an early version \
             of myosotis that this one cannot read",
            path.display()
        )
        }
        None => {}
    }
    let json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(CONFIG_KEY))
        .with_context(|| format!("{} has no model config (metadata key '{CONFIG_KEY}'); it was not written by myosotis", path.display()))?;
    let config = serde_json::from_str(json).with_context(|| {
        format!(
            "{}: the model config in its metadata does not parse",
            path.display()
        )
    })?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let all = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| anyhow::anyhow!("{}: cannot read its tensors: {e}", path.display()))?;
    let (mut tensors, mut optimizer) = (HashMap::new(), HashMap::new());
    for (name, t) in all {
        match name.strip_prefix(OPTIMIZER_PREFIX) {
            Some(rest) => optimizer.insert(rest.to_string(), t),
            None => tensors.insert(name, t),
        };
    }
    Ok(Checkpoint {
        config,
        tensors,
        optimizer,
        metadata,
    })
}

/// A model built by `build` from a checkpoint's `tensors` (from [`read`]) and loaded with them,
/// its variables in `dtype`.
/// Each parameter the model asks for is checked against the file, present and of the same
/// shape, before anything is allocated or computed for it (a config read from a file sizes
/// nothing the file does not hold); then [`load_into`]. `path` names the file in errors.
pub fn build_from<M>(
    tensors: &HashMap<String, Tensor>,
    path: &Path,
    device: &Device,
    dtype: DType,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> Result<(VarMap, M)> {
    let varmap = VarMap::new();
    let stored = Stored {
        varmap: varmap.clone(),
        shapes: tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.dims().to_vec()))
            .collect(),
    };
    let vb = VarBuilder::from_backend(Box::new(stored), dtype, device.clone());
    let model =
        build(vb).map_err(|e| anyhow::anyhow!("{}: building its model: {e}", path.display()))?;
    load_into(&varmap, tensors, path)?;
    Ok((varmap, model))
}

/// The variable builder of [`build_from`]: a `VarMap` whose variables must be in the file.
struct Stored {
    varmap: VarMap,
    shapes: HashMap<String, Vec<usize>>,
}

impl SimpleBackend for Stored {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.shapes.get(name) {
            None => candle_core::bail!("{}", missing(name)),
            Some(dims) if dims != shape.dims() => {
                candle_core::bail!("{}", mis_shaped(name, dims, shape.dims()))
            }
            Some(_) => self.varmap.get(shape, name, init, dtype, device),
        }
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("tensor '{name}' asked for without a shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

fn missing(name: &str) -> String {
    format!("tensor '{name}' is missing (the model has it, the checkpoint does not)")
}

fn mis_shaped(name: &str, file: &[usize], model: &[usize]) -> String {
    format!("tensor '{name}' has shape {file:?}, the model expects {model:?}")
}

/// Loads `tensors` (from [`read`]) into the model's variables: every variable must be present
/// with its shape, and no other tensor may be. `path` names the file in errors.
pub fn load_into(varmap: &VarMap, tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in &names {
        let var = &data[*name];
        let Some(t) = tensors.get(*name) else {
            bail!("{}: {}", path.display(), missing(name));
        };
        if t.dims() != var.dims() {
            bail!(
                "{}: {}",
                path.display(),
                mis_shaped(name, t.dims(), var.dims())
            );
        }
    }
    let mut extra: Vec<&String> = tensors.keys().filter(|k| !data.contains_key(*k)).collect();
    extra.sort();
    if let Some(name) = extra.first() {
        bail!(
            "{}: unexpected tensor '{name}' (the checkpoint has it, the model does not){}",
            path.display(),
            if extra.len() > 1 {
                format!(", and {} more", extra.len() - 1)
            } else {
                String::new()
            }
        );
    }
    for name in names {
        let var = &data[name];
        let t = tensors[name]
            .to_dtype(var.dtype())?
            .to_device(var.device())?;
        var.set(&t)
            .with_context(|| format!("{}: setting tensor '{name}'", path.display()))?;
    }
    Ok(())
}

/// One evaluation of a run, or one training step's record, a line of its `metrics.jsonl`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricRecord {
    /// 1-based.
    pub epoch: usize,
    /// `train`, `val` or `test`; `step` for a training step (its batch's loss and accuracy).
    pub split: String,
    /// Mean loss (JSON `null` when not finite).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Classification: the fraction of correct predictions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Regression: the mean squared error over steps and outputs (the loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mse: Option<f64>,
    /// Optimiser steps taken so far.
    pub step: usize,
    /// Wall time since the run began.
    pub seconds: f64,
    /// A step record's learning rate (the regular group's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// A step record's global gradient norm, before clipping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// A step record's training samples per second since the previous one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// Under f16, in step and train records: the loss scale when the record was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Under f16, in step and train records: the steps skipped so far for gradients that were
    /// not finite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<usize>,
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Reads the records of a `metrics.jsonl` file; a line that does not parse is an error naming
/// the file and the line.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{} line {}: not a metric record", path.display(), i + 1))
        })
        .collect()
}

/// A run's output folder and every file in it:
/// * `config.json` — the run's config (also in every checkpoint's metadata);
/// * `metrics.jsonl` — one [`MetricRecord`] per evaluation;
/// * `last.safetensors` after every epoch — the model, and for resuming the optimiser's moments
///   and the run's progress, in one atomic write, so a run killed at any moment resumes from
///   its last complete epoch — and `best.safetensors` at the best validation accuracy;
/// * `curves.svg` — the curves of the metrics.
///
/// Each file is replaced atomically ([`write_atomic`]); `metrics.jsonl` is appended to, and a
/// line cut short by a kill is dropped when the run resumes.
pub struct RunDir {
    dir: PathBuf,
}

impl RunDir {
    /// The files of a run.
    pub const FILES: [&'static str; 5] = [
        "config.json",
        "metrics.jsonl",
        "curves.svg",
        "best.safetensors",
        "last.safetensors",
    ];

    /// The folder `dir`, created if missing.
    pub fn create(dir: &Path) -> Result<RunDir> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(RunDir::at(dir))
    }

    /// The run files in `dir`, which need not exist.
    pub fn at(dir: &Path) -> RunDir {
        RunDir {
            dir: dir.to_path_buf(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    pub fn metrics(&self) -> PathBuf {
        self.dir.join("metrics.jsonl")
    }

    pub fn curves(&self) -> PathBuf {
        self.dir.join("curves.svg")
    }

    pub fn best(&self) -> PathBuf {
        self.dir.join("best.safetensors")
    }

    pub fn last(&self) -> PathBuf {
        self.dir.join("last.safetensors")
    }

    /// The run files the folder holds.
    pub fn held(&self) -> Vec<&'static str> {
        Self::FILES
            .into_iter()
            .filter(|f| self.dir.join(f).exists())
            .collect()
    }

    /// Deletes the run files the folder holds.
    pub fn remove_run(&self) -> Result<()> {
        for f in self.held() {
            let path = self.dir.join(f);
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
        Ok(())
    }

    /// Removes the temporary files that a process killed while writing left (`.NAME.PID.tmp`
    /// of a run file): they never hold anything the run still needs.
    pub fn remove_stale_temporaries(&self) -> Result<()> {
        let entries = std::fs::read_dir(&self.dir)
            .with_context(|| format!("reading {}", self.dir.display()))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let ours = Self::FILES
                .iter()
                .any(|f| name.starts_with(&format!(".{f}.")) && name.ends_with(".tmp"));
            if ours {
                std::fs::remove_file(entry.path())
                    .with_context(|| format!("removing {}", entry.path().display()))?;
            }
        }
        Ok(())
    }

    /// Writes the run's config as `config.json`.
    pub fn write_config<C: Serialize>(&self, config: &C) -> Result<()> {
        write_atomic(
            &self.config(),
            serde_json::to_string_pretty(config)?.as_bytes(),
        )
    }

    /// Appends `record` to `metrics.jsonl`.
    pub fn append_metric(&self, record: &MetricRecord) -> Result<()> {
        use std::io::Write as _;
        let path = self.metrics();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(f, "{}", serde_json::to_string(record)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Keeps the records of `metrics.jsonl` up to optimiser step `step` (those a resumed run has
    /// in its checkpoint: a checkpoint is written after its step's records) and drops the rest,
    /// a line cut short included; returns the wall time of the last one kept.
    pub fn keep_metrics_until(&self, step: usize) -> Result<f64> {
        let path = self.metrics();
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(0.0);
        };
        let mut seconds = 0.0f64;
        let kept: String = text
            .lines()
            .filter(|l| match serde_json::from_str::<MetricRecord>(l) {
                Ok(r) if r.step <= step => {
                    seconds = seconds.max(r.seconds);
                    true
                }
                _ => false,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        if kept.len() != text.len() {
            write_atomic(&path, kept.as_bytes())?;
        }
        Ok(seconds)
    }
}
