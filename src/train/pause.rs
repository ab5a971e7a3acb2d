//! Hooks for crash tests. With `MYO_PAUSE_AT=POINT@EPOCH` in its environment, a run that
//! reaches POINT in epoch EPOCH (counted from 1) writes `myo: paused at POINT@EPOCH` to
//! stderr and waits to be killed, so that a test can send SIGKILL at a chosen moment: between
//! the metrics and the checkpoints of an epoch, or between writing a checkpoint's temporary
//! file and renaming it. With `MYO_FAIL_AT=POINT@EPOCH`, the write at POINT (`write FILE`)
//! fails there as on a full disk, and with `MYO_FAIL_AT=read-only:POINT@EPOCH` as on a
//! read-only file system (epoch 0: before the first epoch, where a new run writes its
//! `config.json`). Under an MPI launcher, `MYO_PAUSE_RANK=R` restricts the pause to rank R (a
//! rank that stops answering). Without the variables, a point costs an environment lookup.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The epoch the run is in, for the pause points of code that does not know it.
static EPOCH: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn set_epoch(epoch: usize) {
    EPOCH.store(epoch, Ordering::Relaxed);
}

/// Pauses here forever if `MYO_PAUSE_AT` names `point` in the current epoch.
pub(crate) fn point(point: &str) {
    let Ok(at) = std::env::var("MYO_PAUSE_AT") else {
        return;
    };
    let here = format!("{point}@{}", EPOCH.load(Ordering::Relaxed));
    let rank_env = |v: &str| std::env::var(v).ok();
    let this_rank = rank_env("OMPI_COMM_WORLD_RANK").or_else(|| rank_env("PMI_RANK"));
    let other_rank = rank_env("MYO_PAUSE_RANK").is_some_and(|r| Some(r) != this_rank);
    if at == here && !other_rank {
        eprintln!("myo: paused at {here}");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// An error as from a full disk or a read-only file system if `MYO_FAIL_AT` names `point` in
/// the current epoch.
pub(crate) fn fail_point(point: &str) -> std::io::Result<()> {
    let Ok(at) = std::env::var("MYO_FAIL_AT") else {
        return Ok(());
    };
    let (read_only, at) = match at.strip_prefix("read-only:") {
        Some(rest) => (true, rest.to_string()),
        None => (false, at),
    };
    if at != format!("{point}@{}", EPOCH.load(Ordering::Relaxed)) {
        return Ok(());
    }
    Err(if read_only {
        std::io::Error::new(
            std::io::ErrorKind::ReadOnlyFilesystem,
            "read-only file system (MYO_FAIL_AT)",
        )
    } else {
        std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "no space left on device (MYO_FAIL_AT)",
        )
    })
}
