//! How a forward pass runs ([`Mode`]), and the dropout masks' key.

use super::{Dropout, GradSink, Shards};
use crate::ops::dropout::{absorb, mix};
use crate::ops::epilogue::KeyWord;

/// How a forward pass runs.
#[derive(Clone, Copy)]
pub enum Mode<'a> {
    /// Inference: no dropout; BatchNorm uses its running statistics.
    Eval,
    /// Training: dropout masks come from the key; BatchNorm uses (and updates) the statistics
    /// of the batch, summed over its data-parallel shards when the forward computes one of them
    /// (`None`: the forward has the whole batch). With a [`GradSink`], layers that have a
    /// backward written by hand run as one node of the graph each and leave their parameters'
    /// gradients there, for the caller to add to the backward's ([`GradSink::add_to`]).
    Train(DropoutKey, Option<&'a Shards>, Option<&'a GradSink>),
}

impl Mode<'_> {
    /// The sink of the gradients computed by hand, in training.
    pub fn sink(&self) -> Option<&GradSink> {
        match self {
            Mode::Train(_, _, sink) => *sink,
            Mode::Eval => None,
        }
    }
}

/// What a training step's dropout masks are a function of. The mask entry of (dropout site,
/// sample row, feature) is a hash of (seed, step, site, first_row + row, feature): the same
/// whether a batch runs whole or in shards, and the same again when a run is resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    /// The optimiser step.
    pub step: u64,
    /// Row of this forward's first sample in the whole batch (a shard's offset).
    pub first_row: u64,
    /// On CUDA, the kernels read the step's key ([`DropoutKey::step_key`]) from the device's
    /// key word, which the caller writes before the step (`crate::cuda::set_dropout_key`), in
    /// place of taking it by value: a step captured as a CUDA graph then masks each replay with
    /// its own seed and step.
    pub key_on_device: bool,
}

impl DropoutKey {
    /// The hash of the seed, the first link of every call's chain.
    fn seed_hash(&self) -> u64 {
        mix(self.seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The hash of (seed, step): what every dropout call of the step starts from, and what
    /// the device's key word holds for a step whose key is read from it.
    pub fn step_key(&self) -> u64 {
        absorb(self.seed_hash(), self.step)
    }

    /// The hash of (seed, step, site): what every entry of one dropout call starts from.
    fn site_hash(&self, site: u64) -> u64 {
        absorb(self.step_key(), site)
    }
}

/// The dropout of call `site` of a forward pass (one mask per (sample, feature), shared across
/// the length): none in evaluation or at rate 0.
pub(super) fn dropout(p: f64, mode: Mode, site: u64) -> Option<Dropout> {
    match mode {
        Mode::Train(key, ..) if p > 0.0 => Some(Dropout {
            site_hash: key.site_hash(site),
            first_row: key.first_row,
            p,
            key_word: key.key_on_device.then_some(KeyWord { site }),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels make a call's site hash from the key word, which holds the step's key
    /// absorb(seed hash, step), as absorb(word, site): the hash the host makes from the key by
    /// value.
    #[test]
    fn a_key_read_from_the_key_word_makes_the_same_site_hash() {
        for (step, site) in [(0, 0), (1, 4), (77, 9)] {
            let key = DropoutKey {
                seed: 5,
                step,
                first_row: 3,
                key_on_device: true,
            };
            let d = dropout(0.2, Mode::Train(key, None, None), site).expect("a dropout");
            let w = d.key_word.expect("read from the key word");
            assert_eq!(w.site, site);
            assert_eq!(absorb(key.step_key(), w.site), d.site_hash);
            let by_value = DropoutKey {
                key_on_device: false,
                ..key
            };
            let v = dropout(0.2, Mode::Train(by_value, None, None), site).expect("a dropout");
            assert_eq!((v.site_hash, v.key_word), (d.site_hash, None));
        }
    }
}
