//! Speech Commands (Warden 2018; S5 §6.2): one-second recordings of 35 spoken words, classified
//! from the raw 16 kHz waveform (16,000 steps).
//!
//! The dataset's own layout: a folder per word holding mono 16-bit PCM WAV files of at most one
//! second (zero-padded at the end to 16,000 samples); `validation_list.txt` and
//! `testing_list.txt` name the validation and test files (`word/file.wav`, one per line), the
//! others train; other folders (`_background_noise_`) are not read. The class of a word is its place in
//! [`WORDS`] (v0.02's 35, in alphabetical order). The samples, scaled to [−1, 1), are then
//! normalised to zero mean and standard deviation 0.2 (S5 Appendix H) by the mean and standard
//! deviation of the training split's padded clips, the same for every split.
//!
//! A model trained at 16 kHz runs at a rate that divides it ([`decimated`] inputs, every k-th
//! sample) with S5's Δ multiplied by k: the zero-shot test of S5 Table 2.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use super::dataset::Dataset;

/// Speech Commands v0.02's 35 words, in the order of their classes.
pub const WORDS: [&str; 35] = [
    "backward", "bed", "bird", "cat", "dog", "down", "eight", "five", "follow", "forward", "four",
    "go", "happy", "house", "learn", "left", "marvin", "nine", "no", "off", "on", "one", "right",
    "seven", "sheila", "six", "stop", "three", "tree", "two", "up", "visual", "wow", "yes", "zero",
];
/// The recordings' sampling rate.
pub const RATE: u32 = 16_000;
/// Samples per clip after padding: one second.
pub const LEN: usize = 16_000;
/// The standard deviation of the normalised samples.
const STD: f64 = 0.2;

/// One clip at `path`: mono 16-bit PCM at [`RATE`], at most [`LEN`] samples, as values in
/// [−1, 1).
pub fn read_clip(path: &Path) -> Result<Vec<f32>> {
    let at = || path.display();
    let reader =
        hound::WavReader::open(path).with_context(|| format!("{}: not a WAV file", at()))?;
    let spec = reader.spec();
    if spec.channels != 1
        || spec.sample_rate != RATE
        || spec.bits_per_sample != 16
        || spec.sample_format != hound::SampleFormat::Int
    {
        bail!(
            "{}: {} channel(s) of {}-bit {:?} samples at {} Hz; Speech Commands clips are mono \
             16-bit PCM at {RATE} Hz",
            at(),
            spec.channels,
            spec.bits_per_sample,
            spec.sample_format,
            spec.sample_rate
        );
    }
    if reader.len() as usize > LEN {
        bail!(
            "{}: {} samples, more than one second ({LEN})",
            at(),
            reader.len()
        );
    }
    reader
        .into_samples::<i16>()
        .map(|s| s.map(|v| v as f32 / 32768.0))
        .collect::<std::result::Result<Vec<f32>, _>>()
        .with_context(|| format!("{}: a truncated or malformed WAV file", at()))
}

/// The file names listed in `dir/name` (one per line).
fn listed(dir: &Path, name: &str) -> Result<HashSet<String>> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (Speech Commands names its validation and test files there)",
            path.display()
        )
    })?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// The training, validation and test splits of the dataset in `dir`.
pub fn load(dir: &Path) -> Result<[Dataset; 3]> {
    let (val, test) = (
        listed(dir, "validation_list.txt")?,
        listed(dir, "testing_list.txt")?,
    );
    let mut splits: [Vec<(String, u32)>; 3] = Default::default();
    for (label, word) in WORDS.iter().enumerate() {
        let folder = dir.join(word);
        let mut files = vec![];
        let entries = std::fs::read_dir(&folder).with_context(|| {
            format!(
                "{}: no folder {word} (each of the 35 words has one)",
                dir.display()
            )
        })?;
        for e in entries {
            let name = e
                .with_context(|| format!("reading {}", folder.display()))?
                .file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".wav") {
                files.push(format!("{word}/{name}"));
            }
        }
        files.sort();
        for f in files {
            let k = match (val.contains(&f), test.contains(&f)) {
                (_, true) => 2,
                (true, false) => 1,
                (false, false) => 0,
            };
            splits[k].push((f, label as u32));
        }
    }
    let (train, val, test) = (
        clips(dir, &splits[0])?,
        clips(dir, &splits[1])?,
        clips(dir, &splits[2])?,
    );
    // The training split's mean and standard deviation, over its padded samples.
    let n = train.len().max(1) as f64 * LEN as f64;
    let sum: f64 = train.iter().flatten().map(|&v| v as f64).sum();
    let mean = sum / n;
    let sq: f64 = train
        .iter()
        .flatten()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        + (n - train.iter().map(Vec::len).sum::<usize>() as f64) * mean * mean;
    let std = (sq / n).sqrt();
    let scale = if std > 0.0 { STD / std } else { 1.0 };
    let set = |clips: Vec<Vec<f32>>, files: &[(String, u32)]| {
        let mut values = Vec::with_capacity(clips.len() * LEN);
        for c in &clips {
            let padded = c.iter().copied().chain(std::iter::repeat(0.0)).take(LEN);
            values.extend(padded.map(|v| ((v as f64 - mean) * scale) as f32));
        }
        Dataset::Real {
            values,
            len: LEN,
            features: 1,
            labels: files.iter().map(|f| f.1).collect(),
        }
    };
    Ok([
        set(train, &splits[0]),
        set(val, &splits[1]),
        set(test, &splits[2]),
    ])
}

/// The clips of `files` (paths relative to `dir`), read in parallel.
fn clips(dir: &Path, files: &[(String, u32)]) -> Result<Vec<Vec<f32>>> {
    files
        .par_iter()
        .map(|(f, _)| read_clip(&dir.join(f)))
        .collect()
}

/// The sequences of `data` taken at every `k`-th sample (naive decimation, as S5's 8 kHz test).
pub fn decimated(data: &Dataset, k: usize) -> Result<Dataset> {
    match data {
        Dataset::Real {
            values,
            len,
            features,
            labels,
        } if k >= 1 && len.is_multiple_of(k) => {
            let steps = len / k;
            let mut out = Vec::with_capacity(labels.len() * steps * features);
            for seq in values.chunks(len * features) {
                for s in seq.chunks(*features).step_by(k) {
                    out.extend_from_slice(s);
                }
            }
            Ok(Dataset::Real {
                values: out,
                len: steps,
                features: *features,
                labels: labels.clone(),
            })
        }
        _ => bail!("decimating by {k}: expected real sequences whose length {k} divides"),
    }
}
