//! `epilogue_fwd_*` and `epilogue_bwd_*` of kernels/epilogue.cu through the harness: against an
//! f64 reference (GELU with tanh itself, the mask from `dropout_keep`) in every dtype, and bit
//! for bit against the CPU twin (the op's CPU path, ∂y through candle's autograd), with and
//! without the activation, the residual and dropout.

use candle_core::{DType, Device, Var};
use myosotis::ops::dropout_keep;
use myosotis::ops::epilogue::{cuda, epilogue, Activation, Epilogue};

use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order, test_dropout};
use crate::{assert_same, DTYPES};

/// (samples, length, features): one element, odd sizes, a feature width above a warp, and more
/// elements than the grid's threads (each thread then takes several).
const SHAPES: [(usize, usize, usize); 5] = [
    (1, 1, 1),
    (2, 3, 5),
    (3, 7, 33),
    (16, 50, 64),
    (4, 300, 1000),
];

/// f64 GELU and its slope, with tanh itself.
fn gelu_ref(x: f64) -> (f64, f64) {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x.powi(3))).tanh();
    let slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
    (0.5 * x * (1.0 + t), slope)
}

#[test]
fn epilogue_kernels_match_the_reference_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("epilogue_kernels", 41);
    for (dtype, tol) in DTYPES {
        for (k, (b, l, h)) in SHAPES.into_iter().enumerate() {
            // The largest shape in f32 only, all four variants.
            if k + 1 == SHAPES.len() && dtype != DType::F32 {
                continue;
            }
            let n = b * l * h;
            let y = round_to(&uniform(&mut rng, n, -4.0, 4.0), dtype);
            let r = round_to(&uniform(&mut rng, n, -1.0, 1.0), dtype);
            let g = round_to(&uniform(&mut rng, n, -1.0, 1.0), dtype);
            // The last: the site hash made by the kernels from the key word.
            for (act, residual, p, word) in [
                (Activation::Gelu, true, 0.0, false),
                (Activation::Gelu, false, 0.3, false),
                (Activation::Identity, true, 0.5, false),
                (Activation::Gelu, true, 0.1, true),
            ] {
                let what = format!(
                    "{dtype:?} {b} x {l} x {h}, {act:?}, residual {residual}, p {p}, key word \
                     {word}"
                );
                let drop = test_dropout(word, 0x5eed, k as u64, 3, p);
                let e = Epilogue {
                    samples: b,
                    per_sample: l * h,
                    features: h,
                    activation: act,
                    dropout: (p > 0.0).then_some(drop),
                };
                let mut ins: Vec<&[f64]> = vec![&y];
                if residual {
                    ins.push(&r);
                }
                let fwd = cuda::forward_plan(&e, residual, dtype).unwrap();
                let out = run_in_every_order(&fwd, dtype, &ins, seed)
                    .outputs
                    .remove(0);
                let bwd = cuda::backward_plan(&e, dtype).unwrap();
                let dy = run_in_every_order(&bwd, dtype, &[&y, &g], seed)
                    .outputs
                    .remove(0);
                // The reference: k from the mask op, f64 arithmetic.
                let keep = match p > 0.0 {
                    true => to_vec(
                        &dropout_keep(drop.site_hash, 3, b, h, p, DType::F64, &Device::Cpu)
                            .unwrap(),
                    ),
                    false => vec![1.0; b * h],
                };
                let kf = |i: usize| {
                    keep[i / (l * h) * h + i % h] * if p > 0.0 { drop.scale() } else { 1.0 }
                };
                let (mut out_ref, mut dy_ref) = (vec![0.0; n], vec![0.0; n]);
                for i in 0..n {
                    let (v, s) = match act {
                        Activation::Gelu => gelu_ref(y[i]),
                        Activation::Identity => (y[i], 1.0),
                    };
                    out_ref[i] = if residual { r[i] } else { 0.0 } + kf(i) * v;
                    dy_ref[i] = g[i] * kf(i) * s;
                }
                let scale = |v: &[f64]| v.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
                let err = |got: &[f64], want: &[f64]| {
                    rel_err(got, want) * scale(want) / scale(&g).max(scale(&y).min(4.0))
                };
                assert!(
                    err(&out, &out_ref) < tol,
                    "{what}: forward {:e}",
                    err(&out, &out_ref)
                );
                assert!(
                    err(&dy, &dy_ref) < tol,
                    "{what}: backward {:e}",
                    err(&dy, &dy_ref)
                );
                let cpu = Device::Cpu;
                let yv = Var::from_tensor(&tensor(&y, &[b, l, h], dtype, &cpu)).unwrap();
                let rv = Var::from_tensor(&tensor(&r, &[b, l, h], dtype, &cpu)).unwrap();
                let res = residual.then_some(rv.as_tensor());
                let o = epilogue(yv.as_tensor(), res, act, e.dropout).unwrap();
                assert_same(&out, &to_vec(&o), &format!("{what}: forward"));
                let gt = tensor(&g, &[b, l, h], dtype, &cpu);
                let grads = (o * &gt).unwrap().sum_all().unwrap().backward().unwrap();
                assert_same(
                    &dy,
                    &to_vec(grads.get(&yv).unwrap()),
                    &format!("{what}: ∂y"),
                );
                if residual {
                    assert_same(&g, &to_vec(grads.get(&rv).unwrap()), &format!("{what}: ∂r"));
                }
            }
        }
    }
}
