//! Synthetic 28 × 28 "digits" written as MNIST IDX files, so that the image tasks (sMNIST,
//! zMNIST, psMNIST) can be tried, and the GPU acceptance run can train on an image task,
//! without downloading anything. Class k is a bar three pixels thick: horizontal at row
//! 3 + 5k for k < 5, vertical at column 3 + 5(k − 5) otherwise, shifted by up to one pixel,
//! with 5% of the other pixels lit at random.

use std::path::Path;

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::images::ImageSet;

/// Image side (as MNIST).
pub const SIDE: usize = 28;

/// `n` images with labels cycling through the ten classes, from `seed`.
pub fn generate(n: usize, seed: u64) -> ImageSet {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pixels = vec![0u8; n * SIDE * SIDE];
    let mut labels = Vec::with_capacity(n);
    for (i, img) in pixels.chunks_mut(SIDE * SIDE).enumerate() {
        let class = i % 10;
        let at = (3 + 5 * (class % 5)) as i64 + rng.random_range(-1..=1);
        for row in 0..SIDE {
            for col in 0..SIDE {
                let across = if class < 5 { row } else { col } as i64;
                img[row * SIDE + col] = if (at..at + 3).contains(&across) {
                    rng.random_range(200..=255)
                } else if rng.random_bool(0.05) {
                    rng.random_range(1..=255)
                } else {
                    0
                };
            }
        }
        labels.push(class as u8);
    }
    ImageSet {
        pixels,
        labels,
        height: SIDE,
        width: SIDE,
        channels: 1,
    }
}

/// Writes `train` and `test` images (from `seed`) into `dir` as the four MNIST IDX files.
pub fn write_dataset(dir: &Path, train: usize, test: usize, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (split, n, s) in [("train", train, seed), ("t10k", test, seed ^ 0x5eed)] {
        let set = generate(n, s);
        let header = |magic: u32, dims: &[usize]| -> Vec<u8> {
            let mut h = magic.to_be_bytes().to_vec();
            for &d in dims {
                h.extend((d as u32).to_be_bytes());
            }
            h
        };
        let images = [header(2051, &[n, SIDE, SIDE]), set.pixels].concat();
        let labels = [header(2049, &[n]), set.labels].concat();
        for (name, bytes) in [("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)] {
            let path = dir.join(format!("{split}-{name}"));
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(())
}
