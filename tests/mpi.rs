//! Data-parallel training under `mpirun` on the CPU (needs `--features mpi` and Open MPI's
//! `mpirun`): ranks train as one process that cuts every batch into as many shards, bit for bit
//! (the gradients are summed in rank order, as the shards are), also when a step accumulates
//! several batches; a run resumes with another
//! number of ranks; a rank that stops answering or dies ends the run with a message naming it,
//! and the last checkpoint stays.
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const MYO: &str = env!("CARGO_BIN_EXE_myo");

/// A small run: epochs of 100 generated ListOps examples, batches of 16 (the last of each
/// epoch has 4 examples, so with 3 ranks one part is shorter).
const FLAGS: [&str; 12] = [
    "train",
    "--max-train-samples",
    "100",
    "--max-eval-samples",
    "40",
    "--batch-size",
    "16",
    "--d-model",
    "8",
    "--state-size",
    "8",
    "--layers",
];

fn out(name: &str) -> common::Scratch {
    common::unmade(&format!("mpi-{name}"))
}

/// `mpirun -np ranks myo …` (as root too, and with more ranks than cores).
fn mpirun(ranks: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-np", &ranks.to_string(), "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .arg(MYO);
    c
}

fn run(mut c: Command) -> Output {
    let o = c
        .output()
        .unwrap_or_else(|e| panic!("cannot start {c:?}: {e} (is Open MPI's mpirun installed?)"));
    assert!(
        o.status.success(),
        "{c:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// [`FLAGS`] for 2 epochs of `model`, into `d`.
fn flags(model: &[&str], d: &Path) -> Vec<String> {
    flags_epochs(model, d, 2)
}

fn flags_epochs(model: &[&str], d: &Path, epochs: usize) -> Vec<String> {
    FLAGS
        .iter()
        .chain(&[
            "2",
            "--epochs",
            &epochs.to_string(),
            "--out",
            &d.to_string_lossy(),
        ])
        .chain(model)
        .map(|s| s.to_string())
        .collect()
}

fn same_file(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

/// S5 and Myo, with LayerNorm and with BatchNorm (its batch statistics summed over the ranks,
/// as over the threads), on 2 and 3 ranks of one thread each end with the checkpoint of one
/// process with as many threads, byte for byte.
#[test]
fn ranks_train_as_one_process_with_as_many_shards() {
    for model in [
        &["--model", "s5", "--norm", "layer"][..],
        &["--model", "myo", "--norm", "layer"],
        &["--model", "s5", "--norm", "batch"],
        &["--model", "myo", "--norm", "batch"],
        &["--model", "s5", "--norm", "layer", "--accumulate", "2"],
    ] {
        for ranks in [2, 3] {
            let name = format!("{}-{ranks}", model[1..].join("-").replace("--", ""));
            let (single, multi) = (
                out(&format!("{name}-single")),
                out(&format!("{name}-ranks")),
            );
            let mut one = Command::new(MYO);
            one.args(flags(model, &single))
                .args(["--threads", &ranks.to_string()]);
            run(one);
            let mut many = mpirun(ranks);
            many.args(flags(model, &multi)).args(["--threads", "1"]);
            let o = run(many);
            // Rank 0 alone reports.
            let stdout = String::from_utf8_lossy(&o.stdout);
            assert_eq!(stdout.matches("done:").count(), 1, "{stdout}");
            same_file(
                &single.join("last.safetensors"),
                &multi.join("last.safetensors"),
            );
            same_file(
                &single.join("best.safetensors"),
                &multi.join("best.safetensors"),
            );
        }
    }
}

/// A run of 2 ranks stopped after its first epoch and resumed on 3 ends as one process stopped
/// with 2 threads and resumed with 3.
#[test]
fn a_run_resumes_with_another_number_of_ranks() {
    let model = ["--model", "s5"];
    let (single, multi) = (out("resume-single"), out("resume-ranks"));
    // Epoch 1 ends with its checkpoint; the run then pauses (every rank) and is stopped.
    let stop_after_epoch_1 = |mut c: Command, d: &Path| {
        let mut child = c
            .env("MYO_PAUSE_AT", "metrics@2")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !checkpoint_after_epoch(d, 1) {
            assert!(start.elapsed() < Duration::from_secs(120), "no first epoch");
            std::thread::sleep(Duration::from_millis(50));
        }
        // SIGTERM: mpirun passes it on to its ranks.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().unwrap();
    };
    let mut one = Command::new(MYO);
    one.args(flags(&model, &single)).args(["--threads", "2"]);
    stop_after_epoch_1(one, &single);
    let mut many = mpirun(2);
    many.args(flags(&model, &multi)).args(["--threads", "1"]);
    stop_after_epoch_1(many, &multi);

    let mut one = Command::new(MYO);
    one.args(flags(&model, &single))
        .args(["--threads", "3", "--resume"]);
    run(one);
    let mut many = mpirun(3);
    many.args(flags(&model, &multi))
        .args(["--threads", "1", "--resume"]);
    run(many);
    same_file(
        &single.join("last.safetensors"),
        &multi.join("last.safetensors"),
    );
}

/// Whether `d` holds the metrics of epoch `epoch` and its checkpoint (written after them).
fn checkpoint_after_epoch(d: &Path, epoch: usize) -> bool {
    let metrics = std::fs::read_to_string(d.join("metrics.jsonl")).unwrap_or_default();
    metrics.contains(&format!("\"epoch\":{epoch},\"split\":\"val\""))
        && d.join("last.safetensors").exists()
        && std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
}

/// `mpirun` of a 3-epoch S5 run into `d` on 2 ranks whose rank 1 stops answering in epoch 2
/// (after epoch 1's checkpoint), each exchange waiting at most `timeout` seconds.
fn rank_1_stalls(d: &Path, timeout: u64) -> Command {
    let mut c = mpirun(2);
    c.args(flags_epochs(&["--model", "s5"], d, 3))
        .args(["--threads", "1", "--rank-timeout", &timeout.to_string()])
        .env("MYO_PAUSE_AT", "metrics@2")
        .env("MYO_PAUSE_RANK", "1");
    c
}

/// Runs `c` to its end, which must be a failure within `limit`, calling `poll` meanwhile;
/// returns its standard error.
fn run_to_failure(mut c: Command, limit: Duration, mut poll: impl FnMut()) -> String {
    let mut child = c
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the run succeeded");
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the run did not end within {limit:?}");
        }
        poll();
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    err
}

/// The last checkpoint of `d` evaluates.
fn evaluates(d: &Path) {
    let mut eval = Command::new(MYO);
    eval.args(["eval", "--checkpoint"])
        .arg(d.join("last.safetensors"));
    run(eval);
}

/// Rank 1 stops answering in epoch 2 (of 3): rank 0 gives up after --rank-timeout, names itself and
/// what it waited for, and every rank ends; epoch 1's checkpoint is kept.
#[test]
fn a_rank_that_stops_answering_ends_the_run_after_the_timeout() {
    let d = out("stuck");
    let err = run_to_failure(rank_1_stalls(&d, 10), Duration::from_secs(60), || {});
    assert!(
        err.contains("rank 0: no answer from the other ranks for 10 s"),
        "{err}"
    );
    evaluates(&d);
}

/// Rank 1 is killed (SIGKILL) in epoch 2 (of 3): the run ends with a message naming rank 1, well
/// within the timeout; epoch 1's checkpoint is kept.
#[test]
fn a_killed_rank_ends_the_run() {
    let d = out("killed");
    let mut killed = false;
    let err = run_to_failure(rank_1_stalls(&d, 300), Duration::from_secs(120), || {
        if killed || !checkpoint_after_epoch(&d, 1) {
            return;
        }
        // Rank 1 is in epoch 2 or stopped at its end.
        if let Some(pid) = rank_pid(1) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
    });
    assert!(killed, "rank 1 was not found");
    assert!(err.contains("rank 1"), "{err}");
    evaluates(&d);
}

/// The process id of this test's `myo` rank `rank` (from the environment Open MPI gives it).
fn rank_pid(rank: usize) -> Option<i32> {
    let me = std::process::id().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        let has = |v: &str| vars.contains(&v.as_bytes());
        let exe = std::fs::read_link(entry.path().join("exe")).unwrap_or_default();
        if exe.ends_with("myo")
            && has(&format!("OMPI_COMM_WORLD_RANK={rank}"))
            && std::fs::read_to_string(entry.path().join("cmdline"))
                .unwrap_or_default()
                .contains(&format!("myosotis-mpi-killed-{me}"))
        {
            return Some(pid);
        }
    }
    None
}

/// BatchNorm sums its statistics over the ranks in the forward pass, so every rank needs part
/// of every batch: 98 examples in batches of 16 end with a batch of 2, which 3 ranks cannot
/// share, and batches of 2 never can; the run says so before it starts training.
#[test]
fn batch_norm_needs_every_rank_in_every_batch() {
    for (what, examples, batch) in [("last batch", "98", "16"), ("every batch", "100", "2")] {
        let d = out(&format!("short-batch-{batch}"));
        let mut c = mpirun(3);
        let flags = flags(&["--model", "s5", "--norm", "batch", "--threads", "1"], &d);
        c.args(
            flags
                .iter()
                .enumerate()
                .map(|(i, f)| match (i, f.as_str()) {
                    (2, _) => examples,
                    (6, _) => batch,
                    _ => f,
                }),
        );
        // Before the fix, batches of 2 hung in mismatched collectives: a deadline fails it.
        let err = run_to_failure(c, Duration::from_secs(120), || {});
        assert!(
            err.contains("BatchNorm across 3 ranks needs at least 3 examples in every batch"),
            "{what}: {err}"
        );
    }
}
