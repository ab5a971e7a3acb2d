//! The sequence classifier: gradients reach every parameter of every layer kind, checkpoints
//! round-trip exactly, masked pooling ignores padding, and dropout masks follow their key.

mod common;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use common::models::classifier as config;
use common::{assert_all_gradients, randn, to_vec};
use myosotis::nn::*;
use myosotis::train::checkpoint;

fn layer_kinds(len: usize) -> Vec<SeqLayerConfig> {
    vec![
        SeqLayerConfig::S5(S5Config {
            state: 8,
            blocks: 2,
            bidirectional: true,
            ..S5Config::default()
        }),
        SeqLayerConfig::Myo(MyoConfig {
            coupling: Coupling::Hermitian,
            seed: 1,
            ..MyoConfig::new(
                0,
                3,
                TreeSpec::Ragged {
                    leaves: len,
                    arity: 4,
                },
            )
        }),
        // The paper's coupling over all tree nodes (the default of `myo train`).
        SeqLayerConfig::Myo(MyoConfig {
            per_level: true,
            all_nodes: true,
            seed: 2,
            ..MyoConfig::new(
                0,
                3,
                TreeSpec::Ragged {
                    leaves: len,
                    arity: 4,
                },
            )
        }),
        SeqLayerConfig::Ssm2d(Ssm2dConfig {
            d_model: 0,
            state: 2,
            height: 4,
            width: len / 4,
            directions: 2,
            seed: 0,
        }),
        SeqLayerConfig::MinGru(MinGruConfig::default()),
    ]
}

const TRAIN: Mode = Mode::Train(
    DropoutKey {
        seed: 0,
        step: 0,
        first_row: 0,
        key_on_device: false,
    },
    None,
    None,
);

fn build(cfg: &ClassifierConfig) -> (VarMap, SequenceClassifier) {
    let varmap = VarMap::new();
    let model = SequenceClassifier::new(
        cfg.clone(),
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    (varmap, model)
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    let (mut rng, _) = common::seeded_rng("every_parameter_gets_a_finite_nonzero_gradient", 132);
    let len = 16;
    let x = randn(&mut rng, &[5, len, 2], DType::F32, &Device::Cpu);
    let target = Tensor::new(&[0u32, 1, 2, 3, 1], &Device::Cpu).unwrap();
    for layer in layer_kinds(len) {
        for (activation, norm) in [
            (Activation::FullGlu, NormKind::Batch),
            (Activation::HalfGlu1, NormKind::Layer),
            (Activation::HalfGlu2, NormKind::Batch),
            (Activation::Gelu, NormKind::Layer),
        ] {
            // Top-level pooling that includes the leaves (16 leaves, 4-ary: 3 levels); pooling
            // fewer levels leaves the last layer's D (a leaf skip) unused by construction.
            let pooling =
                if matches!(layer, SeqLayerConfig::Myo(_)) && activation == Activation::Gelu {
                    Pooling::TopLevels { k: 3 }
                } else {
                    Pooling::Mean
                };
            let cfg = config(layer.clone(), activation, norm, pooling);
            let (varmap, model) = build(&cfg);
            let logp = model.forward(&x, None, TRAIN).unwrap();
            assert_eq!(logp.dims(), &[5, 4]);
            let loss = candle_nn::loss::nll(&logp, &target).unwrap();
            let grads = loss.backward().unwrap();
            assert_all_gradients(
                &varmap,
                &grads,
                &["running_mean", "running_var"],
                &format!("{cfg:?}"),
            );
        }
    }
}

#[test]
fn checkpoint_round_trip_reproduces_outputs() {
    let (mut rng, _) = common::seeded_rng("checkpoint_round_trip_reproduces_outputs", 133);
    let len = 16;
    let dir = common::scratch("classifier");
    let x = randn(&mut rng, &[3, len, 2], DType::F32, &Device::Cpu);
    for layer in layer_kinds(len) {
        let cfg = config(layer, Activation::HalfGlu1, NormKind::Batch, Pooling::Mean);
        let (varmap, model) = build(&cfg);
        model.forward(&x, None, TRAIN).unwrap(); // moves the BatchNorm statistics
        let path = dir.join("model.safetensors");
        checkpoint::save(&varmap, &cfg, &path).unwrap();
        let ck = checkpoint::read::<ClassifierConfig>(&path).unwrap();
        let (varmap2, model2) = build(&ck.config);
        checkpoint::load_into(&varmap2, &ck.tensors, &path).unwrap();
        assert_eq!(
            to_vec(&model.forward(&x, None, Mode::Eval).unwrap()),
            to_vec(&model2.forward(&x, None, Mode::Eval).unwrap())
        );
    }
}

#[test]
fn masked_pooling_ignores_padding() {
    let (mut rng, _) = common::seeded_rng("masked_pooling_ignores_padding", 134);
    // A causal model (unidirectional S5): steps after a sequence's length cannot change it.
    let layer = SeqLayerConfig::S5(S5Config {
        state: 8,
        blocks: 2,
        ..S5Config::default()
    });
    for pooling in [Pooling::Mean, Pooling::Last] {
        let cfg = ClassifierConfig {
            norm: NormKind::Layer,
            prenorm: true,
            ..config(layer.clone(), Activation::Gelu, NormKind::Layer, pooling)
        };
        let (_, model) = build(&cfg);
        let x = randn(&mut rng, &[2, 10, 2], DType::F32, &Device::Cpu);
        let lengths = Tensor::new(&[6u32, 10], &Device::Cpu).unwrap();
        let noise = randn(&mut rng, &[2, 4, 2], DType::F32, &Device::Cpu);
        let x2 = Tensor::cat(&[x.narrow(1, 0, 6).unwrap(), noise], 1).unwrap();
        let a = to_vec(
            &model
                .forward(&x, Some(&lengths), Mode::Eval)
                .unwrap()
                .get(0)
                .unwrap(),
        );
        let b = to_vec(
            &model
                .forward(&x2, Some(&lengths), Mode::Eval)
                .unwrap()
                .get(0)
                .unwrap(),
        );
        assert!(
            common::rel_err(&a, &b) < 1e-6,
            "{pooling:?}: padding changed the output"
        );
    }
}

#[test]
fn token_encoder_and_myo_root_pooling() {
    // Myo over the leaves and over all nodes.
    for layer in &layer_kinds(8)[1..3] {
        let cfg = ClassifierConfig {
            encoder: EncoderConfig::Embedding { vocab: 20 },
            ..config(
                layer.clone(),
                Activation::HalfGlu2,
                NormKind::Layer,
                Pooling::Root,
            )
        };
        let (_, model) = build(&cfg);
        let tokens = Tensor::new(
            &[[1u32, 5, 7, 19, 0, 0, 3, 2], [4, 4, 4, 4, 4, 4, 4, 4]],
            &Device::Cpu,
        )
        .unwrap();
        let logp = model.forward(&tokens, None, Mode::Eval).unwrap();
        let p = to_vec(&logp.exp().unwrap().sum(D::Minus1).unwrap());
        assert!(p.iter().all(|s| (s - 1.0).abs() < 1e-5), "{cfg:?}");
    }
    // Root pooling needs Myo layers.
    let bad = config(
        layer_kinds(8)[0].clone(),
        Activation::Gelu,
        NormKind::Layer,
        Pooling::Root,
    );
    let e = SequenceClassifier::new(
        bad,
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.starts_with("pooling root needs Myo layers"), "{e}");
}

#[test]
fn dropout_masks_are_a_function_of_the_key_and_the_batch_row() {
    let (mut rng, _) = common::seeded_rng(
        "dropout_masks_are_a_function_of_the_key_and_the_batch_row",
        135,
    );
    let len = 16;
    let x = randn(&mut rng, &[5, len, 2], DType::F32, &Device::Cpu);
    for layer in layer_kinds(len) {
        let mut cfg = config(layer, Activation::HalfGlu2, NormKind::Layer, Pooling::Mean);
        cfg.dropout = 0.5;
        let (_, model) = build(&cfg);
        let run = |x: &Tensor, seed, step, first_row| {
            let key = DropoutKey {
                seed,
                step,
                first_row,
                key_on_device: false,
            };
            to_vec(
                &model
                    .forward(x, None, Mode::Train(key, None, None))
                    .unwrap(),
            )
        };
        let whole = run(&x, 3, 7, 0);
        assert_eq!(whole, run(&x, 3, 7, 0), "same key, same masks: {cfg:?}");
        assert_ne!(whole, run(&x, 3, 8, 0), "another step draws other masks");
        assert_ne!(whole, run(&x, 4, 7, 0), "another seed draws other masks");
        assert_ne!(whole, to_vec(&model.forward(&x, None, Mode::Eval).unwrap()));
        // Rows 2..5 run as a shard starting at row 2 get the whole batch's masks.
        let tail = run(&x.narrow(0, 2, 3).unwrap(), 3, 7, 2);
        let classes = whole.len() / 5;
        for (a, b) in tail.iter().zip(&whole[2 * classes..]) {
            assert!((a - b).abs() < 1e-5, "shard rows differ: {a} vs {b}");
        }
    }
}

#[test]
fn batch_norm_running_averages_decay_by_bn_momentum() {
    let (mut rng, _) = common::seeded_rng("batch_norm_running_averages_decay_by_bn_momentum", 136);
    let len = 8;
    let x = randn(&mut rng, &[4, len, 2], DType::F32, &Device::Cpu);
    let running_mean = |m: f64| {
        let mut cfg = config(
            layer_kinds(len)[0].clone(),
            Activation::Gelu,
            NormKind::Batch,
            Pooling::Mean,
        );
        cfg.dropout = 0.0;
        cfg.bn_momentum = m;
        let (varmap, model) = build(&cfg);
        model.forward(&x, None, TRAIN).unwrap();
        let data = varmap.data().lock().unwrap();
        to_vec(data["layers.0.norm.running_mean"].as_tensor())
    };
    // From zero, one step leaves (1 − m) · batch mean: the ratio of 0.5 to 0.9 is 5.
    let (a, b) = (running_mean(0.9), running_mean(0.5));
    assert!(a.iter().any(|v| v.abs() > 1e-3));
    for (a, b) in a.iter().zip(&b) {
        assert!(
            (b - 5.0 * a).abs() < 1e-4 * (1.0 + b.abs()),
            "{b} vs 5 × {a}"
        );
    }
    // Configurations written before the field existed read as the reference's 0.95.
    let cfg = config(
        layer_kinds(len)[0].clone(),
        Activation::Gelu,
        NormKind::Batch,
        Pooling::Mean,
    );
    let mut json = serde_json::to_value(&cfg).unwrap();
    json.as_object_mut().unwrap().remove("bn_momentum");
    let back: ClassifierConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back.bn_momentum, 0.95);
}

/// Dropout keep-masks: a function of (site, row, feature) only — a shard's rows equal the
/// same rows of the whole batch —, about 1 − p of the entries kept, p = 0 keeping all, and a
/// rate outside [0, 1) refused.
#[test]
fn dropout_masks_depend_on_coordinates_only() {
    use myosotis::ops::dropout_keep;
    let cpu = Device::Cpu;
    let whole = dropout_keep(77, 0, 64, 128, 0.25, DType::F32, &cpu).unwrap();
    let shard = dropout_keep(77, 40, 24, 128, 0.25, DType::F32, &cpu).unwrap();
    let rows = whole.narrow(0, 40, 24).unwrap();
    assert_eq!(
        rows.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        shard.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let kept = whole.mean_all().unwrap().to_scalar::<f32>().unwrap();
    assert!((kept - 0.75).abs() < 0.02, "kept {kept}");
    let all = dropout_keep(3, 0, 8, 8, 0.0, DType::F32, &cpu).unwrap();
    assert_eq!(all.sum_all().unwrap().to_scalar::<f32>().unwrap(), 64.0);
    let err = dropout_keep(3, 0, 8, 8, 1.0, DType::F32, &cpu).unwrap_err();
    assert!(err.to_string().contains("[0, 1)"), "{err}");
}

/// The dense layers start as `dense_init` says: PyTorch's U(±1/√fan_in) for weight and bias, or
/// Flax's truncated lecun_normal weights (|w| ≤ 2σ, σ = 1/(0.8796·√fan_in), so the standard
/// deviation is 1/√fan_in) and zero biases; the frame encoder's convolutions too.
#[test]
fn dense_layers_start_as_dense_init_says() {
    let std = |v: &[f64]| (v.iter().map(|x| x.powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    for init in [DenseInit::Uniform, DenseInit::Lecun] {
        let mut cfg = config(
            SeqLayerConfig::MinGru(MinGruConfig::default()),
            Activation::HalfGlu2,
            NormKind::Layer,
            Pooling::Mean,
        );
        (cfg.encoder, cfg.d_model, cfg.dense_init) = (EncoderConfig::Frames { side: 24 }, 64, init);
        let (varmap, _) = build(&cfg);
        let vars = varmap.data().lock().unwrap();
        // (name, fan-in, values): weights of 64 × 64, 30 × 108 and 12 × 25 values.
        for (name, fan_in) in [
            ("layers.0.out2", 64),
            ("encoder.dense1", 108),
            ("encoder.conv1", 25),
        ] {
            let w = to_vec(vars[&format!("{name}.weight")].as_tensor());
            let b = to_vec(vars[&format!("{name}.bias")].as_tensor());
            let unit = 1.0 / (fan_in as f64).sqrt();
            let largest = w.iter().fold(0f64, |m, x| m.max(x.abs()));
            let (expected_std, bound) = match init {
                DenseInit::Uniform => (unit / 3f64.sqrt(), unit),
                DenseInit::Lecun => (unit, 2.0 * unit / 0.879_625_661_034_239_8),
            };
            assert!(
                largest <= bound,
                "{init:?} {name}: |w| up to {largest}, bound {bound}"
            );
            let s = std(&w);
            assert!(
                (s / expected_std - 1.0).abs() < 0.15,
                "{init:?} {name}: weights' standard deviation {s}, expected {expected_std}"
            );
            match init {
                DenseInit::Uniform => {
                    assert!(b.iter().all(|x| *x != 0.0 && x.abs() <= unit))
                }
                DenseInit::Lecun => assert!(b.iter().all(|x| *x == 0.0), "{name}: bias {b:?}"),
            }
        }
    }
}

/// Training with the backward by hand (a [`GradSink`] in the mode, and the loss's) follows candle's
/// autograd through the same ops: 15 AdamW steps of an f64 model (dropout on; every activation;
/// LayerNorm and BatchNorm, pre- and post-norm; causal S5 also with each step discretised by
/// its own interval) give the same losses and parameters to 1e-9, and every parameter gets its
/// gradient.
#[test]
fn training_by_hand_follows_autograd() {
    use myosotis::nn::loss::log_softmax_nll;
    use myosotis::train::optim::{OptimConfig, Optimizer};
    use rand::Rng;
    let (mut rng, seed) = common::seeded_rng("training by hand", 133);
    let len = 12;
    let x = randn(&mut rng, &[5, len, 2], DType::F64, &Device::Cpu);
    let target = Tensor::new(&[0u32, 1, 2, 3, 1], &Device::Cpu).unwrap();
    let kinds = layer_kinds(len);
    // S5, and Myo over all nodes with skew couplings (the default layer), pooled by the mean
    // over the steps, and Myo also by its root and its top two levels.
    let mean = [&kinds[0], &kinds[2]].into_iter().flat_map(|l| {
        [
            (Activation::HalfGlu2, NormKind::Layer, false),
            (Activation::HalfGlu2, NormKind::Layer, true),
            (Activation::HalfGlu1, NormKind::Layer, false),
            (Activation::FullGlu, NormKind::Layer, true),
            (Activation::Gelu, NormKind::Layer, true),
            (Activation::Gelu, NormKind::Layer, false),
            (Activation::Gelu, NormKind::Batch, true),
            (Activation::HalfGlu2, NormKind::Batch, false),
        ]
        .map(|(a, n, pre)| (l, (a, n, pre, Pooling::Mean)))
    });
    let nodes = [
        (Activation::HalfGlu2, NormKind::Layer, false, Pooling::Root),
        (
            Activation::Gelu,
            NormKind::Batch,
            true,
            Pooling::TopLevels { k: 2 },
        ),
    ]
    .map(|c| (&kinds[2], c));
    // Causal S5 on samples at irregular times (`Timing::Continuous`), as the pendulum's.
    let causal = SeqLayerConfig::S5(S5Config {
        state: 8,
        blocks: 2,
        ..S5Config::default()
    });
    // The last is the pendulum's model: 8 × 8 frames through the frame encoder, a Gaussian
    // (mean, variance) regressed at every step, trained by its negative log-likelihood.
    let timed = [
        (Activation::HalfGlu2, NormKind::Layer, false, Pooling::Mean),
        (Activation::Gelu, NormKind::Batch, true, Pooling::Mean),
        (Activation::HalfGlu2, NormKind::Layer, false, Pooling::None),
    ]
    .map(|c| (&causal, c));
    let dt = common::rand_uniform(&mut rng, (0.2, 3.0), &[5, len], DType::F64, &Device::Cpu);
    let frames: Vec<f64> = (0..5 * len * 64)
        .map(|i| {
            if i % 5 == 0 {
                rng.random_range(0.0..1.0)
            } else {
                0.0
            }
        })
        .collect();
    let frames = common::tensor(&frames, &[5, len, 64], DType::F64, &Device::Cpu);
    let values = randn(&mut rng, &[5, len, 4], DType::F64, &Device::Cpu);
    let cases = mean.chain(nodes).map(|c| (c, false));
    for ((layer, (activation, norm, prenorm, pooling)), is_timed) in
        cases.chain(timed.map(|c| (c, true)))
    {
        let on_frames = is_timed && pooling == Pooling::None;
        let cfg = ClassifierConfig {
            prenorm,
            timing: match is_timed {
                true => Timing::Continuous,
                false => Timing::default(),
            },
            encoder: match on_frames {
                true => EncoderConfig::Frames { side: 8 },
                false => EncoderConfig::Linear { features: 2 },
            },
            decoder: match on_frames {
                true => Decoder::Gaussian,
                false => Decoder::Linear,
            },
            ..config(layer.clone(), activation, norm, pooling)
        };
        let dt = is_timed.then_some(&dt);
        let x = if on_frames { &frames } else { &x };
        let loss = |out: &Tensor, by_hand: bool| match on_frames {
            false => log_softmax_nll(out, &target, by_hand).unwrap().loss,
            true => {
                let nll = myosotis::nn::loss::gaussian_nll(out, &values, by_hand).unwrap();
                nll.objective
            }
        };
        let run = |by_hand: bool| {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
            let model = SequenceClassifier::new(cfg.clone(), vb).unwrap();
            let vars = varmap.data().lock().unwrap().clone();
            let optim = OptimConfig {
                lr: 0.01,
                ssm_lr: 0.002,
                lr_min: 0.0,
                weight_decay: 0.05,
                warmup_steps: 2,
                total_steps: 15,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                clip: None,
            };
            let mut opt = Optimizer::new(optim, &vars, |n| model.param_group(n)).unwrap();
            let mut losses = vec![];
            for step in 0..15 {
                let key = DropoutKey {
                    seed: 3,
                    step,
                    first_row: 0,
                    key_on_device: false,
                };
                let sink = GradSink::new();
                let mode = Mode::Train(key, None, by_hand.then_some(&sink));
                let logits = model.logits_timed(x, None, dt, mode).unwrap();
                let loss = loss(&logits, by_hand);
                let mut grads = loss.backward().unwrap();
                sink.add_to(&mut grads).unwrap();
                if step == 0 {
                    assert_all_gradients(&varmap, &grads, &["running_mean", "running_var"], "");
                }
                losses.push(loss.to_scalar::<f64>().unwrap());
                opt.step(&grads).unwrap();
            }
            let mut params: Vec<(String, Vec<f64>)> =
                vars.iter().map(|(k, v)| (k.clone(), to_vec(v))).collect();
            params.sort_by(|a, b| a.0.cmp(&b.0));
            (losses, params)
        };
        let ((want_loss, want), (got_loss, got)) = (run(false), run(true));
        let what = format!(
            "{layer:?}, {activation:?}, {norm:?}, prenorm {prenorm}, {pooling}, timed {is_timed} \
             (seed {seed})"
        );
        assert!(
            want_loss[14] < want_loss[0],
            "the run does not learn: {want_loss:?}"
        );
        let e = common::rel_err(&got_loss, &want_loss);
        assert!(
            e < 1e-9,
            "losses by hand {got_loss:?}, autograd {want_loss:?}: {e:e}, {what}"
        );
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let e = common::rel_err(g, w);
            assert!(e < 1e-9, "{name} after the run: {e:e}, {what}");
        }
    }
}

/// In f16 and bf16 the blocks run by hand too (the epilogue, the gate, the dense layers' bias
/// and LayerNorm fused in half precision, computed in f32; BatchNorm's rows normalised in f32):
/// a training pass (dropout on) of S5 and Myo models, every activation, both norms, pre- and
/// post-norm,
/// follows the same model in f32 on the half values cast up — logits, ∂x and every
/// parameter's gradient within 0.15 (bf16) and 2e-2 (f16) of its largest value. Two layers of
/// width 6 amplify the rounding in the smallest gradients (layer 1's ∂Λ): the same blocks
/// under candle's autograd in half precision miss by as much (bf16 up to 9e-2, f16 1e-2).
/// (That the blocks do go by hand in half precision is what `tests/step_ops.rs` bounds.)
#[test]
fn training_by_hand_in_half_precision_follows_f32() {
    let (mut rng, seed) = common::seeded_rng("half blocks by hand", 134);
    let len = 12;
    let kinds = layer_kinds(len);
    for layer in [&kinds[0], &kinds[2]] {
        for (activation, norm, prenorm) in [
            (Activation::Gelu, NormKind::Layer, true),
            (Activation::HalfGlu1, NormKind::Layer, false),
            (Activation::HalfGlu2, NormKind::Layer, true),
            (Activation::FullGlu, NormKind::Layer, false),
            (Activation::HalfGlu2, NormKind::Batch, true),
            (Activation::Gelu, NormKind::Batch, false),
        ] {
            let cfg = ClassifierConfig {
                prenorm,
                ..config(layer.clone(), activation, norm, Pooling::Mean)
            };
            for (dtype, tol) in [(DType::BF16, 0.15), (DType::F16, 2e-2)] {
                let what =
                    format!("{layer:?}, {activation:?}, {norm:?}, prenorm {prenorm} (seed {seed})");
                common::half::classifier_follows_f32(
                    &Device::Cpu,
                    dtype,
                    &cfg,
                    len,
                    &mut rng,
                    tol,
                    &what,
                );
            }
        }
    }
}

/// Over all tree nodes, the last block of a node pooling computes the pooled nodes alone; the
/// whole block gives the same values: with the same parameters, the mean over all 16 nodes of
/// a 12-leaf 4-ary tree (`top:3`, every node computed) is 12/16 of the mean over the leaves
/// (`mean`, every node computed) plus 4/16 of the mean over the two top levels (`top:2`, the 4
/// internal nodes alone). In evaluation and in training, by hand and by candle's autograd
/// (dropout on: its masks are per sample and feature, the same for every node).
#[test]
fn the_last_block_of_a_node_pooling_computes_the_pooled_nodes_alone() {
    let (mut rng, seed) = common::seeded_rng("pooled nodes alone", 135);
    let len = 12;
    let x = randn(&mut rng, &[3, len, 2], DType::F64, &Device::Cpu);
    let layer = layer_kinds(len)[2].clone();
    for (activation, norm, prenorm) in [
        (Activation::HalfGlu2, NormKind::Layer, false),
        (Activation::Gelu, NormKind::Layer, true),
        (Activation::FullGlu, NormKind::Batch, true),
    ] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
        let model = |pooling| {
            let cfg = ClassifierConfig {
                prenorm,
                ..config(layer.clone(), activation, norm, pooling)
            };
            SequenceClassifier::new(cfg, vb.clone()).unwrap()
        };
        let [all, leaves, top] = [
            Pooling::TopLevels { k: 3 },
            Pooling::Mean,
            Pooling::TopLevels { k: 2 },
        ]
        .map(model);
        let key = DropoutKey {
            seed: 5,
            step: 1,
            first_row: 0,
            key_on_device: false,
        };
        for by_hand in [None, Some(false), Some(true)] {
            let sink = GradSink::new();
            let mode = match by_hand {
                None => Mode::Eval,
                Some(b) => Mode::Train(key, None, b.then_some(&sink)),
            };
            let f = |m: &SequenceClassifier| to_vec(&m.features(&x, None, mode).unwrap());
            let (want, l, t) = (f(&all), f(&leaves), f(&top));
            let got: Vec<f64> = l
                .iter()
                .zip(&t)
                .map(|(l, t)| (12.0 * l + 4.0 * t) / 16.0)
                .collect();
            let e = common::rel_err(&got, &want);
            assert!(
                e < 1e-12,
                "{activation:?}, {norm:?}, prenorm {prenorm}, by hand {by_hand:?}: {e:e} (seed {seed})"
            );
        }
    }
}
