//! `masked_mean_fwd_*` and `masked_mean_bwd_*` of kernels/masked_mean.cu through the harness:
//! against an f64 loop, and bit for bit against the CPU twin (the op's CPU path, ∂h through
//! candle's autograd), in every dtype (f16 and bf16 with f32 lengths).

use candle_core::{DType, Device, Var};
use myosotis::ops::masked_mean;
use myosotis::ops::masked_mean::cuda::{backward_plan, forward_plan};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_bytes_in_every_order, to_bytes};
use crate::DTYPES;

/// (batch, steps, features): one element, odd sizes, more outputs and elements than the grid's
/// threads (each thread then takes several).
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 1), (3, 7, 5), (16, 50, 33), (300, 40, 64)];

#[test]
fn masked_mean_kernels_match_the_loop_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("masked_mean_kernels", 51);
    for (dtype, tol) in DTYPES {
        // The lengths in the kernels' compute type.
        let len_dtype = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for (b, l, w) in SHAPES {
            let what = format!("{dtype:?} {b} x {l} x {w}");
            let h = round_to(&uniform(&mut rng, b * l * w, -2.0, 2.0), dtype);
            let g = round_to(&uniform(&mut rng, b * w, -1.0, 1.0), dtype);
            // Every length from 1 to L appears when the batch allows.
            let len: Vec<f64> = (0..b)
                .map(|i| match i {
                    0 => l as f64,
                    1 => 1.0,
                    _ => rng.random_range(1..=l) as f64,
                })
                .collect();
            let run = |plan: &myosotis::ops::plan::LaunchPlan, rows: &[f64]| {
                let inputs = [to_bytes(rows, dtype), to_bytes(&len, len_dtype)];
                run_bytes_in_every_order(plan, dtype, &inputs, seed)
                    .outputs
                    .remove(0)
            };
            let out = run(&forward_plan(b, l, w, dtype).unwrap(), &h);
            let dh = run(&backward_plan(b, l, w, dtype).unwrap(), &g);
            let (mut out_ref, mut dh_ref) = (vec![0.0; b * w], vec![0.0; b * l * w]);
            for i in 0..b {
                let n = len[i] as usize;
                for j in 0..w {
                    out_ref[i * w + j] =
                        (0..n).map(|t| h[(i * l + t) * w + j]).sum::<f64>() / len[i];
                    for t in 0..n {
                        dh_ref[(i * l + t) * w + j] = g[i * w + j] / len[i];
                    }
                }
            }
            assert!(rel_err(&out, &out_ref) < tol, "{what}: forward");
            assert!(rel_err(&dh, &dh_ref) < tol, "{what}: backward");
            let hv = Var::from_tensor(&tensor(&h, &[b, l, w], dtype, &Device::Cpu)).unwrap();
            let lt = tensor(&len, &[b], DType::U32, &Device::Cpu);
            let o = masked_mean(hv.as_tensor(), &lt).unwrap();
            assert_same(&out, &to_vec(&o), &format!("{what}: forward"));
            let gt = tensor(&g, &[b, w], dtype, &Device::Cpu);
            let grads = (o * gt).unwrap().sum_all().unwrap().backward().unwrap();
            assert_same(
                &dh,
                &to_vec(grads.get(&hv).unwrap()),
                &format!("{what}: backward"),
            );
        }
    }
}
