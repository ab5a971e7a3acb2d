//! Differentiable custom ops, one per file: the candle `CustomOp` glue, the CPU implementation
//! (the "twin" of the CUDA kernel, following the same algorithm) and the CUDA launch code.

pub mod scan;
pub mod tree_solve;
mod value;

pub use scan::{
    linear_scan, linear_scan_backward, linear_scan_reference, GateShape, ScanGrads, ScanOptions,
};
pub use tree_solve::{
    tree_solve, tree_solve_backward, tree_solve_reference, TreeSolveGrads, TreeSolveOptions,
};
