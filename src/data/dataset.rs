//! A labelled split held in memory, and how its examples become batches (padding included).

use candle_core::{Device, Result, Tensor};

/// A labelled split held in memory.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Token sequences of any lengths (padded per batch with id 0).
    Tokens {
        seqs: Vec<Vec<u32>>,
        labels: Vec<u32>,
    },
    /// Real sequences of one length: `values` is (examples, len, features).
    Real {
        values: Vec<f32>,
        len: usize,
        features: usize,
        labels: Vec<u32>,
    },
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn labels(&self) -> &[u32] {
        match self {
            Dataset::Tokens { labels, .. } | Dataset::Real { labels, .. } => labels,
        }
    }

    /// Feeds the split's examples and labels, in order, to `hash`: with the other splits, a
    /// digest that identifies a run's data by its content wherever the files lie.
    pub fn hash_into(&self, hash: &mut impl sha2::Digest) {
        match self {
            Dataset::Tokens { seqs, .. } => {
                for s in seqs {
                    hash.update((s.len() as u64).to_le_bytes());
                    for t in s {
                        hash.update(t.to_le_bytes());
                    }
                }
            }
            Dataset::Real {
                values,
                len,
                features,
                ..
            } => {
                hash.update((*len as u64).to_le_bytes());
                hash.update((*features as u64).to_le_bytes());
                let mut bytes = Vec::with_capacity(4 << 12);
                for chunk in values.chunks(1 << 12) {
                    bytes.clear();
                    bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                    hash.update(&bytes);
                }
            }
        }
        for l in self.labels() {
            hash.update(l.to_le_bytes());
        }
    }

    /// The first `n` examples (all when fewer).
    pub fn truncated(&self, n: usize) -> Dataset {
        match self {
            Dataset::Tokens { seqs, labels } => Dataset::Tokens {
                seqs: seqs.iter().take(n).cloned().collect(),
                labels: labels.iter().take(n).copied().collect(),
            },
            Dataset::Real {
                values,
                len,
                features,
                labels,
            } => {
                let k = n.min(labels.len());
                Dataset::Real {
                    values: values[..k * len * features].to_vec(),
                    len: *len,
                    features: *features,
                    labels: labels[..k].to_vec(),
                }
            }
        }
    }

    /// The batch of examples `idx`: inputs, their lengths (u32) and labels (u32). Token
    /// sequences are padded to `pad_to` when given (a Myo tree's leaves), else to the longest.
    pub fn batch(
        &self,
        idx: &[usize],
        pad_to: Option<usize>,
        device: &Device,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let labels: Vec<u32> = idx.iter().map(|&i| self.labels()[i]).collect();
        let (x, lengths) = match self {
            Dataset::Tokens { seqs, .. } => {
                let longest = idx.iter().map(|&i| seqs[i].len()).max().unwrap_or(0);
                let width = pad_to.unwrap_or(longest);
                if let Some(&i) = idx
                    .iter()
                    .find(|&&i| seqs[i].len() > width || seqs[i].is_empty())
                {
                    candle_core::bail!(
                        "example {i} has {} tokens; sequences must have 1..={width}",
                        seqs[i].len()
                    );
                }
                let mut flat = vec![0u32; idx.len() * width];
                for (r, &i) in idx.iter().enumerate() {
                    flat[r * width..r * width + seqs[i].len()].copy_from_slice(&seqs[i]);
                }
                let lengths: Vec<u32> = idx.iter().map(|&i| seqs[i].len() as u32).collect();
                (Tensor::from_vec(flat, (idx.len(), width), device)?, lengths)
            }
            Dataset::Real {
                values,
                len,
                features,
                ..
            } => {
                let per = len * features;
                let mut flat = Vec::with_capacity(idx.len() * per);
                for &i in idx {
                    flat.extend_from_slice(&values[i * per..(i + 1) * per]);
                }
                (
                    Tensor::from_vec(flat, (idx.len(), *len, *features), device)?,
                    vec![*len as u32; idx.len()],
                )
            }
        };
        Ok((
            x,
            Tensor::new(lengths, device)?,
            Tensor::new(labels, device)?,
        ))
    }

    /// The padding of batch `idx`: `pad_to`, else the longest token sequence of the whole batch, so
    /// that every shard pads as the unsharded batch would (padding reaches a bidirectional layer).
    pub fn padding(&self, idx: &[usize], pad_to: Option<usize>) -> Option<usize> {
        match self {
            Dataset::Tokens { seqs, .. } => {
                pad_to.or_else(|| idx.iter().map(|&i| seqs[i].len()).max())
            }
            Dataset::Real { .. } => pad_to,
        }
    }
}
