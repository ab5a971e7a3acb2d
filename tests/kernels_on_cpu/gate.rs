//! `gate_fwd_*` and `gate_bwd_*` of kernels/epilogue.cu through the harness: against an f64
//! reference (the sigmoid and the mask from `dropout_keep`) and bit for bit against the CPU
//! twin (the op's CPU path), in every dtype, with and without the residual and dropout.

use candle_core::{DType, Device};
use myosotis::ops::dropout_keep;
use myosotis::ops::epilogue::{cuda, gate, gate_backward, Activation, Epilogue};

use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order, test_dropout};
use crate::{assert_same, DTYPES};

/// (samples, length, features): one element, odd sizes, more elements than the grid's threads.
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 1), (2, 3, 5), (3, 7, 33), (4, 300, 100)];

#[test]
fn gate_kernels_match_the_reference_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("gate_kernels", 43);
    for (dtype, tol) in DTYPES {
        for (k, (b, l, h)) in SHAPES.into_iter().enumerate() {
            let n = b * l * h;
            let [f, z, r, g] =
                [2.0, 6.0, 1.0, 1.0].map(|a| round_to(&uniform(&mut rng, n, -a, a), dtype));
            let bias = round_to(&uniform(&mut rng, h, -1.0, 1.0), dtype);
            // The last: the site hash made by the kernels from the key word.
            for (residual, p, word) in [(true, 0.0, false), (false, 0.3, false), (true, 0.5, true)]
            {
                let what = format!(
                    "{dtype:?} {b} x {l} x {h}, residual {residual}, p {p}, key word {word}"
                );
                let drop = test_dropout(word, 0x9a7e, k as u64, 5, p);
                let dropout = (p > 0.0).then_some(drop);
                let e = Epilogue {
                    samples: b,
                    per_sample: l * h,
                    features: h,
                    activation: Activation::Identity,
                    dropout,
                };
                let mut ins: Vec<&[f64]> = vec![&f, &z, &bias];
                if residual {
                    ins.push(&r);
                }
                let fwd = cuda::gate_forward_plan(&e, residual, dtype).unwrap();
                let mut o = run_in_every_order(&fwd, dtype, &ins, seed).outputs;
                let (s, out) = (o.remove(1), o.remove(0));
                let bwd = cuda::gate_backward_plan(&e, dtype).unwrap();
                let mut d = run_in_every_order(&bwd, dtype, &[&f, &s, &g], seed).outputs;
                let (dz, df) = (d.remove(1), d.remove(0));
                // The reference: k from the mask op, f64 arithmetic.
                let keep = match dropout {
                    Some(d) => to_vec(
                        &dropout_keep(d.site_hash, 5, b, h, p, DType::F64, &Device::Cpu).unwrap(),
                    ),
                    None => vec![1.0; b * h],
                };
                let kf =
                    |i: usize| keep[i / (l * h) * h + i % h] * dropout.map_or(1.0, |d| d.scale());
                let [mut out_ref, mut s_ref, mut df_ref, mut dz_ref] = [0; 4].map(|_| vec![0.0; n]);
                for i in 0..n {
                    let s = 1.0 / (1.0 + (-(z[i] + bias[i % h])).exp());
                    s_ref[i] = s;
                    out_ref[i] = if residual { r[i] } else { 0.0 } + kf(i) * f[i] * s;
                    df_ref[i] = g[i] * kf(i) * s;
                    dz_ref[i] = g[i] * kf(i) * f[i] * s * (1.0 - s);
                }
                for (got, want, part) in [
                    (&out, &out_ref, "out"),
                    (&s, &s_ref, "s"),
                    (&df, &df_ref, "∂f"),
                    (&dz, &dz_ref, "∂z"),
                ] {
                    let e = rel_err(got, want);
                    assert!(e < tol, "{what}: {part} {e:e}");
                }
                // The CPU twin, bit for bit.
                let t = |v: &[f64], dims: &[usize]| tensor(v, dims, dtype, &Device::Cpu);
                let (ft, zt, bt) = (t(&f, &[b, l, h]), t(&z, &[b, l, h]), t(&bias, &[h]));
                let rt = t(&r, &[b, l, h]);
                let [o, st] = gate(&ft, &zt, &bt, residual.then_some(&rt), dropout).unwrap();
                assert_same(&out, &to_vec(&o), &format!("{what}: forward"));
                assert_same(&s, &to_vec(&st), &format!("{what}: s"));
                let [dft, dzt] = gate_backward(&ft, &st, dropout, &t(&g, &[b, l, h])).unwrap();
                assert_same(&df, &to_vec(&dft), &format!("{what}: ∂f"));
                assert_same(&dz, &to_vec(&dzt), &format!("{what}: ∂z"));
            }
        }
    }
}
