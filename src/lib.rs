//! myosotis: structured state-space sequence models on candle.
//!
//! The core is two differentiable custom ops with CPU and CUDA implementations:
//! [`ops::linear_scan`] (S5, minGRU, 2-D SSM rows) and the Myo tree solve.

pub mod bench;
pub mod complex;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device;
pub mod fail;
pub mod nn;
pub mod ops;
pub mod train;
pub mod tree;
