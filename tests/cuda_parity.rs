//! One training step of every model kind on CUDA against the same step on the CPU: the same
//! weights and batch, then the loss, every parameter's gradient and every variable after the
//! step (BatchNorm's running averages move in the forward pass) within 1e-3 of the CPU's
//! (relative to the tensor's largest entry; f32 throughout, and the GPU contracts a·b + c into
//! fused multiply-adds where the CPU does not). Compiled with `--features cuda`; skipped, with a
//! message, when no CUDA device can be opened.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use myosotis::data::dataset::{Dataset, Target};
use myosotis::nn::loss::log_softmax_nll;
use myosotis::nn::*;
use rand::Rng;

/// Relative tolerance of the loss and of each gradient.
const TOL: f64 = 1e-3;
/// Sequence length: a 5 × 8 image for the 2-D SSM, 40 tree leaves for Myo.
const LEN: usize = 40;

/// Each model kind with the norm it trains with.
fn layers() -> Vec<(&'static str, SeqLayerConfig, NormKind)> {
    let default_myo = MyoConfig::new(
        0,
        8,
        TreeSpec::Ragged {
            leaves: LEN,
            arity: 4,
        },
    );
    let myo = |block| MyoConfig {
        coupling: Coupling::Hermitian,
        block,
        ..default_myo.clone()
    };
    let s5 = SeqLayerConfig::S5(S5Config {
        state: 16,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    });
    vec![
        ("S5", s5.clone(), NormKind::Layer),
        // The ListOps and LRA-Image presets' norm (its batch sums are a custom op).
        ("S5 with BatchNorm", s5, NormKind::Batch),
        ("Myo d = 1", SeqLayerConfig::Myo(myo(1)), NormKind::Layer),
        // The default layer: skew couplings with the position phase, the heads' own solve.
        (
            "Myo d = 1, skew",
            SeqLayerConfig::Myo(default_myo.clone()),
            NormKind::Layer,
        ),
        ("Myo d = 2", SeqLayerConfig::Myo(myo(2)), NormKind::Layer),
        (
            "minGRU",
            SeqLayerConfig::MinGru(MinGruConfig::default()),
            NormKind::Layer,
        ),
        (
            "2-D SSM",
            SeqLayerConfig::Ssm2d(Ssm2dConfig {
                d_model: 0,
                state: 4,
                height: 5,
                width: 8,
                directions: 4,
                seed: 0,
            }),
            NormKind::Layer,
        ),
    ]
}

/// A small classifier around `layer` on `dev`, initialised from fixed seeds.
fn model(layer: &SeqLayerConfig, norm: NormKind, dev: &Device) -> (VarMap, SequenceClassifier) {
    let cfg = ClassifierConfig {
        encoder: EncoderConfig::Linear { features: 1 },
        d_model: 16,
        layers: 2,
        layer: layer.clone(),
        norm,
        prenorm: true,
        activation: Activation::HalfGlu2,
        dropout: 0.0,
        pooling: Pooling::Mean,
        classes: 10,
        timing: Default::default(),
        pairs: false,
        decoder: Default::default(),
        seed: 3,
        bn_momentum: BN_MOMENTUM,
        dense_init: Default::default(),
    };
    let varmap = VarMap::new();
    let m =
        SequenceClassifier::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev)).unwrap();
    (varmap, m)
}

#[test]
fn cuda_training_step_matches_the_cpu_for_every_model() {
    let Some(gpu) = gpu("cuda_training_step_matches_the_cpu_for_every_model") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda parity", 31);
    let batch = 6;
    let data = Dataset::Real {
        values: (0..batch * LEN)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect(),
        len: LEN,
        features: 1,
        labels: (0..batch as u32).map(|i| i % 10).collect(),
    };
    let idx: Vec<usize> = (0..batch).collect();
    for (name, layer, norm) in layers() {
        let (cpu_vars, cpu_model) = model(&layer, norm, &Device::Cpu);
        let (gpu_vars, gpu_model) = model(&layer, norm, &gpu);
        // The CPU's weights on the GPU.
        for (k, v) in cpu_vars.data().lock().unwrap().iter() {
            let g = gpu_vars.data().lock().unwrap()[k].clone();
            g.set(&v.as_tensor().to_device(&gpu).unwrap()).unwrap();
        }
        let step = |m: &SequenceClassifier, vars: &VarMap, dev: &Device, by_hand: bool| {
            let batch = data.batch(&idx, None, dev).unwrap();
            let (x, lengths) = (&batch.x, &batch.lengths);
            let Target::Labels(y) = &batch.target else {
                unreachable!("a labelled dataset")
            };
            let key = DropoutKey {
                seed: 0,
                step: 0,
                first_row: 0,
                key_on_device: false,
            };
            let sink = GradSink::new();
            let mode = Mode::Train(key, None, by_hand.then_some(&sink));
            // The loss by hand too (its fused op) where the layers are.
            let logits = m.logits_timed(x, Some(lengths), None, mode).unwrap();
            let loss = log_softmax_nll(&logits, y, by_hand).unwrap().loss;
            let mut grads = loss.backward().unwrap();
            sink.add_to(&mut grads).unwrap();
            let mut out = vec![("loss".to_string(), to_vec(&loss))];
            let data = vars.data().lock().unwrap();
            let mut names: Vec<_> = data.keys().cloned().collect();
            names.sort();
            for k in names {
                let g = grads.get(&data[&k]).map(to_vec).unwrap_or_default();
                // BatchNorm's running averages change in the forward pass.
                out.push((format!("{k} after the step"), to_vec(data[&k].as_tensor())));
                out.push((k, g));
            }
            out
        };
        // Candle's autograd, then the backward by hand where a layer has one (as training runs).
        for by_hand in [false, true] {
            let (want, got) = (
                step(&cpu_model, &cpu_vars, &Device::Cpu, by_hand),
                step(&gpu_model, &gpu_vars, &gpu, by_hand),
            );
            for ((k, w), (_, g)) in want.iter().zip(&got) {
                let e = rel_err(g, w);
                assert!(
                    e < TOL,
                    "{name}: {k} CUDA vs CPU {e:e}, by hand {by_hand} (seed {seed})"
                );
            }
        }
    }
}

/// Dropout masks made on the GPU equal the CPU's (they are a hash of the coordinates).
#[test]
fn cuda_dropout_masks_equal_the_cpu() {
    let Some(gpu) = gpu("cuda_dropout_masks_equal_the_cpu") else {
        return;
    };
    let bf16 = cuda_bf16("cuda_dropout_masks_equal_the_cpu");
    for dtype in [DType::F32, DType::BF16]
        .into_iter()
        .filter(|&d| d != DType::BF16 || bf16)
    {
        let m = |dev: &Device| {
            to_vec(&myosotis::ops::dropout_keep(5, 17, 33, 300, 0.2, dtype, dev).unwrap())
        };
        assert_eq!(m(&gpu), m(&Device::Cpu), "{dtype:?}");
    }
}

/// The S5 and Myo layers by hand in f16 and bf16 on CUDA (their parameter-side ops computing in
/// f32 inside their kernels, the products and the scan or solve in the half dtype) follow the same layers in f32 on CUDA, as
/// `tests/s5.rs` and `tests/myo.rs` check on the CPU.
#[test]
fn cuda_layers_by_hand_in_half_precision_follow_f32() {
    let name = "cuda_layers_by_hand_in_half_precision_follow_f32";
    let Some(gpu) = gpu(name) else {
        return;
    };
    let bf16 = cuda_bf16(name);
    let (mut rng, seed) = seeded_rng(name, 116);
    let half = [(DType::BF16, 4e-2), (DType::F16, 4e-3)];
    for (dtype, tol) in half.into_iter().filter(|&(d, _)| d != DType::BF16 || bf16) {
        let s5 = S5Config {
            d_model: 3,
            state: 8,
            blocks: 2,
            seed: rng.random(),
            ..S5Config::default()
        };
        let what = format!("{s5:?} (seed {seed})");
        common::half::s5_follows_f32(&gpu, dtype, &s5, &mut rng, tol, &what);
        let myo = MyoConfig {
            all_nodes: true,
            seed: rng.random(),
            ..MyoConfig::new(
                3,
                4,
                TreeSpec::Ragged {
                    leaves: 11,
                    arity: 2,
                },
            )
        };
        let what = format!("{myo:?} (seed {seed})");
        common::half::myo_follows_f32(&gpu, dtype, &myo, &mut rng, tol, &what);
    }
}

/// Whole models' training passes by hand in f16 and bf16 on CUDA (their blocks' fused ops in
/// half precision, BatchNorm in f32) follow the same models in f32: what
/// `tests/classifier.rs` checks on the CPU, with its tolerances.
#[test]
fn cuda_blocks_by_hand_in_half_precision_follow_f32() {
    let name = "cuda_blocks_by_hand_in_half_precision_follow_f32";
    let Some(gpu) = gpu(name) else {
        return;
    };
    let bf16 = cuda_bf16(name);
    let (mut rng, seed) = seeded_rng(name, 117);
    let s5 = SeqLayerConfig::S5(S5Config {
        state: 8,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    });
    let myo = SeqLayerConfig::Myo(MyoConfig {
        per_level: true,
        all_nodes: true,
        seed: 2,
        ..MyoConfig::new(
            0,
            3,
            TreeSpec::Ragged {
                leaves: 12,
                arity: 4,
            },
        )
    });
    for (layer, norm, activation) in [
        (&s5, NormKind::Layer, Activation::HalfGlu2),
        (&s5, NormKind::Batch, Activation::Gelu),
        (&myo, NormKind::Layer, Activation::FullGlu),
    ] {
        let cfg = ClassifierConfig {
            prenorm: true,
            ..common::models::classifier(layer.clone(), activation, norm, Pooling::Mean)
        };
        let half = [(DType::BF16, 0.15), (DType::F16, 2e-2)];
        for (dtype, tol) in half.into_iter().filter(|&(d, _)| d != DType::BF16 || bf16) {
            let what = format!("{layer:?}, {norm:?}, {activation:?} (seed {seed})");
            common::half::classifier_follows_f32(&gpu, dtype, &cfg, 12, &mut rng, tol, &what);
        }
    }
}

/// Three AdamW steps (in-place `adamw_step` launches, gradient clipping on, both groups) on CUDA
/// end where the same steps on the CPU end: in f32, and under mixed precision (the kernels that
/// read bf16/f16 gradients and write the compute copy; f16 with its loss scale).
#[test]
fn cuda_optimizer_steps_equal_the_cpu() {
    use candle_core::{Tensor, Var};
    use myosotis::train::optim::{OptimConfig, Optimizer};
    use myosotis::train::precision::Precision;
    use std::collections::HashMap;
    let Some(gpu) = gpu("cuda_optimizer_steps_equal_the_cpu") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda optimizer", 32);
    let shapes: [(&str, &[usize]); 3] =
        [("a.log_step", &[1]), ("w", &[30, 33]), ("big", &[300_007])];
    // (name, initial value, gradient direction, shape) per variable.
    type Param = (String, Vec<f64>, Vec<f64>, Vec<usize>);
    let init: Vec<Param> = shapes
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let mut draw = || {
                (0..n)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect::<Vec<_>>()
            };
            (name.to_string(), draw(), draw(), shape.to_vec())
        })
        .collect();
    // The masters and, under mixed precision, the compute copies after the steps.
    let run = |dev: &Device, precision: Precision| {
        let make = |dtype| -> HashMap<String, Var> {
            init.iter()
                .map(|(name, w, _, shape)| {
                    let t = tensor(w, shape, dtype, dev);
                    (name.clone(), Var::from_tensor(&t).unwrap())
                })
                .collect()
        };
        let vars = make(DType::F32);
        let compute = make(precision.dtype());
        let cfg = OptimConfig {
            lr: 0.01,
            ssm_lr: 0.001,
            lr_min: 0.0,
            weight_decay: 0.05,
            warmup_steps: 1,
            total_steps: 10,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: Some(0.5),
        };
        let group = |n: &str| match n.starts_with("a.") {
            true => ParamGroup::Ssm,
            false => ParamGroup::Regular,
        };
        let mut opt = Optimizer::new(cfg, &vars, group).unwrap();
        let trained = match precision.is_mixed() {
            true => {
                opt.mirror(&vars, &compute, precision).unwrap();
                &compute
            }
            false => &vars,
        };
        for step in 0..3 {
            // loss = Σ_p Σ (w_p ⊙ c_p)·(step + 1) + Σ w_p²: gradient c (step + 1) + 2 w.
            let mut loss = Tensor::zeros((), precision.dtype(), dev).unwrap();
            for (name, _, c, shape) in &init {
                let w = trained[name].as_tensor();
                let c = tensor(c, shape, precision.dtype(), dev);
                let term = ((w * c).unwrap() * (step + 1) as f64)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                loss = (loss + term + w.sqr().unwrap().sum_all().unwrap()).unwrap();
            }
            let loss = (loss * opt.loss_scale()).unwrap();
            opt.step(&loss.backward().unwrap()).unwrap();
        }
        init.iter()
            .map(|(name, ..)| {
                let copy = precision
                    .is_mixed()
                    .then(|| to_vec(compute[name].as_tensor()));
                (to_vec(vars[name].as_tensor()), copy)
            })
            .collect::<Vec<_>>()
    };
    // A copy may round a master that differs in its last bits the other way: one unit in the
    // last place of bf16 (2⁻⁸ relative) or f16 (2⁻¹¹).
    for (precision, copy_tol) in [
        (Precision::F32, 0.0),
        (Precision::Bf16, 8e-3),
        (Precision::F16, 1e-3),
    ] {
        let (want, got) = (run(&Device::Cpu, precision), run(&gpu, precision));
        for ((name, ..), (w, g)) in init.iter().zip(want.iter().zip(&got)) {
            let e = rel_err(&g.0, &w.0);
            assert!(
                e < 1e-5,
                "{name}, {precision}: CUDA vs CPU {e:e} (seed {seed})"
            );
            if let (Some(gc), Some(wc)) = (&g.1, &w.1) {
                let e = rel_err(gc, wc);
                assert!(
                    e <= copy_tol,
                    "{name}, {precision}: the compute copy, CUDA vs CPU {e:e} (seed {seed})"
                );
                // From f32 (half's `from_f64` drops low bits before rounding to bf16).
                let master = tensor(&g.0, &[g.0.len()], DType::F32, &Device::Cpu);
                let cast = to_vec(&master.to_dtype(precision.dtype()).unwrap());
                assert_eq!(
                    gc, &cast,
                    "{name}, {precision}: the copy is not the master, rounded"
                );
            }
        }
    }
}

/// The pendulum's model (8 × 8 frames through the frame encoder, causal S5 discretised per
/// step, a Gaussian decoder at every step and its likelihood): one training step on CUDA
/// against the CPU, by candle's autograd and by hand.
#[test]
fn cuda_pendulum_step_matches_the_cpu() {
    use myosotis::nn::loss::gaussian_nll;
    let Some(gpu) = gpu("cuda_pendulum_step_matches_the_cpu") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda pendulum parity", 32);
    let (batch, len, side, k) = (3, 10, 8, 2);
    let frames: Vec<f64> = (0..batch * len * side * side)
        .map(|i| match i % 4 {
            0 => rng.random_range(0.0..1.0),
            _ => 0.0,
        })
        .collect();
    let dt: Vec<f64> = (0..batch * len)
        .map(|_| rng.random_range(0.2..3.0))
        .collect();
    let values: Vec<f64> = (0..batch * len * k)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let cfg = ClassifierConfig {
        encoder: EncoderConfig::Frames { side },
        d_model: 12,
        layers: 2,
        layer: SeqLayerConfig::S5(S5Config {
            state: 8,
            blocks: 2,
            ..S5Config::default()
        }),
        norm: NormKind::Layer,
        prenorm: false,
        activation: Activation::HalfGlu2,
        dropout: 0.0,
        pooling: Pooling::None,
        classes: k,
        timing: Timing::Continuous,
        pairs: false,
        decoder: Decoder::Gaussian,
        seed: 3,
        bn_momentum: BN_MOMENTUM,
        dense_init: Default::default(),
    };
    let build = |dev: &Device| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
        (
            varmap.clone(),
            SequenceClassifier::new(cfg.clone(), vb).unwrap(),
        )
    };
    let ((cpu_vars, cpu_model), (gpu_vars, gpu_model)) = (build(&Device::Cpu), build(&gpu));
    for (name, v) in cpu_vars.data().lock().unwrap().iter() {
        let g = gpu_vars.data().lock().unwrap()[name].clone();
        g.set(&v.as_tensor().to_device(&gpu).unwrap()).unwrap();
    }
    let step = |m: &SequenceClassifier, vars: &VarMap, dev: &Device, by_hand: bool| {
        let x = tensor(&frames, &[batch, len, side * side], DType::F32, dev);
        let dt = tensor(&dt, &[batch, len], DType::F32, dev);
        let y = tensor(&values, &[batch, len, k], DType::F32, dev);
        let key = DropoutKey {
            seed: 0,
            step: 0,
            first_row: 0,
            key_on_device: false,
        };
        let sink = GradSink::new();
        let mode = Mode::Train(key, None, by_hand.then_some(&sink));
        let out = m.logits_timed(&x, None, Some(&dt), mode).unwrap();
        let loss = gaussian_nll(&out, &y, by_hand).unwrap().objective;
        let mut grads = loss.backward().unwrap();
        sink.add_to(&mut grads).unwrap();
        let data = vars.data().lock().unwrap();
        let mut names: Vec<_> = data.keys().cloned().collect();
        names.sort();
        let mut out = vec![("loss".to_string(), to_vec(&loss))];
        for k in names {
            let g = grads.get(&data[&k]).map(to_vec).unwrap_or_default();
            out.push((k, g));
        }
        out
    };
    for by_hand in [false, true] {
        let want = step(&cpu_model, &cpu_vars, &Device::Cpu, by_hand);
        let got = step(&gpu_model, &gpu_vars, &gpu, by_hand);
        for ((k, w), (_, g)) in want.iter().zip(&got) {
            assert!(
                !w.is_empty(),
                "{k}: no gradient on the CPU, by hand {by_hand}"
            );
            let e = rel_err(g, w);
            assert!(
                e < TOL,
                "pendulum: {k} CUDA vs CPU {e:e}, by hand {by_hand} (seed {seed})"
            );
        }
    }
}
