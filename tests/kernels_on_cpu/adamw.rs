//! `adamw_step_*` of kernels/adamw.cu through the harness, against an f64 reference written
//! from the AdamW formula and, bit for bit, the CPU twin.

use candle_core::{DType, Device};
use myosotis::ops::adamw::cuda::step_plan;
use myosotis::ops::{adamw_step, AdamwHyper};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec};
use crate::exec::{round_to, run, run_in_every_order, HostRun};

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

    fn row(&self) -> Vec<f64> {
        let h = self.hyper;
        vec![h.beta1, h.beta2, h.c1, h.c2, h.eps, h.lr, h.weight_decay]
    }

    /// The inputs as the kernel sees them: every value rounded to `dtype`.
    fn rounded(&self, dtype: DType) -> Vec<Vec<f64>> {
        let mut all = vec![&self.theta, &self.m, &self.v, &self.g]
            .into_iter()
            .map(|x| round_to(x, dtype))
            .collect::<Vec<_>>();
        if let Some(s) = self.scale {
            all.push(round_to(&[s], dtype));
        }
        all.push(round_to(&self.row(), dtype));
        all
    }
}

/// [m'; v'; θ'] in f64 from (rounded) inputs, element by element.
fn reference(x: &[Vec<f64>], scaled: bool) -> Vec<f64> {
    let (theta, m, v, g) = (&x[0], &x[1], &x[2], &x[3]);
    let s = if scaled { x[4][0] } else { 1.0 };
    let h = x.last().unwrap();
    let (b1, b2, c1, c2, eps, lr, wd) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    let n = theta.len();
    let mut out = vec![0.0; 3 * n];
    for e in 0..n {
        let gs = g[e] * s;
        out[e] = b1 * m[e] + (1.0 - b1) * gs;
        out[n + e] = b2 * v[e] + (1.0 - b2) * gs * gs;
        let update = (out[e] / c1) / ((out[n + e] / c2).sqrt() + eps);
        out[2 * n + e] = theta[e] - lr * update - lr * wd * theta[e];
    }
    out
}

/// The CPU twin on the same rounded inputs.
fn twin(x: &[Vec<f64>], scaled: bool, dtype: DType) -> Vec<f64> {
    let n = x[0].len();
    let t = |v: &[f64], len: usize| tensor(v, &[len], dtype, &Device::Cpu);
    let (theta, m, v, g) = (t(&x[0], n), t(&x[1], n), t(&x[2], n), t(&x[3], n));
    let scale = scaled.then(|| t(&x[4], 1));
    let hyper = t(x.last().unwrap(), 7);
    to_vec(&adamw_step(&theta, &m, &v, &g, scale.as_ref(), &hyper).unwrap())
}

fn check(n: usize, scaled: bool, dtype: DType, tol: f64, every_order: bool, rng: &mut impl Rng) {
    let what = format!("n = {n}, scaled {scaled}, {dtype:?}");
    let x = Inputs::random(n, scaled, rng).rounded(dtype);
    let plan = step_plan(n, scaled, dtype).unwrap();
    let inputs: Vec<&[f64]> = x.iter().map(|v| v.as_slice()).collect();
    let HostRun {
        mut outputs,
        status,
    } = match every_order {
        true => run_in_every_order(&plan, dtype, &inputs, 5),
        false => run(&plan, dtype, &inputs, kernels_on_cpu::Order::Descending).unwrap(),
    };
    assert_eq!(status, 0, "{what}");
    let got = outputs.remove(0);
    let want = reference(&x, scaled);
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
                check(n, scaled, dtype, tol, true, &mut rng);
            }
        }
        let n = 1_100_000;
        assert!(step_plan(n, false, dtype).unwrap().grid[0] * 256 < n as u32);
        check(n, true, dtype, tol, false, &mut rng);
    }
}
