//! `grad_norm_parts_*` and `grad_norm_sum_*` of kernels/grad_norm.cu through the harness:
//! against an f64 sum, and bit for bit against the CPU twin (the op's CPU path), in f32 and
//! f64.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::grad_norm;
use myosotis::ops::grad_norm::cuda::{parts_plans, sum_plan};
use myosotis::ops::grad_norm::{parts_cpu, sum_cpu};
use rand::Rng;

use crate::assert_same;
use crate::common::{seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

/// Gradient sizes: one element; a few odd sizes; more elements than one block's 16 per
/// thread (several blocks per gradient); 40 gradients (two launches of partial sums) with an
/// empty one among them.
fn cases(rng: &mut impl Rng) -> Vec<Vec<usize>> {
    vec![
        vec![1],
        vec![3, 17, 256, 1],
        vec![70_000, 5, 4097],
        (0..40)
            .map(|k| if k == 7 { 0 } else { rng.random_range(1..3000) })
            .collect(),
    ]
}

#[test]
fn grad_norm_kernels_match_the_sum_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("grad_norm_kernels", 63);
    for sizes in cases(&mut rng) {
        for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
            let what = format!("{dtype:?} {} gradients", sizes.len());
            let grads: Vec<Vec<f64>> = sizes
                .iter()
                .map(|&n| round_to(&uniform(&mut rng, n, -3.0, 3.0), dtype))
                .collect();
            let inputs: Vec<&[f64]> = grads.iter().map(|g| g.as_slice()).collect();
            let mut parts = Vec::new();
            for plan in parts_plans(&sizes, dtype).unwrap() {
                parts.extend(
                    run_in_every_order(&plan, dtype, &inputs, seed)
                        .outputs
                        .remove(0),
                );
            }
            let norm = run_in_every_order(
                &sum_plan(parts.len(), dtype).unwrap(),
                dtype,
                &[&parts],
                seed,
            )
            .outputs
            .remove(0);
            let want: f64 = grads.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
            assert!(
                (norm[0] - want).abs() <= tol * want,
                "{what}: {} vs {want}",
                norm[0]
            );
            // The twin in the kernel's type.
            let (twin_parts, twin_norm) = match dtype {
                DType::F32 => {
                    let g32: Vec<Vec<f32>> = grads
                        .iter()
                        .map(|g| g.iter().map(|&x| x as f32).collect())
                        .collect();
                    let p = parts_cpu(&g32.iter().map(|g| g.as_slice()).collect::<Vec<_>>());
                    let p32: Vec<f32> = parts.iter().map(|&x| x as f32).collect();
                    let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
                    (widen(&p), sum_cpu(&p32) as f64)
                }
                _ => (parts_cpu(&inputs), sum_cpu(&parts)),
            };
            assert_same(&parts, &twin_parts, &format!("{what}: partial sums"));
            assert_same(&norm, &[twin_norm], &format!("{what}: norm"));
            let ts: Vec<Tensor> = grads
                .iter()
                .zip(&sizes)
                .map(|(g, &n)| tensor(g, &[n], dtype, &Device::Cpu))
                .collect();
            let op = grad_norm(&ts.iter().collect::<Vec<_>>()).unwrap();
            assert_same(&norm, &to_vec(&op), &format!("{what}: the op"));
        }
    }
}
