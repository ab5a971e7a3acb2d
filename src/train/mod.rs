//! Training support: checkpoints (safetensors with the model config in the metadata) and the
//! optimiser (AdamW in the reference's parameter groups, warm-up + cosine schedule), the
//! training loop, whole runs, and their curves.

pub mod checkpoint;
pub mod config;
pub mod optim;
pub(crate) mod pause;
pub mod plot;
pub mod preset;
pub mod run;
pub mod trainer;
