//! Data: the tasks (`task`: one registry entry each), a split in memory and its batches
//! (`dataset`), the readers of the benchmark formats, and the built-in generators (`generate`:
//! ListOps, stroke digits, the pendulum).

pub mod dataset;
pub mod generate;
pub mod hub;
pub mod images;
pub mod listops;
pub mod pathfinder;
pub mod pendulum;
pub mod speech;
pub mod strokes;
pub mod task;
pub mod text;
