//! Every CUDA kernel in `kernels/*.cu`, compiled unchanged as host C++ and run on the CPU by the
//! harness of `tests/kernels_on_cpu/host` through the same launch plans the CUDA launch
//! executes, against the f64 references and the CPU twins. Threads of a block run one at a time
//! from barrier to barrier, in three orders whose results must agree bit for bit: a missing
//! `__syncthreads()` makes them differ.
//!
//! `cargo test --release --test kernels_on_cpu [scan|tree|block|head|dropout|adamw|gelu|epilogue|gate|embedding|gather|grad_norm|masked_mean|cross_entropy|layer_norm|channel|batch_norm|s5]`; `MYO_TEST_SEED` explores
//! other inputs.

mod adamw;
mod batch_norm;
#[path = "../common/mod.rs"]
mod common;
mod cross_entropy;
mod dropout;
mod embedding;
mod epilogue;
mod exec;
mod fused;
mod gate;
mod gather;
mod grad_norm;
mod head_solve;
mod masked_mean;
mod s5_discretize;
mod s5_readout;
mod s5_timed;
mod scan;
mod tree_plans;
mod tree_solve;

use candle_core::DType;
use myosotis::ops::plan::kernel_name;

/// The dtypes every kernel is instantiated for, with the tolerance of its results relative to
/// the largest reference value (f16/bf16 are computed in f32 and rounded once on output).
pub const DTYPES: [(DType, f64); 4] = [
    (DType::F64, 1e-12),
    (DType::F32, 2e-5),
    (DType::F16, 4e-3),
    (DType::BF16, 2e-2),
];

/// Asserts that the harness's `got` equals the CPU twin's `want` element by element (±0
/// alike): the twins do the kernels' arithmetic in the kernels' order.
pub fn assert_same(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(e) = (0..got.len()).find(|&e| got[e] != want[e]) {
        panic!(
            "{what}: element {e} is {} on the harness, {} on the CPU twin",
            got[e], want[e]
        );
    }
}

/// The harness compiled exactly the kernels that the launch plans name, and the tests below
/// run every one of them (every stem and dtype, real and complex where the kernel has both).
#[test]
fn every_kernel_entry_point_is_tested() {
    // (stem, real and complex or one of them, dtypes): the head kernels are complex only,
    // in f32 and f64.
    let all: Vec<DType> = DTYPES.iter().map(|(dt, _)| *dt).collect();
    let wide = [DType::F32, DType::F64].to_vec();
    let half = [DType::F16, DType::BF16].to_vec();
    let (both, real, complex): (&[bool], &[bool], &[bool]) = (&[false, true], &[false], &[true]);
    let stems = [
        ("scan_fwd", both, &all),
        ("scan_bwd", both, &all),
        ("tree_fwd", both, &all),
        ("tree_bwd", both, &all),
        ("tree_block_fwd", both, &all),
        ("tree_block_bwd", both, &all),
        ("tree_lanes_fwd", both, &all),
        ("tree_lanes_bwd", both, &all),
        ("tree_lanes_block_fwd", both, &all),
        ("tree_lanes_block_bwd", both, &all),
        ("tree_pivots", both, &wide),
        ("tree_sweep_fwd", both, &wide),
        ("tree_sweep_bwd", both, &wide),
        ("tree_block_pivots", both, &wide),
        ("tree_sweep_block_fwd", both, &wide),
        ("tree_sweep_block_bwd", both, &wide),
        ("head_pivots", complex, &wide),
        ("head_sweep", complex, &wide),
        ("head_staged", complex, &wide),
        ("head_reduce", complex, &wide),
        ("dropout_keep", real, &all),
        ("adamw_step", real, &all),
        ("adamw_step_wide", real, &half),
        ("gelu_fwd", real, &all),
        ("gelu_bwd", real, &all),
        ("epilogue_fwd", real, &all),
        ("epilogue_bwd", real, &all),
        ("gate_fwd", real, &all),
        ("gate_bwd", real, &all),
        ("embedding_fwd", real, &wide),
        ("embedding_bwd", real, &wide),
        ("gather_fwd", real, &wide),
        ("gather_bwd", real, &wide),
        ("grad_norm_parts", real, &all),
        ("grad_norm_sum", real, &wide),
        ("masked_mean_fwd", real, &all),
        ("masked_mean_bwd", real, &all),
        ("cross_entropy_fwd", real, &wide),
        ("cross_entropy_bwd", real, &wide),
        ("layer_norm_fwd", real, &all),
        ("layer_norm_bwd", real, &all),
        ("layer_norm_sums", real, &all),
        ("channel_fwd", real, &all),
        ("channel_bwd", real, &all),
        ("channel_sums", real, &all),
        ("batch_norm_stats", real, &all),
        ("batch_norm_sums", real, &wide),
        ("batch_norm_apply", real, &all),
        ("batch_norm_bwd_stats", real, &all),
        ("batch_norm_pair", real, &wide),
        ("batch_norm_bwd", real, &all),
        ("batch_norm_running", real, &all),
        ("s5_discretize_fwd", real, &all),
        ("s5_discretize_bwd", real, &all),
        ("s5_readout_fwd", real, &all),
        ("s5_readout_bwd", real, &all),
        ("s5_timed_fwd", real, &wide),
        ("s5_timed_bwd", real, &wide),
        ("s5_timed_sums", real, &wide),
    ];
    let mut planned: Vec<String> = stems
        .iter()
        .flat_map(|&(stem, variants, dtypes)| {
            dtypes.iter().flat_map(move |dt| {
                variants
                    .iter()
                    .map(move |&c| kernel_name(stem, *dt, c).unwrap())
            })
        })
        .collect();
    let mut compiled = kernels_on_cpu::kernels();
    planned.sort();
    compiled.sort();
    assert_eq!(compiled, planned);
}

/// The constants the launch plans and the CPU twin share with the kernels (the block shape the
/// plans launch must be the one the kernels are compiled for).
#[test]
fn kernel_constants_match_the_plans() {
    let read = |f: &str| {
        std::fs::read_to_string(format!("{}/kernels/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let (scan, tree) = (read("scan.cu"), read("tree_solve.cu"));
    use myosotis::ops::rows;
    use myosotis::ops::scan::{SEGMENTS, SEG_LEN, TILE};
    for (src, name, value) in [
        (&scan, "SCAN_TILE", TILE),
        (&scan, "SCAN_SEGMENTS", SEGMENTS),
        (&scan, "SCAN_SEG_LEN", SEG_LEN),
        (
            &tree,
            "TREE_THREADS",
            myosotis::ops::tree_solve::cuda::THREADS as usize,
        ),
        (
            &read("tree_lanes.cu"),
            "LANE_THREADS",
            myosotis::ops::tree_solve::cuda::LANE_THREADS as usize,
        ),
        (
            &read("tree_lanes.cu"),
            "LANE_MAX_D",
            myosotis::ops::tree_solve::cuda::LANE_MAX_D,
        ),
        (
            &read("tree_sweep.cu"),
            "SWEEP_THREADS",
            myosotis::ops::tree_solve::cuda::SWEEP_THREADS as usize,
        ),
        (
            &read("tree_sweep.cu"),
            "SWEEP_WIDE_THREADS",
            myosotis::ops::tree_solve::cuda::SWEEP_WIDE_THREADS as usize,
        ),
        (
            &read("tree_sweep.cu"),
            "SWEEP_BLOCK_THREADS",
            myosotis::ops::tree_solve::cuda::SWEEP_BLOCK_THREADS as usize,
        ),
        (
            &read("tree_sweep.cu"),
            "SWEEP_MAX_D",
            myosotis::ops::tree_solve::cuda::SWEEP_MAX_D,
        ),
        (
            &read("head_solve.cu"),
            "HEAD_THREADS",
            myosotis::ops::head_solve::cuda::THREADS as usize,
        ),
        (
            &read("head_solve.cu"),
            "HEAD_STAGED_THREADS",
            myosotis::ops::head_solve::cuda::STAGED_THREADS as usize,
        ),
        (
            &read("dropout.cu"),
            "DROPOUT_THREADS",
            myosotis::ops::dropout::cuda::THREADS as usize,
        ),
        (
            &read("gather.cu"),
            "GATHER_THREADS",
            rows::ELEMENT_THREADS as usize,
        ),
        (
            &read("gelu.cu"),
            "GELU_THREADS",
            rows::ELEMENT_THREADS as usize,
        ),
        (&read("rows.cuh"), "ROWS_THREADS", rows::THREADS as usize),
        (&read("rows.cuh"), "ROWS_LANES", rows::LANES),
        (
            &read("s5_discretize.cu"),
            "S5D_THREADS",
            myosotis::ops::s5_discretize::THREADS,
        ),
        (
            &read("s5_readout.cu"),
            "S5R_THREADS",
            rows::ELEMENT_THREADS as usize,
        ),
    ] {
        let line = format!("#define {name} {value}");
        assert!(src.contains(&line), "kernels/*.cu lacks `{line}`");
    }
}
