//! How a forward pass runs ([`Mode`]), and the dropout masks' key.

use super::{Dropout, GradSink, Shards};
use crate::ops::dropout::{absorb, mix};

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
}

impl DropoutKey {
    /// The hash of (seed, step, site): what every entry of one dropout call starts from.
    fn site_hash(&self, site: u64) -> u64 {
        let h = mix(self.seed ^ 0x9e37_79b9_7f4a_7c15);
        absorb(absorb(h, self.step), site)
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
        }),
        _ => None,
    }
}
