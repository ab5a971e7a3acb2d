//! `scan_fwd_*` and `scan_bwd_*` of kernels/scan.cu through the harness.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::scan::cuda::{backward_plan, forward_plan};
use myosotis::ops::{linear_scan, linear_scan_backward, GateShape};
use rand::Rng;

use crate::common::*;
use crate::exec::{round_to, run_in_every_order};
use crate::{assert_same, DTYPES};

/// Channels 1, 3, 17, 33 and 64 + 5 (tiles of 32: partial tiles, several blocks per row of the
/// grid); lengths 1, 7, 63, 64, 65, several chunks of 64 and a prime; batches of 1 to 3.
fn cases() -> Vec<Case> {
    scan_cases_of(&[
        (1, 1, 1),
        (2, 7, 3),
        (3, 63, 17),
        (2, 64, 33),
        (1, 65, 69),
        (2, 200, 5),
        (2, 263, 40),
    ])
}

/// Sums per-batch ∂a partials (batch, rest) over the batch.
fn sum_over_batch(partials: &[f64], batch: usize) -> Vec<f64> {
    let n = partials.len() / batch;
    (0..n)
        .map(|e| (0..batch).map(|b| partials[b * n + e]).sum())
        .collect()
}

#[test]
fn scan_kernels_match_the_f64_reference_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("scan kernels", 11);
    let cpu = &Device::Cpu;
    for case in cases() {
        for (dtype, tol) in DTYPES {
            let what = format!("{case:?} {dtype:?} (seed {seed})");
            let x = random_inputs(&case, &mut rng);
            // What the kernel reads: the inputs stored in `dtype`.
            let x = Inputs {
                a: round_to(&x.a, dtype),
                b: round_to(&x.b, dtype),
                h0: round_to(&x.h0, dtype),
            };
            let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, cpu);
            let (a, b, h0) = (
                t(&x.a, &case.a_shape()),
                t(&x.b, &case.b_shape()),
                t(&x.h0, &case.h0_shape()),
            );
            let h0_opt = case.with_h0.then_some(&h0);

            let plan = forward_plan(&a, &b, h0_opt, case.opts()).unwrap();
            let h = run_in_every_order(&plan, dtype, &[&x.a, &x.b, &x.h0], seed)
                .outputs
                .remove(0);
            let e = rel_err(&h, &reference_scan(&case, &x));
            assert!(e < tol, "forward vs f64 reference: {e:e}, {what}");
            let twin = to_vec(&linear_scan(&a, &b, h0_opt, case.opts()).unwrap());
            assert_same(&h, &twin, &format!("forward, {what}"));

            let g: Vec<f64> = (0..h.len()).map(|_| rng.random_range(-1.0..1.0)).collect();
            let g = round_to(&g, dtype);
            let h_t = t(&h, &case.b_shape());
            let plan = backward_plan(&a, &h_t, h0_opt, case.opts()).unwrap();
            let mut out = run_in_every_order(&plan, dtype, &[&x.a, &h, &x.h0, &g], seed).outputs;
            let (db, da_partials, dh0) = (out.remove(0), out.remove(0), out.remove(0));
            let da = match case.gate {
                GateShape::Full => da_partials,
                _ => sum_over_batch(&da_partials, case.batch),
            };
            let [want_da, want_db, want_dh0] = reference_scan_grads(&case, &x, &g);
            for (name, got, want) in [
                ("∂b", &db, &want_db),
                ("∂a", &da, &want_da),
                ("∂h0", &dh0, &want_dh0),
            ] {
                let e = rel_err(got, want);
                assert!(e < 2.0 * tol, "{name} vs f64 reference: {e:e}, {what}");
            }
            let twin = linear_scan_backward(&a, &h_t, h0_opt, &t(&g, &case.b_shape()), case.opts())
                .unwrap();
            assert_same(&db, &to_vec(&twin.b), &format!("∂b, {what}"));
            assert_same(&dh0, &to_vec(&twin.h0), &format!("∂h0, {what}"));
            let twin_da = to_vec(&twin.a);
            if case.gate == GateShape::Full {
                assert_same(&da, &twin_da, &format!("∂a, {what}"));
            } else {
                // Summed over the batch in another order than the twin's.
                let e = rel_err(&da, &twin_da);
                assert!(e < tol, "∂a vs CPU twin: {e:e}, {what}");
            }
        }
    }
}

/// The plans' launch arithmetic: one block per (batch element, tile of 32 channels), a warp
/// per segment, no shared memory beyond the kernel's own; batches beyond the grid's y limit are
/// an error, not a wrapped launch.
#[test]
fn scan_plans_cover_the_tensor_and_refuse_oversized_grids() {
    let zeros = |s: &[usize]| Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap();
    let opts = myosotis::ops::ScanOptions::default();
    let plan = forward_plan(&zeros(&[33]), &zeros(&[3, 10, 33]), None, opts).unwrap();
    assert_eq!(plan.kernel, "scan_fwd_f32");
    assert_eq!((plan.grid, plan.block), ([2, 3, 1], [32, 8, 1]));
    assert_eq!((plan.shared_bytes, plan.workspace_bytes), (0, 0));
    assert_eq!(plan.outputs, vec![3 * 10 * 33]);
    let big = zeros(&[65_536, 1, 1]);
    let err = forward_plan(&zeros(&[1]), &big, None, opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("65535"), "{err}");
}
