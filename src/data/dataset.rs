//! A split held in memory, and how its examples become batches (padding included): labelled
//! sequences (or pairs of them) for classification, or sequences with a target at every step
//! for regression.

use candle_core::{Device, Result, Tensor};

/// A labelled split held in memory.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Token sequences of any lengths (padded per batch with id 0).
    Tokens {
        seqs: Vec<Vec<u32>>,
        labels: Vec<u32>,
    },
    /// Pairs of token sequences with a label per pair: a batch holds the pairs' first
    /// sequences, then their second ones, all padded alike.
    Pairs {
        first: Vec<Vec<u32>>,
        second: Vec<Vec<u32>>,
        labels: Vec<u32>,
    },
    /// Real sequences of one length: `values` is (examples, len, features).
    Real {
        values: Vec<f32>,
        len: usize,
        features: usize,
        labels: Vec<u32>,
    },
    /// Real sequences of one length with a real target at every step, sampled at irregular
    /// times: `values` (examples, len, features), `dt` (examples, len) each step's interval since
    /// the one before (the first step's is one time unit), `targets` (examples, len, outputs).
    Series {
        values: Vec<f32>,
        dt: Vec<f32>,
        targets: Vec<f32>,
        len: usize,
        features: usize,
        outputs: usize,
    },
}

/// A batch of examples on the device (a clone shares its tensors).
#[derive(Debug, Clone)]
pub struct Batch {
    /// (batch, length) token ids or (batch, length, features) values; for pairs (2 × batch,
    /// length), the first sequences then the second ones.
    pub x: Tensor,
    /// (rows of x) u32: the valid steps of each sequence.
    pub lengths: Tensor,
    pub target: Target,
    /// (batch, length) each step's interval since the one before, for series.
    pub dt: Option<Tensor>,
}

/// What a batch's model output is scored against.
#[derive(Debug, Clone)]
pub enum Target {
    /// (batch) u32 class labels.
    Labels(Tensor),
    /// (batch, length, outputs) f32 values at every step.
    Values(Tensor),
}

impl Dataset {
    pub fn len(&self) -> usize {
        match self {
            Dataset::Series { dt, len: steps, .. } => dt.len() / steps.max(&1),
            _ => self.labels().len(),
        }
    }

    /// Whether the examples have real targets at every step (regression) rather than labels.
    pub fn is_regression(&self) -> bool {
        matches!(self, Dataset::Series { .. })
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The class labels (none for series).
    pub fn labels(&self) -> &[u32] {
        match self {
            Dataset::Tokens { labels, .. }
            | Dataset::Pairs { labels, .. }
            | Dataset::Real { labels, .. } => labels,
            Dataset::Series { .. } => &[],
        }
    }

    /// Feeds the split's examples and labels, in order, to `hash`: with the other splits, a
    /// digest that identifies a run's data by its content wherever the files lie.
    pub fn hash_into(&self, hash: &mut impl sha2::Digest) {
        match self {
            Dataset::Tokens { seqs, .. } => hash_tokens(hash, seqs),
            Dataset::Pairs { first, second, .. } => {
                hash_tokens(hash, first);
                hash_tokens(hash, second);
            }
            Dataset::Real {
                values,
                len,
                features,
                ..
            } => {
                hash.update((*len as u64).to_le_bytes());
                hash.update((*features as u64).to_le_bytes());
                hash_floats(hash, values);
            }
            Dataset::Series {
                values,
                dt,
                targets,
                len,
                features,
                outputs,
            } => {
                for n in [len, features, outputs] {
                    hash.update((*n as u64).to_le_bytes());
                }
                for v in [values, dt, targets] {
                    hash_floats(hash, v);
                }
            }
        }
        for l in self.labels() {
            hash.update(l.to_le_bytes());
        }
    }

    /// The first `n` examples (all when fewer).
    pub fn truncated(&self, n: usize) -> Dataset {
        self.examples(0..n.min(self.len()))
    }

    /// The examples after the first `n` (none when fewer).
    pub fn skipped(&self, n: usize) -> Dataset {
        self.examples(n.min(self.len())..self.len())
    }

    /// The examples `r` (within `0..self.len()`).
    fn examples(&self, r: std::ops::Range<usize>) -> Dataset {
        let rows = |v: &[f32], per: usize| v[r.start * per..r.end * per].to_vec();
        match self {
            Dataset::Tokens { seqs, labels } => Dataset::Tokens {
                seqs: seqs[r.clone()].to_vec(),
                labels: labels[r].to_vec(),
            },
            Dataset::Pairs {
                first,
                second,
                labels,
            } => Dataset::Pairs {
                first: first[r.clone()].to_vec(),
                second: second[r.clone()].to_vec(),
                labels: labels[r].to_vec(),
            },
            Dataset::Real {
                values,
                len,
                features,
                labels,
            } => Dataset::Real {
                values: rows(values, len * features),
                len: *len,
                features: *features,
                labels: labels[r].to_vec(),
            },
            Dataset::Series {
                values,
                dt,
                targets,
                len,
                features,
                outputs,
            } => Dataset::Series {
                values: rows(values, len * features),
                dt: rows(dt, *len),
                targets: rows(targets, len * outputs),
                len: *len,
                features: *features,
                outputs: *outputs,
            },
        }
    }

    /// The batch of examples `idx`. Token sequences are padded to `pad_to` when given (a Myo
    /// tree's leaves), else to the longest; real sequences, of one length, are not padded.
    pub fn batch(&self, idx: &[usize], pad_to: Option<usize>, device: &Device) -> Result<Batch> {
        let (x, lengths) = match self {
            Dataset::Tokens { seqs, .. } => {
                let rows: Vec<(usize, &[u32])> = idx.iter().map(|&i| (i, &seqs[i][..])).collect();
                pad_tokens(&rows, pad_to, device)?
            }
            Dataset::Pairs { first, second, .. } => {
                let rows: Vec<(usize, &[u32])> = (idx.iter().map(|&i| (i, &first[i][..])))
                    .chain(idx.iter().map(|&i| (i, &second[i][..])))
                    .collect();
                pad_tokens(&rows, pad_to, device)?
            }
            Dataset::Real {
                values,
                len,
                features,
                ..
            }
            | Dataset::Series {
                values,
                len,
                features,
                ..
            } => {
                if pad_to.is_some_and(|p| p != *len) {
                    candle_core::bail!(
                        "sequences of {len} steps cannot be padded to {} (a tree's leaves): \
                         choose a model without padding",
                        pad_to.unwrap_or_default()
                    );
                }
                let x = rows(
                    values,
                    idx,
                    len * features,
                    (idx.len(), *len, *features),
                    device,
                )?;
                (x, vec![*len as u32; idx.len()])
            }
        };
        let (target, dt) = match self {
            Dataset::Series {
                dt,
                targets,
                len,
                outputs,
                ..
            } => (
                Target::Values(rows(
                    targets,
                    idx,
                    len * outputs,
                    (idx.len(), *len, *outputs),
                    device,
                )?),
                Some(rows(dt, idx, *len, (idx.len(), *len), device)?),
            ),
            _ => {
                let labels: Vec<u32> = idx.iter().map(|&i| self.labels()[i]).collect();
                (Target::Labels(Tensor::new(labels, device)?), None)
            }
        };
        Ok(Batch {
            x,
            lengths: Tensor::new(lengths, device)?,
            target,
            dt,
        })
    }

    /// The longest token sequence (of a pair's two, the longer); `None` for sequences of one
    /// length.
    pub fn longest(&self) -> Option<usize> {
        match self {
            Dataset::Tokens { seqs, .. } => seqs.iter().map(Vec::len).max(),
            Dataset::Pairs { first, second, .. } => first.iter().chain(second).map(Vec::len).max(),
            Dataset::Real { .. } | Dataset::Series { .. } => None,
        }
    }

    /// The padding of batch `idx`: `pad_to`, else the longest token sequence of the whole batch, so
    /// that every shard pads as the unsharded batch would (padding reaches a bidirectional layer).
    pub fn padding(&self, idx: &[usize], pad_to: Option<usize>) -> Option<usize> {
        match self {
            Dataset::Tokens { seqs, .. } => {
                pad_to.or_else(|| idx.iter().map(|&i| seqs[i].len()).max())
            }
            Dataset::Pairs { first, second, .. } => pad_to.or_else(|| {
                idx.iter()
                    .map(|&i| first[i].len().max(second[i].len()))
                    .max()
            }),
            Dataset::Real { .. } | Dataset::Series { .. } => pad_to,
        }
    }
}

/// Token sequences `rows` (each with its example's index, which errors name) padded with id 0
/// to `pad_to`, else to the longest: (rows, width) and each row's length.
fn pad_tokens(
    rows: &[(usize, &[u32])],
    pad_to: Option<usize>,
    device: &Device,
) -> Result<(Tensor, Vec<u32>)> {
    let longest = rows.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let width = pad_to.unwrap_or(longest);
    if let Some((i, s)) = rows.iter().find(|(_, s)| s.len() > width || s.is_empty()) {
        candle_core::bail!(
            "example {i} has a sequence of {} tokens; sequences must have 1..={width}",
            s.len()
        );
    }
    let mut flat = vec![0u32; rows.len() * width];
    for (r, (_, s)) in rows.iter().enumerate() {
        flat[r * width..r * width + s.len()].copy_from_slice(s);
    }
    let lengths = rows.iter().map(|(_, s)| s.len() as u32).collect();
    Ok((
        Tensor::from_vec(flat, (rows.len(), width), device)?,
        lengths,
    ))
}

/// Feeds token sequences to `hash`, each with its length.
fn hash_tokens(hash: &mut impl sha2::Digest, seqs: &[Vec<u32>]) {
    for s in seqs {
        hash.update((s.len() as u64).to_le_bytes());
        for t in s {
            hash.update(t.to_le_bytes());
        }
    }
}

/// Rows `idx` of `values`, `per` values each, as a tensor of `shape`.
fn rows(
    values: &[f32],
    idx: &[usize],
    per: usize,
    shape: impl Into<candle_core::Shape>,
    device: &Device,
) -> Result<Tensor> {
    let mut flat = Vec::with_capacity(idx.len() * per);
    for &i in idx {
        flat.extend_from_slice(&values[i * per..(i + 1) * per]);
    }
    Tensor::from_vec(flat, shape, device)
}

/// Feeds `values`' bytes to `hash`, a chunk at a time.
fn hash_floats(hash: &mut impl sha2::Digest, values: &[f32]) {
    let mut bytes = Vec::with_capacity(4 << 12);
    for chunk in values.chunks(1 << 12) {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        hash.update(&bytes);
    }
}
