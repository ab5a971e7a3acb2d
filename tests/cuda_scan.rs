//! The CUDA scan kernels against the CPU twin and the f64 reference, forward and backward.
//! Compiled with `--features cuda` (CI compiles them); each test prints why it is skipped when
//! no CUDA device can be opened.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Var};
use common::*;
use myosotis::ops::{linear_scan, GateShape};
use rand::rngs::StdRng;
use rand::Rng;

/// h and the gradients of Σ w ⊙ h with respect to (a, b, h0), on `dev` in `dtype`.
fn forward_backward(
    case: &Case,
    x: &Inputs,
    w: &[f64],
    dev: &Device,
    dtype: DType,
) -> [Vec<f64>; 4] {
    let var = |v: &[f64], s: &[usize]| Var::from_tensor(&tensor(v, s, dtype, dev)).unwrap();
    let (a, b, h0) = (
        var(&x.a, &case.a_shape()),
        var(&x.b, &case.b_shape()),
        var(&x.h0, &case.h0_shape()),
    );
    let h = linear_scan(
        a.as_tensor(),
        b.as_tensor(),
        Some(h0.as_tensor()),
        case.opts(),
    )
    .unwrap();
    let w = tensor(w, &case.b_shape(), dtype, dev);
    let grads = (&h * w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |v: &Var| to_vec(grads.get(v).expect("missing gradient"));
    [to_vec(&h), g(&a), g(&b), g(&h0)]
}

/// Rounds values to `dtype`, so the reference sees exactly what the kernel reads.
fn round_to(v: &[f64], dtype: DType) -> Vec<f64> {
    to_vec(&tensor(v, &[v.len()], dtype, &Device::Cpu))
}

fn weights(x: &Inputs, rng: &mut StdRng) -> Vec<f64> {
    (0..x.b.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect()
}

fn all_cases() -> Vec<Case> {
    let mut cases = scan_cases();
    for complex in [false, true] {
        cases.push(Case {
            batch: 2,
            len: 65_537,
            chans: 3,
            gate: GateShape::PerChannel,
            complex,
            reverse: !complex,
            with_h0: true,
        });
    }
    // Enough (batch, channel-tile) blocks to fill the device.
    cases.push(Case {
        batch: 8,
        len: 4096,
        chans: 1536,
        gate: GateShape::Full,
        complex: false,
        reverse: false,
        with_h0: false,
    });
    cases
}

#[test]
fn cuda_matches_cpu_twin_and_f64_reference() {
    let Some(gpu) = gpu("cuda_matches_cpu_twin_and_f64_reference") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda forward/backward", 101);
    for case in all_cases() {
        let x = random_inputs(&case, &mut rng);
        let w = weights(&x, &mut rng);
        let want = reference_scan(&case, &x);
        for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
            let cuda = forward_backward(&case, &x, &w, &gpu, dtype);
            let cpu = forward_backward(&case, &x, &w, &Device::Cpu, dtype);
            let e_ref = rel_err(&cuda[0], &want);
            assert!(
                e_ref < tol,
                "{dtype:?} forward vs f64 reference {e_ref:e} for {case:?} (seed {seed})"
            );
            for (i, name) in ["h", "da", "db", "dh0"].iter().enumerate() {
                // Gradients summed over many steps (shared gates) carry more rounding.
                let tol = if i == 1 { tol * 50.0 } else { tol };
                let e = rel_err(&cuda[i], &cpu[i]);
                assert!(
                    e < tol,
                    "{dtype:?} {name}: CUDA vs CPU twin {e:e} for {case:?} (seed {seed})"
                );
            }
        }
    }
}

#[test]
fn cuda_half_precision_accumulates_in_f32() {
    let Some(gpu) = gpu("cuda_half_precision_accumulates_in_f32") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda half", 102);
    let bf16 = cuda_bf16("cuda_half_precision_accumulates_in_f32");
    for case in scan_cases().into_iter().filter(|c| c.len <= 131) {
        let half = [(DType::F16, 4e-3), (DType::BF16, 3e-2)];
        for (dtype, tol) in half.into_iter().filter(|h| h.0 != DType::BF16 || bf16) {
            let x = random_inputs(&case, &mut rng);
            let x = Inputs {
                a: round_to(&x.a, dtype),
                b: round_to(&x.b, dtype),
                h0: round_to(&x.h0, dtype),
            };
            let w = round_to(&weights(&x, &mut rng), dtype);
            let want = reference_scan(&case, &x);
            let cuda = forward_backward(&case, &x, &w, &gpu, dtype);
            let e = rel_err(&cuda[0], &want);
            assert!(
                e < tol,
                "{dtype:?} forward {e:e} for {case:?} (seed {seed})"
            );
            let cpu = forward_backward(&case, &x, &w, &Device::Cpu, DType::F32);
            for (i, name) in ["da", "db", "dh0"].iter().enumerate() {
                let e = rel_err(&cuda[i + 1], &cpu[i + 1]);
                assert!(
                    e < 4.0 * tol,
                    "{dtype:?} {name} vs f32 CPU {e:e} for {case:?} (seed {seed})"
                );
            }
        }
    }
}
