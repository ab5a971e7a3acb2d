//! `myo train` killed with SIGKILL at many moments — at random times, and at its pause points
//! between an evaluation's metrics and its checkpoints and inside checkpoint writes, at the end
//! of an epoch or within one (`--save-every`) — loses nothing: its last checkpoint (when one
//! was written) loads and evaluates, `--resume` completes the run (or, before the first
//! checkpoint, says why), and the completed run's `last.safetensors` and metrics equal an
//! uninterrupted run's.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::Device;
use myosotis::train::checkpoint;
use myosotis::train::config::RunConfig;
use myosotis::train::run::{eval_checkpoint, Exec};

/// A run of many short epochs, so that kills land in every part of the epoch loop.
static EPOCHS: Runs = Runs::of(&[
    "train",
    "--epochs",
    "24",
    "--d-model",
    "8",
    "--state-size",
    "4",
    "--layers",
    "1",
    "--max-train-samples",
    "48",
    "--max-eval-samples",
    "24",
    "--batch-size",
    "16",
    "--dropout",
    "0.1",
    "--threads",
    "1",
]);

/// A run of three epochs of 10 steps, with a checkpoint every 4 steps, a validation every 5
/// and a step record every 3: most of its checkpoints are mid-epoch.
static STEPS: Runs = Runs::of(&[
    "train",
    "--epochs",
    "3",
    "--d-model",
    "8",
    "--state-size",
    "4",
    "--layers",
    "1",
    "--max-train-samples",
    "160",
    "--max-eval-samples",
    "24",
    "--batch-size",
    "16",
    "--dropout",
    "0.1",
    "--threads",
    "1",
    "--save-every",
    "4",
    "--eval-every",
    "5",
    "--log-every",
    "3",
]);

/// Runs of one command line, and the result of its uninterrupted run.
struct Runs {
    flags: &'static [&'static str],
    whole: OnceLock<Whole>,
}

/// An uninterrupted run's `last.safetensors`, its metrics, and how long it took.
struct Whole {
    last: Vec<u8>,
    metrics: Vec<String>,
    took: Duration,
}

impl Runs {
    const fn of(flags: &'static [&'static str]) -> Self {
        Runs {
            flags,
            whole: OnceLock::new(),
        }
    }

    /// `myo train` into `out`, new, or with `extra` (--resume, --overwrite).
    fn myo(&self, out: &Path, extra: Option<&str>) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_myo"));
        c.args(self.flags).arg("--out").arg(out);
        c.args(extra);
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        c
    }

    fn uninterrupted(&self) -> &Whole {
        self.whole.get_or_init(|| {
            let whole = dir(&format!("whole-{}", self.flags.len()));
            let t = Instant::now();
            let status = self.myo(&whole, None).status().unwrap();
            let took = t.elapsed();
            assert!(status.success(), "the uninterrupted run failed");
            let r = Whole {
                last: std::fs::read(whole.join("last.safetensors")).unwrap(),
                metrics: metrics(&whole),
                took,
            };
            let _ = std::fs::remove_dir_all(&whole);
            r
        })
    }

    /// After a kill: the last checkpoint, if any, loads and evaluates and `--resume` completes
    /// the run; without one, `--resume` says why and a fresh start completes. Either way the
    /// result is the uninterrupted run's. Returns the progress record of the checkpoint resumed
    /// from, if there was one.
    fn finish_killed_run(&self, d: &Path, what: &str) -> Option<serde_json::Value> {
        let last = d.join("last.safetensors");
        let mut progress = None;
        if last.exists() {
            let ck = checkpoint::read::<RunConfig>(&last).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(!ck.tensors.is_empty(), "{what}");
            progress = Some(serde_json::from_str(&ck.metadata["myosotis.progress"]).unwrap());
            eval_checkpoint(&last, None, Some(24), &Exec::on(&Device::Cpu))
                .unwrap_or_else(|e| panic!("{what}: eval: {e:#}"));
            let out = self.myo(d, Some("--resume")).output().unwrap();
            assert!(
                out.status.success(),
                "{what}: --resume failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        } else {
            let out = self.myo(d, Some("--resume")).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("last.safetensors"),
                "{what}: {err}"
            );
            // The folder holds the killed run's first files: a new run there must be asked
            // for.
            if d.join("config.json").exists() {
                let out = self.myo(d, None).output().unwrap();
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    !out.status.success() && err.contains("--overwrite"),
                    "{what}: {err}"
                );
            }
            let out = self.myo(d, Some("--overwrite")).output().unwrap();
            assert!(
                out.status.success(),
                "{what}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Nothing a killed write left behind remains.
        let left: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{what}: temporary files left: {left:?}");
        let whole = self.uninterrupted();
        let got = std::fs::read(&last).unwrap();
        assert!(
            got == whole.last,
            "{what}: last.safetensors differs from the uninterrupted run's"
        );
        assert_eq!(metrics(d), whole.metrics, "{what}");
        progress
    }

    /// Kills the run at each of the pause points `at` (`MYO_PAUSE_AT`) and finishes it;
    /// returns the progress records of the checkpoints resumed from.
    fn kill_at(&self, at: &[&str]) -> Vec<Option<serde_json::Value>> {
        at.iter()
            .map(|at| {
                let d = dir(&at.replace([' ', '@'], "-"));
                let mut child = self.myo(&d, None).env("MYO_PAUSE_AT", at).spawn().unwrap();
                let stderr = BufReader::new(child.stderr.take().unwrap());
                let paused = stderr
                    .lines()
                    .map_while(Result::ok)
                    .any(|l| l == format!("myo: paused at {at}"));
                assert!(paused, "{at}: the run ended without reaching the point");
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                let progress = self.finish_killed_run(&d, &format!("killed at {at}"));
                let _ = std::fs::remove_dir_all(&d);
                progress
            })
            .collect()
    }

    /// Kills the run `n` times, the k-th after `at(k)` of the uninterrupted run's time has
    /// passed since the start, or with `after_checkpoint` since its first checkpoint, and
    /// finishes it; returns the progress records of the checkpoints resumed from.
    fn kill_timed(
        &self,
        n: usize,
        after_checkpoint: bool,
        at: impl Fn(usize) -> f64,
    ) -> Vec<Option<serde_json::Value>> {
        let took = self.uninterrupted().took;
        (0..n)
            .map(|k| {
                let d = dir(&format!("timed-{}-{k}", self.flags.len()));
                let mut child = self.myo(&d, None).spawn().unwrap();
                while after_checkpoint
                    && !d.join("last.safetensors").exists()
                    && child.try_wait().unwrap().is_none()
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let after = took.mul_f64(at(k));
                std::thread::sleep(after);
                child.kill().unwrap(); // SIGKILL
                let finished = child.wait().unwrap().success();
                let what = format!("killed after {after:?}");
                let progress = self.finish_killed_run(&d, &what);
                assert!(
                    progress.is_some() || !finished,
                    "{what}: the run finished without a checkpoint"
                );
                let _ = std::fs::remove_dir_all(&d);
                progress
            })
            .collect()
    }
}

fn dir(name: &str) -> common::Scratch {
    common::unmade(&format!("kill-{name}"))
}

/// Every record of metrics.jsonl but its wall time and speed.
fn metrics(d: &Path) -> Vec<String> {
    std::fs::read_to_string(d.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("seconds");
            v.as_object_mut().unwrap().remove("samples_per_s");
            v.to_string()
        })
        .collect()
}

/// Kills at moments spread over the first half of the run.
#[test]
fn a_run_killed_at_any_moment_resumes_to_the_uninterrupted_result() {
    let resumed = EPOCHS.kill_timed(16, false, |k| 0.02 + 0.03 * k as f64);
    let with_checkpoint = resumed.iter().flatten().count();
    eprintln!(
        "{with_checkpoint} kills after a checkpoint, {} before the first",
        resumed.len() - with_checkpoint
    );
    assert!(
        with_checkpoint >= 4,
        "too few kills landed after a checkpoint: {with_checkpoint}"
    );
}

/// Kills at the run's pause points (`MYO_PAUSE_AT`): after an epoch's metrics, before and
/// during each checkpoint write (its temporary file written, not yet renamed).
#[test]
fn a_run_killed_inside_its_checkpoint_writes_resumes_to_the_uninterrupted_result() {
    EPOCHS.kill_at(&[
        "metrics@1",
        "test metrics@1",
        "rename best.safetensors@1",
        "last@1",
        "rename last.safetensors@1",
        "metrics@4",
        "last@4",
        "rename last.safetensors@4",
        "rename last.safetensors@24",
    ]);
}

/// Mid-epoch checkpoints (`--save-every`) resume as exactly as those at the ends of epochs:
/// kills at moments spread over a run of long epochs that also validates within them (from its
/// first checkpoint on), and at the pause points of its mid-epoch evaluations and writes.
#[test]
fn a_run_killed_between_mid_epoch_checkpoints_resumes_to_the_uninterrupted_result() {
    let within = |p: &Option<serde_json::Value>| {
        p.as_ref()
            .map_or(0, |p| p["within"]["batches"].as_u64().unwrap())
    };
    let timed = STEPS.kill_timed(12, true, |k| 0.05 * k as f64);
    let mid_epoch = timed.iter().filter(|p| within(p) > 0).count();
    eprintln!("{mid_epoch} of {} kills resumed mid-epoch", timed.len());
    assert!(
        mid_epoch >= 3,
        "too few kills resumed from a mid-epoch checkpoint: {mid_epoch}"
    );
    // Epoch 1 (steps 1-10) checkpoints at steps 4 and 8 and validates at 5; epoch 2 at 12
    // and 16, validating at 15; epoch 3 at 24 and 28, validating at 25; each epoch ends with
    // both. The first validation is the best so far.
    let paused = STEPS.kill_at(&[
        "rename best.safetensors@1",
        "last@2",
        "rename last.safetensors@2",
        "metrics@2",
        "metrics@3",
    ]);
    let from: Vec<u64> = paused.iter().map(within).collect();
    assert_eq!(from, [4, 0, 0, 2, 4]);
}

/// Runs `myo train` into `d` with `MYO_FAIL_AT=fail_at` and checks that it fails with a last
/// line naming `file` and saying `why`.
fn run_failing_at(d: &Path, fail_at: &str, file: &str, why: &str) {
    let out = EPOCHS
        .myo(d, None)
        .env("MYO_FAIL_AT", fail_at)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "{fail_at}: the run went on after a failed write"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let last_line = err.lines().last().unwrap_or("");
    assert!(
        last_line.contains(file) && last_line.contains(why),
        "{fail_at}: {last_line}"
    );
}

/// A checkpoint write that fails as on a full disk stops the run with an error naming the file;
/// the previous epoch's checkpoint is still there, and resuming from it (with room again) gives
/// the uninterrupted result.
#[test]
fn a_failed_checkpoint_write_stops_the_run_and_keeps_the_last_good_one() {
    let d = dir("full-disk");
    run_failing_at(
        &d,
        "write last.safetensors@3",
        "last.safetensors",
        "no space left",
    );
    EPOCHS.finish_killed_run(&d, "after a failed write");
    let _ = std::fs::remove_dir_all(&d);
}

/// A read-only `--out`: a new run stops at its first write (`config.json`) naming the file,
/// leaving no run files behind; a run whose folder turns read-only mid-way stops at the
/// checkpoint it cannot write, and the previous checkpoint loads and resumes to the
/// uninterrupted result. (Injected: the tests run as root, whom file modes do not stop.)
#[test]
fn a_read_only_out_stops_the_run_with_a_clear_message() {
    let d = dir("read-only-start");
    run_failing_at(
        &d,
        "read-only:write config.json@0",
        "config.json",
        "read-only",
    );
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "files left in a folder that could not be written: {left:?}"
    );
    let _ = std::fs::remove_dir_all(&d);

    let d = dir("read-only-later");
    run_failing_at(
        &d,
        "read-only:write last.safetensors@2",
        "last.safetensors",
        "read-only",
    );
    EPOCHS.finish_killed_run(&d, "after a read-only write");
    let _ = std::fs::remove_dir_all(&d);
}
