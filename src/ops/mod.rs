//! Differentiable custom ops. The kernel-backed ops have a folder each (`scan/`, `tree_solve/`,
//! `head_solve/`, `dropout/`, `epilogue/`, `masked_mean/`, `cross_entropy/`, `adamw/`, `gelu/`,
//! `embedding/`, `gather/`, `grad_norm/`, `layer_norm/`, `batch_norm/`, `channel/`, `s5_discretize/`,
//! `s5_timed/`, `s5_readout/`: the candle `CustomOp` glue, the CPU twin of the CUDA kernel, the launch
//! plans); `rows` is the row layout LayerNorm, BatchNorm and the channel ops share; the
//! CPU-only transpose is one file.

pub mod adamw;
pub mod batch_norm;
pub mod channel;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod epilogue;
pub mod gather;
pub mod gelu;
pub mod gemm;
pub mod grad_norm;
pub mod head_solve;
mod in_place;
pub mod layer_norm;
pub mod masked_mean;
pub mod plan;
pub mod rows;
pub mod s5_discretize;
pub mod s5_readout;
pub mod s5_timed;
pub mod scan;
pub mod transpose;
pub mod tree_solve;
mod value;
pub(crate) use value::{acc_dtype, widened};

pub use adamw::{adamw_step, AdamwHyper, AdamwParam};
pub use batch_norm::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    column_stats,
};
pub use channel::{channel_add, channel_add_backward, channel_mul, channel_mul_backward};
pub use cross_entropy::{cross_entropy, cross_entropy_backward, CrossEntropy};
pub use dropout::dropout_keep;
pub use embedding::{embedding, embedding_backward};
pub use epilogue::{epilogue, epilogue_backward};
pub use gather::RowGather;
pub use gelu::gelu;
pub use gemm::{gemm, gemm_relaid, Mat};
pub use grad_norm::grad_norm;
pub use head_solve::{
    head_solve, head_solve_backward, head_solve_skew, head_solve_skew_backward, HeadSkewGrads,
    HeadSolveGrads,
};
pub use in_place::in_place_updates;
pub use layer_norm::{layer_norm, layer_norm_backward, layer_norm_composed};
pub use masked_mean::{masked_mean, masked_mean_backward};
pub use s5_discretize::{
    s5_discretize, s5_discretize_backward, s5_discretize_reference, s5_discretize_untracked,
    S5Discretization,
};
pub use s5_readout::{s5_readout, s5_readout_backward};
pub use s5_timed::{s5_timed, s5_timed_backward};
pub use scan::{
    linear_scan, linear_scan_backward, linear_scan_reference, GateShape, ScanGrads, ScanOptions,
};
pub use transpose::swap_dims12;
pub use tree_solve::{
    check_pivots, tree_solve, tree_solve_backward, tree_solve_reference, TreeLayout,
    TreeSolveGrads, TreeSolveOptions,
};
