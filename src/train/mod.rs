//! Training support: checkpoints (safetensors with the model config in the metadata).

pub mod checkpoint;
