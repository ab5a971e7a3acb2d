//! Training: what defines a run and how flags resolve into one (`config`, `preset`), whole runs
//! (`run`), how a split is cut into batches (`batching`), the epoch loop (`trainer`), the optimiser
//! (AdamW in the model's parameter groups, warm-up + cosine schedule), a run folder's files and
//! checkpoints (`checkpoint`), the curves (`plot`), what `myo train` shows of a run (`progress`),
//! and on CUDA the training step captured as a CUDA graph (`captured`).

pub mod args;
pub mod batching;
#[cfg(feature = "cuda")]
mod captured;
pub mod checkpoint;
pub mod config;
pub mod dist;
pub mod eval;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod optim;
pub(crate) mod pause;
mod pending;
pub mod plot;
pub mod precision;
pub mod preset;
pub mod progress;
pub mod run;
pub mod shards;
pub mod start;
pub mod trainer;
