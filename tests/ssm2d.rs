//! The 2-D SSM layer against a direct 2-D recurrence loop in f64, and its gradients.

mod common;

use candle_core::{DType, Device, Module};
use candle_nn::{VarBuilder, VarMap};
use common::{randn, rel_err, to_vec};
use myosotis::nn::{Ssm2d, Ssm2dConfig};

#[test]
fn equals_a_direct_two_dimensional_recurrence() {
    let (mut rng, _) = common::seeded_rng("equals_a_direct_two_dimensional_recurrence", 142);
    for directions in [1, 2, 4] {
        let (h, n, rows, cols, batch) = (2, 3, 4, 5, 2);
        let cfg = Ssm2dConfig {
            d_model: h,
            state: n,
            height: rows,
            width: cols,
            directions,
            seed: 9,
        };
        let varmap = VarMap::new();
        let layer = Ssm2d::new(
            cfg,
            VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
        )
        .unwrap();
        let x = randn(&mut rng, &[batch, rows * cols, h], DType::F64, &Device::Cpu);
        let got = to_vec(&layer.forward(&x).unwrap());
        let xs = to_vec(&x);
        let p = |name: &str| to_vec(varmap.data().lock().unwrap()[name].as_tensor());
        let d = p("d");
        let mut want: Vec<f64> = (0..batch * rows * cols * h)
            .map(|e| d[e % h] * xs[e])
            .collect();
        for k in 0..directions {
            let (a, b, c) = (
                p(&format!("dirs.{k}.a")),
                p(&format!("dirs.{k}.b")),
                p(&format!("dirs.{k}.c")),
            );
            let (flip_r, flip_c) = [(false, false), (false, true), (true, false), (true, true)][k];
            let at = |t: &[f64], m: usize, ch: usize, s: usize| t[(m * h + ch) * n + s];
            for bi in 0..batch {
                for ch in 0..h {
                    for s in 0..n {
                        let den1 = 1.0 + at(&a, 0, ch, s).abs() + at(&a, 1, ch, s).abs();
                        let den2 = 1.0 + at(&a, 2, ch, s).abs() + at(&a, 3, ch, s).abs();
                        let (a1, a2) = (at(&a, 0, ch, s) / den1, at(&a, 1, ch, s) / den1);
                        let (a3, a4) = (at(&a, 2, ch, s) / den2, at(&a, 3, ch, s) / den2);
                        let mut xh = vec![vec![0.0; cols]; rows];
                        let mut xv = vec![vec![0.0; cols]; rows];
                        let ri: Vec<usize> = if flip_r {
                            (0..rows).rev().collect()
                        } else {
                            (0..rows).collect()
                        };
                        let ci: Vec<usize> = if flip_c {
                            (0..cols).rev().collect()
                        } else {
                            (0..cols).collect()
                        };
                        for (si, &i) in ri.iter().enumerate() {
                            for (sj, &j) in ci.iter().enumerate() {
                                let u = xs[((bi * rows + i) * cols + j) * h + ch];
                                let (h_up, v_up) = if si > 0 {
                                    (xh[ri[si - 1]][j], xv[ri[si - 1]][j])
                                } else {
                                    (0.0, 0.0)
                                };
                                let (h_left, v_left) = if sj > 0 {
                                    (xh[i][ci[sj - 1]], xv[i][ci[sj - 1]])
                                } else {
                                    (0.0, 0.0)
                                };
                                xv[i][j] = a3 * h_up + a4 * v_up + at(&b, 1, ch, s) * u;
                                xh[i][j] = a1 * h_left + a2 * v_left + at(&b, 0, ch, s) * u;
                                want[((bi * rows + i) * cols + j) * h + ch] +=
                                    at(&c, 0, ch, s) * xh[i][j] + at(&c, 1, ch, s) * xv[i][j];
                            }
                        }
                    }
                }
            }
        }
        let e = rel_err(&got, &want);
        assert!(e < 1e-12, "error {e:e} with {directions} directions");
        let grads = layer
            .forward(&x)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        common::assert_all_gradients(&varmap, &grads, &[], "2-D SSM");
    }
}
