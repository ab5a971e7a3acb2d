//! BatchNorm's fused training ops (`myosotis::ops::batch_norm`) against f64 loops, candle's
//! autograd through the same norm in candle ops, and central differences of the ops
//! themselves; the statistics of a batch cut into shards; f16 and bf16 rows (the f32 ops'
//! results, rounded); the candle-op fallback; the running averages updated in place; bad
//! operands.

mod common;

use candle_core::{DType, Device, Tensor, Var, D};
use common::{rel_err, running_averages_reference, seeded_rng, tensor, to_vec, uniform};
use myosotis::ops::batch_norm::{composed, stats_dtype};
use myosotis::ops::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    column_stats,
};

const EPS: f64 = 1e-5;

/// The whole batch's (μ, σ²) of rows of h, and y of the norm, as f64 loops.
fn reference(x: &[f64], w: &[f64], b: &[f64], h: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / h;
    let mut mean = vec![0.0; h];
    let mut var = vec![0.0; h];
    for e in 0..x.len() {
        mean[e % h] += x[e] / rows as f64;
    }
    for e in 0..x.len() {
        var[e % h] += (x[e] - mean[e % h]).powi(2) / rows as f64;
    }
    let y = (0..x.len())
        .map(|e| {
            let i = e % h;
            (x[e] - mean[i]) / (var[i] + EPS).sqrt() * w[i] + b[i]
        })
        .collect();
    (mean, var, y)
}

/// The fused forward on `x` (3-D, rows of its last dimension): (μ, σ², y, n).
fn forward(x: &Tensor, w: &Tensor, b: &Tensor) -> [Tensor; 4] {
    let rows = x.elem_count() / x.dim(D::Minus1).unwrap();
    let n = Tensor::full(rows as f64, 1, x.device())
        .unwrap()
        .to_dtype(stats_dtype(x.dtype()))
        .unwrap();
    let mean = column_stats(x, None).unwrap().broadcast_div(&n).unwrap();
    let var = column_stats(x, Some(&mean))
        .unwrap()
        .broadcast_div(&n)
        .unwrap();
    let y = batch_norm_apply(x, &mean, &var, w, b, EPS).unwrap();
    [mean, var, y, n]
}

/// (∂x, ∂γ, ∂β) of Σ g ⊙ y from the fused backward.
fn backward(x: &Tensor, w: &Tensor, g: &Tensor) -> [Tensor; 3] {
    let b = w.zeros_like().unwrap();
    let [mean, var, _, n] = forward(x, w, &b);
    let [dw, db] = batch_norm_backward_stats(x, &mean, &var, g, EPS).unwrap();
    let dx = batch_norm_backward(x, &mean, &var, w, g, &dw, &db, &n, EPS).unwrap();
    [dx, dw, db]
}

#[test]
fn batch_norm_ops_match_loops_autograd_and_finite_differences() {
    let (mut rng, seed) = seeded_rng("batch_norm_ops", 141);
    // (batch, length, h): one row, widths below and above a warp, more rows than a block.
    for &(bs, len, h) in &[(1, 1, 1), (2, 3, 5), (4, 33, 3), (3, 7, 40), (2, 1100, 4)] {
        let what = format!("({bs}, {len}, {h}) seed {seed}");
        let n = bs * len * h;
        // Far from zero mean: the statistics are taken around μ.
        let x = uniform(&mut rng, n, 2.0, 6.0);
        let (w, b) = (
            uniform(&mut rng, h, -1.5, 1.5),
            uniform(&mut rng, h, -1.0, 1.0),
        );
        let g = uniform(&mut rng, n, -1.0, 1.0);
        let t = |v: &[f64], s: &[usize]| tensor(v, s, DType::F64, &Device::Cpu);
        let (xt, wt, bt, gt) = (
            t(&x, &[bs, len, h]),
            t(&w, &[h]),
            t(&b, &[h]),
            t(&g, &[bs, len, h]),
        );
        let (mean, var, y) = reference(&x, &w, &b, h);
        let [m, v, yt, _] = forward(&xt, &wt, &bt);
        assert!(rel_err(&to_vec(&m), &mean) < 1e-13, "{what}: mean");
        assert!(rel_err(&to_vec(&v), &var) < 1e-12, "{what}: variance");
        assert!(rel_err(&to_vec(&yt), &y) < 1e-12, "{what}: y");

        // Gradients: candle's autograd through the norm in candle ops.
        let vars = [
            Var::from_tensor(&xt).unwrap(),
            Var::from_tensor(&wt).unwrap(),
            Var::from_tensor(&bt).unwrap(),
        ];
        let [xv, wv, bv] = vars.each_ref().map(|v| v.as_tensor());
        let xc = xv
            .broadcast_sub(&xv.mean_keepdim(0).unwrap().mean_keepdim(1).unwrap())
            .unwrap();
        let var_c = xc
            .sqr()
            .unwrap()
            .mean_keepdim(0)
            .unwrap()
            .mean_keepdim(1)
            .unwrap();
        let yc = xc
            .broadcast_div(&(var_c + EPS).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(wv)
            .unwrap()
            .broadcast_add(bv)
            .unwrap();
        assert!(
            rel_err(&to_vec(&yc), &y) < 1e-12,
            "{what}: the candle-op norm"
        );
        let grads = (yc * &gt).unwrap().sum_all().unwrap().backward().unwrap();
        let want: Vec<Vec<f64>> = vars
            .iter()
            .map(|v| to_vec(grads.get(v.as_tensor()).unwrap()))
            .collect();
        let got = backward(&xt, &wt, &gt);
        for (k, name) in ["∂x", "∂γ", "∂β"].iter().enumerate() {
            let e = rel_err(&to_vec(&got[k]), &want[k]);
            assert!(e < 1e-10, "{what}: {name} vs autograd: {e:e}");
        }

        // Central differences of the fused forward (x moves μ and σ² too).
        if n <= 120 {
            let loss = |x: &[f64]| -> f64 {
                let y = to_vec(&forward(&t(x, &[bs, len, h]), &wt, &bt)[2]);
                y.iter().zip(&g).map(|(y, g)| y * g).sum()
            };
            let fd: Vec<f64> = (0..n)
                .map(|e| {
                    let at = |d: f64| {
                        let mut xs = x.clone();
                        xs[e] += d;
                        loss(&xs)
                    };
                    (at(1e-6) - at(-1e-6)) / 2e-6
                })
                .collect();
            let e = rel_err(&to_vec(&got[0]), &fd);
            assert!(e < 1e-6, "{what}: ∂x vs finite differences: {e:e}");
        }
    }
}

/// A batch cut into two shards (uneven): each shard's sums added give the whole batch's, and
/// each shard's ∂x, from the whole batch's ∂γ and ∂β, is the whole batch's ∂x on its rows.
#[test]
fn batch_norm_over_shards_is_the_whole_batch() {
    let (mut rng, seed) = seeded_rng("batch_norm_shards", 142);
    let (bs, len, h) = (5, 9, 7);
    let x = uniform(&mut rng, bs * len * h, -3.0, 5.0);
    let (w, g) = (
        uniform(&mut rng, h, 0.5, 2.0),
        uniform(&mut rng, bs * len * h, -1.0, 1.0),
    );
    let t = |v: &[f64], s: &[usize]| tensor(v, s, DType::F64, &Device::Cpu);
    let whole = t(&x, &[bs, len, h]);
    let (wt, gt) = (t(&w, &[h]), t(&g, &[bs, len, h]));
    let [dx_whole, dw_whole, db_whole] = backward(&whole, &wt, &gt);
    let [mean, var, _, n] = forward(&whole, &wt, &wt.zeros_like().unwrap());
    let parts = [(0, 2), (2, 3)];
    let shard = |t: &Tensor, (at, k): (usize, usize)| t.narrow(0, at, k).unwrap();
    let add = |f: &dyn Fn((usize, usize)) -> Tensor| (f(parts[0]) + f(parts[1])).unwrap();
    let sum = add(&|p| column_stats(&shard(&whole, p), None).unwrap());
    assert!(
        rel_err(&to_vec(&sum.broadcast_div(&n).unwrap()), &to_vec(&mean)) < 1e-13,
        "Σx (seed {seed})"
    );
    let sq = add(&|p| column_stats(&shard(&whole, p), Some(&mean)).unwrap());
    assert!(
        rel_err(&to_vec(&sq.broadcast_div(&n).unwrap()), &to_vec(&var)) < 1e-13,
        "Σ(x − μ)²"
    );
    let stats =
        |p| batch_norm_backward_stats(&shard(&whole, p), &mean, &var, &shard(&gt, p), EPS).unwrap();
    let dw = add(&|p| stats(p)[0].clone());
    let db = add(&|p| stats(p)[1].clone());
    assert!(rel_err(&to_vec(&dw), &to_vec(&dw_whole)) < 1e-13, "∂γ");
    assert!(rel_err(&to_vec(&db), &to_vec(&db_whole)) < 1e-13, "∂β");
    for p in parts {
        let dx = batch_norm_backward(
            &shard(&whole, p),
            &mean,
            &var,
            &wt,
            &shard(&gt, p),
            &dw,
            &db,
            &n,
            EPS,
        )
        .unwrap();
        assert!(
            rel_err(&to_vec(&dx), &to_vec(&shard(&dx_whole, p))) < 1e-12,
            "∂x of {p:?}"
        );
    }
}

/// f16 and bf16 rows: the statistics in f32, and every result the f32 ops' on the same values
/// (rounded where it is stored in half precision): the kernels read half precision into f32.
#[test]
fn batch_norm_ops_in_half_precision_are_the_f32_ops_rounded() {
    let (mut rng, seed) = seeded_rng("batch_norm_half", 143);
    for (bs, len, h) in [(1, 1, 1), (2, 32, 6), (3, 700, 5)] {
        let n = bs * len * h;
        let (x, w, b, g) = (
            uniform(&mut rng, n, -2.0, 3.0),
            uniform(&mut rng, h, 0.5, 1.5),
            uniform(&mut rng, h, -1.0, 1.0),
            uniform(&mut rng, n, -1.0, 1.0),
        );
        let (rm, rv) = (
            uniform(&mut rng, h, -1.0, 1.0),
            uniform(&mut rng, h, 0.5, 2.0),
        );
        for dtype in [DType::F16, DType::BF16] {
            let what = format!("{dtype:?} ({bs}, {len}, {h}) seed {seed}");
            let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, &Device::Cpu);
            let (xt, wt, bt, gt) = (
                t(&x, &[bs, len, h]),
                t(&w, &[h]),
                t(&b, &[h]),
                t(&g, &[bs, len, h]),
            );
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let half = forward(&xt, &wt, &bt);
            let wide = forward(&f32(&xt), &f32(&wt), &f32(&bt));
            let back = backward(&xt, &wt, &gt);
            let back_wide = backward(&f32(&xt), &f32(&wt), &f32(&gt));
            let rounded = |t: &Tensor| to_vec(&t.to_dtype(dtype).unwrap());
            let same = [
                ("μ", to_vec(&half[0]), to_vec(&wide[0]), half[0].dtype()),
                ("σ²", to_vec(&half[1]), to_vec(&wide[1]), half[1].dtype()),
                ("y", to_vec(&half[2]), rounded(&wide[2]), half[2].dtype()),
                (
                    "∂x",
                    to_vec(&back[0]),
                    rounded(&back_wide[0]),
                    back[0].dtype(),
                ),
                (
                    "∂γ",
                    to_vec(&back[1]),
                    to_vec(&back_wide[1]),
                    back[1].dtype(),
                ),
                (
                    "∂β",
                    to_vec(&back[2]),
                    to_vec(&back_wide[2]),
                    back[2].dtype(),
                ),
            ];
            for (name, got, want, dt) in same {
                let stored = if name == "y" || name == "∂x" {
                    dtype
                } else {
                    DType::F32
                };
                assert_eq!(dt, stored, "{what}: {name}'s dtype");
                assert_eq!(got, want, "{what}: {name} is not the f32 op's");
            }
            // Near f64's: y within half precision's rounding.
            let (_, _, y) = reference(&to_vec(&xt), &to_vec(&wt), &to_vec(&bt), h);
            let e = rel_err(&to_vec(&half[2]), &y);
            assert!(e < 1e-2, "{what}: y against f64: {e:e}");

            // The running averages of a half-precision model: the f32 update, rounded.
            let [mean, var, _, count] = &half;
            let running = [t(&rm, &[h]), t(&rv, &[h])];
            let running_wide = running.each_ref().map(f32);
            batch_norm_running([&running[0], &running[1]], mean, var, count, 0.9).unwrap();
            let [a, b] = &running_wide;
            batch_norm_running([a, b], mean, var, count, 0.9).unwrap();
            for k in 0..2 {
                let (got, want) = (to_vec(&running[k]), rounded(&running_wide[k]));
                assert_eq!(got, want, "{what}: running average {k}");
            }
        }
    }
}

/// The candle-op fallback (rows the kernels do not take, other devices) agrees with the fused
/// ops in every dtype, with the same dtypes.
#[test]
fn batch_norm_composed_ops_agree_with_the_fused() {
    let (mut rng, seed) = seeded_rng("batch_norm_composed", 145);
    let (rows, h) = (64, 6);
    let (x, w, b, g) = (
        uniform(&mut rng, rows * h, -2.0, 2.0),
        uniform(&mut rng, h, 0.5, 1.5),
        uniform(&mut rng, h, -1.0, 1.0),
        uniform(&mut rng, rows * h, -1.0, 1.0),
    );
    for (dtype, tol) in [
        (DType::F64, 1e-13),
        (DType::F32, 1e-6),
        (DType::F16, 2e-3),
        (DType::BF16, 1e-2),
    ] {
        let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, &Device::Cpu);
        let (xt, wt, bt, gt) = (
            t(&x, &[rows, h]),
            t(&w, &[h]),
            t(&b, &[h]),
            t(&g, &[rows, h]),
        );
        let [mean, var, y, n] = forward(&xt, &wt, &bt);
        let [dx, dw, db] = backward(&xt, &wt, &gt);
        let composed = [
            composed::column_stats(&xt, None)
                .unwrap()
                .broadcast_div(&n)
                .unwrap(),
            composed::column_stats(&xt, Some(&mean))
                .unwrap()
                .broadcast_div(&n)
                .unwrap(),
            composed::apply(&xt, &mean, &var, &wt, &bt, EPS).unwrap(),
            composed::backward(&xt, &mean, &var, &wt, &gt, [&dw, &db], &n, EPS).unwrap(),
        ];
        let [cdw, cdb] = composed::backward_stats(&xt, &mean, &var, &gt, EPS).unwrap();
        let fused = [&mean, &var, &y, &dx, &dw, &db];
        let names = ["μ", "σ²", "y", "∂x", "∂γ", "∂β"];
        for (k, c) in composed.iter().chain([&cdw, &cdb]).enumerate() {
            let what = format!("{dtype:?} {} (seed {seed})", names[k]);
            assert_eq!(c.dtype(), fused[k].dtype(), "{what}: dtype");
            let e = rel_err(&to_vec(c), &to_vec(fused[k]));
            assert!(e < tol, "{what}: composed against fused: {e:e}");
        }
    }
}

/// The running averages in place: against f64 loops, and to the bit against the same update
/// in candle ops (running·m + batch·(1 − m), the variance times n / (n − 1), or 1 for one row),
/// in f32 and f64.
#[test]
fn batch_norm_running_averages_match_loops_and_candle_ops() {
    let (mut rng, seed) = seeded_rng("batch_norm_running", 144);
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-14)] {
        for (h, rows, decay) in [(1, 2, 0.9), (3, 1, 0.9), (7, 50, 0.99), (1000, 7, 0.37)] {
            let what = format!("{dtype:?}, h {h}, {rows} rows, decay {decay} (seed {seed})");
            let t = |v: &[f64]| tensor(v, &[v.len()], dtype, &Device::Cpu);
            let (rm, rv) = (
                uniform(&mut rng, h, -1.0, 1.0),
                uniform(&mut rng, h, 0.5, 2.0),
            );
            let (mean, var) = (
                uniform(&mut rng, h, -1.0, 1.0),
                uniform(&mut rng, h, 0.0, 3.0),
            );
            let (mean_t, var_t, n_t) = (t(&mean), t(&var), t(&[rows as f64]));
            let running = [
                Var::from_tensor(&t(&rm)).unwrap(),
                Var::from_tensor(&t(&rv)).unwrap(),
            ];
            let [rm_t, rv_t] = [running[0].as_tensor(), running[1].as_tensor()];
            batch_norm_running([rm_t, rv_t], &mean_t, &var_t, &n_t, decay).unwrap();

            let [want_m, want_v] = running_averages_reference([&rm, &rv], &mean, &var, rows, decay);
            let e = rel_err(&to_vec(rm_t), &want_m).max(rel_err(&to_vec(rv_t), &want_v));
            assert!(e < tol, "{what}: against f64 loops: {e:e}");

            // A single row's σ² is kept as it is (no unbiased estimate).
            let unbiased = match rows {
                1 => n_t.ones_like().unwrap(),
                _ => (&n_t / n_t.affine(1.0, -1.0).unwrap()).unwrap(),
            };
            let update = |old: &[f64], batch: Tensor| {
                ((t(old) * decay).unwrap() + (batch * (1.0 - decay)).unwrap()).unwrap()
            };
            let composed_m = update(&rm, mean_t.clone());
            let composed_v = update(&rv, var_t.broadcast_mul(&unbiased).unwrap());
            for (name, got, want) in [("mean", rm_t, &composed_m), ("variance", rv_t, &composed_v)]
            {
                let (got, want) = (to_vec(got), to_vec(want));
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ, 0,
                    "{what}: {name}: values unlike candle ops' of {h}"
                );
            }
        }
    }
}

/// A half-precision BatchNorm keeps its running averages in f32 and so follows an f32 one on
/// the same rows to the bit, over 300 steps whose batches' statistics drift slowly (stored in
/// bf16, an update below half a unit in the average's last place would be lost).
#[test]
fn batch_norm_running_averages_of_a_half_model_are_kept_in_f32() {
    use candle_nn::{VarBuilder, VarMap};
    use myosotis::nn::batch_norm::BatchNorm;
    let (mut rng, seed) = seeded_rng("batch_norm_half_running", 145);
    let (h, rows, decay) = (5, 24, 0.95);
    let dev = Device::Cpu;
    let norm = |dtype| {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, dtype, &dev);
        (BatchNorm::new(h, decay, vb).unwrap(), map)
    };
    let running = |map: &VarMap, name: &str| map.data().lock().unwrap()[name].as_tensor().clone();
    for dtype in [DType::F16, DType::BF16] {
        let what = format!("{dtype:?} (seed {seed})");
        let ((half, half_map), (full, full_map)) = (norm(dtype), norm(DType::F32));
        for step in 0..300 {
            let centre = 1.0 + step as f64 / 1000.0;
            let x = uniform(&mut rng, rows * h, centre - 0.5, centre + 0.5);
            let x = tensor(&x, &[2, rows / 2, h], dtype, &dev);
            half.forward_train(&x, None).unwrap();
            full.forward_train(&x.to_dtype(DType::F32).unwrap(), None)
                .unwrap();
        }
        for name in ["running_mean", "running_var"] {
            let (got, want) = (running(&half_map, name), running(&full_map, name));
            assert_eq!(to_vec(&got), to_vec(&want), "{what}: the {name}");
            assert_eq!(got.dtype(), DType::F32, "{what}: the {name}'s dtype");
        }
    }
}

#[test]
fn batch_norm_ops_name_a_bad_operand() {
    let x = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let c = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    let e = column_stats(&x, Some(&c(3))).unwrap_err().to_string();
    assert!(e.contains("the mean has shape [3], expected (4)"), "{e}");
    let e = batch_norm_apply(&x, &c(4), &c(4), &c(5), &c(4), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the weight has shape [5]"), "{e}");
    let e = batch_norm_backward_stats(&x, &c(4), &c(4), &x.narrow(1, 0, 2).unwrap(), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("∂y"), "{e}");
    let e = batch_norm_backward(&x, &c(4), &c(4), &c(4), &x, &c(4), &c(4), &c(2), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("row count"), "{e}");
    let f64s = Tensor::ones(4, DType::F64, &Device::Cpu).unwrap();
    let e = batch_norm_apply(&x, &c(4), &f64s, &c(4), &c(4), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the variance is F64, expected F32"), "{e}");
    let halves = Tensor::ones(4, DType::F16, &Device::Cpu).unwrap();
    let e = column_stats(&x.to_dtype(DType::F16).unwrap(), Some(&halves))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the mean is F16, expected F32"), "{e}");
    let n = Tensor::new(&[8f32], &Device::Cpu).unwrap();
    let e = batch_norm_running([&c(4), &c(3)], &c(4), &c(4), &n, 0.9)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the running variance [3] F32 does not match"),
        "{e}"
    );
    let e = batch_norm_running([&c(4), &c(4)], &c(4), &c(4), &c(2), 0.9)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the row count (1)"), "{e}");
    let same = c(4);
    let e = batch_norm_running([&same, &same], &c(4), &c(4), &n, 0.9)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shares memory"), "{e}");
}
