//! `adamw_step_*` of kernels/adamw.cu through the harness, against an f64 reference written
//! from the AdamW formula and, bit for bit, the CPU twin.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::adamw::cuda::step_plan;
use myosotis::ops::{adamw_step, AdamwHyper};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec};
use crate::exec::{round_to, run_in_place_in_every_order};

/// Random inputs of n elements: θ, m, v (≥ 0), g, the scale and the hyper-parameter row.
struct Inputs {
    theta: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    scale: Option<f64>,
    hyper: AdamwHyper,
}

impl Inputs {
    fn random(n: usize, scaled: bool, rng: &mut impl Rng) -> Inputs {
        let mut draw = |lo: f64, hi: f64| (0..n).map(|_| rng.random_range(lo..hi)).collect();
        let (theta, m, v, g) = (
            draw(-1.0, 1.0),
            draw(-0.1, 0.1),
            draw(0.0, 0.01),
            draw(-1.0, 1.0),
        );
        let t = rng.random_range(1..200);
        let (beta1, beta2) = (0.9, 0.999);
        Inputs {
            theta,
            m,
            v,
            g,
            scale: scaled.then(|| rng.random_range(0.1..1.0)),
            hyper: AdamwHyper {
                beta1,
                beta2,
                c1: 1.0 - f64::powi(beta1, t),
                c2: 1.0 - f64::powi(beta2, t),
                eps: 1e-8,
                lr: rng.random_range(1e-4..1e-2),
                weight_decay: rng.random_range(0.0..0.1),
            },
        }
    }

    /// The row of [`AdamwHyper::to_tensor`]: the hyper-parameters and the scale (or 1).
    fn row(&self) -> Vec<f64> {
        let h = self.hyper;
        let s = self.scale.unwrap_or(1.0);
        vec![h.beta1, h.beta2, h.c1, h.c2, h.eps, h.lr, h.weight_decay, s]
    }

    /// The inputs as the kernels see them, every value rounded to `dtype`: θ, [m; v], g, the row.
    fn rounded(&self, dtype: DType) -> [Vec<f64>; 4] {
        let mv: Vec<f64> = self.m.iter().chain(&self.v).copied().collect();
        [&self.theta, &mv, &self.g, &self.row()].map(|x| round_to(x, dtype))
    }
}

/// [m'; v'; θ'] in f64 from (rounded) inputs, element by element.
fn reference([theta, mv, g, h]: &[Vec<f64>; 4]) -> Vec<f64> {
    let (b1, b2, c1, c2, eps, lr, wd, s) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    let n = theta.len();
    let mut out = vec![0.0; 3 * n];
    for e in 0..n {
        let gs = g[e] * s;
        out[e] = b1 * mv[e] + (1.0 - b1) * gs;
        out[n + e] = b2 * mv[n + e] + (1.0 - b2) * gs * gs;
        let update = (out[e] / c1) / ((out[n + e] / c2).sqrt() + eps);
        out[2 * n + e] = theta[e] - lr * update - lr * wd * theta[e];
    }
    out
}

/// [m'; v'; θ'] from the CPU twin on the same rounded inputs, the clipping scale passed as a
/// tensor as the optimiser does.
fn twin([theta, mv, g, h]: &[Vec<f64>; 4], scaled: bool, dtype: DType) -> Vec<f64> {
    let n = theta.len();
    let t = |v: &[f64], shape: &[usize]| tensor(v, shape, dtype, &Device::Cpu);
    let (theta, mv, g) = (t(theta, &[n]), t(mv, &[2, n]), t(g, &[n]));
    let hyper = AdamwHyper {
        beta1: h[0],
        beta2: h[1],
        c1: h[2],
        c2: h[3],
        eps: h[4],
        lr: h[5],
        weight_decay: h[6],
    };
    let scale = scaled.then(|| t(&h[7..], &[1]));
    let row = hyper
        .to_tensor(scale.as_ref(), dtype, &Device::Cpu)
        .unwrap();
    assert_eq!(to_vec(&row), *h);
    adamw_step(&theta, &mv, &g, &row).unwrap();
    to_vec(&Tensor::cat(&[mv.flatten_all().unwrap(), theta], 0).unwrap())
}

fn check(n: usize, scaled: bool, dtype: DType, tol: f64, rng: &mut impl Rng) {
    let what = format!("n = {n}, scaled {scaled}, {dtype:?}");
    let x = Inputs::random(n, scaled, rng).rounded(dtype);
    let [theta, mv, g, h] = &x;
    let run = run_in_place_in_every_order(
        &step_plan(n, dtype).unwrap(),
        dtype,
        &[theta, mv],
        &[g, h],
        5,
    );
    assert_eq!((run.status, run.outputs.len()), (0, 2), "{what}");
    let got: Vec<f64> = run.outputs[1]
        .iter()
        .chain(&run.outputs[0])
        .copied()
        .collect();
    let want = reference(&x);
    // Each third on its own scale (v is about 1e-3 of θ).
    for (k, part) in ["m'", "v'", "θ'"].iter().enumerate() {
        let r = k * n..(k + 1) * n;
        let e = rel_err(&got[r.clone()], &want[r]);
        assert!(e < tol, "{part} vs the f64 formula: {e:e}, {what}");
    }
    assert_same(&got, &twin(&x, scaled, dtype), &what);
}

/// Sizes from one element to more than the grid's threads (each thread then takes several),
/// with and without a clipping scale, in f32 and f64.
#[test]
fn adamw_kernels_match_the_formula_and_the_cpu_twin() {
    let (mut rng, _) = seeded_rng("adamw kernels", 3);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for n in [1, 7, 300, 4097] {
            for scaled in [false, true] {
                check(n, scaled, dtype, tol, &mut rng);
            }
        }
        let n = 1_100_000;
        assert!(step_plan(n, dtype).unwrap().grid[0] * 256 < n as u32);
        check(n, true, dtype, tol, &mut rng);
    }
}

/// The optimiser's state is updated where it is, and bad operands are refused with the
/// operand named.
#[test]
fn adamw_step_updates_in_place_and_checks_its_operands() {
    let dev = Device::Cpu;
    let theta = Tensor::ones(5, DType::F32, &dev).unwrap();
    let mv = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    let g = Tensor::ones(5, DType::F32, &dev).unwrap();
    let hyper = AdamwHyper {
        beta1: 0.9,
        beta2: 0.999,
        c1: 0.1,
        c2: 0.001,
        eps: 1e-8,
        lr: 0.1,
        weight_decay: 0.0,
    };
    let row = hyper.to_tensor(None, DType::F32, &dev).unwrap();
    let (view, mv_view) = (theta.clone(), mv.clone());
    adamw_step(&theta, &mv, &g, &row).unwrap();
    // A clone shares the storage: it sees the step (θ − η · 1 = 0.9; m = 0.1).
    assert!((to_vec(&view)[0] - 0.9).abs() < 1e-6);
    assert!((to_vec(&mv_view)[0] - 0.1).abs() < 1e-6);
    let err = |r: candle_core::Result<()>| r.unwrap_err().to_string();
    let short = Tensor::zeros(4, DType::F32, &dev).unwrap();
    assert!(err(adamw_step(&theta, &mv, &short, &row)).contains("the gradient"));
    assert!(err(adamw_step(&theta, &g, &g, &row)).contains("the moments"));
    let f64_row = hyper.to_tensor(None, DType::F64, &dev).unwrap();
    assert!(err(adamw_step(&theta, &mv, &g, &f64_row)).contains("hyper-parameter row"));
    let strided = Tensor::zeros((5, 2), DType::F32, &dev)
        .unwrap()
        .t()
        .unwrap();
    assert!(err(adamw_step(&theta, &strided, &g, &row)).contains("contiguous"));
}
