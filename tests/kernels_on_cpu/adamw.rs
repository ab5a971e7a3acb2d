//! `adamw_step_*` of kernels/adamw.cu through the harness, against an f64 reference written
//! from the AdamW formula and, bit for bit, the CPU twin: many parameters per launch, each
//! with its group's hyper-parameters, and under mixed precision f16/bf16 gradients and the
//! compute copies written.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use myosotis::ops::adamw::cuda::{step_plans, SEGMENTS};
use myosotis::ops::adamw::{StepDtypes, HYPER_LEN};
use myosotis::ops::{adamw_step, AdamwHyper, AdamwParam};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec};
use crate::exec::{from_bytes, round_to, run_in_place_bytes_in_every_order, to_bytes};

/// Random parameters of the given sizes (θ, m, v ≥ 0, g), each in a random one of `groups`
/// hyper-parameter rows, and perhaps a clipping scale.
struct Inputs {
    params: Vec<[Vec<f64>; 4]>,
    group: Vec<usize>,
    rows: Vec<AdamwHyper>,
    scale: Option<f64>,
}

impl Inputs {
    fn random(sizes: &[usize], groups: usize, scaled: bool, rng: &mut impl Rng) -> Inputs {
        let mut params = Vec::new();
        for &n in sizes {
            let mut draw = |lo: f64, hi: f64| (0..n).map(|_| rng.random_range(lo..hi)).collect();
            params.push([
                draw(-1.0, 1.0),
                draw(-0.1, 0.1),
                draw(0.0, 0.01),
                draw(-1.0, 1.0),
            ]);
        }
        let group = sizes.iter().map(|_| rng.random_range(0..groups)).collect();
        let rows = (0..groups)
            .map(|_| {
                let t = rng.random_range(1..200);
                let (beta1, beta2) = (rng.random_range(0.8..0.95), 0.999);
                AdamwHyper {
                    beta1,
                    beta2,
                    c1: 1.0 - f64::powi(beta1, t),
                    c2: 1.0 - f64::powi(beta2, t),
                    eps: 1e-8,
                    lr: rng.random_range(1e-4..1e-2),
                    weight_decay: rng.random_range(0.0..0.1),
                }
            })
            .collect();
        Inputs {
            params,
            group,
            rows,
            scale: scaled.then(|| rng.random_range(0.1..1.0)),
        }
    }

    /// The inputs as the kernels see them, every value rounded to its dtype: per parameter
    /// θ, [m; v], g; the hyper-parameter table; the scale.
    fn rounded(&self, k: StepDtypes) -> (Vec<[Vec<f64>; 3]>, Vec<f64>, Option<f64>) {
        let params = self
            .params
            .iter()
            .map(|[theta, m, v, g]| {
                let mv: Vec<f64> = m.iter().chain(v).copied().collect();
                [
                    round_to(theta, k.param),
                    round_to(&mv, k.param),
                    round_to(g, k.grad),
                ]
            })
            .collect();
        let table: Vec<f64> = self.rows.iter().flat_map(AdamwHyper::row).collect();
        let scale = self.scale.map(|s| round_to(&[s], k.param)[0]);
        (params, round_to(&table, k.param), scale)
    }
}

/// Per parameter [m'; v'; θ'] in f64 from (rounded) inputs, element by element.
fn reference(
    params: &[[Vec<f64>; 3]],
    group: &[usize],
    table: &[f64],
    scale: Option<f64>,
) -> Vec<Vec<f64>> {
    let s = scale.unwrap_or(1.0);
    let mut all = Vec::new();
    for ([theta, mv, g], &k) in params.iter().zip(group) {
        let h = &table[k * HYPER_LEN..(k + 1) * HYPER_LEN];
        let (b1, b2, c1, c2, eps, lr, wd) = (h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
        let n = theta.len();
        let mut out = vec![0.0; 3 * n];
        for e in 0..n {
            let gs = g[e] * s;
            out[e] = b1 * mv[e] + (1.0 - b1) * gs;
            out[n + e] = b2 * mv[n + e] + (1.0 - b2) * gs * gs;
            let update = (out[e] / c1) / ((out[n + e] / c2).sqrt() + eps);
            out[2 * n + e] = theta[e] - lr * update - lr * wd * theta[e];
        }
        all.push(out);
    }
    all
}

/// What a compute copy holds before the step: NaN, so that an element the step does not
/// write shows.
fn unwritten(n: usize) -> Vec<f64> {
    vec![f64::NAN; n]
}

/// Per parameter [m'; v'; θ'] and its compute copy (empty without one) from the CPU twin on
/// the same rounded inputs, the table and the scale made as the optimiser makes them.
fn twin(x: &Inputs, k: StepDtypes) -> Vec<(Vec<f64>, Vec<f64>)> {
    let (params, _, scale) = x.rounded(k);
    let t = |v: &[f64], shape: &[usize], dt| tensor(v, shape, dt, &Device::Cpu);
    let held: Vec<[Tensor; 3]> = params
        .iter()
        .map(|[theta, mv, g]| {
            let n = theta.len();
            [
                t(theta, &[n], k.param),
                t(mv, &[2, n], k.param),
                t(g, &[n], k.grad),
            ]
        })
        .collect();
    let copies: Vec<Option<Tensor>> = params
        .iter()
        .map(|[theta, ..]| {
            k.copy
                .map(|c| t(&unwritten(theta.len()), &[theta.len()], c))
        })
        .collect();
    let list: Vec<AdamwParam> = held
        .iter()
        .zip(&x.group)
        .zip(&copies)
        .map(|(([theta, moments, grad], &group), copy)| AdamwParam {
            theta,
            moments,
            grad,
            group,
            copy: copy.as_ref(),
        })
        .collect();
    let table = AdamwHyper::table(&x.rows, k.param, &Device::Cpu).unwrap();
    let scale = scale.map(|s| t(&[s], &[], k.param));
    adamw_step(&list, &table, scale.as_ref()).unwrap();
    held.iter()
        .zip(&copies)
        .map(|([theta, mv, _], copy)| {
            let state = Tensor::cat(&[mv.flatten_all().unwrap(), theta.clone()], 0).unwrap();
            (
                to_vec(&state),
                copy.as_ref().map(to_vec).unwrap_or_default(),
            )
        })
        .collect()
}

fn check(
    sizes: &[usize],
    groups: usize,
    scaled: bool,
    k: StepDtypes,
    tol: f64,
    rng: &mut impl Rng,
) {
    let what = format!(
        "{} parameters, {groups} groups, scaled {scaled}, {k:?}",
        sizes.len()
    );
    let x = Inputs::random(sizes, groups, scaled, rng);
    let (params, table, scale) = x.rounded(k);
    let plans = step_plans(sizes, &x.group, k, scaled).unwrap();
    assert_eq!(plans.len(), sizes.len().div_ceil(SEGMENTS), "{what}");
    // The launches in turn, each on what the ones before left: targets θ, [m; v], the copies.
    let n = sizes.len();
    let mut state: Vec<Vec<u8>> = params.iter().map(|p| to_bytes(&p[0], k.param)).collect();
    state.extend(params.iter().map(|p| to_bytes(&p[1], k.param)));
    if let Some(c) = k.copy {
        state.extend(sizes.iter().map(|&len| to_bytes(&unwritten(len), c)));
    }
    let mut inputs: Vec<Vec<u8>> = params.iter().map(|p| to_bytes(&p[2], k.grad)).collect();
    inputs.push(to_bytes(&table, k.param));
    inputs.extend(scale.map(|s| to_bytes(&[s], k.param)));
    for plan in &plans {
        let run = run_in_place_bytes_in_every_order(plan, &state, &inputs, 5);
        assert_eq!((run.status, run.raw.len()), (0, state.len()), "{what}");
        state = run.raw;
    }
    let got: Vec<Vec<f64>> = (0..n)
        .map(|p| {
            let mut v = from_bytes(&state[n + p], k.param);
            v.extend(from_bytes(&state[p], k.param));
            v
        })
        .collect();
    let copies: Vec<Vec<f64>> = match k.copy {
        Some(c) => (0..n).map(|p| from_bytes(&state[2 * n + p], c)).collect(),
        None => vec![vec![]; n],
    };
    let want = reference(&params, &x.group, &table, scale);
    for (p, (got, want)) in got.iter().zip(&want).enumerate() {
        let len = sizes[p];
        // Each third on its own scale (v is about 1e-3 of θ).
        for (j, part) in ["m'", "v'", "θ'"].iter().enumerate() {
            let r = j * len..(j + 1) * len;
            let e = rel_err(&got[r.clone()], &want[r]);
            assert!(
                e < tol,
                "parameter {p}'s {part} vs the f64 formula: {e:e}, {what}"
            );
        }
        if let Some(c) = k.copy {
            // θ' rounded once more (from f32: half's `from_f64` drops low bits of the f64
            // before rounding to bf16).
            let rounded: Vec<f64> = got[2 * len..]
                .iter()
                .map(|&x| match c {
                    DType::F16 => f16::from_f32(x as f32).to_f64(),
                    _ => bf16::from_f32(x as f32).to_f64(),
                })
                .collect();
            let e = rel_err(&copies[p], &rounded);
            assert!(
                e == 0.0,
                "parameter {p}'s compute copy is not θ' rounded: {e:e}, {what}"
            );
        }
    }
    let (twin_state, twin_copies): (Vec<_>, Vec<_>) = twin(&x, k).into_iter().unzip();
    assert_same(&got.concat(), &twin_state.concat(), &what);
    assert_same(
        &copies.concat(),
        &twin_copies.concat(),
        &format!("{what}: copies"),
    );
}

/// The kinds of step the kernels are made for, and their tolerance against the f64 formula:
/// f64 and f32 parameters alone; f32 parameters with f16/bf16 gradients and compute copies;
/// f32 gradients (sums over a batch's parts) with f16/bf16 copies.
fn kinds() -> Vec<(StepDtypes, f64)> {
    let kind = |param, grad, copy| StepDtypes { param, grad, copy };
    vec![
        (kind(DType::F64, DType::F64, None), 1e-12),
        (kind(DType::F32, DType::F32, None), 2e-5),
        (kind(DType::F32, DType::F16, Some(DType::F16)), 2e-5),
        (kind(DType::F32, DType::BF16, Some(DType::BF16)), 2e-5),
        (kind(DType::F32, DType::F32, Some(DType::F16)), 2e-5),
        (kind(DType::F32, DType::F32, Some(DType::BF16)), 2e-5),
    ]
}

/// Parameters from one element to more than a launch's threads (each thread then takes
/// several), one to three groups, more parameters than one launch takes, with and without a
/// clipping scale, in every kind of step.
#[test]
fn adamw_kernels_match_the_formula_and_the_cpu_twin() {
    let (mut rng, _) = seeded_rng("adamw kernels", 3);
    for (k, tol) in kinds() {
        for scaled in [false, true] {
            check(&[1, 7, 300, 4097], 3, scaled, k, tol, &mut rng);
            let many: Vec<usize> = (0..SEGMENTS + 9).map(|_| rng.random_range(1..70)).collect();
            check(&many, 2, scaled, k, tol, &mut rng);
        }
        let n = 1_100_000;
        let plan = &step_plans(&[5, n], &[0, 0], k, true).unwrap()[0];
        assert!(plan.grid[0] * 256 < n as u32);
        check(&[5, n], 1, true, k, tol, &mut rng);
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
    let table = AdamwHyper::table(&[hyper], DType::F32, &dev).unwrap();
    let param = |theta, moments, grad| AdamwParam {
        theta,
        moments,
        grad,
        group: 0,
        copy: None,
    };
    let (view, mv_view) = (theta.clone(), mv.clone());
    adamw_step(&[param(&theta, &mv, &g)], &table, None).unwrap();
    // A clone shares the storage: it sees the step (θ − η · 1 = 0.9; m = 0.1).
    assert!((to_vec(&view)[0] - 0.9).abs() < 1e-6);
    assert!((to_vec(&mv_view)[0] - 0.1).abs() < 1e-6);
    let err =
        |p: &[AdamwParam], table: &Tensor| adamw_step(p, table, None).unwrap_err().to_string();
    let short = Tensor::zeros(4, DType::F32, &dev).unwrap();
    assert!(err(&[param(&theta, &mv, &short)], &table).contains("gradient"));
    assert!(err(&[param(&theta, &g, &g)], &table).contains("moments"));
    let f64_table = AdamwHyper::table(&[hyper], DType::F64, &dev).unwrap();
    assert!(err(&[param(&theta, &mv, &g)], &f64_table).contains("hyper-parameter table"));
    let strided = Tensor::zeros((5, 2), DType::F32, &dev)
        .unwrap()
        .t()
        .unwrap();
    assert!(err(&[param(&theta, &strided, &g)], &table).contains("contiguous"));
    let twice = [param(&theta, &mv, &g), param(&view, &mv, &g)];
    assert!(err(&twice, &table).contains("shares memory"));
    let other = AdamwParam {
        group: 1,
        ..param(&theta, &mv, &g)
    };
    assert!(err(&[other], &table).contains("group 1"));
}
