//! `grad_norm_parts_*` and `grad_norm_sum_*` of kernels/grad_norm.cu through the harness:
//! against an f64 sum, and bit for bit against the CPU twin (the op's CPU path), for f32, f64,
//! f16 and bf16 gradients (the last two summed in f32).

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use myosotis::ops::grad_norm;
use myosotis::ops::grad_norm::cuda::{parts_plans, sum_plan, sums_dtype};
use myosotis::ops::grad_norm::{parts_cpu, sum_cpu};
use rand::Rng;

use crate::assert_same;
use crate::common::{seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_bytes_in_every_order, run_in_every_order, to_bytes};

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

/// The CPU twin's partial sums and norm of `grads` (values of `dtype`), as f64.
fn twin(grads: &[Vec<f64>], dtype: DType) -> (Vec<f64>, f64) {
    fn typed<T: Copy + Sync>(grads: &[Vec<f64>], cast: fn(f64) -> T) -> Vec<Vec<T>> {
        grads
            .iter()
            .map(|g| g.iter().map(|&x| cast(x)).collect())
            .collect()
    }
    fn slices<T>(g: &[Vec<T>]) -> Vec<&[T]> {
        g.iter().map(Vec::as_slice).collect()
    }
    let wide = |p: Vec<f32>| {
        let n = sum_cpu(&p) as f64;
        (p.into_iter().map(f64::from).collect(), n)
    };
    match dtype {
        DType::F64 => {
            let p = parts_cpu(&slices(grads), |x: f64| x);
            let n = sum_cpu(&p);
            (p, n)
        }
        DType::F32 => wide(parts_cpu(&slices(&typed(grads, |x| x as f32)), |x: f32| x)),
        DType::F16 => wide(parts_cpu(
            &slices(&typed(grads, f16::from_f64)),
            f16::to_f32,
        )),
        _ => wide(parts_cpu(
            &slices(&typed(grads, bf16::from_f64)),
            bf16::to_f32,
        )),
    }
}

#[test]
fn grad_norm_kernels_match_the_sum_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("grad_norm_kernels", 63);
    for sizes in cases(&mut rng) {
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let sums = sums_dtype(dtype);
            let tol = if dtype == DType::F64 { 1e-13 } else { 1e-6 };
            let what = format!("{dtype:?} {} gradients", sizes.len());
            let grads: Vec<Vec<f64>> = sizes
                .iter()
                .map(|&n| round_to(&uniform(&mut rng, n, -3.0, 3.0), dtype))
                .collect();
            let stored: Vec<Vec<u8>> = grads.iter().map(|g| to_bytes(g, dtype)).collect();
            let mut parts = Vec::new();
            for plan in parts_plans(&sizes, dtype).unwrap() {
                // The partial sums come out in `sums`.
                parts.extend(
                    run_bytes_in_every_order(&plan, sums, &stored, seed)
                        .outputs
                        .remove(0),
                );
            }
            let norm =
                run_in_every_order(&sum_plan(parts.len(), sums).unwrap(), sums, &[&parts], seed)
                    .outputs
                    .remove(0);
            let want: f64 = grads.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
            assert!(
                (norm[0] - want).abs() <= tol * want,
                "{what}: {} vs {want}",
                norm[0]
            );
            let (twin_parts, twin_norm) = twin(&grads, dtype);
            assert_same(&parts, &twin_parts, &format!("{what}: partial sums"));
            assert_same(&norm, &[twin_norm], &format!("{what}: norm"));
            let ts: Vec<Tensor> = grads
                .iter()
                .zip(&sizes)
                .map(|(g, &n)| tensor(g, &[n], dtype, &Device::Cpu))
                .collect();
            let op = grad_norm(&ts.iter().collect::<Vec<_>>()).unwrap();
            assert_eq!(op.dtype(), sums, "{what}: the op's dtype");
            assert_same(&norm, &to_vec(&op), &format!("{what}: the op"));
        }
    }
}
