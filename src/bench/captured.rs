//! What `myo bench step` reports of a step captured as a CUDA graph (the types exist on every
//! build: a report read or written without CUDA has none).

use serde::Serialize;

use super::Timing;

/// The nodes of a captured step's CUDA graph, by kind, and the bytes its allocation nodes ask
/// for (all of them, as if none reused another's memory).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct GraphNodes {
    pub kernels: usize,
    pub copies: usize,
    pub memsets: usize,
    pub allocations: usize,
    pub frees: usize,
    pub other: usize,
    pub allocated_bytes: usize,
}

/// Device memory that captured graphs' allocations held at most, in bytes: in use, and
/// reserved (mapped for them; the driver may keep more than is in use).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct GraphMemory {
    pub used_high: usize,
    pub reserved_high: usize,
}

/// A step captured as a CUDA graph: its replay's time, its nodes, and how its results compare
/// with the same steps run eagerly from the same parameters and inputs.
#[derive(Debug, Clone, Serialize)]
pub struct Captured {
    pub step: Timing,
    pub nodes: GraphNodes,
    /// What the graph's allocations held while it was replayed.
    pub memory: GraphMemory,
    /// Replays compared with as many eager steps.
    pub compared: usize,
    /// The largest difference of a parameter after them (0: the same to the bit).
    pub max_difference: f64,
}
