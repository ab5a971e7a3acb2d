//! LRA's byte-level text tasks (Tay et al. 2021; S5 Appendix G.1):
//! * Text: IMDB movie reviews (Maas et al. 2011), negative (0) or positive (1), read from the
//!   release's folder `aclImdb/{train,test}/{neg,pos}/*.txt` (the `aclImdb` folder itself or
//!   one holding it; `train/unsup` is not read). The test reviews are the test split; a tenth
//!   of the training reviews, drawn with a fixed seed, validate the run (S5's loader validates
//!   on the test split).
//! * Retrieval: the ACL Anthology Network citation pairs of the LRA release,
//!   `new_aan_pairs.{train,eval,test}.tsv` (its `tsv_data` folder), the eval file validating:
//!   one pair per line, tab-separated: the label (0 or 1, as an integer or a float), the two
//!   papers' ids and their two texts, no header. The texts are read as the files write them,
//!   as LRA's and S5's loaders do.
//!
//! A document is its bytes: byte b is token b + 1, token 0 pads, and [`EOS`] ends every
//! document. As the benchmark defines its inputs, a document longer than `max_len` − 1 bytes is
//! cut there (4,096 tokens for Text, 4,000 per document for Retrieval).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::{rngs::StdRng, SeedableRng};

use super::dataset::Dataset;

/// Token ids: the padding, 256 bytes and EOS.
pub const VOCAB: usize = 258;
/// The token that ends every document.
pub const EOS: u32 = 257;
/// The seed of the validation reviews' draw.
const VALIDATION_SEED: u64 = 42;
/// The Retrieval task's files, in split order.
pub const AAN_FILES: [&str; 3] = [
    "new_aan_pairs.train.tsv",
    "new_aan_pairs.eval.tsv",
    "new_aan_pairs.test.tsv",
];

/// `text` as tokens: its first `max_len` − 1 bytes, shifted by one, then [`EOS`].
pub fn tokenize(text: &[u8], max_len: usize) -> Vec<u32> {
    let keep = max_len.saturating_sub(1).min(text.len());
    let mut tokens: Vec<u32> = text[..keep].iter().map(|&b| b as u32 + 1).collect();
    tokens.push(EOS);
    tokens
}

/// The `aclImdb` folder: `dir` itself or its `aclImdb` subfolder.
fn imdb_root(dir: &Path) -> Result<PathBuf> {
    let nested = dir.join("aclImdb");
    let root = if nested.is_dir() { nested } else { dir.into() };
    if !root.join("train").join("pos").is_dir() {
        bail!(
            "{}: no IMDB reviews; expected the aclImdb folder, train/{{neg,pos}}/*.txt and \
             test/{{neg,pos}}/*.txt",
            dir.display()
        );
    }
    Ok(root)
}

/// The reviews of split `split` (`train` or `test`) under `root` and their labels: negative,
/// then positive, each in file-name order.
fn read_reviews(root: &Path, split: &str, max_len: usize) -> Result<(Vec<Vec<u32>>, Vec<u32>)> {
    let (mut seqs, mut labels) = (Vec::new(), Vec::new());
    for (label, class) in ["neg", "pos"].iter().enumerate() {
        let folder = root.join(split).join(class);
        let entries = std::fs::read_dir(&folder)
            .with_context(|| format!("{}: cannot list the reviews", folder.display()))?;
        let mut files = Vec::new();
        for e in entries {
            let path = e
                .with_context(|| format!("{}: cannot list the reviews", folder.display()))?
                .path();
            if path.extension().is_some_and(|x| x == "txt") {
                files.push(path);
            }
        }
        files.sort();
        for f in files {
            let text =
                std::fs::read(&f).with_context(|| format!("{}: cannot read", f.display()))?;
            seqs.push(tokenize(&text, max_len));
            labels.push(label as u32);
        }
    }
    if labels.is_empty() {
        bail!(
            "{}: no reviews in {split}/neg or {split}/pos (*.txt)",
            root.display()
        );
    }
    Ok((seqs, labels))
}

/// The Text task's training, validation and test splits from the IMDB folder `dir`.
pub fn load_imdb(dir: &Path, max_len: usize) -> Result<[Dataset; 3]> {
    let root = imdb_root(dir)?;
    let (seqs, labels) = read_reviews(&root, "train", max_len)?;
    let mut idx: Vec<usize> = (0..labels.len()).collect();
    idx.shuffle(&mut StdRng::seed_from_u64(VALIDATION_SEED));
    let (val, train) = idx.split_at(labels.len() / 10);
    let pick = |rows: &[usize]| Dataset::Tokens {
        seqs: rows.iter().map(|&i| seqs[i].clone()).collect(),
        labels: rows.iter().map(|&i| labels[i]).collect(),
    };
    Ok([pick(train), pick(val), load_imdb_test(&root, max_len)?])
}

/// The Text task's test split alone.
pub fn load_imdb_test(dir: &Path, max_len: usize) -> Result<Dataset> {
    let (seqs, labels) = read_reviews(&imdb_root(dir)?, "test", max_len)?;
    Ok(Dataset::Tokens { seqs, labels })
}

/// The pairs of one Retrieval file.
pub fn read_aan(path: &Path, max_len: usize) -> Result<Dataset> {
    let at = || path.display();
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", at()))?;
    let (mut first, mut second, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&[u8]> = line.split(|&b| b == b'\t').collect();
        if fields.len() != 5 {
            bail!(
                "{}:{}: {} tab-separated fields; a pair has 5 (label, id1, id2, text1, text2)",
                at(),
                i + 1,
                fields.len()
            );
        }
        let label = std::str::from_utf8(fields[0])
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|&l| l == 0.0 || l == 1.0)
            .with_context(|| {
                format!(
                    "{}:{}: label '{}'; expected 0 or 1",
                    at(),
                    i + 1,
                    String::from_utf8_lossy(fields[0])
                )
            })?;
        labels.push(label as u32);
        first.push(tokenize(fields[3], max_len));
        second.push(tokenize(fields[4], max_len));
    }
    if labels.is_empty() {
        bail!("{}: no pairs", at());
    }
    Ok(Dataset::Pairs {
        first,
        second,
        labels,
    })
}

/// The Retrieval task's training, validation and test splits from the folder `dir`.
pub fn load_aan(dir: &Path, max_len: usize) -> Result<[Dataset; 3]> {
    let [train, val, test] = AAN_FILES.map(|f| dir.join(f));
    Ok([
        read_aan(&train, max_len)?,
        read_aan(&val, max_len)?,
        read_aan(&test, max_len)?,
    ])
}
