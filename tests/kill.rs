//! `myo train` killed with SIGKILL at many moments — at random times, and at its pause points
//! between an epoch's metrics and its checkpoints and inside checkpoint writes — loses nothing: its last checkpoint (when one was written) loads and
//! evaluates, `--resume` completes the run (or, before the first checkpoint, says why), and
//! the completed run's `last.safetensors` and metrics equal an uninterrupted run's.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use candle_core::Device;
use myosotis::train::checkpoint;
use myosotis::train::config::RunConfig;
use myosotis::train::run::{eval_checkpoint, Exec};

/// A run of many short epochs, so that kills land in every part of the epoch loop.
const FLAGS: &[&str] = &[
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
];

/// `myo train` into `out`, new, or with `extra` (--resume, --overwrite).
fn myo(out: &Path, extra: Option<&str>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_myo"));
    c.args(FLAGS).arg("--out").arg(out);
    c.args(extra);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("myosotis-kill-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
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

/// The uninterrupted run's `last.safetensors` and metrics.
fn uninterrupted() -> &'static (Vec<u8>, Vec<String>) {
    static WHOLE: std::sync::OnceLock<(Vec<u8>, Vec<String>)> = std::sync::OnceLock::new();
    WHOLE.get_or_init(|| {
        let whole = dir("whole");
        let status = myo(&whole, None).status().unwrap();
        assert!(status.success(), "the uninterrupted run failed");
        let r = (
            std::fs::read(whole.join("last.safetensors")).unwrap(),
            metrics(&whole),
        );
        let _ = std::fs::remove_dir_all(&whole);
        r
    })
}

/// After a kill: the last checkpoint, if any, loads and evaluates and `--resume` completes the
/// run; without one, `--resume` says why and a fresh start completes. Either way the result is
/// the uninterrupted run's. Returns whether a checkpoint was there.
fn finish_killed_run(d: &Path, what: &str) -> bool {
    let last = d.join("last.safetensors");
    let had = last.exists();
    if had {
        let ck = checkpoint::read::<RunConfig>(&last).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!ck.tensors.is_empty(), "{what}");
        eval_checkpoint(&last, None, Some(24), &Exec::on(&Device::Cpu))
            .unwrap_or_else(|e| panic!("{what}: eval: {e:#}"));
        let out = myo(d, Some("--resume")).output().unwrap();
        assert!(
            out.status.success(),
            "{what}: --resume failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        let out = myo(d, Some("--resume")).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("last.safetensors"),
            "{what}: {err}"
        );
        // The folder holds the killed run's first files: a new run there must be asked for.
        if d.join("config.json").exists() {
            let out = myo(d, None).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("--overwrite"),
                "{what}: {err}"
            );
        }
        let out = myo(d, Some("--overwrite")).output().unwrap();
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
    let (want_bytes, want_metrics) = uninterrupted();
    let got = std::fs::read(&last).unwrap();
    assert!(
        &got == want_bytes,
        "{what}: last.safetensors differs from the uninterrupted run's"
    );
    assert_eq!(&metrics(d), want_metrics, "{what}");
    had
}

/// Kills at moments spread over the first half of the run.
#[test]
fn a_run_killed_at_any_moment_resumes_to_the_uninterrupted_result() {
    let (mut with_checkpoint, mut before_first) = (0, 0);
    for (k, ms) in (0..16).map(|i| 15 + 35 * i).enumerate() {
        let d = dir(&format!("timed-{k}"));
        let mut child = myo(&d, None).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(ms));
        child.kill().unwrap(); // SIGKILL
        let finished = child.wait().unwrap().success();
        let what = format!("killed after {ms} ms");
        if finish_killed_run(&d, &what) {
            with_checkpoint += 1;
        } else {
            before_first += 1;
            assert!(!finished, "{what}: the run finished without a checkpoint");
        }
        let _ = std::fs::remove_dir_all(&d);
    }
    eprintln!("{with_checkpoint} kills after a checkpoint, {before_first} before the first");
    assert!(
        with_checkpoint >= 4,
        "too few kills landed after a checkpoint: {with_checkpoint}"
    );
}

/// Kills at the run's pause points (`MYO_PAUSE_AT`): after an epoch's metrics, before and
/// during each checkpoint write (its temporary file written, not yet renamed).
#[test]
fn a_run_killed_inside_its_checkpoint_writes_resumes_to_the_uninterrupted_result() {
    for at in [
        "metrics@1",
        "test metrics@1",
        "rename best.safetensors@1",
        "last@1",
        "rename last.safetensors@1",
        "metrics@4",
        "last@4",
        "rename last.safetensors@4",
        "rename last.safetensors@24",
    ] {
        let d = dir(&at.replace([' ', '@'], "-"));
        let mut child = myo(&d, None).env("MYO_PAUSE_AT", at).spawn().unwrap();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let paused = stderr
            .lines()
            .map_while(Result::ok)
            .any(|l| l == format!("myo: paused at {at}"));
        assert!(paused, "{at}: the run ended without reaching the point");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        finish_killed_run(&d, &format!("killed at {at}"));
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Runs `myo train` into `d` with `MYO_FAIL_AT=fail_at` and checks that it fails with a last
/// line naming `file` and saying `why`.
fn run_failing_at(d: &Path, fail_at: &str, file: &str, why: &str) {
    let out = myo(d, None).env("MYO_FAIL_AT", fail_at).output().unwrap();
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
    finish_killed_run(&d, "after a failed write");
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
    finish_killed_run(&d, "after a read-only write");
    let _ = std::fs::remove_dir_all(&d);
}
