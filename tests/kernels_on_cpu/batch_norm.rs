//! kernels/batch_norm.cu through the harness: bit for bit against the CPU twins (the ops'
//! CPU paths) in every dtype, and against f64 references. Half-precision rows take f32
//! statistics: each operand is passed as stored in its own dtype.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::batch_norm::{cuda, stats_dtype};
use myosotis::ops::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    column_stats,
};

use crate::common::{rel_err, running_averages_reference, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{
    from_bytes, round_to, run_bytes_in_every_order, run_in_place_bytes_in_every_order, to_bytes,
};
use crate::fused::SHAPES;
use crate::{assert_same, DTYPES};

const EPS: f64 = 1e-5;

/// Operands as stored: values and their dtype.
fn stored(operands: &[(&[f64], DType)]) -> Vec<Vec<u8>> {
    operands.iter().map(|(v, dt)| to_bytes(v, *dt)).collect()
}

/// Runs a stats launch and the launch adding its partial rows (statistics, in `s`); returns
/// the latter's outputs.
fn stats(
    plans: &[myosotis::ops::plan::LaunchPlan; 2],
    s: DType,
    inputs: &[(&[f64], DType)],
    seed: u64,
) -> Vec<Vec<f64>> {
    let part = run_bytes_in_every_order(&plans[0], s, &stored(inputs), seed)
        .raw
        .remove(0);
    run_bytes_in_every_order(&plans[1], s, &[part], seed).outputs
}

#[test]
fn batch_norm_kernels_match_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("batch_norm_kernels", 29);
    for (dtype, tol) in DTYPES.into_iter().filter(|(dt, _)| cuda::supports(1, *dt)) {
        let s = stats_dtype(dtype);
        for (rows, h) in SHAPES {
            let what = format!("batch_norm {dtype:?} {rows} x {h}");
            let n = rows * h;
            let x = round_to(&uniform(&mut rng, n, 1.0, 4.0), dtype);
            let w = round_to(&uniform(&mut rng, h, 0.5, 1.5), dtype);
            let b = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            let g = round_to(&uniform(&mut rng, n, -1.0, 1.0), dtype);

            // Σx, then Σ(x − μ)² around the kernels' own μ; each over the rows, rounded.
            let moment = |inputs: &[(&[f64], DType)]| {
                let plans = cuda::stats_plans(rows, h, inputs.len() == 2, dtype).unwrap();
                let sums = stats(&plans, s, inputs, seed).remove(0);
                let per_row: Vec<f64> = sums.iter().map(|v| v / rows as f64).collect();
                (sums, round_to(&per_row, s))
            };
            let (sum, mean) = moment(&[(&x, dtype)]);
            let (sq, var) = moment(&[(&x, dtype), (&mean, s)]);
            let y = run_bytes_in_every_order(
                &cuda::apply_plan(n, h, EPS, dtype).unwrap(),
                dtype,
                &stored(&[(&x, dtype), (&mean, s), (&var, s), (&w, dtype), (&b, dtype)]),
                seed,
            )
            .outputs
            .remove(0);
            let [dw, db]: [Vec<f64>; 2] = stats(
                &cuda::backward_stats_plans(rows, h, EPS, dtype).unwrap(),
                s,
                &[(&x, dtype), (&mean, s), (&var, s), (&g, dtype)],
                seed,
            )
            .try_into()
            .expect("two outputs");
            let count = [rows as f64];
            let operands = [
                (&x[..], dtype),
                (&mean, s),
                (&var, s),
                (&w, dtype),
                (&g, dtype),
                (&dw, s),
                (&db, s),
                (&count, s),
            ];
            let dx = run_bytes_in_every_order(
                &cuda::backward_plan(n, h, EPS, dtype).unwrap(),
                dtype,
                &stored(&operands),
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
            let [wt, bt] = [&w, &b].map(|v| t(v, &[h]));
            let [mt, vt] = [&mean, &var].map(|v| tensor(v, &[h], s, &Device::Cpu));
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
            let nt: Tensor = tensor(&count, &[1], s, &Device::Cpu);
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
            let s = stats_dtype(dtype);
            let rm = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            let rv = round_to(&uniform(&mut rng, h, 0.5, 2.0), dtype);
            let mean = round_to(&uniform(&mut rng, h, -1.0, 1.0), s);
            let var = round_to(&uniform(&mut rng, h, 0.0, 3.0), s);
            let count = [rows as f64];
            let plan = cuda::running_plan(h, decay, dtype).unwrap();
            let run = run_in_place_bytes_in_every_order(
                &plan,
                &stored(&[(&rm, dtype), (&rv, dtype)]),
                &stored(&[(&mean, s), (&var, s), (&count, s)]),
                seed,
            );
            let [want_m, want_v] = running_averages_reference([&rm, &rv], &mean, &var, rows, decay);
            let [got_m, got_v] = [0, 1].map(|k| from_bytes(&run.raw[k], dtype));
            let (got_m, got_v) = (&got_m, &got_v);
            let e = rel_err(got_m, &want_m).max(rel_err(got_v, &want_v));
            assert!(e < tol, "{what}: against f64 loops: {e:e}");

            let t = |v: &[f64], dt| tensor(v, &[v.len()], dt, &Device::Cpu);
            let (rm_t, rv_t) = (t(&rm, dtype), t(&rv, dtype));
            let [mt, vt, nt] = [&mean[..], &var, &count].map(|v| t(v, s));
            batch_norm_running([&rm_t, &rv_t], &mt, &vt, &nt, decay).unwrap();
            assert_same(got_m, &to_vec(&rm_t), &format!("{what}: running mean"));
            assert_same(got_v, &to_vec(&rv_t), &format!("{what}: running variance"));
        }
    }
}
