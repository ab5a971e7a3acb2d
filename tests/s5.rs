//! S5: the HiPPO-N diagonalisation in f64, and the layer against a direct sequential complex
//! recurrence in f64 computed from its parameters.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{randn, rel_err, to_vec};
use myosotis::nn::hippo::{block_init, hippo_n, hippo_normal};
use myosotis::nn::{CInit, Discretization, S5Config, S5};
use nalgebra::{Complex, DMatrix};
use rand::Rng;

#[test]
fn hippo_n_is_diagonalised_by_a_unitary_basis() {
    for n in [2, 4, 8, 16, 64] {
        let h = hippo_n(n);
        let s = hippo_normal(n);
        for l in &h.lambda {
            assert!((l.re + 0.5).abs() < 1e-12, "Re λ = {} for n = {n}", l.re);
        }
        for w in h.lambda.windows(2) {
            assert!(w[0].im <= w[1].im, "eigenvalues ascending");
        }
        let vh_v = h.v.adjoint() * &h.v;
        let eye = DMatrix::<Complex<f64>>::identity(n, n);
        assert!((vh_v - &eye).norm() < 1e-10, "VᴴV = I for n = {n}");
        let recon = &h.v
            * DMatrix::from_diagonal(&nalgebra::DVector::from_vec(h.lambda.clone()))
            * h.v.adjoint();
        let s_c = s.map(|x| Complex::new(x, 0.0));
        assert!(
            (recon - s_c).norm() < 1e-9 * (n as f64),
            "V Λ Vᴴ = S for n = {n}"
        );
    }
    // Conjugate symmetry keeps one of each pair: the negative imaginary halves.
    let init = block_init(16, 4, true).unwrap();
    let (lambda, v, vinv) = (init.lambda, init.v, init.vinv);
    assert_eq!(lambda.len(), 8);
    assert_eq!(
        (v.nrows(), v.ncols(), vinv.nrows(), vinv.ncols()),
        (16, 8, 8, 16)
    );
    assert!(lambda.iter().all(|l| l.im < 0.0));
    assert!((&vinv * &v - DMatrix::<Complex<f64>>::identity(8, 8)).norm() < 1e-10);
    assert!(block_init(10, 4, false).is_err());
    assert!(block_init(12, 4, true).is_err());
}

/// The layer's output recomputed from its parameters with plain f64 complex arithmetic; with
/// `dt` (batch × len intervals, causal layers) each step discretised with Δ·dt_k.
fn reference(
    cfg: &S5Config,
    params: &std::collections::HashMap<String, Vec<f64>>,
    u: &[f64],
    batch: usize,
    len: usize,
    dt: Option<&[f64]>,
) -> Vec<f64> {
    let h = cfg.d_model;
    let p = params["lambda_re"].len();
    let c_len = params["c"].len() / (2 * h);
    let (lre, lim, bt, ct, d, ls) = (
        &params["lambda_re"],
        &params["lambda_im"],
        &params["b"],
        &params["c"],
        &params["d"],
        &params["log_step"],
    );
    // State i discretised with the step Δ_i·scale: (Λ̄_i, the factor of B̃'s row i).
    let disc = |i: usize, scale: f64| {
        let re = if cfg.clip_eigs {
            lre[i].min(-1e-4)
        } else {
            lre[i]
        };
        let lam = Complex::new(re, lim[i]);
        let dt = ls[i].exp() * scale;
        match cfg.discretization {
            Discretization::Zoh => {
                let lb = (lam * dt).exp();
                (lb, (lb - 1.0) / lam)
            }
            Discretization::Bilinear => {
                let bl = 1.0 / (1.0 - lam * (dt / 2.0));
                (bl * (1.0 + lam * (dt / 2.0)), bl * dt)
            }
        }
    };
    let bt_at = |i: usize, j: usize| Complex::new(bt[(i * h + j) * 2], bt[(i * h + j) * 2 + 1]);
    let factor = if cfg.conj_sym { 2.0 } else { 1.0 };
    let mut y = vec![0.0; batch * len * h];
    for b in 0..batch {
        let scale = |t: usize| dt.map_or(1.0, |d| d[b * len + t]);
        // (Λ̄_i, B̄_i u_t) at step t.
        let step = |t: usize, i: usize| {
            let (lb, coef) = disc(i, scale(t));
            let bu: Complex<f64> = (0..h).map(|j| bt_at(i, j) * u[(b * len + t) * h + j]).sum();
            (lb, coef * bu)
        };
        let mut states = vec![vec![Complex::new(0.0, 0.0); c_len]; len];
        let mut x = vec![Complex::new(0.0, 0.0); p];
        for (t, state) in states.iter_mut().enumerate() {
            for i in 0..p {
                let (lb, bu) = step(t, i);
                x[i] = lb * x[i] + bu;
                state[i] = x[i];
            }
        }
        if cfg.bidirectional {
            let mut x = vec![Complex::new(0.0, 0.0); p];
            for t in (0..len).rev() {
                for i in 0..p {
                    let (lb, bu) = step(t, i);
                    x[i] = lb * x[i] + bu;
                    states[t][p + i] = x[i];
                }
            }
        }
        for t in 0..len {
            for o in 0..h {
                let cx: Complex<f64> = (0..c_len)
                    .map(|i| {
                        Complex::new(ct[(o * c_len + i) * 2], ct[(o * c_len + i) * 2 + 1])
                            * states[t][i]
                    })
                    .sum();
                y[(b * len + t) * h + o] = factor * cx.re + d[o] * u[(b * len + t) * h + o];
            }
        }
    }
    y
}

fn build(cfg: &S5Config) -> (VarMap, S5) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let layer = S5::new(cfg.clone(), vb).unwrap();
    (varmap, layer)
}

fn params(varmap: &VarMap) -> std::collections::HashMap<String, Vec<f64>> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), to_vec(v.as_tensor())))
        .collect()
}

#[test]
fn layer_equals_the_sequential_complex_recurrence() {
    let (mut rng, seed) = common::seeded_rng("s5 layer", 112);
    let (batch, len) = (2, 13);
    for disc in [Discretization::Zoh, Discretization::Bilinear] {
        for conj_sym in [false, true] {
            for bidirectional in [false, true] {
                for (c_init, clip_eigs) in [
                    (CInit::TruncStandardNormal, false),
                    (CInit::ComplexNormal, true),
                    (CInit::LecunNormal, false),
                ] {
                    let cfg = S5Config {
                        d_model: 3,
                        state: 8,
                        blocks: 2,
                        conj_sym,
                        clip_eigs,
                        discretization: disc,
                        c_init,
                        bidirectional,
                        seed: rng.random(),
                        ..S5Config::default()
                    };
                    let (varmap, layer) = build(&cfg);
                    let u: Vec<f64> = (0..batch * len * 3)
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect();
                    let ut = Tensor::from_vec(u.clone(), (batch, len, 3), &Device::Cpu).unwrap();
                    let got = to_vec(&layer.forward(&ut).unwrap());
                    let want = reference(&cfg, &params(&varmap), &u, batch, len, None);
                    let e = rel_err(&got, &want);
                    assert!(e < 1e-12, "error {e:e} for {cfg:?} (seed {seed})");
                }
            }
        }
    }
}

/// With an interval per sample (`forward_timed`), step k is discretised with Δ·dt_k: the layer
/// equals the recurrence with per-step Λ̄_k, B̄_k (ZOH and bilinear), intervals of 1 give the
/// untimed layer, the gradients equal central differences of the f64 recurrence, and a
/// bidirectional layer or intervals of another shape are refused.
#[test]
fn a_step_per_sample_follows_the_recurrence_of_its_intervals() {
    let (mut rng, seed) = common::seeded_rng("s5 timed", 113);
    let (batch, len) = (2, 11);
    for disc in [Discretization::Zoh, Discretization::Bilinear] {
        for (conj_sym, clip_eigs) in [(true, false), (false, true)] {
            let cfg = S5Config {
                d_model: 3,
                state: 8,
                blocks: 2,
                conj_sym,
                clip_eigs,
                discretization: disc,
                seed: rng.random(),
                ..S5Config::default()
            };
            let (varmap, layer) = build(&cfg);
            let u: Vec<f64> = (0..batch * len * 3)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let dt: Vec<f64> = (0..batch * len)
                .map(|_| rng.random_range(0.2..30.0))
                .collect();
            let ut = Tensor::from_vec(u.clone(), (batch, len, 3), &Device::Cpu).unwrap();
            let dtt = Tensor::from_vec(dt.clone(), (batch, len), &Device::Cpu).unwrap();
            let got = to_vec(&layer.forward_timed(&ut, &dtt).unwrap());
            let want = reference(&cfg, &params(&varmap), &u, batch, len, Some(&dt));
            let e = rel_err(&got, &want);
            assert!(e < 1e-12, "error {e:e} for {cfg:?} (seed {seed})");
            let ones = dtt.ones_like().unwrap();
            let timed = to_vec(&layer.forward_timed(&ut, &ones).unwrap());
            let e = rel_err(&timed, &to_vec(&layer.forward(&ut).unwrap()));
            assert!(e < 1e-12, "intervals of 1: error {e:e} for {cfg:?}");
            // Gradients of Σ y² against central differences of the recurrence.
            let y = layer.forward_timed(&ut, &dtt).unwrap();
            let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let vars = varmap.data().lock().unwrap().clone();
            for name in ["log_step", "lambda_re", "lambda_im", "b"] {
                let g = to_vec(grads.get(vars[name].as_tensor()).unwrap());
                for k in [0, g.len() / 2, g.len() - 1] {
                    let loss = |delta: f64| {
                        let mut p = params(&varmap);
                        p.get_mut(name).unwrap()[k] += delta;
                        let y = reference(&cfg, &p, &u, batch, len, Some(&dt));
                        y.iter().map(|v| v * v).sum::<f64>()
                    };
                    let fd = (loss(1e-6) - loss(-1e-6)) / 2e-6;
                    assert!(
                        (g[k] - fd).abs() <= 1e-5 * (1.0 + fd.abs()),
                        "∂/∂{name}[{k}]: {} vs {fd} for {cfg:?}",
                        g[k]
                    );
                }
            }
        }
    }
    let (_, bidirectional) = build(&S5Config {
        d_model: 3,
        state: 8,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    });
    let u = Tensor::zeros((1, 4, 3), DType::F64, &Device::Cpu).unwrap();
    let dt = Tensor::ones((1, 4), DType::F64, &Device::Cpu).unwrap();
    let e = bidirectional
        .forward_timed(&u, &dt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("need a causal layer"), "{e}");
    let (_, causal) = build(&S5Config {
        d_model: 3,
        state: 8,
        blocks: 2,
        ..S5Config::default()
    });
    let e = causal
        .forward_timed(&u, &dt.reshape((4, 1)).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("the intervals have shape [4, 1]"), "{e}");
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    let (mut rng, _) = common::seeded_rng("every_parameter_gets_a_finite_nonzero_gradient", 140);
    let cfg = S5Config {
        d_model: 4,
        state: 8,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    };
    let (varmap, layer) = build(&cfg);
    let u = randn(&mut rng, &[2, 9, 4], DType::F64, &Device::Cpu);
    let loss = layer.forward(&u).unwrap().sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    common::assert_all_gradients(&varmap, &grads, &[], "S5");
}

#[test]
fn existing_parameters_are_kept_not_reinitialised() {
    let (mut rng, _) = common::seeded_rng("existing_parameters_are_kept_not_reinitialised", 141);
    let cfg = S5Config {
        d_model: 3,
        state: 8,
        blocks: 2,
        ..S5Config::default()
    };
    let (varmap, first) = build(&cfg);
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let second = S5::new(
        S5Config {
            seed: 99,
            ..cfg.clone()
        },
        vb,
    )
    .unwrap();
    let u = randn(&mut rng, &[1, 5, 3], DType::F64, &Device::Cpu);
    assert_eq!(
        to_vec(&first.forward(&u).unwrap()),
        to_vec(&second.forward(&u).unwrap())
    );
    assert!(S5::new(
        S5Config { blocks: 3, ..cfg },
        VarBuilder::from_varmap(&VarMap::new(), DType::F64, &Device::Cpu)
    )
    .is_err());
}

/// The initial spread of C̃ per (re, im) part: 1/P for trunc_standard_normal (LeCun rows of
/// (1, P, 2)) and 1/(H·P) for lecun_normal (one LeCun draw over (H, P, 2), fan-in H·P), with P
/// the state size before conjugate symmetry; C̃ = C V keeps it (V unitary, columns kept in
/// conjugate pairs).
#[test]
fn c_initial_variance_follows_the_reference_fan_in() {
    let (h, p) = (64, 256);
    let variance = |c_init| {
        let cfg = S5Config {
            d_model: h,
            state: p,
            blocks: 4,
            c_init,
            seed: 5,
            ..S5Config::default()
        };
        let varmap = VarMap::new();
        S5::new(
            cfg,
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        )
        .unwrap();
        let c = to_vec(varmap.data().lock().unwrap()["c"].as_tensor());
        c.iter().map(|x| x * x).sum::<f64>() / c.len() as f64
    };
    for (c_init, want) in [
        (CInit::TruncStandardNormal, 1.0 / p as f64),
        (CInit::LecunNormal, 1.0 / (h * p) as f64),
    ] {
        let v = variance(c_init);
        assert!(
            (v / want - 1.0).abs() < 0.1,
            "{c_init:?}: {v:e}, want {want:e}"
        );
    }
}

/// The layer as one node with its backward by hand (`forward_by_hand`) gives the forward's
/// output to the bit and the gradients of candle's autograd through the same ops (to 1e-12 in
/// f64, 1e-5 in f32), for every discretisation, conj_sym, direction and clip; the parameters
/// get their gradients also when the input needs none; and the gradients equal central
/// differences of the loss.
#[test]
fn backward_by_hand_equals_autograd() {
    use candle_core::Var;
    use myosotis::nn::GradSink;
    let (mut rng, seed) = common::seeded_rng("s5 by hand", 114);
    let (batch, len, h) = (2, 9, 3);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for disc in [Discretization::Zoh, Discretization::Bilinear] {
            for (conj_sym, bidirectional, clip_eigs) in [
                (true, true, false),
                (false, true, true),
                (true, false, false),
            ] {
                let cfg = S5Config {
                    d_model: h,
                    state: 8,
                    blocks: 2,
                    conj_sym,
                    clip_eigs,
                    discretization: disc,
                    bidirectional,
                    seed: rng.random(),
                    ..S5Config::default()
                };
                let varmap = VarMap::new();
                let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
                let layer = S5::new(cfg.clone(), vb).unwrap();
                let u = Var::from_tensor(&randn(&mut rng, &[batch, len, h], dtype, &Device::Cpu))
                    .unwrap();
                let g = randn(&mut rng, &[batch, len, h], dtype, &Device::Cpu);
                let what = format!("{cfg:?} {dtype:?} (seed {seed})");
                let y = layer.forward(u.as_tensor()).unwrap();
                let want = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let sink = GradSink::new();
                let y_hand = layer.forward_by_hand(u.as_tensor(), &sink).unwrap();
                assert_eq!(to_vec(&y_hand), to_vec(&y), "output by hand, {what}");
                let mut got = (&y_hand * &g)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                sink.add_to(&mut got).unwrap();
                let vars = varmap.data().lock().unwrap().clone();
                let params: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
                let with_input = [params.clone(), vec![("u", &u)]].concat();
                common::assert_same_gradients(&with_input, &got, &want, tol, &what);
                // An input that needs no gradient: the parameters still get theirs.
                let sink = GradSink::new();
                let y = layer
                    .forward_by_hand(&u.as_tensor().detach(), &sink)
                    .unwrap();
                let mut only = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                sink.add_to(&mut only).unwrap();
                let what = format!("input detached, {what}");
                common::assert_same_gradients(&params, &only, &want, tol, &what);
            }
        }
    }
    // Central differences of the f64 loss for a few entries of each parameter and the input.
    let cfg = S5Config {
        d_model: h,
        state: 8,
        blocks: 2,
        bidirectional: true,
        seed: 7,
        ..S5Config::default()
    };
    let varmap = VarMap::new();
    let layer = S5::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
    )
    .unwrap();
    let u = Var::from_tensor(&randn(&mut rng, &[batch, len, h], DType::F64, &Device::Cpu)).unwrap();
    let g = randn(&mut rng, &[batch, len, h], DType::F64, &Device::Cpu);
    let loss = || {
        let y = layer.forward(u.as_tensor()).unwrap();
        (&y * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let sink = GradSink::new();
    let y = layer.forward_by_hand(u.as_tensor(), &sink).unwrap();
    let mut grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    sink.add_to(&mut grads).unwrap();
    let vars = varmap.data().lock().unwrap().clone();
    let named: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
    common::assert_central_differences(&[named, vec![("u", &u)]].concat(), &grads, loss, "S5");
}

/// In f16 and bf16 the layer runs by hand too, its parameter-side ops (the discretisation, the
/// readout matrix) in f32: its output and gradients follow the f32 layer's on the same rounded
/// parameters and input, to the half dtype's precision, every gradient in its parameter's dtype.
#[test]
fn backward_by_hand_in_half_precision_follows_f32() {
    let (mut rng, seed) = common::seeded_rng("s5 by hand in half precision", 115);
    for (dtype, tol) in [(DType::BF16, 4e-2), (DType::F16, 4e-3)] {
        for bidirectional in [true, false] {
            let cfg = S5Config {
                d_model: 3,
                state: 8,
                blocks: 2,
                bidirectional,
                seed: rng.random(),
                ..S5Config::default()
            };
            let what = format!("{cfg:?} (seed {seed})");
            common::half::s5_follows_f32(&Device::Cpu, dtype, &cfg, &mut rng, tol, &what);
        }
    }
}

/// With an interval per sample, the layer by hand (`forward_timed_by_hand`: `ops::s5_timed`
/// and the backward written out) gives `forward_timed`'s output (the same ops: to the bit) and
/// the gradients of candle's autograd through it (to 1e-12 in f64, 1e-5 in f32), for both
/// discretisations, conj_sym and clip; the gradients equal central differences of the loss;
/// and a bidirectional layer is refused as `forward_timed` refuses it.
#[test]
fn timed_backward_by_hand_equals_autograd() {
    use candle_core::Var;
    use myosotis::nn::GradSink;
    let (mut rng, seed) = common::seeded_rng("s5 timed by hand", 115);
    let (batch, len, h) = (3, 7, 3);
    let cfg_of = |disc, conj_sym, clip_eigs, seed| S5Config {
        d_model: h,
        state: 8,
        blocks: 2,
        conj_sym,
        clip_eigs,
        discretization: disc,
        seed,
        ..S5Config::default()
    };
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for disc in [Discretization::Zoh, Discretization::Bilinear] {
            for (conj_sym, clip_eigs) in [(true, false), (false, true)] {
                let cfg = cfg_of(disc, conj_sym, clip_eigs, rng.random());
                let varmap = VarMap::new();
                let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
                let layer = S5::new(cfg.clone(), vb).unwrap();
                let u = Var::from_tensor(&randn(&mut rng, &[batch, len, h], dtype, &Device::Cpu))
                    .unwrap();
                let dt: Vec<f64> = (0..batch * len)
                    .map(|_| rng.random_range(0.2..30.0))
                    .collect();
                let dt = common::tensor(&dt, &[batch, len], dtype, &Device::Cpu);
                let g = randn(&mut rng, &[batch, len, h], dtype, &Device::Cpu);
                let what = format!("{cfg:?} {dtype:?} (seed {seed})");
                let y = layer.forward_timed(u.as_tensor(), &dt).unwrap();
                let want = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let sink = GradSink::new();
                let y_hand = layer
                    .forward_timed_by_hand(u.as_tensor(), &dt, &sink)
                    .unwrap();
                assert_eq!(to_vec(&y_hand), to_vec(&y), "output by hand, {what}");
                let mut got = (&y_hand * &g)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                sink.add_to(&mut got).unwrap();
                let vars = varmap.data().lock().unwrap().clone();
                let params: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
                let with_input = [params, vec![("u", &u)]].concat();
                common::assert_same_gradients(&with_input, &got, &want, tol, &what);
            }
        }
    }
    let cfg = cfg_of(Discretization::Zoh, true, true, 9);
    let varmap = VarMap::new();
    let layer = S5::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
    )
    .unwrap();
    let u = Var::from_tensor(&randn(&mut rng, &[batch, len, h], DType::F64, &Device::Cpu)).unwrap();
    let dt = common::rand_uniform(
        &mut rng,
        (0.5, 3.0),
        &[batch, len],
        DType::F64,
        &Device::Cpu,
    );
    let g = randn(&mut rng, &[batch, len, h], DType::F64, &Device::Cpu);
    let loss = || {
        let y = layer.forward_timed(u.as_tensor(), &dt).unwrap();
        (&y * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let sink = GradSink::new();
    let y = layer
        .forward_timed_by_hand(u.as_tensor(), &dt, &sink)
        .unwrap();
    let mut grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    sink.add_to(&mut grads).unwrap();
    let vars = varmap.data().lock().unwrap().clone();
    let named: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
    let what = "S5 timed";
    common::assert_central_differences(&[named, vec![("u", &u)]].concat(), &grads, loss, what);
    let bidirectional = S5::new(
        S5Config {
            bidirectional: true,
            ..cfg_of(Discretization::Zoh, true, false, 3)
        },
        VarBuilder::from_varmap(&VarMap::new(), DType::F64, &Device::Cpu),
    )
    .unwrap();
    let e = bidirectional
        .forward_timed_by_hand(u.as_tensor(), &dt, &GradSink::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("need a causal layer"), "{e}");
}
