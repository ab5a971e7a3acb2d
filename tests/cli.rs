//! `myo train` as a user runs it: the banner and progress lines of a piped run (resumed too),
//! one-line errors, `--resume` and `--config` with a run's own flags, and the run folders made
//! without `--out`.

mod common;

use common::runs::{metrics, out, synthetic_mnist};

/// Piped to a file, `myo train` starts with a banner (model and size, device and threads, task
/// and splits, outputs) and writes a progress line within the epoch, not only at its end.
#[test]
fn a_piped_run_shows_a_banner_and_progress_lines() {
    let dir = out("banner");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
        .args([
            "train",
            "--epochs",
            "1",
            "--max-train-samples",
            "48",
            "--batch-size",
            "16",
        ])
        .args([
            "--max-eval-samples",
            "16",
            "--d-model",
            "8",
            "--state-size",
            "4",
        ])
        .args(["--threads", "1", "--progress-every", "0", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines[0].starts_with("model   2 layers of S5 P 4 bidirectional, width 8 (")
            && lines[0].ends_with(" parameters)"),
        "{stderr}"
    );
    assert_eq!(lines[1], "device  cpu, 1 thread", "{stderr}");
    assert_eq!(
        lines[2], "task    listops: 48 training, 16 validation, 16 test examples",
        "{stderr}"
    );
    assert_eq!(lines[3], format!("out     {}", dir.display()), "{stderr}");
    assert!(
        lines[4].starts_with("epoch 1/1  16/48 samples  loss "),
        "{stderr}"
    );
    assert!(lines[5].starts_with("epoch 1/1  32/48 samples"), "{stderr}");
    // Resumed from a mid-epoch checkpoint (step 2 of 3), the epoch's progress goes on from
    // there: 48 of 48 after its one remaining batch.
    let paused = out("banner-resumed");
    let piped = |extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_myo"));
        c.args(["train", "--epochs", "1", "--max-train-samples", "48"])
            .args([
                "--batch-size",
                "16",
                "--max-eval-samples",
                "16",
                "--d-model",
                "8",
            ])
            .args([
                "--state-size",
                "4",
                "--threads",
                "1",
                "--progress-every",
                "0",
            ])
            .args(["--save-every", "1", "--out"])
            .arg(&paused)
            .args(extra)
            .stderr(std::process::Stdio::piped());
        c
    };
    let mut child = piped(&[]).env("MYO_PAUSE_AT", "metrics@1").spawn().unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let at = std::io::BufRead::lines(stderr)
        .map_while(Result::ok)
        .any(|l| l == "myo: paused at metrics@1");
    assert!(at, "the run did not pause");
    child.kill().unwrap();
    child.wait().unwrap();
    let resumed = piped(&["--resume"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(lines[3].ends_with("; resuming from step 2"), "{stderr}");
    assert!(
        lines[4].starts_with("epoch 1/1  48/48 samples  loss "),
        "{stderr}"
    );
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
        .args(["train", "--progress-every=-1", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("--progress-every -1: expected seconds ≥ 0"),
        "{stderr}"
    );
    use myosotis::train::progress::significant;
    for (x, text) in [
        (1234.0, "1230"),
        (45.67, "45.7"),
        (0.1234, "0.123"),
        (7.0, "7.00"),
    ] {
        assert_eq!(significant(x), text);
    }
}

/// An error is one line for the user, also when `RUST_BACKTRACE` asks candle to attach its
/// stack to the error.
#[test]
fn errors_are_one_line_even_with_rust_backtrace_set() {
    let cases: [(&[&str], &str); 2] = [
        (
            &["train", "--model", "myo", "--heads", "0"],
            "error: --heads must be at least 1",
        ),
        (
            // Refused by candle's `bail!`, which attaches the stack.
            &["bench", "scan", "--len", "0"],
            "error: scan benchmark failed: --len 0: expected at least 1",
        ),
    ];
    for backtrace in ["1", "full"] {
        for (args, says) in cases {
            let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
                .args(args)
                .env("RUST_BACKTRACE", backtrace)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert!(!run.status.success());
            assert_eq!(stderr.trim_end(), says, "RUST_BACKTRACE={backtrace}");
        }
    }
}

/// The benchmarks share their flags' names (`--batch` and `--batch-size` alike), refuse shapes
/// below their least values and flags that only training reads, naming the flag, and print
/// times and rates to three significant digits.
#[test]
fn bench_flags_are_consistent_and_numbers_have_three_digits() {
    let myo = |args: &[&str]| {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&run.stdout).into_owned()
            + &String::from_utf8_lossy(&run.stderr);
        (run.status.success(), text)
    };
    let quick = ["--no-reference", "--repeats", "3", "--warmup", "0"];
    for batch in ["--batch", "--batch-size"] {
        let (ok, text) = myo(&[&["bench", "scan", batch, "2", "--len", "64"][..], &quick].concat());
        assert!(ok && text.contains("(batch 2, len 64"), "{text}");
        // "median 0.0123 ms  (min 0.0120, 3 samples)  7.89 GB/s = 9.49% of copy (83.1 GB/s)"
        let line = text.lines().find(|l| l.contains("myosotis")).unwrap();
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || "(),%".contains(c))
            .filter(|w| !w.is_empty())
            .collect();
        let numbers: Vec<&str> = words
            .windows(2)
            .filter(|w| w[0].parse::<f64>().is_ok() && w[1] != "samples")
            .map(|w| w[0])
            .collect();
        assert_eq!(numbers.len(), 5, "{line}");
        for n in numbers {
            let digits = match n.contains('.') {
                true => n.trim_start_matches(['0', '.']).replace('.', ""),
                false => n.trim_end_matches('0').to_string(),
            };
            assert!(
                digits.len() == 3 || (!n.contains('.') && digits.len() < 3),
                "{n} in {line}"
            );
        }
    }
    for (args, says) in [
        (
            &["bench", "tree", "--arity", "1"][..],
            "--arity 1: expected at least 2",
        ),
        (&["bench", "heads", "--batch", "0"][..], "--batch 0"),
        (
            &["bench", "step", "--epochs", "3"][..],
            "--epochs applies to myo train, not to bench step",
        ),
        (
            &["bench", "step", "--early-stop", "3"][..],
            "--early-stop applies to myo train",
        ),
        (
            &["bench", "step", "--accumulate", "2"][..],
            "--accumulate applies to myo train",
        ),
        (
            &["bench", "step", "--cuda-graph", "maybe"][..],
            "'maybe' for '--cuda-graph <CUDA_GRAPH>'",
        ),
    ] {
        let (ok, text) = myo(args);
        assert!(!ok && text.contains(says), "{args:?}: {text}");
    }
}

/// `myo bench step --threads N` on the CPU times the step as `myo train` takes it: the batch cut
/// into N shards (at most one per example), for every kind of input (tokens, pairs of them,
/// feature vectors, frames with regression targets) and with BatchNorm, whose shards meet at
/// their batch sums.
#[test]
fn bench_step_on_threads_times_the_sharded_training_step() {
    let small = "--d-model 8 --state-size 4 --layers 1 --warmup 0 --repeats 1 --json";
    for (flags, shards) in [
        ("--task listops --batch-size 3 --threads 2", 2),
        ("--task retrieval --batch-size 2 --threads 2", 2),
        ("--task smnist --norm batch --batch-size 4 --threads 2", 2),
        (
            "--model myo --task zmnist --norm batch --batch-size 3 --threads 2",
            2,
        ),
        ("--task pendulum --batch-size 2 --threads 3", 2),
        ("--task smnist --batch-size 2 --threads 1", 1),
    ] {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
            .args(["bench", "step"])
            .args(flags.split(' ').chain(small.split(' ')))
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{flags}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
        assert_eq!(report["shards"], shards, "{flags}");
        assert!(
            report["step"]["median_ms"].as_f64().unwrap() > 0.0,
            "{flags}"
        );
    }
}

/// `myo train` with `args`, which must succeed (`ok`) or fail; its standard error.
fn myo_train(args: &[&str], ok: bool) -> String {
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
        .arg("train")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(run.status.success(), ok, "{args:?}: {stderr}");
    stderr
}

/// `--resume` continues with the run's own settings (how often it logs and saves included): it
/// needs no flags, extends the run with a larger `--epochs`, finds the same data at another path
/// (compared by content), and refuses a flag that changes a setting, or other data, naming what
/// differs. `--config` starts a new run from a run's flags, with flags given overriding them.
#[test]
fn resume_continues_with_the_runs_own_settings() {
    let (a, b, other) = (out("resume-a"), out("resume-b"), out("resume-other"));
    synthetic_mnist(&a, 48, 16);
    synthetic_mnist(&other, 64, 16);
    let run = out("resume-run");
    let (a_str, run_str) = (a.to_str().unwrap(), run.to_str().unwrap());
    let flags = [
        "--task",
        "smnist",
        "--epochs",
        "1",
        "--d-model",
        "8",
        "--state-size",
        "4",
    ];
    let more = [
        "--layers",
        "1",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--progress-every",
        "9",
        "--log-every",
        "1",
        "--save-every",
        "2",
    ];
    let mut first = vec!["--data-dir", a_str, "--out", run_str];
    first.extend(flags.iter().chain(&more));
    myo_train(&first, true);
    // The data moves; the run continues from it for one more epoch, its settings its own.
    std::fs::rename(&a, &b).unwrap();
    let (b_str, other_str) = (b.to_str().unwrap(), other.to_str().unwrap());
    let resume = |extra: &[&str], ok: bool| {
        let mut args = vec!["--resume", "--out", run_str, "--threads", "1"];
        args.extend(extra);
        myo_train(&args, ok)
    };
    resume(&["--data-dir", b_str, "--epochs", "2"], true);
    let epochs: Vec<u64> = metrics(&run)
        .iter()
        .filter(|r| r["split"] == "train")
        .map(|r| r["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, [1, 2]);
    // How often it logs (and saves) is the run's too: a step record at every step.
    let steps: Vec<u64> = metrics(&run)
        .iter()
        .filter(|r| r["split"] == "step")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    assert!(steps.len() >= 4, "{steps:?}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["epochs"], 2);
    assert_eq!(cfg["model"]["d_model"], 8);
    assert_eq!(cfg["environment"]["threads"], 1);
    assert!(cfg["environment"]["command_line"][1] == "train", "{cfg}");
    let e = resume(&["--data-dir", b_str, "--d-model", "16"], false);
    assert!(e.contains("model.d_model is 8 in the run, 16 now"), "{e}");
    let e = resume(&["--data-dir", other_str, "--epochs", "3"], false);
    assert!(
        e.contains("the data read now differs from the run's"),
        "{e}"
    );
    let e = resume(&["--data-dir", b_str, "--epochs", "1"], false);
    assert!(
        e.contains("--epochs 1: the run has already completed 2 epochs"),
        "{e}"
    );
    // A new run from this one's flags, one of them overridden.
    let again = out("resume-config");
    let config = run.join("config.json");
    myo_train(
        &[
            "--config",
            config.to_str().unwrap(),
            "--out",
            again.to_str().unwrap(),
            "--layers",
            "2",
        ],
        true,
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(again.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (
            cfg["model"]["layers"].clone(),
            cfg["model"]["d_model"].clone()
        ),
        (2.into(), 8.into())
    );
}

/// Without `--out` a run gets a fresh folder named by task, model and time, linked as
/// `runs/latest`, which `--resume` continues; a start that fails leaves no folder, and an
/// `--overwrite` that fails to start leaves the run it would replace.
#[test]
fn runs_get_their_own_folders_and_failed_starts_leave_none() {
    let cwd = out("fresh-folders");
    std::fs::create_dir_all(&cwd).unwrap();
    let myo = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
            .current_dir(&cwd)
            .arg("train")
            .args(args)
            .args(["--d-model", "8", "--state-size", "4", "--threads", "1"])
            .output()
            .unwrap()
    };
    let tiny = [
        "--epochs",
        "1",
        "--max-train-samples",
        "32",
        "--max-eval-samples",
        "16",
    ];
    assert!(myo(&tiny).status.success());
    let folders = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(cwd.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let names = folders();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names[0].starts_with("latest") && names[1].starts_with("listops-s5-2"),
        "{names:?}"
    );
    let link = std::fs::read_link(cwd.join("runs/latest")).unwrap();
    assert_eq!(link.to_str().unwrap(), names[1]);
    let resumed = myo(&["--resume", "--epochs", "2"]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let records = metrics(&cwd.join("runs").join(&names[1]));
    assert_eq!(records.iter().filter(|r| r["split"] == "train").count(), 2);
    // A start that fails (no data) makes no folder; nor does an --overwrite that fails remove
    // the run it would replace.
    let bad = ["--task", "smnist", "--data-dir", "/nonexistent"];
    assert!(!myo(&bad).status.success());
    assert_eq!(folders(), names);
    let run = cwd.join("runs").join(&names[1]);
    let over: Vec<&str> = bad
        .iter()
        .copied()
        .chain(["--overwrite", "--out"])
        .collect();
    let mut args = over.clone();
    args.push(run.to_str().unwrap());
    assert!(!myo(&args).status.success());
    assert!(run.join("last.safetensors").exists());
}
