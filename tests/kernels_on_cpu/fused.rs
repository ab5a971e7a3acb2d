//! The fused element and row kernels (kernels/gelu.cu, layer_norm.cu, channel.cu) through the
//! harness: bit for bit against the CPU twins (the ops' CPU paths, gradients through candle's
//! autograd) and against f64 references, in every dtype.

use candle_core::{DType, Device, Tensor, Var};
use myosotis::ops::plan::LaunchPlan;
use myosotis::ops::{channel, gelu, layer_norm, rows::RowSplit};

use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_bytes_in_every_order, run_in_every_order};
use crate::{assert_same, DTYPES};

/// (rows, h): one row, widths below, at and above a warp of lanes, more rows than the grid's
/// blocks (each block takes several groups of rows), a ragged last block.
pub const SHAPES: [(usize, usize); 7] = [
    (1, 1),
    (3, 5),
    (7, 32),
    (9, 33),
    (50, 128),
    (1000, 3),
    (8200, 16),
];

/// Runs a two-launch backward: the row kernel, then the sums over its partial rows (its last
/// output, passed on as stored: the partials are kept in the compute type, f32 for f16/bf16).
/// Returns the row kernel's other outputs and the sums.
fn run_backward(
    plans: &[LaunchPlan; 2],
    dtype: DType,
    inputs: &[&[f64]],
    seed: u64,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut rows = run_in_every_order(&plans[0], dtype, inputs, seed);
    rows.outputs.pop();
    let part = rows.raw.pop().expect("partials");
    let sums = run_bytes_in_every_order(&plans[1], dtype, &[part], seed)
        .outputs
        .remove(0);
    (rows.outputs, sums)
}

/// The CPU twin's gradients of Σ g ⊙ f(vars) with respect to `vars`.
fn twin_grads(vars: &[&Var], y: &Tensor, g: &Tensor) -> Vec<Vec<f64>> {
    let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
    vars.iter()
        .map(|v| to_vec(grads.get(v).expect("a gradient")))
        .collect()
}

#[test]
fn gelu_kernels_match_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("gelu_kernels", 21);
    for (dtype, tol) in DTYPES {
        for (rows, h) in SHAPES {
            let n = rows * h;
            let what = format!("gelu {dtype:?} {rows} x {h}");
            let x = round_to(&uniform(&mut rng, n, -6.0, 6.0), dtype);
            let g = round_to(&uniform(&mut rng, n, -1.0, 1.0), dtype);
            let y = run_in_every_order(
                &gelu::cuda::forward_plan(n, dtype).unwrap(),
                dtype,
                &[&x],
                seed,
            )
            .outputs
            .remove(0);
            let dx = run_in_every_order(
                &gelu::cuda::backward_plan(n, dtype).unwrap(),
                dtype,
                &[&x, &g],
                seed,
            )
            .outputs
            .remove(0);
            // f64 reference with tanh itself.
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = |x: f64| (c * (x + 0.044715 * x.powi(3))).tanh();
            let y_ref: Vec<f64> = x.iter().map(|&x| 0.5 * x * (1.0 + t(x))).collect();
            let dx_ref: Vec<f64> = x
                .iter()
                .zip(&g)
                .map(|(&x, &g)| {
                    let t = t(x);
                    g * (0.5 * (1.0 + t)
                        + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x))
                })
                .collect();
            // Errors relative to the inputs' scale: gelu(x) of a negative x is far smaller than
            // x, and 1 + tanh z cancels there (in the kernel and the CPU op alike).
            let err = |got: &[f64], want: &[f64], scale: &[f64]| {
                let m = scale.iter().fold(0f64, |m, v| m.max(v.abs()));
                rel_err(got, want) * want.iter().fold(1e-30f64, |m, v| m.max(v.abs())) / m
            };
            assert!(err(&y, &y_ref, &x) < tol, "{what}: forward");
            assert!(err(&dx, &dx_ref, &g) < tol, "{what}: backward");
            let xv = Var::from_tensor(&tensor(&x, &[n], dtype, &Device::Cpu)).unwrap();
            let yt = gelu(xv.as_tensor()).unwrap();
            assert_same(&y, &to_vec(&yt), &format!("{what}: forward"));
            let gt = tensor(&g, &[n], dtype, &Device::Cpu);
            let dxt = twin_grads(&[&xv], &yt, &gt).remove(0);
            assert_same(&dx, &dxt, &format!("{what}: backward"));
        }
    }
}

/// f64 LayerNorm and its gradients (dx, dw, db) for upstream g.
fn layer_norm_reference(x: &[f64], w: &[f64], b: &[f64], g: &[f64], eps: f64) -> [Vec<f64>; 4] {
    let h = w.len();
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut db) = (vec![0.0; h], vec![0.0; h]);
    for r in 0..x.len() / h {
        let (xr, gr) = (&x[r * h..(r + 1) * h], &g[r * h..(r + 1) * h]);
        let mean = xr.iter().sum::<f64>() / h as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / h as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let gh: Vec<f64> = (0..h).map(|i| gr[i] * w[i]).collect();
        let mg = gh.iter().sum::<f64>() / h as f64;
        let mgx = (0..h).map(|i| gh[i] * xh[i]).sum::<f64>() / h as f64;
        for i in 0..h {
            y[r * h + i] = xh[i] * w[i] + b[i];
            dx[r * h + i] = (gh[i] - mg - xh[i] * mgx) * rstd;
            dw[i] += gr[i] * xh[i];
            db[i] += gr[i];
        }
    }
    [y, dx, dw, db]
}

#[test]
fn layer_norm_kernels_match_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("layer_norm_kernels", 22);
    let eps = 1e-5;
    for (dtype, tol) in DTYPES
        .into_iter()
        .filter(|(dt, _)| layer_norm::cuda::supports(1, *dt))
    {
        for (rows, h) in SHAPES {
            let what = format!("layer_norm {dtype:?} {rows} x {h}");
            let x = round_to(&uniform(&mut rng, rows * h, -2.0, 3.0), dtype);
            let w = round_to(&uniform(&mut rng, h, 0.5, 1.5), dtype);
            let b = round_to(&uniform(&mut rng, h, -0.5, 0.5), dtype);
            let g = round_to(&uniform(&mut rng, rows * h, -1.0, 1.0), dtype);
            let fwd = layer_norm::cuda::forward_plan(rows, h, eps, dtype).unwrap();
            let y = run_in_every_order(&fwd, dtype, &[&x, &w, &b], seed)
                .outputs
                .remove(0);
            let plans = layer_norm::cuda::backward_plans(rows, h, eps, dtype).unwrap();
            assert_eq!(plans[0].grid[0] as usize, RowSplit::new(rows).blocks);
            let (mut outs, dwb) = run_backward(&plans, dtype, &[&x, &w, &g], seed);
            let dx = outs.remove(0);
            let [y_ref, dx_ref, dw_ref, db_ref] = layer_norm_reference(&x, &w, &b, &g, eps);
            for (name, got, want) in [
                ("y", &y[..], &y_ref[..]),
                ("dx", &dx[..], &dx_ref[..]),
                ("dw", &dwb[..h], &dw_ref[..]),
                ("db", &dwb[h..], &db_ref[..]),
            ] {
                assert!(rel_err(got, want) < tol, "{what}: {name}");
            }
            let cpu = |v: &[f64], shape: &[usize]| {
                Var::from_tensor(&tensor(v, shape, dtype, &Device::Cpu)).unwrap()
            };
            let (xv, wv, bv) = (cpu(&x, &[rows, h]), cpu(&w, &[h]), cpu(&b, &[h]));
            let yt = layer_norm(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), eps).unwrap();
            assert_same(&y, &to_vec(&yt), &format!("{what}: forward"));
            let gt = tensor(&g, &[rows, h], dtype, &Device::Cpu);
            let grads = twin_grads(&[&xv, &wv, &bv], &yt, &gt);
            assert_same(&dx, &grads[0], &format!("{what}: dx"));
            assert_same(&dwb[..h], &grads[1], &format!("{what}: dw"));
            assert_same(&dwb[h..], &grads[2], &format!("{what}: db"));
        }
    }
}

#[test]
fn channel_kernels_match_the_cpu_twin_and_the_reference() {
    let (mut rng, seed) = seeded_rng("channel_kernels", 23);
    for (dtype, tol) in DTYPES
        .into_iter()
        .filter(|(dt, _)| channel::cuda::supports(1, *dt))
    {
        for (rows, h) in SHAPES {
            for mul in [false, true] {
                let what = format!("channel {dtype:?} {rows} x {h} mul {mul}");
                let x = round_to(&uniform(&mut rng, rows * h, -2.0, 2.0), dtype);
                let p = round_to(&uniform(&mut rng, h, -1.5, 1.5), dtype);
                let g = round_to(&uniform(&mut rng, rows * h, -1.0, 1.0), dtype);
                let fwd = channel::cuda::forward_plan(rows * h, h, mul, dtype).unwrap();
                let y = run_in_every_order(&fwd, dtype, &[&x, &p], seed)
                    .outputs
                    .remove(0);
                let plans = channel::cuda::backward_plans(rows, h, mul, dtype).unwrap();
                let (outs, dp) = run_backward(&plans, dtype, &[&x, &p, &g], seed);
                let at = |e: usize| (x[e], p[e % h], g[e]);
                let y_ref: Vec<f64> = (0..rows * h)
                    .map(|e| {
                        if mul {
                            at(e).0 * at(e).1
                        } else {
                            at(e).0 + at(e).1
                        }
                    })
                    .collect();
                let mut dp_ref = vec![0.0; h];
                for e in 0..rows * h {
                    dp_ref[e % h] += if mul { g[e] * x[e] } else { g[e] };
                }
                assert!(rel_err(&y, &y_ref) < tol, "{what}: forward");
                assert!(rel_err(&dp, &dp_ref) < tol, "{what}: dp");
                let cpu = |v: &[f64], shape: &[usize]| {
                    Var::from_tensor(&tensor(v, shape, dtype, &Device::Cpu)).unwrap()
                };
                let (xv, pv) = (cpu(&x, &[rows, h]), cpu(&p, &[h]));
                let yt = match mul {
                    true => myosotis::ops::channel_mul(xv.as_tensor(), pv.as_tensor()),
                    false => myosotis::ops::channel_add(xv.as_tensor(), pv.as_tensor()),
                }
                .unwrap();
                assert_same(&y, &to_vec(&yt), &format!("{what}: forward"));
                let gt = tensor(&g, &[rows, h], dtype, &Device::Cpu);
                let grads = twin_grads(&[&xv, &pv], &yt, &gt);
                assert_same(&dp, &grads[1], &format!("{what}: dp"));
                if mul {
                    assert_same(&outs[0], &grads[0], &format!("{what}: dx"));
                } else {
                    assert!(outs.is_empty(), "{what}: add writes no dx");
                }
            }
        }
    }
}
