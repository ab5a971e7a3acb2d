//! How a run starts: what a resumed run must share with the run it continues (its settings,
//! and its data by content), what `config.json` records of the environment and of the flags
//! given (which `--resume` and `--config` read back), and the folder of a run started without
//! `--out`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::config::{RunArgs, RunConfig};
use super::run::Exec;
use crate::data::dataset::Dataset;
use crate::nn::SeqLayerConfig;

/// Whether a run with `cfg` may continue one with `run`'s config, `done` = (epochs completed,
/// batches trained of the next) and the data digest `digest` (absent in checkpoints of earlier versions): the same settings,
/// except that `--epochs` may extend it (the cosine schedule then spans the longer run from the
/// step reached), and the same data by content (`data`, the digest of the splits now read),
/// wherever it lies. Names each differing setting with both values.
pub(crate) fn resumable(
    run: &RunConfig,
    cfg: &RunConfig,
    done: (usize, usize),
    digest: Option<&str>,
    data: &str,
) -> Result<()> {
    let flat = |c: &RunConfig| -> Result<BTreeMap<String, serde_json::Value>> {
        let mut v = serde_json::to_value(c)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("epochs");
            // Compared by content when the checkpoint holds the digest.
            if digest.is_some() {
                o.remove("data");
            }
        }
        let mut out = vec![];
        flatten("", &v, &mut out);
        Ok(out.into_iter().collect())
    };
    let (was, now) = (flat(run)?, flat(cfg)?);
    let shown = |v: Option<&serde_json::Value>| v.map_or("unset".into(), |v| v.to_string());
    let differ: Vec<String> = was
        .keys()
        .chain(now.keys().filter(|k| !was.contains_key(*k)))
        .filter(|key| was.get(*key) != now.get(*key))
        .map(|key| {
            let (a, b) = (shown(was.get(key)), shown(now.get(key)));
            format!("{key} is {a} in the run, {b} now")
        })
        .collect();
    if !differ.is_empty() {
        bail!(
            "the run has other settings: {} (leave out the flags that change them)",
            differ.join("; ")
        );
    }
    if digest.is_some_and(|d| d != data) {
        bail!(
            "the data read now differs from the run's (compared by content, not by path): \
             another dataset, or other --max-train-samples / --max-eval-samples"
        );
    }
    match done {
        (epochs, 0) if cfg.epochs < epochs => bail!(
            "--epochs {}: the run has already completed {epochs} epochs",
            cfg.epochs
        ),
        (epochs, within) if within > 0 && cfg.epochs <= epochs => bail!(
            "--epochs {}: the run is already in epoch {}",
            cfg.epochs,
            epochs + 1
        ),
        _ => {}
    }
    Ok(())
}

/// The leaves of a JSON value, each with its dotted path.
fn flatten(path: &str, v: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        serde_json::Value::Object(o) => o.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| flatten(&join(&i.to_string()), v, out)),
        leaf => out.push((path.to_string(), leaf.clone())),
    }
}

/// The SHA-256 of the splits' examples and labels, in hex.
pub(crate) fn data_digest(splits: &[&Dataset]) -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for s in splits {
        s.hash_into(&mut hash);
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `config.json`: the run's config, with where and from what command line it was started.
pub(crate) fn with_environment(cfg: &RunConfig, exec: &Exec) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(cfg)?;
    let environment = serde_json::json!({
        "device": crate::device::describe(&exec.device),
        "threads": exec.shards,
        "ranks": exec.world.size(),
        "version": env!("CARGO_PKG_VERSION"),
        "commit": option_env!("MYO_COMMIT"),
        "command_line": exec.origin.command_line,
        "flags": exec.origin.flags,
    });
    if let Some(o) = v.as_object_mut() {
        o.insert("environment".into(), environment);
    }
    Ok(v)
}

/// A new folder for a run of `cfg` under `runs`: `TASK-MODEL-YYYYmmdd-HHMMSS` (UTC), with a
/// suffix `-2`, `-3`, … when that name is taken. Not created.
pub fn fresh_run_dir(runs: &Path, cfg: &RunConfig) -> PathBuf {
    let model = match cfg.model.layer {
        SeqLayerConfig::S5(_) => "s5",
        SeqLayerConfig::Myo(_) => "myo",
        SeqLayerConfig::MinGru(_) => "mingru",
        SeqLayerConfig::Ssm2d(_) => "ssm2d",
    };
    let stamp = chrono::Utc::now().format("%Y%m%d-%H%M%S");
    let name = format!("{}-{model}-{stamp}", cfg.task.name);
    (1..)
        .map(|k| match k {
            1 => runs.join(&name),
            k => runs.join(format!("{name}-{k}")),
        })
        .find(|p| !p.exists())
        .expect("a free name")
}

/// Points the link `latest` in `run`'s parent folder at `run` (replacing the link atomically),
/// so that `runs/latest` is the newest run.
pub fn point_latest_at(run: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (run.parent(), run.file_name()) else {
        bail!("{}: not a folder in a folder", run.display());
    };
    let link = parent.join("latest");
    if link.exists() && !link.is_symlink() {
        bail!(
            "{} is not a link (a run of an earlier version?): move it to point it at the newest run",
            link.display()
        );
    }
    let tmp = parent.join(format!(".latest.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    symlink(name, &tmp).with_context(|| format!("linking {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("replacing {}", link.display()))
}

#[cfg(unix)]
fn symlink(target: &std::ffi::OsStr, at: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, at)
}

#[cfg(not(unix))]
fn symlink(_: &std::ffi::OsStr, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "symbolic links are made on Unix only",
    ))
}

/// The run flags (those of [`RunArgs`]) that a command line gave, as flags again, e.g.
/// `["--model=myo", "--per-level"]`: `matches` are those of a command that flattens `RunArgs`.
pub fn given_flags(matches: &clap::ArgMatches) -> Vec<String> {
    let cmd = <RunArgs as clap::Args>::augment_args(clap::Command::new("run"));
    let mut flags = vec![];
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        let given = matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        let Some(long) = arg.get_long().filter(|_| given) else {
            continue;
        };
        if !arg.get_action().takes_values() {
            flags.push(format!("--{long}"));
            continue;
        }
        for v in matches.get_raw(id).into_iter().flatten() {
            flags.push(format!("--{long}={}", v.to_string_lossy()));
        }
    }
    flags
}

/// The run flags an earlier run recorded in its `config.json` (`environment.flags`), for
/// `--resume` and `--config`.
pub fn recorded_flags(config_json: &std::path::Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(config_json)
        .with_context(|| format!("reading {}", config_json.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a run's config.json", config_json.display()))?;
    let Some(flags) = v.pointer("/environment/flags").and_then(|f| f.as_array()) else {
        bail!(
            "{} records no command-line flags (a run started from code, or by an earlier \
             version): give its flags instead",
            config_json.display()
        );
    };
    flags
        .iter()
        .map(|f| f.as_str().map(str::to_string))
        .collect::<Option<_>>()
        .with_context(|| {
            format!(
                "{}: environment.flags holds a non-string",
                config_json.display()
            )
        })
}
