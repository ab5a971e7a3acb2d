//! `--hub`: MNIST and CIFAR-10 from the Hugging Face Hub, as the Hub serves every dataset: the
//! Parquet files of the `refs/convert/parquet` revision (`ylecun/mnist`, `uoft-cs/cifar10`;
//! one row per image: the PNG's bytes and the label).
//!
//! Files go through hf-hub's cache (`$HF_HOME/hub`, else `~/.cache/huggingface/hub`), so a
//! second run reads them from disk; `HF_ENDPOINT` picks a mirror and `HF_HUB_OFFLINE=1` reads
//! the cache alone. When the Hub cannot be reached, the error says how to use `--data-dir`.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::{Repo, RepoType};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;

use super::images::{decode_png, ImageSet};

/// The revision under which the Hub keeps its Parquet conversion of a dataset.
pub const PARQUET_REVISION: &str = "refs/convert/parquet";

/// A dataset the Hub serves for `--hub`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HubDataset {
    Mnist,
    Cifar10,
}

impl HubDataset {
    /// The dataset repository on the Hub.
    pub fn repo(self) -> &'static str {
        match self {
            HubDataset::Mnist => "ylecun/mnist",
            HubDataset::Cifar10 => "uoft-cs/cifar10",
        }
    }

    /// The folder of a split's Parquet files in the repository: `config/split/`.
    pub fn split_dir(self, split: &str) -> String {
        let config = match self {
            HubDataset::Mnist => "mnist",
            HubDataset::Cifar10 => "plain_text",
        };
        format!("{config}/{split}/")
    }

    /// Image side and channels.
    pub fn shape(self) -> (usize, usize) {
        match self {
            HubDataset::Mnist => (28, 1),
            HubDataset::Cifar10 => (32, 3),
        }
    }

    /// What to pass to `--data-dir` instead, for the error when the Hub is out of reach.
    fn local_files(self) -> &'static str {
        match self {
            HubDataset::Mnist => {
                "the four MNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, \
                 t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, plain or .gz)"
            }
            HubDataset::Cifar10 => {
                "the CIFAR-10 binary files (data_batch_1.bin … data_batch_5.bin, test_batch.bin, \
                 from cifar-10-binary.tar.gz)"
            }
        }
    }
}

/// Where the Hub's files come from: the cache folder, the endpoint, and whether the network
/// may be used.
#[derive(Clone, Debug)]
pub struct Hub {
    /// hf-hub's cache folder (holding `datasets--owner--name/`).
    pub cache: PathBuf,
    /// The Hub's address; `None` for <https://huggingface.co>.
    pub endpoint: Option<String>,
    /// Read the cache only (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
}

impl Hub {
    /// The settings the Hugging Face tools share: `HF_HOME`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`.
    pub fn from_env() -> Self {
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"));
        Hub {
            cache: hf_hub::Cache::from_env().path().clone(),
            endpoint: std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()),
            offline,
        }
    }

    fn repo(dataset: HubDataset) -> Repo {
        Repo::with_revision(
            dataset.repo().to_string(),
            RepoType::Dataset,
            PARQUET_REVISION.to_string(),
        )
    }

    /// The local paths of a split's Parquet files (sorted, at least one), downloaded into the
    /// cache first unless offline.
    pub fn split_files(&self, dataset: HubDataset, split: &str) -> Result<Vec<PathBuf>> {
        let dir = dataset.split_dir(split);
        let unreachable = |what: String| {
            anyhow!(
                "--hub: {what}. Without the Hub, download {} yourself and pass their folder \
                 with --data-dir DIR instead of --hub (the README lists where to get them)",
                dataset.local_files()
            )
        };
        if self.offline {
            let files = self.cached_files(dataset, &dir)?;
            if files.is_empty() {
                return Err(unreachable(format!(
                    "HF_HUB_OFFLINE is set and the cache {} holds no {dir}*.parquet of {} \
                     (revision {PARQUET_REVISION})",
                    self.cache.display(),
                    dataset.repo()
                )));
            }
            return Ok(files);
        }
        let mut builder =
            hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(self.cache.clone()))
                .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        if let Some(e) = &self.endpoint {
            builder = builder.with_endpoint(e.clone());
        }
        let endpoint = self.endpoint.as_deref().unwrap_or("https://huggingface.co");
        let api = builder
            .build()
            .map_err(|e| unreachable(format!("cannot set up the Hub client: {e}")))?;
        let repo = api.repo(Self::repo(dataset));
        let info = match repo.info() {
            Ok(info) => info,
            Err(e) => {
                // As the Hub's own tools do: with the Hub out of reach, use what is cached.
                let cached = self.cached_files(dataset, &dir)?;
                if !cached.is_empty() {
                    tracing::warn!(
                        "cannot reach {endpoint} ({e}); using the cached {dir} files of {}",
                        dataset.repo()
                    );
                    return Ok(cached);
                }
                return Err(unreachable(format!(
                    "cannot reach {endpoint} for {} ({e})",
                    dataset.repo()
                )));
            }
        };
        let mut names: Vec<String> = info
            .siblings
            .into_iter()
            .map(|s| s.rfilename)
            .filter(|f| f.starts_with(&dir) && f.ends_with(".parquet"))
            .collect();
        names.sort();
        if names.is_empty() {
            bail!(
                "--hub: {} (revision {PARQUET_REVISION}) at {endpoint} has no {dir}*.parquet",
                dataset.repo()
            );
        }
        names
            .iter()
            .map(|name| {
                repo.get(name).map_err(|e| {
                    unreachable(format!(
                        "cannot download {name} of {} from {endpoint} ({e})",
                        dataset.repo()
                    ))
                })
            })
            .collect()
    }

    /// A split's Parquet files already in the cache, sorted.
    fn cached_files(&self, dataset: HubDataset, dir: &str) -> Result<Vec<PathBuf>> {
        let repo_dir = self.cache.join(Self::repo(dataset).folder_name());
        let Ok(commit) = std::fs::read_to_string(repo_dir.join("refs").join(PARQUET_REVISION))
        else {
            return Ok(vec![]);
        };
        let folder = repo_dir.join("snapshots").join(commit.trim()).join(dir);
        let Ok(entries) = std::fs::read_dir(&folder) else {
            return Ok(vec![]);
        };
        let mut files = vec![];
        for e in entries {
            let path = e
                .with_context(|| format!("cannot list {}", folder.display()))?
                .path();
            if path.extension().is_some_and(|x| x == "parquet") {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    /// The training and test images of `dataset`.
    pub fn load(&self, dataset: HubDataset) -> Result<(ImageSet, ImageSet)> {
        // A split's shards, in order, as one set.
        let read = |split| -> Result<ImageSet> {
            let mut files = self.split_files(dataset, split)?.into_iter();
            let first = files
                .next()
                .ok_or_else(|| anyhow!("--hub: no files for the {split} split"))?;
            let mut set = read_parquet_images(&first, dataset.shape())?;
            for f in files {
                let part = read_parquet_images(&f, dataset.shape())?;
                set.pixels.extend(part.pixels);
                set.labels.extend(part.labels);
            }
            Ok(set)
        };
        Ok((read("train")?, read("test")?))
    }
}

/// Images from a Parquet file of the Hub's image datasets: per row, a struct column holding the
/// PNG's `bytes` (`image` for MNIST, `img` for CIFAR-10) and an integer `label` (0–9).
pub fn read_parquet_images(path: &Path, shape: (usize, usize)) -> Result<ImageSet> {
    // The parquet crate panics on some malformed files (found by tests/fuzz: a footer whose
    // Thrift encoding is cut short); such a file is an error like any other. The default hook
    // would print the panic as if the program had crashed, so it is silenced meanwhile.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let read = std::panic::catch_unwind(|| read_parquet(path, shape));
    std::panic::set_hook(hook);
    match read {
        Ok(result) => result,
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            bail!(
                "{}: not a readable Parquet file (the Parquet reader failed: {why})",
                path.display()
            )
        }
    }
}

fn read_parquet(path: &Path, (side, channels): (usize, usize)) -> Result<ImageSet> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file_len = file.metadata().map_or(0, |m| m.len() as usize);
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
    let rows = reader.metadata().file_metadata().num_rows().max(0) as usize;
    // The footer's row count is not trusted with an allocation: a row takes at least a byte.
    let capacity = rows.min(file_len);
    let mut set = ImageSet {
        pixels: Vec::with_capacity(capacity * side * side * channels),
        labels: Vec::with_capacity(capacity),
        height: side,
        width: side,
        channels,
    };
    let iter = reader
        .get_row_iter(None)
        .with_context(|| format!("{}: cannot read its rows", path.display()))?;
    for (i, row) in iter.enumerate() {
        let at = || format!("{}: row {i}", path.display());
        let row = row.with_context(at)?;
        let (mut png, mut label) = (None, None);
        for (name, field) in row.get_column_iter() {
            match field {
                Field::Group(g) => {
                    for (inner, f) in g.get_column_iter() {
                        if let (true, Field::Bytes(b)) = (inner == "bytes", f) {
                            png = Some(b.data());
                        }
                    }
                }
                _ if name == "label" => label = integer(field),
                _ => {}
            }
        }
        let png = png.ok_or_else(|| anyhow!("{}: no image bytes", at()))?;
        let label = match label {
            Some(l @ 0..=9) => l as u8,
            Some(l) => bail!("{}: label {l}, expected 0-9", at()),
            None => bail!("{}: no integer label column", at()),
        };
        let pixels = decode_png(png, side, channels).with_context(|| format!("{}: image", at()))?;
        set.pixels.extend(pixels);
        set.labels.push(label);
    }
    if set.labels.len() != rows {
        bail!(
            "{}: read {} rows, the footer says {rows}",
            path.display(),
            set.labels.len()
        );
    }
    Ok(set)
}

fn integer(f: &Field) -> Option<i64> {
    Some(match *f {
        Field::Byte(v) => v.into(),
        Field::Short(v) => v.into(),
        Field::Int(v) => v.into(),
        Field::Long(v) => v,
        Field::UByte(v) => v.into(),
        Field::UShort(v) => v.into(),
        Field::UInt(v) => v.into(),
        Field::ULong(v) => i64::try_from(v).ok()?,
        _ => return None,
    })
}
