//! kernels/batch_norm.cu through the harness: bit for bit against the CPU twins (the ops'
//! CPU paths) in f32 and f64, and against f64 references.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::batch_norm::cuda;
use myosotis::ops::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    column_stats,
};

use crate::common::{rel_err, running_averages_reference, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order, run_in_place_in_every_order};
use crate::fused::SHAPES;
use crate::{assert_same, DTYPES};

const EPS: f64 = 1e-5;

/// Runs a stats launch and the launch adding its partial rows; returns the latter's outputs.
fn stats(
    plans: &[myosotis::ops::plan::LaunchPlan; 2],
    dtype: DType,
    inputs: &[&[f64]],
    seed: u64,
) -> Vec<Vec<f64>> {
    let part = run_in_every_order(&plans[0], dtype, inputs, seed)
        .outputs
        .remove(0);
    run_in_every_order(&plans[1], dtype, &[&part], seed).outputs
}

#[test]
fn batch_norm_kernels_match_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("batch_norm_kernels", 29);
    for (dtype, tol) in DTYPES.into_iter().filter(|(dt, _)| cuda::supports(1, *dt)) {
        for (rows, h) in SHAPES {
            let what = format!("batch_norm {dtype:?} {rows} x {h}");
            let n = rows * h;
            let x = round_to(&uniform(&mut rng, n, 1.0, 4.0), dtype);
            let w = round_to(&uniform(&mut rng, h, 0.5, 1.5), dtype);
            let b = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            let g = round_to(&uniform(&mut rng, n, -1.0, 1.0), dtype);

            // Σx, then Σ(x − μ)² around the kernels' own μ; each over the rows, rounded.
            let moment = |inputs: &[&[f64]]| {
                let plans = cuda::stats_plans(rows, h, inputs.len() == 2, dtype).unwrap();
                let sums = stats(&plans, dtype, inputs, seed).remove(0);
                let per_row: Vec<f64> = sums.iter().map(|s| s / rows as f64).collect();
                (sums, round_to(&per_row, dtype))
            };
            let (sum, mean) = moment(&[&x]);
            let (sq, var) = moment(&[&x, &mean]);
            let y = run_in_every_order(
                &cuda::apply_plan(n, h, EPS, dtype).unwrap(),
                dtype,
                &[&x, &mean, &var, &w, &b],
                seed,
            )
            .outputs
            .remove(0);
            let [dw, db]: [Vec<f64>; 2] = stats(
                &cuda::backward_stats_plans(rows, h, EPS, dtype).unwrap(),
                dtype,
                &[&x, &mean, &var, &g],
                seed,
            )
            .try_into()
            .expect("two outputs");
            let count = [rows as f64];
            let dx = run_in_every_order(
                &cuda::backward_plan(n, h, EPS, dtype).unwrap(),
                dtype,
                &[&x, &mean, &var, &w, &g, &dw, &db, &count],
                seed,
            )
            .outputs
            .remove(0);

            // The references, from the same μ and σ².
            let mut sum_ref = vec![0.0; h];
            let mut sq_ref = vec![0.0; h];
            let (mut dw_ref, mut db_ref) = (vec![0.0; h], vec![0.0; h]);
            let k: Vec<f64> = var.iter().map(|v| 1.0 / (v + EPS).sqrt()).collect();
            let xh = |e: usize| (x[e] - mean[e % h]) * k[e % h];
            for e in 0..n {
                let i = e % h;
                sum_ref[i] += x[e];
                sq_ref[i] += (x[e] - mean[i]).powi(2);
                dw_ref[i] += g[e] * xh(e);
                db_ref[i] += g[e];
            }
            let y_ref: Vec<f64> = (0..n).map(|e| xh(e) * w[e % h] + b[e % h]).collect();
            let dx_ref: Vec<f64> = (0..n)
                .map(|e| {
                    let i = e % h;
                    w[i] * k[i] * (g[e] - (db_ref[i] + xh(e) * dw_ref[i]) / rows as f64)
                })
                .collect();
            for (name, got, want) in [
                ("Σx", &sum, &sum_ref),
                ("Σ(x − μ)²", &sq, &sq_ref),
                ("y", &y, &y_ref),
                ("∂γ", &dw, &dw_ref),
                ("∂β", &db, &db_ref),
                ("∂x", &dx, &dx_ref),
            ] {
                let e = rel_err(got, want);
                assert!(e < tol, "{what}: {name} against the reference: {e:e}");
            }

            // The CPU twins: the ops' CPU paths on the same values.
            let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, &Device::Cpu);
            let (xt, gt) = (t(&x, &[rows, h]), t(&g, &[rows, h]));
            let [mt, vt, wt, bt] = [&mean, &var, &w, &b].map(|v| t(v, &[h]));
            assert_same(
                &sum,
                &to_vec(&column_stats(&xt, None).unwrap()),
                &format!("{what}: Σx"),
            );
            assert_same(
                &sq,
                &to_vec(&column_stats(&xt, Some(&mt)).unwrap()),
                &format!("{what}: Σ(x − μ)²"),
            );
            assert_same(
                &y,
                &to_vec(&batch_norm_apply(&xt, &mt, &vt, &wt, &bt, EPS).unwrap()),
                &format!("{what}: y"),
            );
            let [dwt, dbt] = batch_norm_backward_stats(&xt, &mt, &vt, &gt, EPS).unwrap();
            assert_same(&dw, &to_vec(&dwt), &format!("{what}: ∂γ"));
            assert_same(&db, &to_vec(&dbt), &format!("{what}: ∂β"));
            let nt: Tensor = t(&count, &[1]);
            let dxt = batch_norm_backward(&xt, &mt, &vt, &wt, &gt, &dwt, &dbt, &nt, EPS).unwrap();
            assert_same(&dx, &to_vec(&dxt), &format!("{what}: ∂x"));
        }
    }
}

/// `batch_norm_running` in place: against f64 loops and, bit for bit, the CPU twin.
#[test]
fn batch_norm_running_kernel_matches_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("batch_norm_running_kernel", 30);
    for (dtype, tol) in DTYPES.into_iter().filter(|(dt, _)| cuda::supports(1, *dt)) {
        for (h, rows, decay) in [(1, 2, 0.9), (3, 1, 0.9), (300, 7, 0.99), (5000, 1000, 0.1)] {
            let what = format!("batch_norm running {dtype:?}, h {h}, {rows} rows (seed {seed})");
            let rm = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            let rv = round_to(&uniform(&mut rng, h, 0.5, 2.0), dtype);
            let mean = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            let var = round_to(&uniform(&mut rng, h, 0.0, 3.0), dtype);
            let count = [rows as f64];
            let plan = cuda::running_plan(h, decay, dtype).unwrap();
            let run = run_in_place_in_every_order(
                &plan,
                dtype,
                &[&rm, &rv],
                &[&mean, &var, &count],
                seed,
            );
            let [want_m, want_v] = running_averages_reference([&rm, &rv], &mean, &var, rows, decay);
            let (got_m, got_v) = (&run.outputs[0], &run.outputs[1]);
            let e = rel_err(got_m, &want_m).max(rel_err(got_v, &want_v));
            assert!(e < tol, "{what}: against f64 loops: {e:e}");

            let t = |v: &[f64]| tensor(v, &[v.len()], dtype, &Device::Cpu);
            let (rm_t, rv_t) = (t(&rm), t(&rv));
            batch_norm_running([&rm_t, &rv_t], &t(&mean), &t(&var), &t(&count), decay).unwrap();
            assert_same(got_m, &to_vec(&rm_t), &format!("{what}: running mean"));
            assert_same(got_v, &to_vec(&rv_t), &format!("{what}: running variance"));
        }
    }
}
