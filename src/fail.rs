//! Panics as errors. A panic in `myo` (a bug: every expected failure is an error) must end a
//! multi-rank run like an error does — message printed, every rank aborted — rather than
//! unwind past the launcher and leave the other ranks waiting for this one. [`catch_panics`]
//! turns a panic in `f` (or in a thread it joins) into an error naming where it happened; the
//! panic hook it installs keeps the message and prints nothing, unless `RUST_BACKTRACE` asks for
//! the usual report. [`message`] is an error as a user reads it: its chain, without the
//! backtraces candle attaches when `RUST_BACKTRACE` is set.

use std::sync::{Mutex, Once};

/// The last panic's message and location, kept by the hook.
static LAST: Mutex<Option<String>> = Mutex::new(None);

/// Installs the hook that keeps a panic's message (once per process; the hook it replaces
/// still reports when `RUST_BACKTRACE` is set).
fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let report = std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0");
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let what = match (
                payload.downcast_ref::<&str>(),
                payload.downcast_ref::<String>(),
            ) {
                (Some(s), _) => s.to_string(),
                (_, Some(s)) => s.clone(),
                _ => "(no message)".into(),
            };
            let at = info
                .location()
                .map_or_else(String::new, |l| format!(" at {}:{}", l.file(), l.line()));
            // The first panic is the cause; a thread that panics on seeing it comes later.
            LAST.lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(format!("internal error (a panic{at}): {what}"));
            if report {
                default(info);
            }
        }));
    });
}

/// Runs `f`; a panic in it becomes an error "internal error (a panic at file:line): message".
pub fn catch_panics<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    install_hook();
    LAST.lock().unwrap_or_else(|e| e.into_inner()).take();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            let last = LAST.lock().unwrap_or_else(|e| e.into_inner()).take();
            Err(anyhow::anyhow!(
                "{}",
                last.unwrap_or_else(|| "internal error (a panic)".into())
            ))
        }
    }
}

/// `e`'s chain of messages (`outer: inner: …`) without the stack frames candle's errors carry
/// when `RUST_BACKTRACE` is set: what a user of `myo` reads.
pub fn message(e: &anyhow::Error) -> String {
    let frame = |line: &str| {
        let t = line.trim_start();
        t == "stack backtrace:"
            || t.split_once(": ")
                .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
            || t.starts_with("at ")
                && t.rsplit(':')
                    .next()
                    .is_some_and(|n| n.parse::<u32>().is_ok())
    };
    let text = format!("{e:#}");
    let kept: Vec<&str> = text.lines().filter(|l| !frame(l)).collect();
    kept.join("\n").trim_end().to_string()
}
