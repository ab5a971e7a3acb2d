//! The fused GELU, LayerNorm, BatchNorm, channel, block epilogue, GLU gate, loss, embedding,
//! row-gather and S5 discretisation (per state and per sample) ops and the strided products
//! (`gemm`) on CUDA against their CPU twins (f32 and f64, up to the GPU's fused multiply-adds;
//! GELU, LayerNorm, BatchNorm, the channel ops, the epilogue, the gate, S5's discretisation
//! and the masked mean in f16 and bf16 too, up to a unit in the last place; S5's readout
//! exactly in every dtype),
//! and GELU in f16/bf16 against the f32 CPU op, forward and gradients, on awkward shapes.
//! Compiled with `--features cuda` (CI compiles them); each test prints why it is skipped when
//! no CUDA device can be opened.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use myosotis::ops::batch_norm::stats_dtype;
use myosotis::ops::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    channel_add, channel_mul, column_stats, gelu, gemm, gemm_relaid, layer_norm, s5_discretize,
    s5_discretize_backward, s5_discretize_untracked, s5_readout, Mat, S5Discretization,
};

/// Each of the outputs `got` within `tol` of `want`'s, relative to its largest value (`what`
/// names the case in a failure).
fn assert_close(got: &[Vec<f64>], want: &[Vec<f64>], tol: f64, what: &str) {
    for (k, (a, b)) in got.iter().zip(want).enumerate() {
        let e = rel_err(a, b);
        assert!(e <= tol, "{what}: output {k} differs by {e:e}");
    }
}

const SHAPES: [(usize, usize); 6] = [(1, 1), (3, 5), (9, 33), (50, 128), (1000, 3), (4100, 96)];

/// The op's output and the gradients of Σ g ⊙ op(inputs), on `dev` in `dtype`.
fn run(
    op: &dyn Fn(&[Tensor]) -> Tensor,
    inputs: &[(Vec<f64>, Vec<usize>)],
    g: &[f64],
    dev: &Device,
    dtype: DType,
) -> Vec<Vec<f64>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|(v, s)| Var::from_tensor(&tensor(v, s, dtype, dev)).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts);
    let gt = tensor(g, y.dims(), dtype, dev);
    let grads = (&y * gt).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![to_vec(&y)];
    out.extend(
        vars.iter()
            .map(|v| to_vec(grads.get(v).expect("a gradient"))),
    );
    out
}

/// Every float dtype: f16 and bf16 compute in f32 on both devices and may round apart by one
/// unit in the last place of what they store.
const EVERY: [(DType, f64); 4] = [
    (DType::F64, 1e-12),
    (DType::F32, 1e-5),
    (DType::F16, 2e-3),
    (DType::BF16, 1.6e-2),
];

/// An op's outputs and gradients on CUDA against the CPU's in `dtypes` (bf16 where the
/// kernels are built for it).
fn check_in(
    name: &str,
    op: &dyn Fn(&[Tensor]) -> Tensor,
    widths: &dyn Fn(usize, usize) -> Vec<Vec<usize>>,
    dtypes: &[(DType, f64)],
) {
    let Some(gpu) = gpu(name) else { return };
    let dtypes: Vec<(DType, f64)> = dtypes
        .iter()
        .copied()
        .filter(|d| d.0 != DType::BF16 || cuda_bf16(name))
        .collect();
    let (mut rng, _) = seeded_rng(name, 31);
    for (rows, h) in SHAPES {
        let shapes = widths(rows, h);
        let inputs: Vec<(Vec<f64>, Vec<usize>)> = shapes
            .iter()
            .map(|s| (uniform(&mut rng, s.iter().product(), -2.0, 2.0), s.clone()))
            .collect();
        let g = uniform(&mut rng, rows * h, -1.0, 1.0);
        for &(dtype, tol) in &dtypes {
            let want = run(op, &inputs, &g, &Device::Cpu, dtype);
            let got = run(op, &inputs, &g, &gpu, dtype);
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                // Relative to values of order one: a width-1 norm's gradient is zero on the CPU
                // and the GPU's fused multiply-add leaves rounding there.
                let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
                let e = rel_err(a, b) * (scale + 1e-30) / scale.max(1.0);
                assert!(
                    e < tol,
                    "{name} {dtype:?} {rows} x {h}: output {k} differs by {e:e}"
                );
            }
        }
    }
}

#[test]
fn cuda_gelu() {
    check_in(
        "cuda_gelu",
        &|t| gelu(&t[0]).unwrap(),
        &|r, h| vec![vec![r, h]],
        &EVERY,
    );
    // f16/bf16 on CUDA against f32 on the CPU.
    let Some(gpu) = gpu("cuda_gelu") else { return };
    let (mut rng, _) = seeded_rng("cuda_gelu_half", 32);
    let x = uniform(&mut rng, 5000, -5.0, 5.0);
    let g = uniform(&mut rng, 5000, -1.0, 1.0);
    let op = |t: &[Tensor]| gelu(&t[0]).unwrap();
    let half = [(DType::F16, 4e-3), (DType::BF16, 2e-2)];
    for (dtype, tol) in half
        .into_iter()
        .filter(|h| h.0 != DType::BF16 || cuda_bf16("cuda_gelu"))
    {
        let xr = to_vec(&tensor(&x, &[5000], dtype, &Device::Cpu));
        let gr = to_vec(&tensor(&g, &[5000], dtype, &Device::Cpu));
        let inputs = [(xr, vec![5000])];
        let want = run(&op, &inputs, &gr, &Device::Cpu, DType::F32);
        let got = run(&op, &inputs, &gr, &gpu, dtype);
        assert_close(&got, &want, tol, &format!("gelu {dtype:?}"));
    }
}

#[test]
fn cuda_layer_norm() {
    check_in(
        "cuda_layer_norm",
        &|t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        &|r, h| vec![vec![r, h], vec![h], vec![h]],
        &EVERY,
    );
}

#[test]
fn cuda_channel_ops() {
    check_in(
        "cuda_channel_add",
        &|t| channel_add(&t[0], &t[1]).unwrap(),
        &|r, h| vec![vec![r, h], vec![h]],
        &EVERY,
    );
    check_in(
        "cuda_channel_mul",
        &|t| channel_mul(&t[0], &t[1]).unwrap(),
        &|r, h| vec![vec![r, h], vec![h]],
        &EVERY,
    );
}

/// BatchNorm's fused training ops (no autograd: the backward is their own), the statistics
/// chained as the layer chains them, and the running averages updated from them; f16 and bf16
/// rows with f32 statistics.
#[test]
fn cuda_batch_norm() {
    let Some(gpu) = gpu("cuda_batch_norm") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_batch_norm", 37);
    let eps = 1e-5;
    for (rows, h) in SHAPES {
        let x = uniform(&mut rng, rows * h, 1.0, 4.0);
        let (w, b) = (
            uniform(&mut rng, h, 0.5, 1.5),
            uniform(&mut rng, h, -1.0, 1.0),
        );
        let g = uniform(&mut rng, rows * h, -1.0, 1.0);
        let run = |dev: &Device, dtype: DType| -> Vec<Vec<f64>> {
            let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, dev);
            let (x, g, w, b) = (
                t(&x, &[rows, h]),
                t(&g, &[rows, h]),
                t(&w, &[h]),
                t(&b, &[h]),
            );
            let n = tensor(&[rows as f64], &[1], stats_dtype(dtype), dev);
            let mean = column_stats(&x, None).unwrap().broadcast_div(&n).unwrap();
            let var = column_stats(&x, Some(&mean))
                .unwrap()
                .broadcast_div(&n)
                .unwrap();
            let y = batch_norm_apply(&x, &mean, &var, &w, &b, eps).unwrap();
            let [dw, db] = batch_norm_backward_stats(&x, &mean, &var, &g, eps).unwrap();
            let dx = batch_norm_backward(&x, &mean, &var, &w, &g, &dw, &db, &n, eps).unwrap();
            let running = [w.copy().unwrap(), b.copy().unwrap()];
            batch_norm_running([&running[0], &running[1]], &mean, &var, &n, 0.9).unwrap();
            let [rm, rv] = running;
            [mean, var, y, dw, db, dx, rm, rv]
                .iter()
                .map(to_vec)
                .collect()
        };
        let dtypes = [
            (DType::F64, 1e-12),
            (DType::F32, 1e-5),
            (DType::F16, 2e-3),
            (DType::BF16, 1e-2),
        ];
        for (dtype, tol) in dtypes {
            let (want, got) = (run(&Device::Cpu, dtype), run(&gpu, dtype));
            let names = ["μ", "σ²", "y", "∂γ", "∂β", "∂x", "running μ", "running σ²"];
            for (k, name) in names.iter().enumerate() {
                let e = rel_err(&got[k], &want[k]);
                assert!(
                    e < tol,
                    "batch_norm {dtype:?} {rows} x {h}: {name} differs by {e:e}"
                );
            }
        }
    }
}

#[test]
fn cuda_s5_discretize() {
    let Some(gpu) = gpu("cuda_s5_discretize") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_s5_discretize", 33);
    let bf16 = cuda_bf16("cuda_s5_discretize");
    for (p, h) in [(1, 1), (3, 5), (16, 130), (384, 512)] {
        for (bilinear, clip_eigs) in [(false, false), (false, true), (true, false), (true, true)] {
            let how = S5Discretization {
                bilinear,
                clip_eigs,
            };
            let mut re = uniform(&mut rng, p, -2.0, -0.05);
            re[0] = 0.25;
            let inputs = [
                (re, vec![p]),
                (uniform(&mut rng, p, -3.0, 3.0), vec![p]),
                (uniform(&mut rng, p, -6.0, -1.0), vec![p]),
                (uniform(&mut rng, p * h * 2, -1.0, 1.0), vec![p, h, 2]),
            ];
            let g = uniform(&mut rng, 2 * p + 2 * p * h, -1.0, 1.0);
            let op = |t: &[Tensor]| {
                let (gate, bmat) = s5_discretize(&t[0], &t[1], &t[2], &t[3], how).unwrap();
                Tensor::cat(
                    &[gate.flatten_all().unwrap(), bmat.flatten_all().unwrap()],
                    0,
                )
                .unwrap()
            };
            // f32: ∂λ sums H products with cancellation, added with fused multiply-adds on the
            // GPU and without on the CPU (1.9e-5 seen at H = 512).
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4)] {
                let want = run(&op, &inputs, &g, &Device::Cpu, dtype);
                let got = run(&op, &inputs, &g, &gpu, dtype);
                let what = format!("s5_discretize {dtype:?} P {p} H {h} {how:?}");
                assert_close(&got, &want, tol, &what);
            }
            // f16 and bf16, as the layers by hand take them (outside candle's graph): computed
            // in f32, so the devices differ by the f32 results' differences, rounded (a unit
            // in the last place at most).
            let half = [(DType::F16, 2e-3), (DType::BF16, 1.6e-2)];
            for (dtype, tol) in half.into_iter().filter(|&(d, _)| d != DType::BF16 || bf16) {
                let on = |dev: &Device| -> Vec<Vec<f64>> {
                    let t: Vec<Tensor> = inputs
                        .iter()
                        .map(|(v, s)| tensor(v, s, dtype, dev))
                        .collect();
                    let (gate, bmat) =
                        s5_discretize_untracked(&t[0], &t[1], &t[2], &t[3], how).unwrap();
                    let dg = tensor(&g[..2 * p], &[p, 2], dtype, dev);
                    let db = tensor(&g[2 * p..], &[h, 2 * p], dtype, dev);
                    let d = s5_discretize_backward([&t[0], &t[1], &t[2], &t[3]], how, &dg, &db)
                        .unwrap();
                    let mut out = vec![to_vec(&gate), to_vec(&bmat)];
                    out.extend(d.iter().map(to_vec));
                    out
                };
                let (want, got) = (on(&Device::Cpu), on(&gpu));
                let what = format!("s5_discretize {dtype:?} P {p} H {h} {how:?}");
                assert_close(&got, &want, tol, &what);
            }
        }
    }
}

/// S5's discretisation per sample (`ops::s5_timed`, not in candle's graph), forward and
/// backward, against the CPU twin; the largest state sizes the backward's shared memory takes.
#[test]
fn cuda_s5_timed() {
    use myosotis::ops::{s5_timed, s5_timed_backward};
    let Some(gpu) = gpu("cuda_s5_timed") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_s5_timed", 37);
    for (n, p) in [
        (1, 1),
        (5, 3),
        (300, 33),
        (9000, 2),
        (1600, 256),
        (700, 512),
    ] {
        for (bilinear, clip_eigs) in [(false, false), (true, true)] {
            let how = S5Discretization {
                bilinear,
                clip_eigs,
            };
            let mut re = uniform(&mut rng, p, -2.0, -0.05);
            re[0] = 0.25;
            let params = [
                re,
                uniform(&mut rng, p, -3.0, 3.0),
                uniform(&mut rng, p, -4.0, -1.0),
            ];
            let dt = uniform(&mut rng, n, 0.2, 5.0);
            let [bu, gg, gv] = [0; 3].map(|_| uniform(&mut rng, 2 * n * p, -1.0, 1.0));
            let dtypes = match p {
                512 => vec![(DType::F32, 1e-4)],
                _ => vec![(DType::F64, 1e-12), (DType::F32, 1e-4)],
            };
            for (dtype, tol) in dtypes {
                let on = |dev: &Device| -> Vec<Vec<f64>> {
                    let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, dev);
                    let ps = params.each_ref().map(|v| t(v, &[p]));
                    let pr = [&ps[0], &ps[1], &ps[2]];
                    let (dtt, but) = (t(&dt, &[n]), t(&bu, &[n, p, 2]));
                    let (gate, v) = s5_timed(pr, &dtt, &but, how).unwrap();
                    let (ggt, gvt) = (t(&gg, &[n, p, 2]), t(&gv, &[n, p, 2]));
                    let (dbu, d) = s5_timed_backward(pr, &dtt, &but, how, &ggt, &gvt).unwrap();
                    let mut out = vec![to_vec(&gate), to_vec(&v), to_vec(&dbu)];
                    out.extend(d.iter().map(to_vec));
                    out
                };
                let (want, got) = (on(&Device::Cpu), on(&gpu));
                let what = format!("s5_timed {dtype:?} N {n} P {p} {how:?}");
                assert_close(&got, &want, tol, &what);
            }
        }
    }
}

#[test]
fn cuda_s5_readout() {
    let Some(gpu) = gpu("cuda_s5_readout") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_s5_readout", 34);
    let bf16 = cuda_bf16("cuda_s5_readout");
    for (h, p, dirs) in [(1, 1, 1), (3, 5, 2), (512, 384, 2)] {
        for conj_sym in [false, true] {
            let inputs = [(
                uniform(&mut rng, h * dirs * p * 2, -1.0, 1.0),
                vec![h, dirs * p, 2],
            )];
            let g = uniform(&mut rng, h * dirs * p * 2, -1.0, 1.0);
            let op = |t: &[Tensor]| s5_readout(&t[0], dirs, conj_sym).unwrap();
            let dtypes = [DType::F64, DType::F32, DType::F16, DType::BF16];
            for dtype in dtypes.into_iter().filter(|&d| d != DType::BF16 || bf16) {
                let want = run(&op, &inputs, &g, &Device::Cpu, dtype);
                let got = run(&op, &inputs, &g, &gpu, dtype);
                // A relayout times ±1 or ±2: exact.
                assert_eq!(got, want, "s5_readout {dtype:?} H {h} P {p} dirs {dirs}");
            }
        }
    }
}

/// The block epilogue (GELU or identity, dropout, residual) on rows × h viewed as
/// (rows / 1, 1, h)-shaped samples: each row a sample, so the dropout mask varies per row.
#[test]
fn cuda_epilogue() {
    use myosotis::ops::epilogue::{epilogue, Activation, Dropout};
    let drop = |p: f64| {
        (p > 0.0).then_some(Dropout {
            site_hash: 17,
            first_row: 2,
            p,
            key_word: None,
        })
    };
    for (act, p) in [
        (Activation::Gelu, 0.0),
        (Activation::Gelu, 0.3),
        (Activation::Identity, 0.5),
    ] {
        let name = format!("cuda_epilogue {act:?} p {p}");
        let three = |t: &Tensor| {
            let (r, h) = t.dims2().unwrap();
            t.reshape((r, 1, h)).unwrap()
        };
        check_in(
            &name,
            &|t| {
                epilogue(&three(&t[0]), Some(&three(&t[1])), act, drop(p))
                    .unwrap()
                    .squeeze(1)
                    .unwrap()
            },
            &|r, h| vec![vec![r, h], vec![r, h]],
            &EVERY,
        );
    }
}

/// The mean over each sample's valid steps: rows × h viewed as (rows, 1, h) per sample would
/// have one step; here each sample is a block of 3 rows with lengths 1..=3. Every dtype (f16
/// and bf16 summed in f32).
#[test]
fn cuda_masked_mean() {
    use myosotis::ops::masked_mean;
    check_in(
        "cuda_masked_mean",
        &|t| {
            let (r, h) = t[0].dims2().unwrap();
            let b = r.div_ceil(3).max(1);
            let padded = t[0]
                .pad_with_zeros(0, 0, b * 3 - r)
                .unwrap()
                .reshape((b, 3, h))
                .unwrap();
            let len: Vec<u32> = (0..b).map(|i| 1 + (i % 3) as u32).collect();
            let len = Tensor::new(len, t[0].device()).unwrap();
            // Back to rows × h for the check: the means repeated per row of their sample.
            masked_mean(&padded, &len)
                .unwrap()
                .unsqueeze(1)
                .unwrap()
                .repeat((1, 3, 1))
                .unwrap()
                .reshape((b * 3, h))
                .unwrap()
                .narrow(0, 0, r)
                .unwrap()
        },
        &|r, h| vec![vec![r, h]],
        &EVERY,
    );
}

/// The embedding of a 13-row table at `rows` ids that repeat (one, and several of the
/// backward's stages of 256), forward and ∂W the CPU twin's.
#[test]
fn cuda_embedding() {
    use myosotis::ops::embedding;
    let Some(gpu) = gpu("cuda_embedding") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_embedding", 36);
    for (rows, h) in SHAPES {
        let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 3) % 13).collect();
        let op = |t: &[Tensor]| {
            embedding(&t[0], &Tensor::new(ids.as_slice(), t[0].device()).unwrap()).unwrap()
        };
        let w = vec![(uniform(&mut rng, 13 * h, -2.0, 2.0), vec![13, h])];
        let g = uniform(&mut rng, rows * h, -1.0, 1.0);
        for dtype in [DType::F64, DType::F32] {
            let want = run(&op, &w, &g, &Device::Cpu, dtype);
            let got = run(&op, &w, &g, &gpu, dtype);
            assert_eq!(got, want, "{dtype:?} {rows} x {h}");
        }
    }
}

/// The fixed gather of rows (`ops::RowGather`) forward and backward: the CPU's values to the
/// bit (the same sums in the same order).
#[test]
fn cuda_row_gather() {
    use myosotis::ops::RowGather;
    let Some(gpu) = gpu("cuda_row_gather") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_row_gather", 38);
    for (rows, h) in SHAPES {
        let index: Vec<u32> = (0..3 * rows as u32)
            .map(|i| (i * 7 + 3) % rows as u32)
            .collect();
        let len = index.len();
        let x = vec![(uniform(&mut rng, rows * h, -2.0, 2.0), vec![rows, h])];
        let g = uniform(&mut rng, len * h, -1.0, 1.0);
        for dtype in [DType::F64, DType::F32] {
            let on = |dev: &Device| {
                let gather = RowGather::new(index.clone(), rows, dev).unwrap();
                run(
                    &|t: &[Tensor]| gather.forward(&t[0]).unwrap(),
                    &x,
                    &g,
                    dev,
                    dtype,
                )
            };
            assert_eq!(
                on(&gpu),
                on(&Device::Cpu),
                "{dtype:?} {len} of {rows} rows of {h}"
            );
        }
    }
}

/// The gradient norm of 40 gradients (two launches of partial sums, one gradient past a
/// block's share) against the CPU twin, up to the GPU's fused multiply-adds.
#[test]
fn cuda_grad_norm() {
    use myosotis::ops::grad_norm;
    let Some(gpu) = gpu("cuda_grad_norm") else {
        return;
    };
    let sizes: Vec<usize> = (0..40)
        .map(|k| if k == 3 { 70_000 } else { 1 + 37 * k })
        .collect();
    for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
        let norm = |dev: &Device| {
            let (mut rng, _) = seeded_rng("cuda_grad_norm", 37);
            let gs: Vec<Tensor> = sizes
                .iter()
                .map(|&n| tensor(&uniform(&mut rng, n, -2.0, 2.0), &[n], dtype, dev))
                .collect();
            to_vec(&grad_norm(&gs.iter().collect::<Vec<_>>()).unwrap())[0]
        };
        let (got, want) = (norm(&gpu), norm(&Device::Cpu));
        assert!(
            (got - want).abs() <= tol * want,
            "{dtype:?}: {got} vs {want}"
        );
    }
}

/// The loss op and its backward on CUDA against the CPU twin (f32, f64), with more rows than
/// the forward's threads.
#[test]
fn cuda_cross_entropy() {
    use myosotis::ops::{cross_entropy, cross_entropy_backward};
    let Some(gpu) = gpu("cuda_cross_entropy") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_cross_entropy", 35);
    for (rows, classes) in [(1, 1), (7, 10), (600, 3), (4, 1000)] {
        let x = uniform(&mut rng, rows * classes, -4.0, 4.0);
        let y: Vec<f64> = (0..rows).map(|r| ((r * 7 + 3) % classes) as f64).collect();
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let run = |dev: &Device| {
                let xt = tensor(&x, &[rows, classes], dtype, dev);
                let ce = cross_entropy(&xt, &tensor(&y, &[rows], DType::U32, dev)).unwrap();
                let g = tensor(&[1.5], &[], dtype, dev);
                let dx = cross_entropy_backward(&ce.logp, &ce.labels, &g).unwrap();
                [ce.logp, ce.loss, ce.correct, dx].map(|t| to_vec(&t))
            };
            for (k, (a, b)) in run(&gpu).iter().zip(&run(&Device::Cpu)).enumerate() {
                let e = rel_err(a, b);
                assert!(
                    e < tol,
                    "cross_entropy {dtype:?} {rows} x {classes}: output {k}: {e:e}"
                );
            }
        }
    }
}

/// The GLU's gate and its backward on CUDA against the CPU twin in every float dtype, with
/// dropout and the residual.
#[test]
fn cuda_gate() {
    use myosotis::ops::epilogue::{gate, gate_backward, Dropout};
    let Some(gpu) = gpu("cuda_gate") else { return };
    let (mut rng, _) = seeded_rng("cuda_gate", 37);
    for (rows, h) in SHAPES {
        let (b, l) = (rows.div_ceil(5), 5);
        let n = b * l * h;
        let [f, z, r, g] = [0; 4].map(|_| uniform(&mut rng, n, -2.0, 2.0));
        let bias = uniform(&mut rng, h, -1.0, 1.0);
        let drop = Some(Dropout {
            site_hash: 11,
            first_row: 4,
            p: 0.2,
            key_word: None,
        });
        let bf16 = cuda_bf16("cuda_gate");
        for (dtype, tol) in EVERY.into_iter().filter(|d| d.0 != DType::BF16 || bf16) {
            let run = |dev: &Device| {
                let t = |v: &[f64], dims: &[usize]| tensor(v, dims, dtype, dev);
                let (ft, zt, bt) = (t(&f, &[b, l, h]), t(&z, &[b, l, h]), t(&bias, &[h]));
                let [o, s] = gate(&ft, &zt, &bt, Some(&t(&r, &[b, l, h])), drop).unwrap();
                let [df, dz] = gate_backward(&ft, &s, drop, &t(&g, &[b, l, h])).unwrap();
                [o, s, df, dz].map(|t| to_vec(&t))
            };
            for (k, (a, c)) in run(&gpu).iter().zip(&run(&Device::Cpu)).enumerate() {
                let e = rel_err(a, c);
                assert!(e < tol, "gate {dtype:?} {b} x {l} x {h}: output {k}: {e:e}");
            }
        }
    }
}

/// `ops::gemm` on the layouts the backward passes by hand use — rows, transposes, a batch
/// over interleaved columns (which cuBLAS cannot read in place: copied first), a shared side,
/// an offset — on CUDA against the CPU.
#[test]
fn cuda_gemm() {
    let Some(gpu) = gpu("cuda_gemm") else {
        return;
    };
    let (mut rng, _) = seeded_rng("cuda_gemm", 35);
    const ROWS: usize = 300;
    const WIDTH: usize = 64;
    const HEADS: usize = 32;
    let (rows, width, heads) = (ROWS, WIDTH, HEADS);
    let x = uniform(&mut rng, rows * width, -1.0, 1.0);
    let du = uniform(&mut rng, rows * heads * 2, -1.0, 1.0);
    let r = uniform(&mut rng, 2 * 2 * heads * width, -1.0, 1.0);
    type Make = dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor;
    let cases: [(&str, Box<Make>); 5] = [
        (
            "rows × rowsᵀ",
            Box::new(|x, _, r| {
                let r = r.reshape((4 * HEADS, WIDTH)).unwrap();
                gemm(
                    &Mat::matrix(x, WIDTH).unwrap(),
                    &Mat::rows(&r).unwrap().t(),
                    (ROWS, 4 * HEADS),
                )
                .unwrap()
            }),
        ),
        (
            "rowsᵀ × rows",
            Box::new(|x, du, _| {
                let x = Mat::matrix(x, WIDTH).unwrap().t();
                gemm(&x, &Mat::matrix(du, 2 * HEADS).unwrap(), (WIDTH, 2 * HEADS)).unwrap()
            }),
        ),
        (
            "shared Xᵀ × a batch over ∂U's interleaved columns",
            Box::new(|x, du, _| {
                let x = Mat::matrix(x, WIDTH).unwrap().t();
                let du = Mat::strided(du, 0, [HEADS, ROWS, 2], [2, 2 * HEADS, 1]).unwrap();
                gemm(&x, &du, (HEADS, WIDTH, 2)).unwrap()
            }),
        ),
        (
            "Xᵀ ∂U written as (heads, H, 2)",
            Box::new(|x, du, _| {
                let x = Mat::matrix(x, WIDTH).unwrap().t();
                let du = Mat::matrix(du, 2 * HEADS).unwrap();
                let (dims, strides) = ([HEADS, WIDTH, 2], [2, 2 * HEADS, 1]);
                gemm_relaid(&x, &du, dims, strides, (HEADS, WIDTH, 2)).unwrap()
            }),
        ),
        (
            "rows × R_kᵀ from an offset",
            Box::new(|x, _, r| {
                let rk = Mat::strided(r, 2 * HEADS * WIDTH, [1, WIDTH, 2 * HEADS], [0, 1, WIDTH])
                    .unwrap();
                gemm(&Mat::matrix(x, WIDTH).unwrap(), &rk, (ROWS, 2 * HEADS)).unwrap()
            }),
        ),
    ];
    for (what, make) in &cases {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let on = |dev: &Device| {
                let t = |v: &[f64]| tensor(v, &[v.len()], dtype, dev);
                to_vec(&make(&t(&x), &t(&du), &t(&r)))
            };
            let e = rel_err(&on(&gpu), &on(&Device::Cpu));
            assert!(
                e < tol,
                "gemm {what} {dtype:?}: CUDA differs from the CPU by {e:e}"
            );
        }
    }
}
