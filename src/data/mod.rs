//! Data: the tasks (`task`: one registry entry each), a split in memory and its batches
//! (`dataset`), the readers of the benchmark formats and the built-in ListOps generator.

pub mod dataset;
pub mod hub;
pub mod images;
pub mod listops;
pub mod pathfinder;
pub mod strokes;
pub mod task;
