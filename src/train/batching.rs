//! How a split is cut into batches: their size, the data-parallel shards and micro-batches of
//! a training step, and how token sequences are padded.

use crate::data::dataset::Dataset;

/// The most lengths that the token batches of a split take when [`Batching::bucketed`].
pub const PAD_LENGTHS: usize = 4;

/// How a split is cut into batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    pub batch_size: usize,
    /// Pad token sequences to this length (a Myo tree's leaves) instead of the batch's longest.
    pub pad_to: Option<usize>,
    /// Without `pad_to`, pad token sequences to the batch's longest rounded up to a multiple of
    /// a [`PAD_LENGTHS`]th of the split's longest (at most to it), so that a split's batches
    /// take at most [`PAD_LENGTHS`] lengths: on CUDA each length's step is captured once and
    /// replayed (`train::captured`). `false`: to the batch's longest.
    pub bucketed: bool,
    /// The split's longest sequence ([`Batching::over`]).
    pub longest: Option<usize>,
    /// Data-parallel shards per batch (1: none): each shard's forward and backward run on its
    /// own rayon worker and the gradients are summed, in shard order (deterministic). Meant
    /// for the CPU with candle's own ops single-threaded (as `myo train` sets up), where one
    /// shard per core beats parallelism inside each op.
    pub shards: usize,
    /// Micro-batches per optimiser step (`--accumulate`): a step takes `accumulate` batches of
    /// `batch_size`, one after the other, and adds their gradients. BatchNorm normalises each
    /// micro-batch with its own statistics, as PyTorch does: summing them across micro-batches
    /// would need every micro-batch's forward pass before any backward pass, which is the
    /// memory that accumulating saves.
    pub accumulate: usize,
    /// The model has BatchNorm, whose batch statistics are summed over the shards (and ranks)
    /// of a training batch: the shards then run together, each on a thread of its own, and
    /// with several ranks each rank computes its part as one shard.
    pub batch_norm: bool,
}

impl Batching {
    /// Examples per optimiser step: `accumulate` micro-batches of `batch_size`.
    pub fn step_size(&self) -> usize {
        self.batch_size.max(1) * self.accumulate.max(1)
    }

    /// This batching of `data`: with its longest sequence, which the buckets divide.
    pub fn over(self, data: &Dataset) -> Batching {
        let longest = self.bucketed.then(|| data.longest()).flatten();
        Batching { longest, ..self }
    }

    /// The length that the batch `idx` of `data` is padded to (`None`: sequences of one
    /// length), `self` being [`Batching::over`] `data`.
    pub fn padding(&self, data: &Dataset, idx: &[usize]) -> Option<usize> {
        let batch = data.padding(idx, self.pad_to)?;
        Some(match (self.pad_to, self.bucketed, self.longest) {
            (None, true, Some(max)) if batch < max => {
                let step = max.div_ceil(PAD_LENGTHS);
                (batch.div_ceil(step) * step).min(max)
            }
            _ => batch,
        })
    }
}
