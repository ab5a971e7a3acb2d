//! Model checkpoints as safetensors files.
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
//! * A run's `last.safetensors` also holds what resuming needs, so that one rename commits it
//!   all: the optimiser's state as tensors named [`OPTIMIZER_PREFIX`]`…` (set apart by
//!   [`read`]; a model never loads them) and more metadata (the run's progress).
//! * The same tensors and metadata always give the same bytes.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Metadata key of the model config (JSON).
pub const CONFIG_KEY: &str = "myosotis.config";
/// Metadata key of the checkpoint format version.
pub const FORMAT_KEY: &str = "myosotis.format";
const FORMAT: &str = "1";

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

/// Writes named tensors and metadata to the safetensors file `path` atomically (a temporary
/// file in the same directory, then a rename; the temporary file is removed on failure), the
/// same tensors and metadata always as the same bytes.
pub(crate) fn write_safetensors(
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
    path: &Path,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("checkpoint path {} has no file name", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
    let written = safetensors::serialize(named, Some(metadata))
        .map_err(anyhow::Error::from)
        .and_then(canonical_header)
        .and_then(|bytes| {
            super::pause::fail_point(&format!("write {}", name.to_string_lossy()))?;
            Ok(std::fs::write(&tmp, bytes)?)
        })
        .with_context(|| format!("writing {}", path.display()));
    if written.is_ok() {
        super::pause::point(&format!("rename {}", name.to_string_lossy()));
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

/// Loads `tensors` (from [`read`]) into the model's variables: every variable must be present
/// with its shape, and no other tensor may be. `path` names the file in errors.
pub fn load_into(varmap: &VarMap, tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in &names {
        let var = &data[*name];
        let Some(t) = tensors.get(*name) else {
            bail!(
                "{}: tensor '{name}' is missing (the model has it, the checkpoint does not)",
                path.display()
            );
        };
        if t.dims() != var.dims() {
            bail!(
                "{}: tensor '{name}' has shape {:?}, the model expects {:?}",
                path.display(),
                t.dims(),
                var.dims()
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
