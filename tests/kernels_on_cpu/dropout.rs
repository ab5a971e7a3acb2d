//! `dropout_keep_*` of kernels/dropout.cu through the harness, against the CPU twin.

use candle_core::{DType, Device};
use myosotis::ops::dropout::cuda::keep_plan;
use myosotis::ops::dropout_keep;

use crate::common::to_vec;
use crate::exec::{run, run_in_every_order};
use crate::{assert_same, DTYPES};

/// Every dtype, rates 0 to 0.9, awkward shapes, shifted rows (a shard's offset): the kernel's
/// masks equal the CPU's bit for bit.
#[test]
fn dropout_kernels_match_the_cpu_twin() {
    for (dtype, _) in DTYPES {
        for (rows, features) in [(1, 1), (3, 17), (50, 256), (7, 1000)] {
            for (p, site_hash, first_row) in [
                (0.0, 1, 0),
                (0.1, 0x0123_4567_89ab_cdef, 5),
                (0.5, u64::MAX, 1 << 40),
                (0.9, 42, 3),
            ] {
                let what = format!("{dtype:?}, {rows} x {features}, p = {p}");
                let plan = keep_plan(rows, features, site_hash, first_row, p, dtype).unwrap();
                let got = run_in_every_order(&plan, dtype, &[], 1).outputs.remove(0);
                let want =
                    dropout_keep(site_hash, first_row, rows, features, p, dtype, &Device::Cpu);
                assert_same(&got, &to_vec(&want.unwrap()), &what);
            }
        }
    }
}

/// More entries than the grid has threads: each thread takes several, and about 1 − p of them
/// are kept.
#[test]
fn dropout_kernel_strides_over_large_masks() {
    let (rows, features, p) = (1030, 1024, 0.3);
    let plan = keep_plan(rows, features, 9, 0, p, DType::F32).unwrap();
    assert!((plan.grid[0] * plan.block[0]) < (rows * features) as u32);
    let got = run(&plan, DType::F32, &[], kernels_on_cpu::Order::Ascending)
        .unwrap()
        .outputs
        .remove(0);
    let want = dropout_keep(9, 0, rows, features, p, DType::F32, &Device::Cpu).unwrap();
    assert_same(&got, &to_vec(&want), "1030 x 1024");
    let kept = got.iter().sum::<f64>() / got.len() as f64;
    assert!((kept - (1.0 - p)).abs() < 0.01, "kept {kept}");
}
