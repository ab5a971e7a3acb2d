//! The pendulum regression benchmark (Becker et al. 2019; Schirmer et al. 2022; S5 §6.3): a
//! pendulum driven by random kicks, seen as noisy 24 × 24 images; the targets are the sine and
//! cosine of its angle at every frame.
//!
//! [`generate`] follows the benchmark's public generator (facts, not its code):
//! - physics: a rod of length 1 and mass 1 (inertia 1/3), gravity 9.81, friction 0.1, at rest
//!   at a uniform angle; each frame of dt = 0.01 is 100 semi-implicit Euler steps of 1e-4
//!   (ω ← ω + h (3g/l · sin θ − 0.1 ω), θ ← θ + h ω), then ω gets Gaussian noise of std 0.1
//!   and θ is wrapped to [0, 2π); the angle reported is θ − π (so 0 hangs straight down);
//! - rendering: a line of width 8 from the centre of a 128 × 128 canvas, 55 pixels long along
//!   (sin, cos) of the angle (observed with noise of std 1e-5), shrunk to 24 × 24 with a
//!   Lanczos-3 filter, clipped to [0, 1], times 255, truncated to bytes;
//! - image noise correlated in time: per sequence a factor f₀ ~ U(0, 1) walks by U(−0.2, 0.2)
//!   steps clipped to [0, 1], is stretched by bounds t₁ ~ U(0, 0.25), t₂ ~ U(0.75, 1) to
//!   (f − t₁)/(t₂ − t₁) clipped to [0, 1], set to 1 on the first 5 frames, and each frame
//!   becomes f · image + (1 − f) · U(0, 255) per pixel.
//!
//! What differs: the random numbers (ours, seeded, not NumPy's), and the rasteriser: a pixel
//! is lit when its centre lies within 4 pixels of the segment, between its ends, where PIL
//! fills a polygon with corners rounded to whole pixels. The shrinking filter is PIL's
//! (compared with Pillow 13: equal to 1e-7 on the same canvas). Against Pillow's own drawing
//! of the same angles, a clean frame differs by 0.9 per pixel on average (of 255; the frames'
//! mean brightness is 7), by up to 108 on a pixel where an edge of the rod falls.
//!
//! [`write_dataset`] writes the benchmark's file layout (`pend_regression.npz`, which NumPy
//! reads) with a validation split of its own; [`read_split`] reads it or the benchmark's file
//! (train and test only), deflated or not.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use std::io::Read as _;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use super::dataset::Dataset;
use crate::nn::init::normal;

/// Image side of the frames.
pub const SIDE: usize = 24;
/// The benchmark's file name.
pub const FILE: &str = "pend_regression.npz";

const DT: f64 = 0.01;
const SUBSTEPS: usize = 100;
const GRAVITY: f64 = 9.81;
const FRICTION: f64 = 0.1;
const TRANSITION_NOISE: f64 = 0.1;
const OBSERVATION_NOISE: f64 = 1e-5;
const CANVAS: usize = 128;
const ARM: f64 = 55.0;
const HALF_WIDTH: f64 = 4.0;
const CLEAN_FRAMES: usize = 5;

/// How many sequences of how many frames each split gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct PendulumConfig {
    /// Training sequences.
    #[arg(long, default_value_t = 2_000)]
    pub train: usize,
    /// Validation sequences.
    #[arg(long, default_value_t = 1_000)]
    pub valid: usize,
    /// Test sequences.
    #[arg(long, default_value_t = 1_000)]
    pub test: usize,
    /// Frames per sequence (dt = 0.01 apart).
    #[arg(long, default_value_t = 100)]
    pub frames: usize,
    /// Seeds the generator (each split draws with its own stream).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for PendulumConfig {
    fn default() -> Self {
        PendulumConfig {
            train: 2_000,
            valid: 1_000,
            test: 1_000,
            frames: 100,
            seed: 0,
        }
    }
}

/// Sequences of frames: `obs` (n, frames, 24, 24) bytes, `targets` (n, frames, 2) as (sin, cos)
/// of the angle, `ts` (n, frames) the frames' times in steps of dt.
#[derive(Clone, Debug, PartialEq)]
pub struct Episodes {
    pub n: usize,
    pub frames: usize,
    pub obs: Vec<u8>,
    pub targets: Vec<f64>,
    pub ts: Vec<f64>,
}

/// One frame of the pendulum's motion from (θ, ω): the substeps of [`generate`]'s physics,
/// without the noise and the wrap.
pub fn advance(theta: f64, omega: f64) -> (f64, f64) {
    // A rod about its end: g·l·m / I with I = m l² / 3.
    let c = 3.0 * GRAVITY;
    let h = DT / SUBSTEPS as f64;
    let (mut theta, mut omega) = (theta, omega);
    for _ in 0..SUBSTEPS {
        omega += h * (c * theta.sin() - FRICTION * omega);
        theta += h * omega;
    }
    (theta, omega)
}

/// The 24 × 24 image (values in [0, 1], row-major, rows along y) of the pendulum at the angle
/// whose sine and cosine are `(x, y)`.
pub fn render(x: f64, y: f64) -> Vec<f32> {
    let centre = CANVAS as f64 / 2.0;
    let (ex, ey) = (x * ARM, y * ARM);
    let len2 = ex * ex + ey * ey;
    let mut canvas = vec![0f64; CANVAS * CANVAS];
    // Only the pixels near the segment can be lit.
    let span = |a: f64, b: f64| {
        let lo = (centre + a.min(b) - HALF_WIDTH - 1.0).floor().max(0.0) as usize;
        let hi = ((centre + a.max(b) + HALF_WIDTH + 2.0).ceil() as usize).min(CANVAS);
        lo..hi
    };
    for row in span(0.0, ey) {
        for col in span(0.0, ex) {
            let (px, py) = (col as f64 - centre, row as f64 - centre);
            // Position along the segment and distance across it.
            let along = (px * ex + py * ey) / len2.max(1e-300);
            let across = (px * ey - py * ex).abs() / len2.sqrt().max(1e-300);
            if (0.0..=1.0).contains(&along) && across <= HALF_WIDTH {
                canvas[row * CANVAS + col] = 1.0;
            }
        }
    }
    let taps = lanczos_taps(CANVAS, SIDE);
    // Rows first, then columns (the filter is separable).
    let mut rows = vec![0f64; SIDE * CANVAS];
    for (o, (first, w)) in taps.iter().enumerate() {
        for col in 0..CANVAS {
            rows[o * CANVAS + col] = w
                .iter()
                .enumerate()
                .map(|(k, w)| w * canvas[(first + k) * CANVAS + col])
                .sum();
        }
    }
    let mut out = vec![0f32; SIDE * SIDE];
    for row in 0..SIDE {
        for (o, (first, w)) in taps.iter().enumerate() {
            let v: f64 = w
                .iter()
                .enumerate()
                .map(|(k, w)| w * rows[row * CANVAS + first + k])
                .sum();
            out[row * SIDE + o] = v.clamp(0.0, 1.0) as f32;
        }
    }
    out
}

/// For each of `to` output pixels, the first input pixel and the normalised Lanczos-3 weights
/// of shrinking `from` pixels to `to`: the kernel stretched by the scale, centred on the output
/// pixel's centre.
fn lanczos_taps(from: usize, to: usize) -> Vec<(usize, Vec<f64>)> {
    let scale = from as f64 / to as f64;
    let support = 3.0 * scale;
    let sinc = |x: f64| {
        if x.abs() < 1e-12 {
            1.0
        } else {
            let p = std::f64::consts::PI * x;
            p.sin() / p
        }
    };
    let lanczos = |x: f64| {
        if x.abs() < 3.0 {
            sinc(x) * sinc(x / 3.0)
        } else {
            0.0
        }
    };
    (0..to)
        .map(|o| {
            let centre = (o as f64 + 0.5) * scale;
            let first = (centre - support).floor().max(0.0) as usize;
            let last = ((centre + support).ceil() as usize).min(from);
            let w: Vec<f64> = (first..last)
                .map(|i| lanczos((i as f64 + 0.5 - centre) / scale))
                .collect();
            let sum: f64 = w.iter().sum();
            (first, w.iter().map(|w| w / sum).collect())
        })
        .collect()
}

/// Replaces `frames` (frames × 24 × 24 bytes of one sequence) by noise as [`generate`]
/// describes: a factor per frame, correlated in time, mixes each with uniform noise.
fn add_noise(frames: &mut [u8], rng: &mut StdRng) {
    let count = frames.len() / (SIDE * SIDE);
    let mut f = vec![0f64; count];
    f[0] = rng.random_range(0.0..1.0);
    for i in 1..count {
        f[i] = (f[i - 1] + rng.random_range(-0.2..0.2)).clamp(0.0, 1.0);
    }
    let (t1, t2) = (rng.random_range(0.0..0.25), rng.random_range(0.75..1.0));
    for (i, frame) in frames.chunks_mut(SIDE * SIDE).enumerate() {
        let f = match i < CLEAN_FRAMES {
            true => 1.0,
            false => ((f[i] - t1) / (t2 - t1)).clamp(0.0, 1.0),
        };
        for p in frame {
            let noise = rng.random_range(0.0..255.0);
            *p = (f * *p as f64 + (1.0 - f) * noise) as u8;
        }
    }
}

/// `n` sequences of `frames` frames, the i-th drawn from `seed` and i (in parallel, the same
/// whatever the threads).
pub fn generate(n: usize, frames: usize, seed: u64) -> Episodes {
    let sequences: Vec<(Vec<u8>, Vec<f64>)> = (0..n)
        .into_par_iter()
        .map(|i| {
            let stream = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i as u64);
            sequence(frames, &mut StdRng::seed_from_u64(stream))
        })
        .collect();
    let mut ep = Episodes {
        n,
        frames,
        obs: Vec::with_capacity(n * frames * SIDE * SIDE),
        targets: Vec::with_capacity(n * frames * 2),
        ts: (0..n).flat_map(|_| (0..frames).map(|k| k as f64)).collect(),
    };
    for (obs, targets) in sequences {
        ep.obs.extend(obs);
        ep.targets.extend(targets);
    }
    ep
}

/// One sequence's frames and targets.
fn sequence(frames: usize, rng: &mut StdRng) -> (Vec<u8>, Vec<f64>) {
    let (mut obs, mut targets) = (vec![], vec![]);
    let (mut theta, mut omega) = (rng.random_range(0.0..std::f64::consts::TAU), 0.0);
    for k in 0..frames {
        if k > 0 {
            (theta, omega) = advance(theta, omega);
            omega += TRANSITION_NOISE * normal(rng);
            theta = theta.rem_euclid(std::f64::consts::TAU);
        }
        let angle = theta - std::f64::consts::PI;
        targets.extend([angle.sin(), angle.cos()]);
        let seen = angle + OBSERVATION_NOISE * normal(rng);
        let image = render(seen.sin(), seen.cos());
        obs.extend(image.iter().map(|v| (255.0 * *v as f64) as u8));
    }
    add_noise(&mut obs, rng);
    (obs, targets)
}

/// Writes `pend_regression.npz` into `dir` (created if missing): `{train,valid,test}_obs`
/// (n, frames, 24, 24, 1) u8, `_targets` (n, frames, 2) f64, `_ts` (n, frames) f64, each split
/// from its own seed (`cfg.seed` + 0, 1, 2). Returns the file's path.
pub fn write_dataset(dir: &Path, cfg: &PendulumConfig) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut arrays: Vec<(String, Tensor)> = vec![];
    for (k, (split, n)) in [
        ("train", cfg.train),
        ("valid", cfg.valid),
        ("test", cfg.test),
    ]
    .into_iter()
    .enumerate()
    {
        let ep = generate(n, cfg.frames, cfg.seed.wrapping_add(k as u64));
        let f = cfg.frames;
        let cpu = &Device::Cpu;
        arrays.push((
            format!("{split}_obs"),
            Tensor::from_vec(ep.obs, (n, f, SIDE, SIDE, 1), cpu)?,
        ));
        arrays.push((
            format!("{split}_targets"),
            Tensor::from_vec(ep.targets, (n, f, 2), cpu)?,
        ));
        arrays.push((format!("{split}_ts"), Tensor::from_vec(ep.ts, (n, f), cpu)?));
    }
    let path = dir.join(FILE);
    let tmp = dir.join(format!("{FILE}.tmp"));
    let named: Vec<(&str, &Tensor)> = arrays.iter().map(|(k, t)| (k.as_str(), t)).collect();
    Tensor::write_npz(&named, &tmp).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The split `split` (train, valid or test) of the benchmark's file at `path`: its arrays
/// `{split}_obs` (u8), `_targets` and `_ts` (f64 or f32), checked against each other.
pub fn read_split(path: &Path, split: &str) -> Result<Episodes> {
    let at = || path.display();
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", at()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .with_context(|| format!("{}: not an npz (zip) file", at()))?;
    let mut array = |key: &str| -> Result<Npy> {
        let name = format!("{split}_{key}");
        let entry = zip
            .by_name(&format!("{name}.npy"))
            .with_context(|| format!("{}: no array {name}", at()))?;
        let size = entry.size();
        Npy::read(entry, size).with_context(|| format!("{}: array {name}", at()))
    };
    let (obs, targets, ts) = (array("obs")?, array("targets")?, array("ts")?);
    let (n, frames) = match ts.shape[..] {
        [n, f] => (n, f),
        _ => bail!(
            "{}: {split}_ts has shape {:?}, expected (n, frames)",
            at(),
            ts.shape
        ),
    };
    let image = [n, frames, SIDE, SIDE];
    if obs.shape != [n, frames, SIDE, SIDE, 1] && obs.shape != image {
        bail!(
            "{}: {split}_obs has shape {:?}, expected ({n}, {frames}, {SIDE}, {SIDE}, 1)",
            at(),
            obs.shape
        );
    }
    if targets.shape != [n, frames, 2] {
        bail!(
            "{}: {split}_targets has shape {:?}, expected ({n}, {frames}, 2)",
            at(),
            targets.shape
        );
    }
    let obs = match obs.kind {
        Kind::U8 => obs.data,
        k => bail!("{}: {split}_obs holds {k:?}, expected u8", at()),
    };
    let (targets, ts) = (targets.floats()?, ts.floats()?);
    if let Some(v) = targets.iter().chain(&ts).find(|v| !v.is_finite()) {
        bail!(
            "{}: a non-finite value ({v}) in {split}'s targets or times",
            at()
        );
    }
    Ok(Episodes {
        n,
        frames,
        obs,
        targets,
        ts,
    })
}

/// An array of an `.npy` file: its element type, shape (C order) and bytes.
struct Npy {
    kind: Kind,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// The element types the benchmark's file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    U8,
    F32,
    F64,
}

impl Npy {
    /// Reads an `.npy` stream of `size` bytes: the magic, the version, the header (a Python
    /// dict of `descr`, `fortran_order` and `shape`), then exactly the bytes the shape needs.
    fn read(mut r: impl std::io::Read, size: u64) -> Result<Npy> {
        let mut head = [0u8; 8];
        r.read_exact(&mut head)
            .context("shorter than an npy header")?;
        if &head[..6] != b"\x93NUMPY" {
            bail!("not an npy array (no magic)");
        }
        let len = match head[6] {
            1 => {
                let mut b = [0u8; 2];
                r.read_exact(&mut b)?;
                u16::from_le_bytes(b) as u64
            }
            2 | 3 => {
                let mut b = [0u8; 4];
                r.read_exact(&mut b)?;
                u32::from_le_bytes(b) as u64
            }
            v => bail!("npy version {v} (1, 2 or 3 expected)"),
        };
        let mut header = Vec::new();
        (&mut r).take(len).read_to_end(&mut header)?;
        if header.len() as u64 != len {
            bail!("the header is cut short");
        }
        let header = String::from_utf8_lossy(&header);
        let field = |key: &str| -> Option<&str> {
            let rest = &header[header.find(&format!("'{key}'"))? + key.len() + 2..];
            Some(rest.trim_start().strip_prefix(':')?.trim_start())
        };
        let descr = field("descr").and_then(|d| d.split('\'').nth(1));
        let kind = match descr {
            Some("|u1" | "<u1" | "u1") => Kind::U8,
            Some("<f4") => Kind::F32,
            Some("<f8") => Kind::F64,
            d => bail!("element type {d:?} (u1, <f4 or <f8 expected)"),
        };
        if !field("fortran_order").is_some_and(|f| f.starts_with("False")) {
            bail!("not in C order");
        }
        let shape = field("shape")
            .and_then(|s| s.strip_prefix('('))
            .and_then(|s| s.split(')').next())
            .context("no shape")?;
        let shape: Vec<usize> = shape
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| d.parse().with_context(|| format!("shape entry '{d}'")))
            .collect::<Result<_>>()?;
        let item = match kind {
            Kind::U8 => 1,
            Kind::F32 => 4,
            Kind::F64 => 8,
        };
        let bytes = shape
            .iter()
            .try_fold(item, |acc: u64, d| acc.checked_mul(*d as u64))
            .context("a shape too large")?;
        let head_len = 8 + if head[6] == 1 { 2 } else { 4 } + len;
        if head_len.checked_add(bytes) != Some(size) {
            bail!(
                "shape {shape:?} needs {bytes} bytes of data, the file holds {}",
                size.saturating_sub(head_len)
            );
        }
        let mut data = Vec::new();
        r.take(bytes).read_to_end(&mut data)?;
        if data.len() as u64 != bytes {
            bail!("the data is cut short");
        }
        Ok(Npy { kind, shape, data })
    }

    /// The elements as f64 (from f32 or f64).
    fn floats(&self) -> Result<Vec<f64>> {
        Ok(match self.kind {
            Kind::F64 => self
                .data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            Kind::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64)
                .collect(),
            Kind::U8 => bail!("bytes where floats are expected"),
        })
    }
}

/// Keeps `keep` of each sequence's frames, drawn without replacement and kept in time order,
/// from `seed` and the sequence's index (the benchmark keeps half: sample rate 0.5).
pub fn subsample(ep: &Episodes, keep: usize, seed: u64) -> Result<Episodes> {
    if keep == 0 || keep > ep.frames {
        bail!("keeping {keep} of {} frames per sequence", ep.frames);
    }
    let px = SIDE * SIDE;
    let mut out = Episodes {
        n: ep.n,
        frames: keep,
        obs: Vec::with_capacity(ep.n * keep * px),
        targets: Vec::with_capacity(ep.n * keep * 2),
        ts: Vec::with_capacity(ep.n * keep),
    };
    for i in 0..ep.n {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
        let mut chosen = rand::seq::index::sample(&mut rng, ep.frames, keep).into_vec();
        chosen.sort_unstable();
        for k in chosen {
            let at = i * ep.frames + k;
            out.obs.extend_from_slice(&ep.obs[at * px..(at + 1) * px]);
            out.targets
                .extend_from_slice(&ep.targets[at * 2..at * 2 + 2]);
            out.ts.push(ep.ts[at]);
        }
    }
    Ok(out)
}

/// The pendulum task's splits from the benchmark file in `dir`: each sequence keeps `keep` of
/// its frames ([`subsample`], split k drawing from `seed` + k·2³²), pixels scaled to [0, 1].
/// Validation is the file's `valid_*` arrays, or without them the last third of its training
/// sequences (the benchmark's own file has training and test sequences only).
pub fn load(dir: &Path, keep: usize, seed: u64) -> Result<[Dataset; 3]> {
    let path = dir.join(FILE);
    let split = |name: &str, k: u64| series_split(&path, name, k, keep, seed);
    let test = split("test", 2)?;
    if has_split(&path, "valid")? {
        return Ok([split("train", 0)?, split("valid", 1)?, test]);
    }
    let all = split("train", 0)?;
    let train = all.len() - all.len() / 3;
    if train == all.len() {
        bail!(
            "{}: {} training sequences and no valid_* arrays: at least 3 are needed to hold a \
             third out for validation",
            path.display(),
            all.len()
        );
    }
    Ok([all.truncated(train), all.skipped(train), test])
}

/// The pendulum task's test split alone (see [`load`]).
pub fn load_test(dir: &Path, keep: usize, seed: u64) -> Result<Dataset> {
    series_split(&dir.join(FILE), "test", 2, keep, seed)
}

/// Split `name` of the file at `path`, the k-th of [`load`]'s draws, as a series dataset.
fn series_split(path: &Path, name: &str, k: u64, keep: usize, seed: u64) -> Result<Dataset> {
    let ep = subsample(&read_split(path, name)?, keep, seed.wrapping_add(k << 32))
        .with_context(|| format!("{}: {name}", path.display()))?;
    Ok(series(&ep))
}

/// Whether the npz file at `path` has arrays of `split`.
fn has_split(path: &Path, split: &str) -> Result<bool> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .with_context(|| format!("{}: not an npz (zip) file", path.display()))?;
    let prefix = format!("{split}_");
    let found = zip
        .file_names()
        .any(|n| n.is_ok_and(|n| n.starts_with(&prefix)));
    Ok(found)
}

/// Episodes as a series dataset: frames of [0, 1] values, each step's interval since the one
/// before (the first step's one frame), and the (sin, cos) targets.
fn series(ep: &Episodes) -> Dataset {
    let mut dt = Vec::with_capacity(ep.ts.len());
    for seq in ep.ts.chunks(ep.frames.max(1)) {
        dt.push(1.0);
        dt.extend(seq.windows(2).map(|w| (w[1] - w[0]) as f32));
    }
    Dataset::Series {
        values: ep.obs.iter().map(|&p| p as f32 / 255.0).collect(),
        dt,
        targets: ep.targets.iter().map(|&v| v as f32).collect(),
        len: ep.frames,
        features: SIDE * SIDE,
        outputs: 2,
    }
}
