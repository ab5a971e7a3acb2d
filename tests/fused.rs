//! The fused CPU ops behind the layers (layer_norm, gelu, channel_add/mul, swap_dims12, gate,
//! s5_discretize, s5_readout):
//! forward against independent f64 loops, backward against central finite differences of the
//! op itself (f64) and against candle autograd through the same computation in plain candle
//! ops (f32), on shapes that do and do not fill the ops' row tiles.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{rel_err, seeded_rng, tensor, to_vec};
use myosotis::ops::{
    channel_add, channel_add_backward, channel_mul, gelu, layer_norm, layer_norm_composed,
    s5_discretize, s5_discretize_reference, s5_readout, swap_dims12, S5Discretization,
};
use rand::rngs::StdRng;
use rand::Rng;

fn randn(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// Checks the gradients of `sum(f(inputs) ⊙ r)` for every input against central differences.
fn check_fd(
    what: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    f: impl Fn(&[Tensor]) -> Tensor,
    rng: &mut StdRng,
) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|(v, s)| Var::from_tensor(&tensor(v, s, DType::F64, &Device::Cpu)).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let r = tensor(
        &randn(rng, y.elem_count()),
        y.dims(),
        DType::F64,
        &Device::Cpu,
    );
    let loss = |ts: &[Tensor]| -> f64 {
        (f(ts) * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let eps = 1e-6;
    for (k, (v, s)) in inputs.iter().enumerate() {
        let g = to_vec(grads.get(vars[k].as_tensor()).expect("gradient"));
        let mut fd = vec![0.0; v.len()];
        for i in 0..v.len() {
            let at = |d: f64| {
                let mut ts = ts.clone();
                let mut w = v.clone();
                w[i] += d;
                ts[k] = tensor(&w, s, DType::F64, &Device::Cpu);
                loss(&ts)
            };
            fd[i] = (at(eps) - at(-eps)) / (2.0 * eps);
        }
        let e = rel_err(&g, &fd);
        assert!(
            e < 1e-6,
            "{what}: input {k} gradient vs finite differences: {e:e}"
        );
    }
}

#[test]
fn layer_norm_matches_loop_and_finite_differences() {
    let (mut rng, _) = seeded_rng("layer_norm", 104);
    for &(rows, h) in &[(1, 1), (3, 5), (64, 8), (65, 7), (130, 64), (2, 300)] {
        let (x, w, b) = (
            randn(&mut rng, rows * h),
            randn(&mut rng, h),
            randn(&mut rng, h),
        );
        let mut want = vec![0.0; rows * h];
        for r in 0..rows {
            let row = &x[r * h..(r + 1) * h];
            let mean = row.iter().sum::<f64>() / h as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / h as f64;
            for i in 0..h {
                want[r * h + i] = (row[i] - mean) / (var + 1e-5).sqrt() * w[i] + b[i];
            }
        }
        for dtype in [DType::F64, DType::F32] {
            let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, &Device::Cpu);
            let got = layer_norm(&t(&x, &[rows, h]), &t(&w, &[h]), &t(&b, &[h]), 1e-5).unwrap();
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let e = rel_err(&to_vec(&got), &want);
            assert!(e < tol, "layer_norm ({rows}, {h}) {dtype:?}: {e:e}");
        }
        if rows * h <= 400 {
            check_fd(
                &format!("layer_norm ({rows}, {h})"),
                &[(x, vec![rows, h]), (w, vec![h]), (b, vec![h])],
                |ts| layer_norm(&ts[0], &ts[1], &ts[2], 1e-5).unwrap(),
                &mut rng,
            );
        }
    }
}

#[test]
fn layer_norm_gradients_match_candle_ops_on_3d_views() {
    let (mut rng, _) = seeded_rng("layer_norm_3d", 105);
    let (b, l, h) = (3, 67, 24);
    let x = Var::new(randn(&mut rng, b * l * h), &Device::Cpu).unwrap();
    let w = Var::new(randn(&mut rng, h), &Device::Cpu).unwrap();
    let bias = Var::new(randn(&mut rng, h), &Device::Cpu).unwrap();
    let x = Var::from_tensor(&x.to_dtype(DType::F32).unwrap().reshape((b, h, l)).unwrap()).unwrap();
    let (w, bias) = (
        Var::from_tensor(&w.to_dtype(DType::F32).unwrap()).unwrap(),
        Var::from_tensor(&bias.to_dtype(DType::F32).unwrap()).unwrap(),
    );
    // A transposed (non-contiguous) input.
    let xt = x.transpose(1, 2).unwrap();
    let r = tensor(
        &randn(&mut rng, b * l * h),
        &[b, l, h],
        DType::F32,
        &Device::Cpu,
    );
    let fused = layer_norm(&xt, &w, &bias, 1e-5).unwrap();
    let plain = layer_norm_composed(&xt, &w, &bias, 1e-5).unwrap();
    assert!(rel_err(&to_vec(&fused), &to_vec(&plain)) < 1e-5);
    let gf = (fused * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let gp = (plain * &r).unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in [("x", &x), ("weight", &w), ("bias", &bias)] {
        let e = rel_err(&to_vec(gf.get(v).unwrap()), &to_vec(gp.get(v).unwrap()));
        assert!(
            e < 1e-4,
            "layer_norm gradient of {name} vs candle ops: {e:e}"
        );
    }
}

#[test]
fn layer_norm_rejects_bad_parameters() {
    let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    let ok = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let bad = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    let e = layer_norm(&x, &bad, &ok, 1e-5).unwrap_err().to_string();
    assert!(e.contains("weight") && e.contains("(4)"), "{e}");
    let e = layer_norm(&x, &ok, &ok.to_dtype(DType::F64).unwrap(), 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bias"), "{e}");
}

#[test]
fn gelu_matches_tanh_formula_and_finite_differences() {
    let (mut rng, _) = seeded_rng("gelu", 106);
    let mut x: Vec<f64> = (0..40_000).map(|_| rng.random_range(-12.0..12.0)).collect();
    x.extend([0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 200.0, -200.0]);
    let want: Vec<f64> = x
        .iter()
        .map(|&v| {
            let z = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
            0.5 * v * (1.0 + z.tanh())
        })
        .collect();
    for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
        let got = to_vec(&gelu(&tensor(&x, &[x.len()], dtype, &Device::Cpu)).unwrap());
        // Absolute error per element, relative to max(1, |x|).
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs() / x[i].abs().max(1.0);
            assert!(err < tol, "gelu {dtype:?} at x = {}: {g} vs {w}", x[i]);
        }
    }
    let small: Vec<f64> = (0..300).map(|_| rng.random_range(-5.0..5.0)).collect();
    check_fd(
        "gelu",
        &[(small.clone(), vec![3, 100])],
        |ts| gelu(&ts[0]).unwrap(),
        &mut rng,
    );
    // f32 gradient against candle's own gelu (same approximation), on a strided view.
    let v = Var::from_tensor(&tensor(&small, &[3, 100], DType::F32, &Device::Cpu)).unwrap();
    let view = v.t().unwrap();
    let gf = gelu(&view).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = view.gelu().unwrap().sum_all().unwrap().backward().unwrap();
    let e = rel_err(&to_vec(gf.get(&v).unwrap()), &to_vec(gc.get(&v).unwrap()));
    assert!(e < 1e-5, "gelu gradient vs candle: {e:e}");
}

#[test]
fn channel_ops_match_broadcasts_and_finite_differences() {
    let (mut rng, _) = seeded_rng("channel", 107);
    for &(rows, h) in &[(1, 1), (129, 3), (5, 64), (300, 17)] {
        let (x, p) = (randn(&mut rng, rows * h), randn(&mut rng, h));
        let t = |v: &[f64], s: &[usize]| tensor(v, s, DType::F64, &Device::Cpu);
        let (xt, pt) = (t(&x, &[rows, h]), t(&p, &[h]));
        let add = to_vec(&channel_add(&xt, &pt).unwrap());
        let mul = to_vec(&channel_mul(&xt, &pt).unwrap());
        for r in 0..rows {
            for i in 0..h {
                assert_eq!(add[r * h + i], x[r * h + i] + p[i]);
                assert_eq!(mul[r * h + i], x[r * h + i] * p[i]);
            }
        }
        // ∂b of channel_add on its own: the column sums of ∂y (given as (2, rows, h) here).
        let g = randn(&mut rng, 2 * rows * h);
        let db = to_vec(&channel_add_backward(&pt, &t(&g, &[2, rows, h])).unwrap());
        for i in 0..h {
            let want: f64 = (0..2 * rows).map(|r| g[r * h + i]).sum();
            assert!(
                (db[i] - want).abs() <= 1e-12 * (1.0 + want.abs()),
                "∂b[{i}]"
            );
        }
        if rows * h <= 600 {
            let inputs = [(x.clone(), vec![rows, h]), (p.clone(), vec![h])];
            check_fd(
                "channel_add",
                &inputs,
                |ts| channel_add(&ts[0], &ts[1]).unwrap(),
                &mut rng,
            );
            check_fd(
                "channel_mul",
                &inputs,
                |ts| channel_mul(&ts[0], &ts[1]).unwrap(),
                &mut rng,
            );
        }
    }
    let x = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let e = channel_mul(&x, &Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("(4)"), "{e}");
    let e = channel_add_backward(&Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(), &x)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[3]"), "{e}");
}

#[test]
fn swap_dims12_matches_transpose_on_views() {
    let (mut rng, _) = seeded_rng("swap", 108);
    for &(b, m, n, k) in &[(1, 1, 1, 1), (2, 3, 17, 2), (3, 64, 33, 2), (2, 5, 40, 3)] {
        let x = randn(&mut rng, b * m * (n + 4) * k);
        let full = tensor(&x, &[b, m, n + 4, k], DType::F64, &Device::Cpu);
        // A narrowed view: the op reads strided input.
        let view = full.narrow(2, 1, n).unwrap();
        let got = swap_dims12(&view).unwrap();
        assert_eq!(got.dims(), &[b, n, m, k]);
        let want = view.transpose(1, 2).unwrap().contiguous().unwrap();
        assert_eq!(to_vec(&got), to_vec(&want));
        if b * m * n * k <= 300 {
            let small = randn(&mut rng, b * m * n * k);
            check_fd(
                "swap_dims12",
                &[(small, vec![b, m, n, k])],
                |ts| swap_dims12(&ts[0].narrow(2, 0, n).unwrap()).unwrap(),
                &mut rng,
            );
        }
    }
    let e = swap_dims12(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-D"), "{e}");
}

/// S5's parameters (λ_re < 0, λ_im, log Δ, B̃) of `p` states and `h` channels; with `clip`
/// some λ_re at and above the clip's bound −10⁻⁴.
fn s5_params(rng: &mut StdRng, p: usize, h: usize, clip: bool) -> Vec<(Vec<f64>, Vec<usize>)> {
    let mut re: Vec<f64> = (0..p).map(|_| rng.random_range(-2.0..-0.05)).collect();
    if clip && p >= 3 {
        re[0] = 0.3;
        re[1] = -1e-4f32 as f64;
    }
    vec![
        (re, vec![p]),
        (
            (0..p).map(|_| rng.random_range(-3.0..3.0)).collect(),
            vec![p],
        ),
        (
            (0..p).map(|_| rng.random_range(-6.0..-1.0)).collect(),
            vec![p],
        ),
        (randn(rng, p * h * 2), vec![p, h, 2]),
    ]
}

/// Λ̄ and B̄ side by side, one tensor, for gradient checks of both outputs at once.
fn s5_both(ts: &[Tensor], how: S5Discretization, fused: bool) -> Tensor {
    let f = if fused {
        s5_discretize
    } else {
        s5_discretize_reference
    };
    let (gate, b_mat) = f(&ts[0], &ts[1], &ts[2], &ts[3], how).unwrap();
    Tensor::cat(
        &[gate.flatten_all().unwrap(), b_mat.flatten_all().unwrap()],
        0,
    )
    .unwrap()
}

#[test]
fn s5_discretize_matches_candle_ops_and_finite_differences() {
    let (mut rng, _) = seeded_rng("s5_discretize", 108);
    for &(p, h) in &[(1, 1), (3, 5), (16, 130), (64, 33)] {
        for (bilinear, clip_eigs) in [(false, false), (false, true), (true, false), (true, true)] {
            let how = S5Discretization {
                bilinear,
                clip_eigs,
            };
            let what = format!("s5_discretize P {p} H {h} {how:?}");
            let inputs = s5_params(&mut rng, p, h, clip_eigs);
            // Forward: the same arithmetic as the candle ops, so the same f32 values.
            let ts: Vec<Tensor> = inputs
                .iter()
                .map(|(v, s)| tensor(v, s, DType::F32, &Device::Cpu))
                .collect();
            let (fused, reference) = (s5_both(&ts, how, true), s5_both(&ts, how, false));
            assert_eq!(to_vec(&fused), to_vec(&reference), "{what}: forward");
            // Backward: candle autograd through the same ops (f64), and finite differences.
            let vars: Vec<Var> = inputs
                .iter()
                .map(|(v, s)| Var::from_tensor(&tensor(v, s, DType::F64, &Device::Cpu)).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let r = tensor(
                &randn(&mut rng, 2 * p + 2 * p * h),
                &[2 * p + 2 * p * h],
                DType::F64,
                &Device::Cpu,
            );
            let grads = |fused: bool| {
                let g = (s5_both(&ts, how, fused) * &r).unwrap().sum_all().unwrap();
                let g = g.backward().unwrap();
                vars.iter()
                    .map(|v| to_vec(g.get(v.as_tensor()).expect("gradient")))
                    .collect::<Vec<_>>()
            };
            for (k, (a, b)) in grads(true).iter().zip(grads(false)).enumerate() {
                let e = rel_err(a, &b);
                assert!(
                    e < 1e-12,
                    "{what}: input {k} gradient vs candle autograd: {e:e}"
                );
            }
            if p * h <= 64 && !clip_eigs {
                check_fd(&what, &inputs, |ts| s5_both(ts, how, true), &mut rng);
            }
        }
    }
}

#[test]
fn s5_readout_matches_the_layout_and_finite_differences() {
    let (mut rng, _) = seeded_rng("s5_readout", 109);
    for &(h, p, dirs) in &[(1, 1, 1), (3, 5, 2), (64, 16, 1), (7, 33, 2)] {
        for conj_sym in [false, true] {
            let what = format!("s5_readout H {h} P {p} dirs {dirs} conj_sym {conj_sym}");
            let c = randn(&mut rng, h * dirs * p * 2);
            let ct = tensor(&c, &[h, dirs * p, 2], DType::F64, &Device::Cpu);
            let r = to_vec(&s5_readout(&ct, dirs, conj_sym).unwrap());
            let s = if conj_sym { 2.0 } else { 1.0 };
            for d in 0..dirs {
                for q in 0..2 * p {
                    for j in 0..h {
                        let v = c[((j * dirs + d) * p + q / 2) * 2 + q % 2];
                        let want = if q % 2 == 1 { -s * v } else { s * v };
                        assert_eq!(r[(d * 2 * p + q) * h + j], want, "{what}");
                    }
                }
            }
            if h * p * dirs <= 64 {
                let inputs = [(c.clone(), vec![h, dirs * p, 2])];
                check_fd(
                    &what,
                    &inputs,
                    |ts| s5_readout(&ts[0], dirs, conj_sym).unwrap(),
                    &mut rng,
                );
            }
        }
    }
}

/// The epilogue r + k ⊙ act(y) equals the candle ops it replaces bit for bit (forward and both
/// gradients, f32), passes finite differences (f64), and refuses bad operands.
#[test]
fn epilogue_matches_the_candle_ops_and_finite_differences() {
    use myosotis::ops::dropout_keep;
    use myosotis::ops::epilogue::{epilogue, Activation, Dropout};
    let (mut rng, _) = seeded_rng("epilogue", 107);
    let cpu = Device::Cpu;
    let (b, l, h) = (3, 5, 7);
    let y = randn(&mut rng, b * l * h);
    let r = randn(&mut rng, b * l * h);
    for (act, residual, p) in [
        (Activation::Gelu, true, 0.0),
        (Activation::Gelu, true, 0.25),
        (Activation::Gelu, false, 0.5),
        (Activation::Identity, true, 0.25),
        (Activation::Identity, false, 0.0),
    ] {
        let what = format!("{act:?}, residual {residual}, p {p}");
        let drop = (p > 0.0).then_some(Dropout {
            site_hash: 99,
            first_row: 4,
            p,
            key_word: None,
        });
        let yv = Var::from_tensor(&tensor(&y, &[b, l, h], DType::F32, &cpu)).unwrap();
        let rv = Var::from_tensor(&tensor(&r, &[b, l, h], DType::F32, &cpu)).unwrap();
        let res = residual.then_some(rv.as_tensor());
        let fused = epilogue(yv.as_tensor(), res, act, drop).unwrap();
        // The same in candle ops, as the classifier wrote it.
        let mut z = match act {
            Activation::Gelu => gelu(yv.as_tensor()).unwrap(),
            Activation::Identity => yv.as_tensor().clone(),
        };
        if let Some(d) = drop {
            let keep = dropout_keep(d.site_hash, d.first_row, b, h, p, DType::F32, &cpu).unwrap();
            let scale = (1.0 / (1.0 - p)) as f32;
            z = z
                .broadcast_mul(&(keep * scale as f64).unwrap().reshape((b, 1, h)).unwrap())
                .unwrap();
        }
        let plain = match res {
            Some(r) => (r + z).unwrap(),
            None => z,
        };
        assert_eq!(to_vec(&fused), to_vec(&plain), "{what}: forward");
        let g = tensor(&randn(&mut rng, b * l * h), &[b, l, h], DType::F32, &cpu);
        let gf = (&fused * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gp = (&plain * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, v) in [("∂y", &yv), ("∂r", &rv)] {
            if name == "∂r" && !residual {
                continue;
            }
            assert_eq!(
                to_vec(gf.get(v).unwrap()),
                to_vec(gp.get(v).unwrap()),
                "{what}: {name}"
            );
        }
        let mut inputs = vec![(y.clone(), vec![b, l, h])];
        if residual {
            inputs.push((r.clone(), vec![b, l, h]));
        }
        check_fd(
            &format!("epilogue {what}"),
            &inputs,
            |ts| epilogue(&ts[0], ts.get(1), act, drop).unwrap(),
            &mut rng,
        );
    }
    let y3 = tensor(&y, &[b, l, h], DType::F32, &cpu);
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let short = Tensor::zeros((b, l, h - 1), DType::F32, &cpu).unwrap();
    assert!(err(epilogue(&y3, Some(&short), Activation::Gelu, None)).contains("residual"));
    let bad = Dropout {
        site_hash: 0,
        first_row: 0,
        p: 1.0,
        key_word: None,
    };
    assert!(err(epilogue(&y3, None, Activation::Gelu, Some(bad))).contains("[0, 1)"));
    let flat = Tensor::zeros(4, DType::F32, &cpu).unwrap();
    assert!(err(epilogue(&flat, None, Activation::Gelu, None)).contains("feature dimension"));
}

/// The tests' relative error sees what it must: an inf in the reference met by a finite value,
/// infinities of opposite sign, NaN on either side; a matching inf is no error and does not
/// hide an error elsewhere.
#[test]
fn rel_err_sees_infinities_and_nans() {
    let inf = f64::INFINITY;
    assert_eq!(rel_err(&[1.0, 5.0], &[1.0, inf]), inf);
    assert_eq!(rel_err(&[inf], &[-inf]), inf);
    assert_eq!(rel_err(&[f64::NAN], &[f64::NAN]), inf);
    assert_eq!(rel_err(&[1.0, inf], &[1.0, inf]), 0.0);
    // A wrong finite element beside a matching inf: 0.5 against a scale of 2.
    assert_eq!(rel_err(&[1.5, inf, 2.0], &[1.0, inf, 2.0]), 0.25);
}

/// The masked mean equals the candle ops it replaces (mask, product, sums, quotient) bit for
/// bit forward and backward (f32), passes finite differences (f64), and checks the lengths'
/// shape.
#[test]
fn masked_mean_matches_the_candle_ops_and_finite_differences() {
    use myosotis::ops::masked_mean;
    let (mut rng, _) = seeded_rng("masked_mean", 108);
    let cpu = Device::Cpu;
    let (b, l, w) = (4, 9, 6);
    let h = randn(&mut rng, b * l * w);
    let len = [9.0, 1.0, 4.0, 7.0];
    let lt = tensor(&len, &[b], DType::U32, &cpu);
    let hv = Var::from_tensor(&tensor(&h, &[b, l, w], DType::F32, &cpu)).unwrap();
    let fused = masked_mean(hv.as_tensor(), &lt).unwrap();
    let steps = Tensor::arange(0u32, l as u32, &cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = steps
        .broadcast_lt(&lt.unsqueeze(1).unwrap())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let plain = hv
        .broadcast_mul(&mask.unsqueeze(2).unwrap())
        .unwrap()
        .sum(1)
        .unwrap()
        .broadcast_div(&mask.sum_keepdim(1).unwrap())
        .unwrap();
    assert_eq!(to_vec(&fused), to_vec(&plain), "forward");
    let g = tensor(&randn(&mut rng, b * w), &[b, w], DType::F32, &cpu);
    let gf = (&fused * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gp = (&plain * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // The same values; a masked-out step is +0 here, −0 in candle's product where ∂out < 0.
    let (a, c) = (to_vec(gf.get(&hv).unwrap()), to_vec(gp.get(&hv).unwrap()));
    assert!(a.iter().zip(&c).all(|(x, y)| x == y), "backward");
    check_fd(
        "masked_mean",
        &[(h.clone(), vec![b, l, w])],
        |ts| masked_mean(&ts[0], &lt).unwrap(),
        &mut rng,
    );
    let short = tensor(&len[..3], &[3], DType::U32, &cpu);
    let e = masked_mean(hv.as_tensor(), &short).unwrap_err().to_string();
    assert!(e.contains("lengths have shape [3], expected (4)"), "{e}");
}

/// The GLU's gated epilogue: r + k ⊙ (f ⊙ σ(z + b)) equals the candle ops to 1e-14 (f64, with
/// dropout and a residual), and its backward (∂f, ∂z, and ∂b as the sum of ∂z) passes central
/// differences of the op itself.
#[test]
fn gate_matches_the_candle_ops_and_finite_differences() {
    use myosotis::ops::dropout_keep;
    use myosotis::ops::epilogue::{gate, gate_backward, Dropout};
    let (mut rng, seed) = seeded_rng("gate", 109);
    let cpu = Device::Cpu;
    let (b, l, h) = (3, 5, 4);
    let n = b * l * h;
    let dropout = Dropout {
        site_hash: 77,
        first_row: 2,
        p: 0.25,
        key_word: None,
    };
    let drop = Some(dropout);
    let t = |v: &[f64], dims: &[usize]| tensor(v, dims, DType::F64, &cpu);
    let (f, z, r, g) = (
        randn(&mut rng, n),
        randn(&mut rng, n),
        randn(&mut rng, n),
        randn(&mut rng, n),
    );
    let bias = randn(&mut rng, h);
    let run = |f: &[f64], z: &[f64], bias: &[f64]| {
        gate(
            &t(f, &[b, l, h]),
            &t(z, &[b, l, h]),
            &t(bias, &[h]),
            Some(&t(&r, &[b, l, h])),
            drop,
        )
        .unwrap()
    };
    let keep = dropout_keep(77, 2, b, h, 0.25, DType::F64, &cpu).unwrap();
    let k = (keep * dropout.scale())
        .unwrap()
        .reshape((b, 1, h))
        .unwrap();
    let s = candle_nn::ops::sigmoid(&t(&z, &[b, l, h]).broadcast_add(&t(&bias, &[h])).unwrap())
        .unwrap();
    let plain =
        ((t(&f, &[b, l, h]) * &s).unwrap().broadcast_mul(&k).unwrap() + t(&r, &[b, l, h])).unwrap();
    let [out, s_out] = run(&f, &z, &bias);
    let e = rel_err(&to_vec(&out), &to_vec(&plain));
    assert!(e < 1e-14, "forward vs candle ops: {e:e}, seed {seed}");
    let e = rel_err(&to_vec(&s_out), &to_vec(&s));
    assert!(
        e < 1e-14,
        "the gate s vs candle's sigmoid: {e:e}, seed {seed}"
    );
    let [df, dz] = gate_backward(&t(&f, &[b, l, h]), &s_out, drop, &t(&g, &[b, l, h])).unwrap();
    let (df, dz) = (to_vec(&df), to_vec(&dz));
    let db: Vec<f64> = (0..h)
        .map(|j| (0..n / h).map(|i| dz[i * h + j]).sum())
        .collect();
    let loss = |f: &[f64], z: &[f64], bias: &[f64]| -> f64 {
        let [out, _] = run(f, z, bias);
        to_vec(&out).iter().zip(&g).map(|(o, g)| o * g).sum()
    };
    let eps = 1e-6;
    for (which, analytic) in [(0, &df), (1, &dz), (2, &db)] {
        let fd: Vec<f64> = (0..analytic.len())
            .map(|i| {
                let at = |d: f64| {
                    let (mut f, mut z, mut bias) = (f.clone(), z.clone(), bias.clone());
                    [&mut f, &mut z, &mut bias][which][i] += d;
                    loss(&f, &z, &bias)
                };
                (at(eps) - at(-eps)) / (2.0 * eps)
            })
            .collect();
        let e = rel_err(analytic, &fd);
        assert!(
            e < 1e-6,
            "input {which} vs finite differences: {e:e}, seed {seed}"
        );
    }
}

/// The embedding equals candle's `index_select` forward (bit for bit, f32) and its gradient
/// candle's `index_add` (f64, to rounding: the sums run in another order), for ids of two
/// dimensions with repeats over several of the backward's stages; it passes finite differences
/// (f64), and names an id outside the table. `embedding_backward` alone gives the same ∂W.
#[test]
fn embedding_matches_candle_and_finite_differences() {
    use myosotis::ops::{embedding, embedding_backward};
    let (mut rng, _) = seeded_rng("embedding", 109);
    let cpu = Device::Cpu;
    let (b, l, h, vocab) = (3, 150, 37, 11);
    let ids: Vec<f64> = (0..b * l)
        .map(|_| rng.random_range(0..vocab) as f64)
        .collect();
    let it = tensor(&ids, &[b, l], DType::U32, &cpu);
    let w = randn(&mut rng, vocab * h);
    let g = randn(&mut rng, b * l * h);
    for dtype in [DType::F32, DType::F64] {
        let wv = Var::from_tensor(&tensor(&w, &[vocab, h], dtype, &cpu)).unwrap();
        let fused = embedding(wv.as_tensor(), &it).unwrap();
        let plain = candle_nn::Embedding::new(wv.as_tensor().clone(), h);
        let plain = candle_core::Module::forward(&plain, &it).unwrap();
        assert_eq!(fused.dims(), [b, l, h]);
        assert_eq!(to_vec(&fused), to_vec(&plain), "{dtype:?} forward");
        let gt = tensor(&g, &[b, l, h], dtype, &cpu);
        let grad = |y: &Tensor| {
            let grads = (y * &gt).unwrap().sum_all().unwrap().backward().unwrap();
            to_vec(grads.get(&wv).unwrap())
        };
        let tol = if dtype == DType::F64 { 1e-13 } else { 1e-5 };
        assert!(
            rel_err(&grad(&fused), &grad(&plain)) < tol,
            "{dtype:?} backward"
        );
        // The backward on its own (Myo's per-level sums) is the op's gradient.
        let flat = it.flatten_all().unwrap();
        let alone = embedding_backward(&flat, &gt.reshape((b * l, h)).unwrap(), vocab).unwrap();
        assert_eq!(to_vec(&alone), grad(&fused), "{dtype:?} backward alone");
    }
    check_fd(
        "embedding",
        &[(w.clone(), vec![vocab, h])],
        |ts| embedding(&ts[0], &it).unwrap(),
        &mut rng,
    );
    let wt = tensor(&w, &[vocab, h], DType::F32, &cpu);
    let bad = tensor(&[1.0, 11.0], &[2], DType::U32, &cpu);
    let e = embedding(&wt, &bad).unwrap_err().to_string();
    assert!(
        e.contains("token id 11 at position 1 is outside the vocabulary of 11"),
        "{e}"
    );
    let e = embedding(&wt, &wt).unwrap_err().to_string();
    assert!(
        e.contains("ids of dtype F32, expected an integer dtype"),
        "{e}"
    );
    let e = embedding_backward(&bad, &wt, vocab)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ids [2] of U32 for a gradient [11, 37]"), "{e}");
}
