//! The losses by hand (one node of candle's graph each) against candle's autograd.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{randn, to_vec};

/// The labels' negative log-likelihood by hand (the fused op) has the values of candle's ops to
/// 1e-14, the same count of correct rows (ties included), and their gradient to 1e-12 (f64,
/// awkward shapes, any incoming gradient).
#[test]
fn nll_by_hand_equals_autograd() {
    use candle_core::Var;
    use myosotis::nn::loss::log_softmax_nll;
    let (mut rng, seed) = common::seeded_rng("nll by hand", 134);
    for (rows, classes) in [(1, 2), (7, 10), (33, 3)] {
        let logits =
            Var::from_tensor(&randn(&mut rng, &[rows, classes], DType::F64, &Device::Cpu)).unwrap();
        let labels: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 7 + 1) % classes as u32)
            .collect();
        let labels = Tensor::new(labels, &Device::Cpu).unwrap();
        if rows > 1 {
            // A tie for the first row's largest logit.
            let mut v = to_vec(logits.as_tensor());
            v[1] = v[0].max(v[1]) + 1.0;
            v[0] = v[1];
            logits
                .set(&Tensor::from_vec(v, (rows, classes), &Device::Cpu).unwrap())
                .unwrap();
        }
        let run = |by_hand: bool| {
            let nll = log_softmax_nll(logits.as_tensor(), &labels, by_hand).unwrap();
            let grads = (&nll.loss * 1.7).unwrap().backward().unwrap();
            let g = to_vec(grads.get(&logits).unwrap());
            let values = [to_vec(&nll.logp), to_vec(&nll.loss)].concat();
            (values, nll.correct.to_scalar::<f64>().unwrap(), g)
        };
        let ((v, c, g), (v_h, c_h, g_h)) = (run(false), run(true));
        let e = common::rel_err(&v_h, &v);
        assert!(e < 1e-14, "values: {e:e}, ({rows}, {classes}), seed {seed}");
        assert_eq!(c_h, c, "correct rows, ({rows}, {classes}), seed {seed}");
        let loss = || {
            log_softmax_nll(logits.as_tensor(), &labels, true)
                .unwrap()
                .loss
        };
        common::assert_central_differences(
            &[("logits", &logits)],
            &loss().backward().unwrap(),
            || loss().to_scalar::<f64>().unwrap(),
            &format!("({rows}, {classes}), seed {seed}"),
        );
        let e = common::rel_err(&g_h, &g);
        assert!(
            e < 1e-12,
            "gradient by hand: {e:e}, ({rows}, {classes}), seed {seed}"
        );
    }
}

/// The Gaussian decoder's negative log-likelihood by hand: the same values as candle's ops, and
/// their gradient to 1e-12 (f64, variances below the least one included) and, where none is,
/// to central differences (whose steps would cross the bound).
#[test]
fn gaussian_nll_by_hand_equals_autograd() {
    use candle_core::Var;
    use myosotis::nn::loss::gaussian_nll;
    let (mut rng, seed) = common::seeded_rng("gaussian nll by hand", 136);
    let shapes = [(vec![1, 1], 1), (vec![3, 7], 2), (vec![2, 5], 3)];
    for ((shape, k), low) in shapes
        .into_iter()
        .flat_map(|c| [(c.clone(), false), (c, true)])
    {
        let n: usize = shape.iter().product();
        let mut out = to_vec(&randn(&mut rng, &[n, 2 * k], DType::F64, &Device::Cpu));
        for (i, v) in out.iter_mut().enumerate() {
            if i % (2 * k) >= k {
                // Variances: positive, and (`low`) every fifth below the least one read, 1e-6.
                *v = if low && i % 5 == 0 {
                    1e-8
                } else {
                    0.3 + v.abs()
                };
            }
        }
        let dims = [&shape[..], &[2 * k]].concat();
        let out = Var::from_tensor(&common::tensor(&out, &dims, DType::F64, &Device::Cpu)).unwrap();
        let y = randn(
            &mut rng,
            &[&shape[..], &[k]].concat(),
            DType::F64,
            &Device::Cpu,
        );
        let run = |by_hand: bool| {
            let nll = gaussian_nll(out.as_tensor(), &y, by_hand).unwrap();
            let grads = (&nll.objective * 1.7).unwrap().backward().unwrap();
            let g = to_vec(grads.get(&out).unwrap());
            ([to_vec(&nll.objective), to_vec(&nll.mse)].concat(), g)
        };
        let ((v, g), (v_h, g_h)) = (run(false), run(true));
        assert_eq!(v_h, v, "values, {shape:?}, seed {seed}");
        let e = common::rel_err(&g_h, &g);
        assert!(e < 1e-12, "gradient by hand: {e:e}, {shape:?}, seed {seed}");
        if low {
            continue;
        }
        let objective = || gaussian_nll(out.as_tensor(), &y, true).unwrap().objective;
        common::assert_central_differences(
            &[("out", &out)],
            &objective().backward().unwrap(),
            || objective().to_scalar::<f64>().unwrap(),
            &format!("{shape:?}, seed {seed}"),
        );
    }
}
