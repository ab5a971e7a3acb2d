//! The LRA Pathfinder and Path-X images (format in docs/reference.md): a difficulty directory such as
//! `pathfinder32/curv_contour_length_14/` holds `metadata/<k>.npy` files — plain text despite
//! the name, one space-separated row per image: subpath, file name, an index, the label (0/1),
//! … — and the greyscale PNGs at `<subpath>/<file name>` (32 × 32; 128 × 128 for Path-X).
//! Errors name the metadata file and line, or the image.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::images::{decode_png, ImageSet};

/// The difficulty S5 (and LRA) train on.
pub const DIFFICULTY: &str = "curv_contour_length_14";

/// The directory with `metadata/`: `dir` itself, or `dir/pathfinder{side}/DIFFICULTY`, or
/// `dir/DIFFICULTY`.
pub fn locate(dir: &Path, side: usize) -> Result<PathBuf> {
    let candidates = [
        dir.to_path_buf(),
        dir.join(format!("pathfinder{side}")).join(DIFFICULTY),
        dir.join(DIFFICULTY),
    ];
    candidates
        .iter()
        .find(|d| d.join("metadata").is_dir())
        .cloned()
        .with_context(|| {
            format!(
                "no metadata/ folder in {} (nor in pathfinder{side}/{DIFFICULTY} or {DIFFICULTY} below it)",
                dir.display()
            )
        })
}

/// Every image listed in `root/metadata/*.npy` (files in numeric order of their stems, rows in
/// file order), as a one-channel [`ImageSet`] of `side` × `side` pixels.
pub fn read_pathfinder(root: &Path, side: usize) -> Result<ImageSet> {
    let meta_dir = root.join("metadata");
    let mut metas: Vec<(u64, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(&meta_dir)
        .with_context(|| format!("cannot list {}", meta_dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "npy") {
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            let k = stem
                .parse::<u64>()
                .with_context(|| format!("{}: expected a numeric file name", path.display()))?;
            metas.push((k, path));
        }
    }
    if metas.is_empty() {
        bail!("{}: no .npy metadata files", meta_dir.display());
    }
    metas.sort();
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for (_, meta) in &metas {
        let text = std::fs::read_to_string(meta)
            .with_context(|| format!("cannot read {} as text", meta.display()))?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{} line {}", meta.display(), i + 1);
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 4 {
                bail!(
                    "{}: expected at least 4 fields (subpath, file, index, label), got {}",
                    at(),
                    f.len()
                );
            }
            let label = match f[3] {
                "0" => 0u8,
                "1" => 1u8,
                other => bail!("{}: label {other:?} is not 0 or 1", at()),
            };
            let image = root.join(f[0]).join(f[1]);
            let px = read_png(&image, side).with_context(at)?;
            pixels.extend_from_slice(&px);
            labels.push(label);
        }
    }
    Ok(ImageSet {
        pixels,
        labels,
        height: side,
        width: side,
        channels: 1,
    })
}

/// A greyscale PNG of `side` × `side` pixels.
fn read_png(path: &Path, side: usize) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("image {} is missing or unreadable", path.display()))?;
    decode_png(&bytes, side, 1).with_context(|| path.display().to_string())
}
