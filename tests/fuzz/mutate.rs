//! The fuzzing harness of `tests/fuzz`: mutations of a file's bytes (proptest strategies), their
//! application, and the runner of one target.

use crate::common::Scratch;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use std::path::{Path, PathBuf};

/// One edit of a file's bytes; positions are taken modulo the file's length.
#[derive(Clone, Debug)]
enum Mutation {
    Flip {
        at: usize,
        mask: u8,
    },
    Byte {
        at: usize,
        value: u8,
    },
    /// A big-endian 32-bit word (IDX and npy headers, lengths) set to `value`, at a position in
    /// the first 64 bytes, where the headers are.
    Word {
        at: usize,
        value: u32,
    },
    Truncate {
        keep: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    /// `len` bytes from `from` copied over the bytes at `to`.
    Splice {
        from: usize,
        len: usize,
        to: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let word = prop_oneof![
        Just(0u32),
        Just(1),
        Just(2),
        Just(28),
        Just(255),
        Just(256),
        Just(2049),
        Just(2051),
        Just(0x7fff_ffff),
        Just(0x8000_0000),
        Just(u32::MAX),
        any::<u32>(),
    ];
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        (0..64usize, word).prop_map(|(at, value)| Mutation::Word { at, value }),
        any::<usize>().prop_map(|keep| Mutation::Truncate { keep }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1..256usize, any::<usize>())
            .prop_map(|(from, len, to)| Mutation::Splice { from, len, to }),
    ]
}

fn apply(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for m in mutations {
        let n = b.len();
        match *m {
            Mutation::Flip { at, mask } if n > 0 => b[at % n] ^= mask,
            Mutation::Byte { at, value } if n > 0 => b[at % n] = value,
            Mutation::Word { at, value } if n >= 4 => {
                let at = at % (n - 3);
                b[at..at + 4].copy_from_slice(&value.to_be_bytes());
            }
            Mutation::Truncate { keep } => b.truncate(keep % (n + 1)),
            Mutation::Insert { at, ref bytes } => {
                let at = at % (n + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Splice { from, len, to } if n > 0 => {
                let from = from % n;
                let len = len.min(n - from);
                let piece = b[from..from + len].to_vec();
                let to = to % n;
                let end = (to + len).min(n);
                b[to..end].copy_from_slice(&piece[..end - to]);
            }
            _ => {}
        }
    }
    b
}

pub fn cases() -> u32 {
    std::env::var("MYO_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

pub fn temp(name: &str) -> Scratch {
    crate::common::scratch(&format!("fuzz-{name}"))
}

/// A runner of [`cases`] cases from `MYO_FUZZ_SEED`, else `default_seed`; and the seed.
pub fn runner(default_seed: u64) -> (TestRunner, u64) {
    let seed = std::env::var("MYO_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_seed);
    let runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        ..Config::default()
    });
    (runner, seed)
}

/// A case fails unless the error `e` names `place` (a file or its folder).
pub fn names(e: &anyhow::Error, place: &Path) -> Result<(), TestCaseError> {
    let msg = format!("{e:#}");
    if msg.contains(&*place.to_string_lossy()) {
        Ok(())
    } else {
        Err(TestCaseError::fail(format!(
            "the error does not name the file: {msg}"
        )))
    }
}

/// Runs target `name`: each case picks one of the `files` (paths under `dir`, with their
/// valid contents), writes it mutated, runs `read` on `dir`, and restores it. `read` must
/// return `Ok` or an error whose message names a path under `dir`.
pub fn fuzz(
    name: &str,
    default_seed: u64,
    dir: &Path,
    files: Vec<(PathBuf, Vec<u8>)>,
    read: impl Fn(&Path) -> anyhow::Result<()>,
) {
    let (mut runner, seed) = runner(default_seed);
    // The seed corpus itself reads back.
    read(dir).unwrap_or_else(|e| panic!("{name}: the valid files do not read: {e:#}"));
    let strategy = (0..files.len(), prop::collection::vec(mutation(), 1..6));
    let started = std::time::Instant::now();
    let result = runner.run(&strategy, |(k, mutations)| {
        let (path, valid) = &files[k];
        std::fs::write(path, apply(valid, &mutations)).unwrap();
        let outcome = read(dir);
        std::fs::write(path, valid).unwrap();
        match outcome {
            Ok(()) => Ok(()),
            Err(e) => names(&e, dir),
        }
    });
    eprintln!(
        "{name}: {} cases in {:.1} s (seed {seed})",
        cases(),
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

/// The files of a folder, as (path, contents).
pub fn contents(paths: &[PathBuf]) -> Vec<(PathBuf, Vec<u8>)> {
    paths
        .iter()
        .map(|p| (p.clone(), std::fs::read(p).unwrap()))
        .collect()
}
