//! Mixed precision (`--precision bf16|f16`): runs track the f32 run, f16's loss scaler skips
//! exactly the steps whose gradients are not finite, checkpoints stay f32, and a resumed f16
//! run equals an uninterrupted one.

mod common;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::runs::{metrics, out};
use myosotis::nn::ParamGroup;
use myosotis::train::config::RunArgs;
use myosotis::train::optim::{OptimConfig, Optimizer};
use myosotis::train::precision::{LossScaler, Precision};
use myosotis::train::progress::Event;
use myosotis::train::run::{eval_checkpoint_at, train, Exec, Start};

/// The run `flags` describe (on the built-in ListOps, small), trained into `dir`.
fn run(dir: &std::path::Path, flags: &[&str], start: Start, on: impl FnMut(Event)) {
    let base = [
        "--max-train-samples",
        "192",
        "--max-eval-samples",
        "64",
        "--d-model",
        "16",
        "--state-size",
        "8",
    ];
    let all: Vec<&str> = base.iter().chain(flags).copied().collect();
    let cfg = RunArgs::from_flags(all).unwrap().resolve().unwrap();
    train(&cfg, dir, &Exec::on(&Device::Cpu), start, on).unwrap();
}

/// A run's (train, val) loss per epoch.
fn losses(dir: &std::path::Path) -> Vec<(f64, f64)> {
    let m = metrics(dir);
    let of = |split: &str| -> Vec<f64> {
        m.iter()
            .filter(|r| r["split"] == split)
            .map(|r| r["loss"].as_f64().unwrap())
            .collect()
    };
    of("train").into_iter().zip(of("val")).collect()
}

/// bf16 and f16 runs of S5 and Myo (and S5 with BatchNorm) track the f32 run's training and
/// validation losses at every epoch (the same initialisation and batches): bf16 within 0.5%,
/// f16 within 2% (it skips its first steps while the loss scale comes down; seen: bf16 0.06%,
/// f16 1.0% at most). Their checkpoints hold f32 tensors; the f32 run's best checkpoint scores
/// within 0.5% of its f32 loss in either.
#[test]
fn bf16_and_f16_runs_track_the_f32_run() {
    for (model, norm) in [("s5", "layer"), ("myo", "layer"), ("s5", "batch")] {
        let model_flags = ["--model", model, "--norm", norm, "--epochs", "3"];
        let f32_dir = out(&format!("prec-{model}-{norm}-f32"));
        run(&f32_dir, &model_flags, Start::New, |_| {});
        let want = losses(&f32_dir);
        assert_eq!(want.len(), 3);
        for p in ["bf16", "f16"] {
            let dir = out(&format!("prec-{model}-{norm}-{p}"));
            let flags = [&model_flags[..], &["--precision", p]].concat();
            run(&dir, &flags, Start::New, |_| {});
            let tolerance = if p == "bf16" { 0.005 } else { 0.02 };
            let got = losses(&dir);
            assert_eq!(got.len(), want.len());
            for (epoch, (g, w)) in got.iter().zip(&want).enumerate() {
                for (what, g, w) in [("train", g.0, w.0), ("val", g.1, w.1)] {
                    let rel = (g - w).abs() / w;
                    assert!(
                        rel <= tolerance,
                        "{model} ({norm} norm) {p} epoch {}: {what} loss {g} against f32's {w} \
                         ({:.2}%)",
                        epoch + 1,
                        100.0 * rel
                    );
                }
            }
            let ck = myosotis::train::checkpoint::read::<serde_json::Value>(
                &dir.join("last.safetensors"),
            )
            .unwrap();
            assert!(ck.tensors.values().all(|t| t.dtype() == DType::F32));
            let _ = std::fs::remove_dir_all(&dir);
        }
        // The f32 checkpoint scored in each precision.
        let best = f32_dir.join("best.safetensors");
        let exec = Exec::on(&Device::Cpu);
        let at = |p| eval_checkpoint_at(&best, None, None, None, p, &exec).unwrap();
        let f32_loss = at(Precision::F32).loss;
        for (p, tolerance) in [(Precision::Bf16, 0.005), (Precision::F16, 0.005)] {
            let loss = at(p).loss;
            let rel = (loss - f32_loss).abs() / f32_loss;
            assert!(
                rel <= tolerance,
                "{model} evaluated in {p}: {loss} against {f32_loss}"
            );
            assert_ne!(loss, f32_loss, "{model} evaluated in {p} as in f32");
        }
        let _ = std::fs::remove_dir_all(&f32_dir);
    }
}

/// Constant-rate AdamW without weight decay.
fn optim() -> OptimConfig {
    OptimConfig {
        lr: 0.1,
        ssm_lr: 0.1,
        lr_min: 0.1,
        weight_decay: 0.0,
        warmup_steps: 0,
        total_steps: 100,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        clip: None,
    }
}

/// An optimiser of one f32 master parameter w (SSM group: no weight decay) training its f16
/// copy.
fn mirrored() -> (Optimizer, Var, Var) {
    let dev = Device::Cpu;
    let master = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 0.5], &dev).unwrap()).unwrap();
    let compute = Var::zeros(3, DType::F16, &dev).unwrap();
    let vars = |v: &Var| HashMap::from([("w".to_string(), v.clone())]);
    let mut opt = Optimizer::new(optim(), &vars(&master), |_| ParamGroup::Ssm).unwrap();
    opt.mirror(&vars(&master), &vars(&compute), Precision::F16)
        .unwrap();
    (opt, master, compute)
}

fn values(v: &Var) -> Vec<f32> {
    v.as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The gradient `g` (unscaled) of `compute`, as the backward pass of the loss times the
/// optimiser's scale gives it, in f16.
fn grads(opt: &Optimizer, compute: &Var, g: [f32; 3]) -> GradStore {
    let c = (Tensor::new(&g, &Device::Cpu).unwrap() * opt.loss_scale())
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    (compute.as_tensor() * c)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
}

/// A compute copy built in `Optimizer::compute_varmap` shares the variables the optimiser does
/// not train with the masters: a bf16 copy's BatchNorm updates the masters' f32 running
/// averages itself. A copy with running averages of its own is refused, naming them.
#[test]
fn the_compute_copy_shares_the_running_averages_with_the_masters() {
    use candle_nn::{VarBuilder, VarMap};
    use myosotis::nn::batch_norm::BatchNorm;
    let dev = Device::Cpu;
    let vars = |m: &VarMap| m.data().lock().unwrap().clone();
    let norm =
        |map: &VarMap, dtype| BatchNorm::new(3, 0.5, VarBuilder::from_varmap(map, dtype, &dev));
    let master = VarMap::new();
    norm(&master, DType::F32).unwrap();
    let group = |n: &str| match n.contains("running") {
        true => ParamGroup::Frozen,
        false => ParamGroup::Ssm,
    };
    let mut opt = Optimizer::new(optim(), &vars(&master), group).unwrap();
    let compute = opt.compute_varmap(&vars(&master));
    let copy = norm(&compute, DType::BF16).unwrap();
    opt.mirror(&vars(&master), &vars(&compute), Precision::Bf16)
        .unwrap();
    let x = Tensor::new(&[[1f32, 2.0, 3.0], [3.0, 6.0, 9.0]], &dev).unwrap();
    copy.forward_train(&x.to_dtype(DType::BF16).unwrap(), None)
        .unwrap();
    // running = 0.5 · (0, 1) + 0.5 · (the mean, the unbiased variance) of the two rows.
    let mean = &vars(&master)["running_mean"];
    assert_eq!(mean.dtype(), DType::F32);
    assert_eq!(values(mean), [1.0, 2.0, 3.0]);
    assert_eq!(values(&vars(&master)["running_var"]), [1.5, 4.5, 9.5]);

    let own = VarMap::new();
    norm(&own, DType::BF16).unwrap();
    let mut opt = Optimizer::new(optim(), &vars(&master), group).unwrap();
    let err = opt
        .mirror(&vars(&master), &vars(&own), Precision::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("'running_"), "{err}");
}

/// f16's loss scaler: a step whose scaled gradients hold an infinity or a NaN (injected) is
/// skipped — the master, its copy, the moments and the step count stay — and the scale halves;
/// the steps around it are taken, unscaled: the same as with an f32 optimiser given the
/// unscaled gradients. After 2,000 clean steps the scale doubles. The state is saved with
/// the optimiser's and restored from it.
#[test]
fn the_loss_scaler_skips_exactly_the_steps_with_non_finite_gradients() {
    let (mut opt, master, compute) = mirrored();
    assert_eq!(
        values(&compute),
        values(&master),
        "the copy starts as the master"
    );
    assert_eq!(opt.loss_scale(), LossScaler::INITIAL);
    // The same steps in f32 with the unscaled gradients: what the f16 steps must equal.
    let plain = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 0.5], &Device::Cpu).unwrap()).unwrap();
    let mut reference = Optimizer::new(
        optim(),
        &HashMap::from([("w".to_string(), plain.clone())]),
        |_| ParamGroup::Ssm,
    )
    .unwrap();
    let g = [0.25f32, -0.5, 0.125];
    let steps: [(Option<f32>, bool); 6] = [
        (None, true),
        (Some(f32::INFINITY), false),
        (None, true),
        (Some(f32::NAN), false),
        (Some(f32::NEG_INFINITY), false),
        (None, true),
    ];
    let mut skipped = 0;
    for (k, (bad, taken)) in steps.into_iter().enumerate() {
        let before = (values(&master), values(&compute), opt.step_count());
        let scale = opt.loss_scale();
        let mut gk = g;
        if let Some(b) = bad {
            gk[1] = b;
        }
        opt.step(&grads(&opt, &compute, gk)).unwrap();
        let s = opt.scaler().unwrap();
        if taken {
            let loss = (plain.as_tensor() * Tensor::new(&g, &Device::Cpu).unwrap()).unwrap();
            reference
                .step(&loss.sum_all().unwrap().backward().unwrap())
                .unwrap();
            assert_eq!(opt.step_count(), before.2 + 1, "step {k} was not taken");
            assert_eq!(
                s.scale, scale,
                "step {k}: the scale changed after a clean step"
            );
            // The scaled gradient is exact in f16 here (powers of two), so the step equals
            // the f32 one up to the rounding of the division.
            for (a, b) in values(&master).iter().zip(values(&plain)) {
                assert!(
                    (a - b).abs() <= 1e-6,
                    "step {k}: master {a} against f32's {b}"
                );
            }
            let copy: Vec<f32> = values(&master)
                .iter()
                .map(|v| half::f16::from_f32(*v).to_f32())
                .collect();
            assert_eq!(
                values(&compute),
                copy,
                "step {k}: the copy is not the cast master"
            );
        } else {
            skipped += 1;
            assert_eq!(
                (values(&master), values(&compute), opt.step_count()),
                before,
                "step {k} with a non-finite gradient changed the parameters"
            );
            assert_eq!(s.scale, scale / 2.0, "step {k}: the scale did not halve");
        }
        assert_eq!(s.skipped, skipped);
    }
    // The moments did not see the skipped steps either.
    let state: HashMap<String, Tensor> = opt.state().unwrap().into_iter().collect();
    let want: HashMap<String, Tensor> = reference.state().unwrap().into_iter().collect();
    for key in ["adam.m.w", "adam.v.w"] {
        let (a, b) = (&state[key], &want[key]);
        let d = (a - b).unwrap().abs().unwrap().max(0).unwrap();
        assert!(d.to_scalar::<f32>().unwrap() <= 1e-6, "{key}");
    }
    // Growth: the scale doubles after GROWTH_INTERVAL clean steps in a row.
    let scale = opt.loss_scale();
    let clean = opt.scaler().unwrap().clean;
    assert_eq!(clean, 1, "one clean step since the last skip");
    for _ in clean..LossScaler::GROWTH_INTERVAL - 1 {
        opt.step(&grads(&opt, &compute, [1e-3; 3])).unwrap();
    }
    assert_eq!(opt.loss_scale(), scale);
    opt.step(&grads(&opt, &compute, [1e-3; 3])).unwrap();
    assert_eq!(opt.loss_scale(), 2.0 * scale);
    // Saved and restored with the optimiser's state.
    let saved: HashMap<String, Tensor> = opt.state().unwrap().into_iter().collect();
    let (mut fresh, _, _) = mirrored();
    fresh.load_state(&saved).unwrap();
    assert_eq!(fresh.scaler(), opt.scaler());
}

/// AdamW under mixed precision reads the compute copy's gradients in their dtype (or, summed
/// over a batch's parts, in f32) and writes the stepped parameters into the copy: the same
/// bits as a plain f32 step on the gradients cast to f32 (unscaled: f16's loss scale is a power
/// of two) followed by a cast of the parameters, which it replaces. Three parameters of
/// different sizes in three groups, gradient clipping on (the norm taken of the half
/// gradients), three steps.
#[test]
fn a_mixed_precision_step_is_the_f32_step_on_the_cast_gradients() {
    use rand::{Rng, SeedableRng};
    let dev = Device::Cpu;
    let cfg = OptimConfig {
        clip: Some(0.5),
        weight_decay: 0.01,
        ..optim()
    };
    let names = ["a", "b", "c"];
    let group = |n: &str| match n {
        "a" => ParamGroup::Regular,
        "b" => ParamGroup::Ssm,
        _ => ParamGroup::SsmDecayed,
    };
    for (precision, summed) in [
        (Precision::Bf16, false),
        (Precision::Bf16, true),
        (Precision::F16, false),
        (Precision::F16, true),
    ] {
        let what = format!("{precision} (gradients summed in f32: {summed})");
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut draw = |n: usize, r: f32| -> Tensor {
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-r..r)).collect();
            Tensor::new(v, &dev).unwrap()
        };
        let init: Vec<Tensor> = [1, 300, 5000].iter().map(|&n| draw(n, 1.0)).collect();
        let var = |t: &Tensor, dt| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap();
        let master: Vec<Var> = init.iter().map(|t| var(t, DType::F32)).collect();
        let plain: Vec<Var> = init.iter().map(|t| var(t, DType::F32)).collect();
        let compute: Vec<Var> = init.iter().map(|t| var(t, precision.dtype())).collect();
        let map = |vs: &[Var]| -> HashMap<String, Var> {
            names
                .iter()
                .map(|n| n.to_string())
                .zip(vs.iter().cloned())
                .collect()
        };
        let mut opt = Optimizer::new(cfg.clone(), &map(&master), group).unwrap();
        opt.mirror(&map(&master), &map(&compute), precision)
            .unwrap();
        let mut reference = Optimizer::new(cfg.clone(), &map(&plain), group).unwrap();
        for step in 0..3 {
            let scale = opt.loss_scale();
            // The compute copy's gradients: Σ c ⊙ g'(scaled, in the compute dtype).
            let g: Vec<Tensor> = init
                .iter()
                .map(|t| {
                    (draw(t.elem_count(), 0.1) * scale)
                        .unwrap()
                        .to_dtype(precision.dtype())
                        .unwrap()
                })
                .collect();
            let objective = |vs: &[Var], g: &[Tensor]| -> GradStore {
                let mut sum = Tensor::zeros((), vs[0].dtype(), &dev).unwrap();
                for (v, g) in vs.iter().zip(g) {
                    sum = (sum + (v.as_tensor() * g).unwrap().sum_all().unwrap()).unwrap();
                }
                sum.backward().unwrap()
            };
            let mut grads = objective(&compute, &g);
            if summed {
                opt.grads_to_f32(&mut grads).unwrap();
            }
            let unscaled: Vec<Tensor> = g
                .iter()
                .map(|g| (g.to_dtype(DType::F32).unwrap() * (1.0 / scale)).unwrap())
                .collect();
            opt.step(&grads).unwrap();
            reference.step(&objective(&plain, &unscaled)).unwrap();
            assert_eq!(
                opt.step_count(),
                step + 1,
                "{what}: step {step} was skipped"
            );
            for (k, (m, p)) in master.iter().zip(&plain).enumerate() {
                assert_eq!(values(m), values(p), "{what}: step {step}, parameter {k}");
                let cast = m.as_tensor().to_dtype(precision.dtype()).unwrap();
                assert_eq!(
                    values(&compute[k]),
                    values(&Var::from_tensor(&cast).unwrap()),
                    "{what}: step {step}, parameter {k}'s copy"
                );
            }
        }
    }
}

/// An f16 run interrupted after its second epoch and resumed ends with the same checkpoint,
/// to the byte, as the run that was not interrupted: the loss scaler's state is saved with it.
#[test]
fn a_resumed_f16_run_equals_the_uninterrupted_run() {
    let (a, b) = (out("f16-whole"), out("f16-resumed"));
    let flags = ["--model", "s5", "--precision", "f16", "--epochs", "4"];
    run(&a, &flags, Start::New, |_| {});
    let mut stop = 0;
    let interrupted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(&b, &flags, Start::New, |ev| {
            if let Event::EpochEnd { epoch, .. } = ev {
                stop = epoch;
                if epoch == 2 {
                    panic!("interrupted");
                }
            }
        })
    }));
    assert!(interrupted.is_err() && stop == 2);
    run(&b, &flags, Start::Resume, |_| {});
    let bytes = |d: &std::path::Path| std::fs::read(d.join("last.safetensors")).unwrap();
    assert!(bytes(&a) == bytes(&b), "last.safetensors differs");
    // Every step was either taken or skipped, and the records say how many were skipped.
    let train: Vec<serde_json::Value> = metrics(&a)
        .into_iter()
        .filter(|r| r["split"] == "train")
        .collect();
    let last = train.last().unwrap();
    let skipped = last["skipped_steps"].as_u64().unwrap();
    let steps = last["step"].as_u64().unwrap();
    assert!(skipped > 0, "the initial scale 2^16 overflows f16 here");
    assert_eq!(
        steps + skipped,
        4 * 192 / 32,
        "steps taken + skipped = batches"
    );
    let scale = last["loss_scale"].as_f64().unwrap();
    assert_eq!(scale, LossScaler::INITIAL / 2f64.powi(skipped as i32));
    for d in [a, b] {
        let _ = std::fs::remove_dir_all(d);
    }
}
