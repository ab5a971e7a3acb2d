//! Readers of the image benchmarks' files (formats in docs/reference.md), with errors that name the
//! file and record:
//! * MNIST IDX: `{train,t10k}-images-idx3-ubyte` (magic 2051, count, rows, cols, pixels) and
//!   `{train,t10k}-labels-idx1-ubyte` (magic 2049, count, labels), big-endian, plain or `.gz`;
//! * CIFAR-10 binary: `data_batch_{1..5}.bin`, `test_batch.bin`, records of 1 label byte and
//!   3,072 pixel bytes (the R, G, B planes of 32 × 32).
//!
//! Then how an image task's [`Pixels`] become normalised pixel sequences and splits.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::{rngs::StdRng, SeedableRng};

use super::dataset::Dataset;
use super::task::{ImageFiles, Order, Pixels, Split};

/// Images with labels, pixels as bytes in (image, row, column, channel) order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSet {
    pub pixels: Vec<u8>,
    pub labels: Vec<u8>,
    pub height: usize,
    pub width: usize,
    pub channels: usize,
}

impl ImageSet {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Pixels of image i, (row, column, channel).
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.height * self.width * self.channels;
        &self.pixels[i * n..(i + 1) * n]
    }
}

/// The pixels of a PNG of `side` × `side` pixels as `channels` (1: greyscale, 3: RGB) bytes
/// each, in (row, column, channel) order. Palettes are expanded, 16-bit samples cut to 8 and
/// alpha dropped; greyscale becomes RGB by repetition, while colour asked for as greyscale is
/// an error (the datasets never need it).
pub fn decode_png(bytes: &[u8], side: usize, channels: usize) -> Result<Vec<u8>> {
    use png::{ColorType, Transformations};
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    decoder.set_transformations(Transformations::EXPAND | Transformations::STRIP_16);
    let mut reader = decoder.read_info().context("not a PNG")?;
    let mut buf = vec![0; reader.output_buffer_size().unwrap_or(0)];
    let info = reader.next_frame(&mut buf).context("corrupt PNG data")?;
    if (info.width as usize, info.height as usize) != (side, side) {
        bail!(
            "{} × {} pixels, expected {side} × {side}",
            info.width,
            info.height
        );
    }
    buf.truncate(info.buffer_size());
    let src = info.color_type.samples();
    let colour = matches!(info.color_type, ColorType::Rgb | ColorType::Rgba);
    if colour && channels == 1 {
        bail!("{:?} PNG, expected greyscale", info.color_type);
    }
    if info.color_type == ColorType::Grayscale && channels == 1 {
        return Ok(buf);
    }
    if info.color_type == ColorType::Rgb && channels == 3 {
        return Ok(buf);
    }
    let mut out = Vec::with_capacity(side * side * channels);
    for px in buf.chunks_exact(src) {
        if colour {
            out.extend_from_slice(&px[..3]);
        } else {
            out.extend(std::iter::repeat_n(px[0], channels));
        }
    }
    Ok(out)
}

/// `name`, or `name.gz`, in `dir`.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    if plain.exists() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.exists() {
        return Ok(gz);
    }
    bail!("{} not found (nor {}.gz)", plain.display(), name)
}

/// A file's bytes, decompressed when it ends in `.gz`.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = vec![];
        flate2::read::GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .with_context(|| format!("{}: not a valid gzip file", path.display()))?;
        return Ok(out);
    }
    Ok(raw)
}

fn be_u32(bytes: &[u8], at: usize, path: &Path) -> Result<u32> {
    let b = bytes.get(at..at + 4).with_context(|| {
        format!(
            "{}: truncated header ({} bytes)",
            path.display(),
            bytes.len()
        )
    })?;
    Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// One MNIST split (`train` or `t10k`) from the IDX files in `dir`.
pub fn read_mnist(dir: &Path, split: &str) -> Result<ImageSet> {
    let ip = find(dir, &format!("{split}-images-idx3-ubyte"))?;
    let lp = find(dir, &format!("{split}-labels-idx1-ubyte"))?;
    let (images, labels) = (read_bytes(&ip)?, read_bytes(&lp)?);
    let magic = be_u32(&images, 0, &ip)?;
    if magic != 2051 {
        bail!(
            "{}: magic number {magic}, expected 2051 (IDX images)",
            ip.display()
        );
    }
    let (n, rows, cols) = (
        be_u32(&images, 4, &ip)? as usize,
        be_u32(&images, 8, &ip)? as usize,
        be_u32(&images, 12, &ip)? as usize,
    );
    let have = images.len().saturating_sub(16);
    let per = rows.saturating_mul(cols);
    if n.checked_mul(per) != Some(have) {
        bail!(
            "{}: header says {n} images of {rows} x {cols} ({} bytes) but the file has {have}: image {} is {}",
            ip.display(),
            n as u128 * per as u128,
            have / per.max(1),
            if (have as u128) < n as u128 * per as u128 { "truncated" } else { "followed by extra bytes" }
        );
    }
    let magic = be_u32(&labels, 0, &lp)?;
    if magic != 2049 {
        bail!(
            "{}: magic number {magic}, expected 2049 (IDX labels)",
            lp.display()
        );
    }
    let m = be_u32(&labels, 4, &lp)? as usize;
    if labels.len() - 8 != m {
        bail!(
            "{}: header says {m} labels but the file has {}",
            lp.display(),
            labels.len() - 8
        );
    }
    if m != n {
        bail!(
            "{} has {n} images but {} has {m} labels",
            ip.display(),
            lp.display()
        );
    }
    if let Some(i) = labels[8..].iter().position(|&l| l > 9) {
        bail!(
            "{}: label {} of record {i} is not a digit",
            lp.display(),
            labels[8 + i]
        );
    }
    Ok(ImageSet {
        pixels: images[16..].to_vec(),
        labels: labels[8..].to_vec(),
        height: rows,
        width: cols,
        channels: 1,
    })
}

/// CIFAR-10 records from the given binary files in `dir` (e.g. `data_batch_1.bin` …).
pub fn read_cifar10(dir: &Path, files: &[&str]) -> Result<ImageSet> {
    const SIDE: usize = 32;
    const PLANE: usize = SIDE * SIDE;
    const RECORD: usize = 1 + 3 * PLANE;
    let mut set = ImageSet {
        pixels: vec![],
        labels: vec![],
        height: SIDE,
        width: SIDE,
        channels: 3,
    };
    for name in files {
        let path = dir.join(name);
        let bytes = std::fs::read(&path)
            .with_context(|| format!("cannot read CIFAR-10 file {}", path.display()))?;
        if bytes.is_empty() || bytes.len() % RECORD != 0 {
            bail!(
                "{}: {} bytes is not a whole number of {RECORD}-byte records (record {} is truncated)",
                path.display(),
                bytes.len(),
                bytes.len() / RECORD
            );
        }
        for (i, rec) in bytes.chunks_exact(RECORD).enumerate() {
            if rec[0] > 9 {
                bail!(
                    "{}: record {i} has label {}, expected 0-9",
                    path.display(),
                    rec[0]
                );
            }
            set.labels.push(rec[0]);
            // planes R, G, B → (row, column, channel)
            for p in 0..PLANE {
                set.pixels
                    .extend([rec[1 + p], rec[1 + PLANE + p], rec[1 + 2 * PLANE + p]]);
            }
        }
    }
    Ok(set)
}

/// The CIFAR-10 training files.
pub const CIFAR_TRAIN: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];
/// The CIFAR-10 test file.
pub const CIFAR_TEST: [&str; 1] = ["test_batch.bin"];

impl Pixels {
    /// Input features per pixel.
    pub fn features(&self) -> usize {
        if self.grey {
            1
        } else {
            self.files.channels()
        }
    }

    /// Sequence position → row-major pixel index.
    pub fn order(&self) -> Vec<usize> {
        let n = self.side * self.side;
        match self.order {
            Order::Raster => (0..n).collect(),
            Order::Morton => {
                crate::tree::Ordering::morton(self.side, self.side)
                    .expect("a non-empty image")
                    .perm
            }
            Order::Permuted { seed } => {
                let mut p: Vec<usize> = (0..n).collect();
                p.shuffle(&mut StdRng::seed_from_u64(seed));
                p
            }
        }
    }

    /// Images `idx` of `set` as normalised pixel sequences.
    fn sequences(&self, set: &ImageSet, idx: &[usize]) -> Dataset {
        let features = self.features();
        let order = self.order();
        let (mean, std) = (&self.mean, &self.std);
        let mut values = Vec::with_capacity(idx.len() * order.len() * features);
        for &i in idx {
            let img = set.image(i);
            for &px in &order {
                let p = &img[px * set.channels..(px + 1) * set.channels];
                if self.grey {
                    let grey = 0.2989 * p[0] as f32 + 0.5870 * p[1] as f32 + 0.1140 * p[2] as f32;
                    values.push((grey / 255.0 - mean[0]) / std[0]);
                } else {
                    for c in 0..features {
                        values.push((p[c] as f32 / 255.0 - mean[c]) / std[c]);
                    }
                }
            }
        }
        Dataset::Real {
            values,
            len: order.len(),
            features,
            labels: idx.iter().map(|&i| set.labels[i] as u32).collect(),
        }
    }

    /// The splits from the files in `dir`.
    pub(super) fn load(&self, dir: &Path) -> Result<[Dataset; 3]> {
        match self.files {
            ImageFiles::Pathfinder => {
                use super::pathfinder::{locate, read_pathfinder};
                let all = read_pathfinder(&locate(dir, self.side)?, self.side)?;
                self.split_one(&all)
            }
            ImageFiles::Mnist => {
                self.split_pair(&read_mnist(dir, "train")?, &read_mnist(dir, "t10k")?, dir)
            }
            ImageFiles::Cifar10 => self.split_pair(
                &read_cifar10(dir, &CIFAR_TRAIN)?,
                &read_cifar10(dir, &CIFAR_TEST)?,
                dir,
            ),
        }
    }

    /// The test split alone from the files in `dir` (see [`Task::load_test`]).
    pub(super) fn load_test(&self, dir: &Path) -> Result<Dataset> {
        let test = match self.files {
            ImageFiles::Pathfinder => {
                let [_, _, test] = self.load(dir)?;
                return Ok(test);
            }
            ImageFiles::Mnist => read_mnist(dir, "t10k")?,
            ImageFiles::Cifar10 => read_cifar10(dir, &CIFAR_TEST)?,
        };
        self.check(&test, dir)?;
        let all: Vec<usize> = (0..test.len()).collect();
        Ok(self.sequences(&test, &all))
    }

    /// Checks that `set` (read from `from`) holds images of this task's size and channels.
    fn check(&self, set: &ImageSet, from: &Path) -> Result<()> {
        let (side, channels) = (self.side, self.files.channels());
        if (set.height, set.width, set.channels) != (side, side, channels) {
            bail!(
                "{}: images of {} x {} with {} channel(s); this task needs {side} x {side} with {channels}",
                from.display(),
                set.height,
                set.width,
                set.channels
            );
        }
        Ok(())
    }

    /// The splits of a dataset that comes as training and test images (read from `from`).
    pub(super) fn split_pair(
        &self,
        train: &ImageSet,
        test: &ImageSet,
        from: &Path,
    ) -> Result<[Dataset; 3]> {
        self.check(train, from)?;
        self.check(test, from)?;
        let Split::HoldOut { seed } = self.split else {
            bail!(
                "{:?} files come as training and test sets: their split is hold_out",
                self.files
            );
        };
        let mut idx: Vec<usize> = (0..train.len()).collect();
        idx.shuffle(&mut StdRng::seed_from_u64(seed));
        let (val, train_idx) = idx.split_at(train.len() / 10);
        let all_test: Vec<usize> = (0..test.len()).collect();
        Ok([
            self.sequences(train, train_idx),
            self.sequences(train, val),
            self.sequences(test, &all_test),
        ])
    }

    /// The splits of a dataset that comes as one set of images.
    fn split_one(&self, all: &ImageSet) -> Result<[Dataset; 3]> {
        let Split::Shuffle { seed } = self.split else {
            bail!(
                "{:?} files come as one set: their split is shuffle",
                self.files
            );
        };
        let mut idx: Vec<usize> = (0..all.len()).collect();
        idx.shuffle(&mut StdRng::seed_from_u64(seed));
        let tenth = all.len() / 10;
        let (val, rest) = idx.split_at(tenth);
        let (test, train) = rest.split_at(tenth);
        Ok([
            self.sequences(all, train),
            self.sequences(all, val),
            self.sequences(all, test),
        ])
    }
}
