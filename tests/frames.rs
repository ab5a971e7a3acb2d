//! The pendulum benchmark's frame encoder against the same layers written as loops in f64.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{rel_err, to_vec};
use myosotis::nn::frames::{FrameEncoder, FrameEncoderConfig};
use myosotis::nn::DenseInit;
use rand::Rng;

/// A convolution of `x` (c_in, s, s) by `w` (c_out, c_in, k, k) plus `b`, zero-padded by
/// `pad`, with stride `stride`, then a ReLU; returns it and its side.
fn conv(
    (x, c_in, s): (&[f64], usize, usize),
    (w, b): (&[f64], &[f64]),
    (k, pad, stride): (usize, usize, usize),
) -> (Vec<f64>, usize) {
    let c_out = b.len();
    let o = (s + 2 * pad - k) / stride + 1;
    let mut y = vec![0.0; c_out * o * o];
    for co in 0..c_out {
        for r in 0..o {
            for c in 0..o {
                let mut acc = b[co];
                for ci in 0..c_in {
                    for i in 0..k {
                        for j in 0..k {
                            let (rr, cc) = (
                                (r * stride + i) as isize - pad as isize,
                                (c * stride + j) as isize - pad as isize,
                            );
                            if rr >= 0 && cc >= 0 && (rr as usize) < s && (cc as usize) < s {
                                acc += w[((co * c_in + ci) * k + i) * k + j]
                                    * x[(ci * s + rr as usize) * s + cc as usize];
                            }
                        }
                    }
                }
                y[(co * o + r) * o + c] = acc.max(0.0); // with the ReLU
            }
        }
    }
    (y, o)
}

/// 2 × 2 max-pooling of (c, s, s), dropping an odd last row and column.
fn pool(x: &[f64], c: usize, s: usize) -> (Vec<f64>, usize) {
    let o = s / 2;
    let mut y = vec![f64::MIN; c * o * o];
    for ch in 0..c {
        for r in 0..o {
            for col in 0..o {
                for (i, j) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let v = x[(ch * s + 2 * r + i) * s + 2 * col + j];
                    let at = (ch * o + r) * o + col;
                    y[at] = y[at].max(v);
                }
            }
        }
    }
    (y, o)
}

fn dense(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    b.iter()
        .enumerate()
        .map(|(o, bo)| {
            bo + x
                .iter()
                .enumerate()
                .map(|(i, xi)| w[o * x.len() + i] * xi)
                .sum::<f64>()
        })
        .collect()
}

#[test]
fn the_encoder_equals_its_layers_as_loops() {
    let (mut rng, seed) = common::seeded_rng("frame encoder", 301);
    for (side, d_model, append_dt) in [(24, 30, false), (8, 5, true), (13, 7, false)] {
        let cfg = FrameEncoderConfig {
            side,
            d_model,
            seed: rng.random(),
            append_dt,
            init: if append_dt {
                DenseInit::Lecun
            } else {
                DenseInit::Uniform
            },
        };
        let varmap = VarMap::new();
        let enc = FrameEncoder::new(
            cfg.clone(),
            VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
        )
        .unwrap();
        let p: std::collections::HashMap<String, Vec<f64>> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), to_vec(v.as_tensor())))
            .collect();
        let (batch, len) = (2, 3);
        let x: Vec<f64> = (0..batch * len * side * side)
            .map(|_| rng.random_range(0.0..1.0))
            .collect();
        let dt: Vec<f64> = (0..batch * len)
            .map(|_| rng.random_range(0.5..3.0))
            .collect();
        let dt_t = Tensor::from_vec(dt.clone(), (batch, len), &Device::Cpu).unwrap();
        let forward = |x: Vec<f64>| {
            let x = Tensor::from_vec(x, (batch, len, side * side), &Device::Cpu).unwrap();
            enc.forward_timed(&x, Some(&dt_t)).unwrap()
        };
        let got = to_vec(&forward(x.clone()));
        let mut want = vec![];
        for (frame, dt) in x.chunks(side * side).zip(&dt) {
            let (y, s) = conv(
                (frame, 1, side),
                (&p["conv1.weight"], &p["conv1.bias"]),
                (5, 2, 1),
            );
            let (y, s) = pool(&y, 12, s);
            let (y, s) = conv(
                (&y, 12, s),
                (&p["conv2.weight"], &p["conv2.bias"]),
                (3, 1, 2),
            );
            let (y, _) = pool(&y, 12, s);
            let mut h: Vec<f64> = dense(&y, &p["dense1.weight"], &p["dense1.bias"])
                .iter()
                .map(|v| v.max(0.0))
                .collect();
            if append_dt {
                h.push(*dt);
            }
            want.extend(dense(&h, &p["dense2.weight"], &p["dense2.bias"]));
        }
        let e = rel_err(&got, &want);
        assert!(e < 1e-12, "side {side}: error {e:e} (seed {seed})");
        // Every parameter learns, and its gradient is the loss's finite difference.
        let loss = |x: Vec<f64>| forward(x).sqr().unwrap().sum_all().unwrap();
        let grads = loss(x.clone()).backward().unwrap();
        common::assert_all_gradients(&varmap, &grads, &[], "frame encoder");
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let g = to_vec(grads.get(var.as_tensor()).unwrap());
            let w = to_vec(var.as_tensor());
            for _ in 0..3 {
                let i = rng.random_range(0..w.len());
                let at = |v: f64| {
                    let mut w = w.clone();
                    w[i] = v;
                    var.set(&Tensor::from_vec(w, var.dims(), &Device::Cpu).unwrap())
                        .unwrap();
                    loss(x.clone()).to_scalar::<f64>().unwrap()
                };
                let h = 1e-6;
                let fd = (at(w[i] + h) - at(w[i] - h)) / (2.0 * h);
                at(w[i]);
                let err = (fd - g[i]).abs() / (1e-6 + fd.abs().max(g[i].abs()));
                assert!(
                    err < 1e-5,
                    "side {side}: d loss / d {name}[{i}] = {} by backprop, {fd} by finite \
                     differences (seed {seed})",
                    g[i]
                );
            }
        }
    }
    let small = FrameEncoderConfig {
        side: 7,
        d_model: 4,
        seed: 0,
        append_dt: false,
        init: DenseInit::Uniform,
    };
    let e = FrameEncoder::new(
        small,
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("frames of side 7"), "{e}");
}

/// Frames of `side`: uniform noise, or (`sparse`) a black background with a few grey pixels,
/// as the pendulum's, whose constant regions make equal corners in the max-pooling.
fn frames(rng: &mut impl Rng, n: usize, side: usize, sparse: bool) -> Vec<f64> {
    (0..n * side * side)
        .map(|_| match sparse {
            true if rng.random_range(0.0..1.0) < 0.85 => 0.0,
            _ => rng.random_range(0.0..1.0),
        })
        .collect()
}

#[test]
fn the_backward_by_hand_equals_autograd() {
    use myosotis::nn::GradSink;
    let (mut rng, seed) = common::seeded_rng("frame encoder by hand", 302);
    let cases = [
        (24, 30, false, DType::F64, false),
        (24, 30, true, DType::F64, true),
        (13, 7, false, DType::F64, true),
        (8, 5, true, DType::F32, false),
        (24, 30, true, DType::F32, true),
    ];
    for (side, d_model, append_dt, dtype, sparse) in cases {
        let cfg = FrameEncoderConfig {
            side,
            d_model,
            seed: rng.random(),
            append_dt,
            init: DenseInit::Lecun,
        };
        let varmap = VarMap::new();
        let enc =
            FrameEncoder::new(cfg, VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu)).unwrap();
        let (batch, len) = (3, 4);
        let x = frames(&mut rng, batch * len, side, sparse);
        let x = common::tensor(&x, &[batch, len, side * side], dtype, &Device::Cpu);
        let dt = common::rand_uniform(&mut rng, (0.5, 3.0), &[batch, len], dtype, &Device::Cpu);
        let r = common::randn(&mut rng, &[batch, len, d_model], dtype, &Device::Cpu);
        let dt = append_dt.then_some(&dt);
        let want_y = enc.forward_timed(&x, dt).unwrap();
        let want = (&want_y * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let sink = GradSink::new();
        let y = enc.forward_by_hand(&x, dt, &sink).unwrap();
        assert_eq!(
            to_vec(&y),
            to_vec(&want_y),
            "the same forward (seed {seed})"
        );
        let mut got = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        sink.add_to(&mut got).unwrap();
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let (g, w) = (got.get(var).unwrap(), want.get(var).unwrap());
            let e = rel_err(&to_vec(g), &to_vec(w));
            assert!(
                e < tol,
                "side {side}, {dtype:?}, sparse {sparse}: ∂{name} off by {e:e} (seed {seed})"
            );
        }
    }
    // Frames that need a gradient take candle's ops, and get it.
    let varmap = VarMap::new();
    let cfg = FrameEncoderConfig {
        side: 8,
        d_model: 3,
        seed: 5,
        append_dt: false,
        init: DenseInit::Lecun,
    };
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let enc = FrameEncoder::new(cfg, vb).unwrap();
    let x = candle_core::Var::from_tensor(&common::tensor(
        &frames(&mut rng, 2, 8, false),
        &[1, 2, 64],
        DType::F64,
        &Device::Cpu,
    ))
    .unwrap();
    let y = enc.forward_by_hand(&x, None, &GradSink::new()).unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(to_vec(grads.get(&x).unwrap()).iter().any(|v| *v != 0.0));
}
