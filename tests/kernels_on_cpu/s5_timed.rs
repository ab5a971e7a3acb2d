//! `s5_timed_*` of kernels/s5_timed.cu through the harness: against an f64 loop (the forward,
//! ∂bu, and central differences of it for the parameters' sums), and bit for bit against the
//! CPU twin (the op's CPU path), ZOH and bilinear, with and without the eigenvalue clip.

use candle_core::{DType, Device};
use myosotis::ops::s5_timed::cuda::{backward_plans, forward_plan};
use myosotis::ops::s5_timed::{backward_cpu, forward_cpu};
use myosotis::ops::{s5_timed, s5_timed_backward, S5Discretization};
use nalgebra::Complex;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

type C = Complex<f64>;

/// The f64 loop: (Λ̄, k) of every sample and state, for parameters (re, im, log Δ) and
/// intervals `dt`.
fn discretised(params: &[f64], dt: &[f64], how: S5Discretization) -> Vec<(C, C)> {
    let p = params.len() / 3;
    let one = C::new(1.0, 0.0);
    let mut out = vec![];
    for &d in dt {
        for k in 0..p {
            let re = match how.clip_eigs {
                true => params[k].min(-1e-4),
                false => params[k],
            };
            let lam = C::new(re, params[p + k]);
            let step = d * params[2 * p + k].exp();
            out.push(match how.bilinear {
                true => {
                    let den = one - lam * step / 2.0;
                    ((one + lam * step / 2.0) / den, step / den)
                }
                false => {
                    let g = (lam * step).exp();
                    (g, (g - 1.0) / lam)
                }
            });
        }
    }
    out
}

/// [gate | v] by the loop.
fn reference(params: &[f64], dt: &[f64], bu: &[f64], how: S5Discretization) -> Vec<f64> {
    let (mut gate, mut v) = (vec![], vec![]);
    for (e, (g, k)) in discretised(params, dt, how).into_iter().enumerate() {
        let x = k * C::new(bu[2 * e], bu[2 * e + 1]);
        gate.extend([g.re, g.im]);
        v.extend([x.re, x.im]);
    }
    [gate, v].concat()
}

#[test]
fn s5_timed_kernels_match_the_loop_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("s5_timed_kernels", 25);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        // One sample and state; states over a warp's 32 lanes; rows over many blocks; more
        // rows than 1,024 blocks of 8 (blocks of several slots' runs).
        for (n, p) in [(1, 1), (5, 3), (300, 33), (9000, 2)] {
            for (bilinear, clip_eigs) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let how = S5Discretization {
                    bilinear,
                    clip_eigs,
                };
                let what = format!("s5_timed {dtype:?} N {n} P {p} {how:?}");
                let mut re = uniform(&mut rng, p, -2.0, -0.05);
                if clip_eigs {
                    re[0] = 0.25;
                }
                let im = uniform(&mut rng, p, -3.0, 3.0);
                let log_dt = uniform(&mut rng, p, -4.0, -1.0);
                let params = round_to(&[re, im, log_dt].concat(), dtype);
                let dt = round_to(&uniform(&mut rng, n, 0.2, 5.0), dtype);
                let bu = round_to(&uniform(&mut rng, 2 * n * p, -1.0, 1.0), dtype);
                let g = round_to(&uniform(&mut rng, 4 * n * p, -1.0, 1.0), dtype);
                let (gg, gv) = g.split_at(2 * n * p);
                let ps = [&params[..p], &params[p..2 * p], &params[2 * p..]];
                let fwd = forward_plan(n, p, how, dtype).unwrap();
                let out = run_in_every_order(&fwd, dtype, &[ps[0], ps[1], ps[2], &dt, &bu], seed)
                    .outputs
                    .remove(0);
                let [rows, sums] = backward_plans(n, p, how, dtype).unwrap();
                let inputs = [ps[0], ps[1], ps[2], &dt[..], &bu[..], gg, gv];
                let mut back = run_in_every_order(&rows, dtype, &inputs, seed).outputs;
                let part = back.remove(1);
                let d = run_in_every_order(&sums, dtype, &[&part], seed)
                    .outputs
                    .remove(0);
                let dbu = back.remove(0);
                // The f64 loop.
                let want = reference(&params, &dt, &bu, how);
                assert!(rel_err(&out, &want) < tol, "{what}: forward");
                let dbu_ref: Vec<f64> = discretised(&params, &dt, how)
                    .into_iter()
                    .enumerate()
                    .flat_map(|(e, (_, k))| {
                        let x = k.conj() * C::new(gv[2 * e], gv[2 * e + 1]);
                        [x.re, x.im]
                    })
                    .collect();
                assert!(rel_err(&dbu, &dbu_ref) < tol, "{what}: ∂bu");
                if dtype == DType::F64 && n < 1000 {
                    // Central differences of Σ g ⊙ [gate | v] for each parameter.
                    let loss = |q: &[f64]| -> f64 {
                        let y = reference(q, &dt, &bu, how);
                        y.iter().zip(&g).map(|(a, b)| a * b).sum()
                    };
                    for i in 0..3 * p {
                        if clip_eigs && i == 0 {
                            continue; // the clip's kink: the gradient is zero past it
                        }
                        let (mut up, mut down) = (params.clone(), params.clone());
                        up[i] += 1e-6;
                        down[i] -= 1e-6;
                        let fd = (loss(&up) - loss(&down)) / 2e-6;
                        assert!(
                            (d[i] - fd).abs() < 1e-6 * (1.0 + fd.abs()),
                            "{what}: parameter {i}: {} vs {fd}",
                            d[i]
                        );
                    }
                    if clip_eigs {
                        assert_eq!(d[0], 0.0, "{what}: λ_re past the clip");
                    }
                }
                // The CPU twin, directly (in f64) and through the op (in the dtype).
                if dtype == DType::F64 {
                    let twin = forward_cpu(ps, &dt, &bu, how);
                    assert_same(&out, &twin, &format!("{what}: forward"));
                    let (tdbu, td) = backward_cpu(ps, &dt, &bu, how, gg, gv);
                    assert_same(&dbu, &tdbu, &format!("{what}: ∂bu"));
                    assert_same(&d, &td, &format!("{what}: parameters"));
                }
                let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, &Device::Cpu);
                let pt = [t(ps[0], &[p]), t(ps[1], &[p]), t(ps[2], &[p])];
                let pr = [&pt[0], &pt[1], &pt[2]];
                let (dtt, but) = (t(&dt, &[n]), t(&bu, &[n, p, 2]));
                let (gate, v) = s5_timed(pr, &dtt, &but, how).unwrap();
                let op = [to_vec(&gate), to_vec(&v)].concat();
                assert_same(&out, &op, &format!("{what}: forward, the op"));
                let (ggt, gvt) = (t(gg, &[n, p, 2]), t(gv, &[n, p, 2]));
                let (obu, od) = s5_timed_backward(pr, &dtt, &but, how, &ggt, &gvt).unwrap();
                assert_same(&dbu, &to_vec(&obu), &format!("{what}: ∂bu, the op"));
                let od: Vec<f64> = od.iter().flat_map(to_vec).collect();
                assert_same(&d, &od, &format!("{what}: parameters, the op"));
            }
        }
    }
}
