//! Training support: checkpoints (safetensors with the model config in the metadata) and the
//! optimiser (AdamW in the reference's parameter groups, warm-up + cosine schedule).

pub mod checkpoint;
pub mod optim;
pub mod run;
pub mod trainer;
