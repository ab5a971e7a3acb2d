//! The linear scan on the CPU against an independent f64 sequential loop, finite differences
//! and candle autograd through a loop of plain candle ops.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use myosotis::ops::{
    linear_scan, linear_scan_backward, linear_scan_reference, GateShape, ScanOptions,
};
use rand::Rng;

fn run_op(case: &Case, x: &Inputs, dtype: DType) -> Vec<f64> {
    let dev = Device::Cpu;
    let a = tensor(&x.a, &case.a_shape(), dtype, &dev);
    let b = tensor(&x.b, &case.b_shape(), dtype, &dev);
    let h0 = case
        .with_h0
        .then(|| tensor(&x.h0, &case.h0_shape(), dtype, &dev));
    let h = linear_scan(&a, &b, h0.as_ref(), case.opts()).unwrap();
    assert_eq!(h.dims(), case.b_shape().as_slice());
    assert_eq!(h.dtype(), dtype);
    to_vec(&h)
}

#[test]
fn forward_matches_sequential_f64_reference() {
    let (mut rng, seed) = seeded_rng("forward", 113);
    for case in scan_cases() {
        let x = random_inputs(&case, &mut rng);
        let want = reference_scan(&case, &x);
        // Errors relative to the largest term added, not only to the result: a state that
        // cancels to near zero (h = a h0 + b with a h0 ≈ −b) keeps the rounding of its terms.
        let b_max = x.b.iter().fold(0f64, |m, v| m.max(v.abs()));
        let w_max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let e32 = rel_err(&run_op(&case, &x, DType::F32), &want) * w_max / w_max.max(b_max);
        let e64 = rel_err(&run_op(&case, &x, DType::F64), &want);
        assert!(e32 < 2e-5, "f32 error {e32:e} for {case:?} (seed {seed})");
        assert!(e64 < 1e-12, "f64 error {e64:e} for {case:?} (seed {seed})");
    }
}

#[test]
fn forward_long_sequence_beyond_many_chunks() {
    let (mut rng, seed) = seeded_rng("long", 114);
    for complex in [false, true] {
        for gate in [GateShape::Full, GateShape::PerChannel] {
            let case = Case {
                batch: 1,
                len: 65_537,
                chans: 2,
                gate,
                complex,
                reverse: complex,
                with_h0: true,
            };
            let x = random_inputs(&case, &mut rng);
            let want = reference_scan(&case, &x);
            let e = rel_err(&run_op(&case, &x, DType::F32), &want);
            assert!(e < 2e-5, "error {e:e} for {case:?} (seed {seed})");
        }
    }
}

/// Outputs of 16 MiB and more are written with non-temporal stores; rows here are not
/// 16-byte aligned (odd channel counts) and the last channel tile is partial.
#[test]
fn large_outputs_written_by_streaming_stores_are_exact() {
    let (mut rng, seed) = seeded_rng("streaming", 115);
    for (complex, chans) in [(false, 1031), (true, 515)] {
        let case = Case {
            batch: 2,
            len: 2049,
            chans,
            gate: GateShape::Full,
            complex,
            reverse: complex,
            with_h0: true,
        };
        assert!(case.b_shape().iter().product::<usize>() * 4 >= 16 << 20);
        let x = random_inputs(&case, &mut rng);
        let dev = Device::Cpu;
        let a = tensor(&x.a, &case.a_shape(), DType::F32, &dev);
        let b = tensor(&x.b, &case.b_shape(), DType::F32, &dev);
        let h0 = tensor(&x.h0, &case.h0_shape(), DType::F32, &dev);
        let h = linear_scan(&a, &b, Some(&h0), case.opts()).unwrap();
        let e = rel_err(&to_vec(&h), &reference_scan(&case, &x));
        assert!(e < 2e-5, "forward error {e:e} for {case:?} (seed {seed})");
        let g: Vec<f64> = (0..x.b.len())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let gt = tensor(&g, &case.b_shape(), DType::F32, &dev);
        let got = linear_scan_backward(&a, &h, Some(&h0), &gt, case.opts()).unwrap();
        let want = reference_scan_grads(&case, &x, &g);
        for (name, t, w) in [
            ("a", &got.a, &want[0]),
            ("b", &got.b, &want[1]),
            ("h0", &got.h0, &want[2]),
        ] {
            let e = rel_err(&to_vec(t), w);
            assert!(e < 1e-4, "∂{name} error {e:e} for {case:?} (seed {seed})");
        }
    }
}

#[test]
fn half_precision_inputs_are_computed_in_f32() {
    let (mut rng, seed) = seeded_rng("half", 116);
    let case = Case {
        batch: 2,
        len: 50,
        chans: 9,
        gate: GateShape::PerChannel,
        complex: true,
        reverse: false,
        with_h0: true,
    };
    let x = random_inputs(&case, &mut rng);
    // The reference runs on the inputs as rounded to the half type, so what remains is the
    // op's own error: f32 accumulation plus one rounding of each output (2^-11 for f16,
    // 2^-8 for bf16, relative). Accumulating in the half type would cost ~len roundings.
    // (Against unrounded inputs the bound depended on the seed: 1 run in ~150 failed.)
    for (dtype, tol) in [(DType::F16, 1e-3), (DType::BF16, 8e-3)] {
        let round = |v: &[f64]| to_vec(&tensor(v, &[v.len()], dtype, &Device::Cpu));
        let xr = Inputs {
            a: round(&x.a),
            b: round(&x.b),
            h0: round(&x.h0),
        };
        let e = rel_err(&run_op(&case, &xr, dtype), &reference_scan(&case, &xr));
        assert!(e < tol, "{dtype:?} error {e:e} (seed {seed})");
    }
}

/// Loss Σ w ⊙ h and its gradients with respect to a, b, h0 through `scan`.
fn grads_through(
    scan: impl Fn(&Tensor, &Tensor, Option<&Tensor>, ScanOptions) -> candle_core::Result<Tensor>,
    case: &Case,
    x: &Inputs,
    w: &[f64],
) -> (f64, [Vec<f64>; 3]) {
    let dev = Device::Cpu;
    let a = Var::from_tensor(&tensor(&x.a, &case.a_shape(), DType::F64, &dev)).unwrap();
    let b = Var::from_tensor(&tensor(&x.b, &case.b_shape(), DType::F64, &dev)).unwrap();
    let h0 = Var::from_tensor(&tensor(&x.h0, &case.h0_shape(), DType::F64, &dev)).unwrap();
    let w = tensor(w, &case.b_shape(), DType::F64, &dev);
    let h = scan(
        a.as_tensor(),
        b.as_tensor(),
        Some(h0.as_tensor()),
        case.opts(),
    )
    .unwrap();
    let loss = (h * w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = |v: &Var| to_vec(grads.get(v).expect("missing gradient"));
    (loss.to_scalar::<f64>().unwrap(), [g(&a), g(&b), g(&h0)])
}

fn loss_of(case: &Case, x: &Inputs, w: &[f64]) -> f64 {
    reference_scan(case, x)
        .iter()
        .zip(w)
        .map(|(h, w)| h * w)
        .sum()
}

#[test]
fn gradients_match_central_finite_differences() {
    let (mut rng, seed) = seeded_rng("finite differences", 117);
    let mut cases = vec![];
    for gate in [GateShape::Full, GateShape::PerStep, GateShape::PerChannel] {
        for complex in [false, true] {
            for reverse in [false, true] {
                cases.push(Case {
                    batch: 2,
                    len: 5,
                    chans: 3,
                    gate,
                    complex,
                    reverse,
                    with_h0: true,
                });
            }
        }
    }
    // One case longer than a chunk, so the carried state is differentiated too.
    cases.push(Case {
        batch: 1,
        len: 70,
        chans: 1,
        gate: GateShape::Full,
        complex: true,
        reverse: false,
        with_h0: true,
    });
    for case in cases {
        let x = random_inputs(&case, &mut rng);
        let w: Vec<f64> = (0..x.b.len())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (_, [ga, gb, gh0]) = grads_through(linear_scan, &case, &x, &w);
        let eps = 1e-6;
        let loss_with = |which: usize, i: usize, delta: f64| {
            let mut xp = x.clone();
            match which {
                0 => xp.a[i] += delta,
                1 => xp.b[i] += delta,
                _ => xp.h0[i] += delta,
            }
            loss_of(&case, &xp, &w)
        };
        let fd = |which, i| (loss_with(which, i, eps) - loss_with(which, i, -eps)) / (2.0 * eps);
        for (which, (name, got)) in [("a", &ga), ("b", &gb), ("h0", &gh0)]
            .into_iter()
            .enumerate()
        {
            let want: Vec<f64> = (0..got.len()).map(|i| fd(which, i)).collect();
            let e = rel_err(got, &want);
            assert!(e < 1e-6, "d{name}: error {e:e} for {case:?} (seed {seed})");
        }
    }
}

#[test]
fn gradients_match_autograd_through_candle_loop() {
    let (mut rng, seed) = seeded_rng("autograd", 118);
    for case in scan_cases()
        .into_iter()
        .filter(|c| c.len <= 131 && c.chans <= 33)
    {
        let x = random_inputs(&case, &mut rng);
        let w: Vec<f64> = (0..x.b.len())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (l_op, g_op) = grads_through(linear_scan, &case, &x, &w);
        let (l_ref, g_ref) = grads_through(linear_scan_reference, &case, &x, &w);
        assert!(
            (l_op - l_ref).abs() <= 1e-9 * (1.0 + l_ref.abs()),
            "loss {l_op} vs {l_ref}"
        );
        for (name, (got, want)) in ["a", "b", "h0"].iter().zip(g_op.iter().zip(&g_ref)) {
            let e = rel_err(got, want);
            assert!(e < 1e-10, "d{name}: error {e:e} for {case:?} (seed {seed})");
        }
    }
}

#[test]
fn public_backward_equals_autograd_and_handles_f32() {
    let (mut rng, seed) = seeded_rng("public backward", 119);
    let case = Case {
        batch: 3,
        len: 77,
        chans: 40,
        gate: GateShape::PerStep,
        complex: true,
        reverse: true,
        with_h0: true,
    };
    let x = random_inputs(&case, &mut rng);
    let w: Vec<f64> = (0..x.b.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let (_, want) = grads_through(linear_scan_reference, &case, &x, &w);
    let dev = Device::Cpu;
    let t = |v: &[f64], s: &[usize]| tensor(v, s, DType::F32, &dev);
    let (a, b, h0, g) = (
        t(&x.a, &case.a_shape()),
        t(&x.b, &case.b_shape()),
        t(&x.h0, &case.h0_shape()),
        t(&w, &case.b_shape()),
    );
    let h = linear_scan(&a, &b, Some(&h0), case.opts()).unwrap();
    let got = linear_scan_backward(&a, &h, Some(&h0), &g, case.opts()).unwrap();
    assert_eq!(got.a.dims(), a.dims());
    assert_eq!(got.h0.dims(), h0.dims());
    for ((name, got), want) in [("a", &got.a), ("b", &got.b), ("h0", &got.h0)]
        .into_iter()
        .zip(want.iter())
    {
        let e = rel_err(&to_vec(got), want);
        assert!(e < 5e-5, "d{name} f32 error {e:e} (seed {seed})");
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let dev = Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
    let real = ScanOptions::default();
    let cplx = ScanOptions {
        complex: true,
        reverse: false,
    };
    let cases: Vec<(&str, candle_core::Result<Tensor>)> = vec![
        ("b rank", linear_scan(&z(&[3]), &z(&[2, 3]), None, real)),
        ("a shape", linear_scan(&z(&[4]), &z(&[2, 5, 3]), None, real)),
        (
            "a batch",
            linear_scan(&z(&[1, 5, 3]), &z(&[2, 5, 3]), None, real),
        ),
        (
            "h0 shape",
            linear_scan(&z(&[3]), &z(&[2, 5, 3]), Some(&z(&[3])), real),
        ),
        (
            "complex tail",
            linear_scan(&z(&[3, 3]), &z(&[2, 5, 3, 3]), None, cplx),
        ),
        (
            "complex missing",
            linear_scan(&z(&[3]), &z(&[2, 5, 3]), None, cplx),
        ),
        ("empty", linear_scan(&z(&[0]), &z(&[2, 5, 0]), None, real)),
        (
            "dtype",
            linear_scan(
                &Tensor::zeros(3, DType::F64, &dev).unwrap(),
                &z(&[2, 5, 3]),
                None,
                real,
            ),
        ),
        (
            "integer",
            linear_scan(
                &Tensor::zeros(3, DType::U32, &dev).unwrap(),
                &Tensor::zeros((2, 5, 3), DType::U32, &dev).unwrap(),
                None,
                real,
            ),
        ),
    ];
    for (what, r) in cases {
        let msg = r.expect_err(what).to_string();
        assert!(
            msg.contains("linear_scan"),
            "{what}: unhelpful message {msg}"
        );
    }
    let a = z(&[2, 5, 3]);
    let h = z(&[2, 5, 3]);
    let err = linear_scan_backward(&a, &h, None, &z(&[2, 5, 4]), real).unwrap_err();
    assert!(err.to_string().contains("grad_h"), "{err}");
}

#[test]
fn shared_gate_is_not_materialised_and_equals_broadcast() {
    // The shared forms must give exactly what the explicitly broadcast gate gives.
    let (mut rng, seed) = seeded_rng("shared", 120);
    let case = Case {
        batch: 3,
        len: 70,
        chans: 5,
        gate: GateShape::PerChannel,
        complex: false,
        reverse: false,
        with_h0: false,
    };
    let x = random_inputs(&case, &mut rng);
    let dev = Device::Cpu;
    let a = tensor(&x.a, &case.a_shape(), DType::F32, &dev);
    let b = tensor(&x.b, &case.b_shape(), DType::F32, &dev);
    let shared = linear_scan(&a, &b, None, case.opts()).unwrap();
    let full = linear_scan(&a.broadcast_as(b.shape()).unwrap(), &b, None, case.opts()).unwrap();
    assert_eq!(to_vec(&shared), to_vec(&full), "seed {seed}");
}
