//! `cross_entropy_fwd_*` and `cross_entropy_bwd_*` of kernels/cross_entropy.cu through the
//! harness: against an f64 loop, and bit for bit against the CPU twin (the op's CPU path), in
//! f32 and f64.

use candle_core::{DType, Device};
use myosotis::ops::cross_entropy::cuda::{backward_plan, forward_plan};
use myosotis::ops::{cross_entropy, cross_entropy_backward};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

/// (rows, classes): one of each, odd sizes, more rows than the forward's 256 threads (each
/// thread then takes several), many classes.
const SHAPES: [(usize, usize); 5] = [(1, 1), (3, 7), (300, 10), (600, 2), (5, 1000)];

#[test]
fn cross_entropy_kernels_match_the_loop_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("cross_entropy_kernels", 53);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for (rows, classes) in SHAPES {
            let what = format!("{dtype:?} {rows} x {classes}");
            let mut x = round_to(&uniform(&mut rng, rows * classes, -4.0, 4.0), dtype);
            // Ties for the largest logit: the first one counts.
            if classes > 2 {
                x[1] = x[2].max(x[0]) + 1.0;
                x[2] = x[1];
                x = round_to(&x, dtype);
            }
            let y: Vec<f64> = (0..rows)
                .map(|r| match r {
                    0 if classes > 2 => 2.0,
                    _ => rng.random_range(0..classes) as f64,
                })
                .collect();
            let g = round_to(&[rng.random_range(0.5..2.0)], dtype);
            let out = run_in_every_order(
                &forward_plan(rows, classes, dtype).unwrap(),
                dtype,
                &[&x, &y],
                seed,
            )
            .outputs
            .remove(0);
            let n = rows * classes;
            let dx = run_in_every_order(
                &backward_plan(rows, classes, dtype).unwrap(),
                dtype,
                &[&out[..n], &y, &g],
                seed,
            )
            .outputs
            .remove(0);
            // The f64 loop.
            let (mut logp, mut loss, mut correct) = (vec![0.0; n], 0.0, 0.0);
            let mut dx_ref = vec![0.0; n];
            for r in 0..rows {
                let xr = &x[r * classes..][..classes];
                let m = xr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + xr.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                let arg = (0..classes).find(|&c| xr[c] == m).unwrap();
                let label = y[r] as usize;
                for c in 0..classes {
                    logp[r * classes + c] = xr[c] - lse;
                    let p = (xr[c] - lse).exp();
                    dx_ref[r * classes + c] =
                        (p - f64::from(u8::from(c == label))) * g[0] / rows as f64;
                }
                loss -= logp[r * classes + label] / rows as f64;
                correct += f64::from(u8::from(arg == label));
            }
            assert!(rel_err(&out[..n], &logp) < tol, "{what}: logp");
            assert!(rel_err(&out[n..n + 1], &[loss]) < tol, "{what}: loss");
            assert_eq!(out[n + 1], correct, "{what}: correct");
            assert!(rel_err(&dx, &dx_ref) < tol, "{what}: backward");
            // The CPU twin, bit for bit.
            let xt = tensor(&x, &[rows, classes], dtype, &Device::Cpu);
            let yt = tensor(&y, &[rows], DType::U32, &Device::Cpu);
            let ce = cross_entropy(&xt, &yt).unwrap();
            assert_same(&out[..n], &to_vec(&ce.logp), &format!("{what}: logp"));
            assert_same(
                &out[n..],
                &[to_vec(&ce.loss), to_vec(&ce.correct)].concat(),
                &format!("{what}: loss and correct"),
            );
            let gt = tensor(&g, &[], dtype, &Device::Cpu);
            let d = cross_entropy_backward(&ce.logp, &ce.labels, &gt).unwrap();
            assert_same(&dx, &to_vec(&d), &format!("{what}: backward"));
        }
    }
}
