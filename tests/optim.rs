//! The optimiser: schedule, AdamW arithmetic per group, clipping, and exact resumption.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use myosotis::nn::ParamGroup;
use myosotis::train::optim::{OptimConfig, Optimizer};

/// The groups by name, for these tests' hand-made variables.
fn by_name(name: &str) -> ParamGroup {
    if name.contains(".ssm.b") {
        ParamGroup::SsmDecayed
    } else if name.contains(".ssm.") {
        ParamGroup::Ssm
    } else {
        ParamGroup::Regular
    }
}

fn cfg() -> OptimConfig {
    OptimConfig {
        lr: 0.01,
        ssm_lr: 0.002,
        lr_min: 0.0,
        weight_decay: 0.1,
        warmup_steps: 4,
        total_steps: 20,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        clip: None,
    }
}

#[test]
fn schedule_warms_up_linearly_then_decays_by_cosine() {
    let c = cfg();
    let r: Vec<f64> = (0..21).map(|s| c.rate(1.0, s)).collect();
    assert_eq!(&r[..4], &[0.25, 0.5, 0.75, 1.0]);
    assert!((r[4] - 1.0).abs() < 1e-12);
    assert!(
        (r[12] - 0.5).abs() < 1e-12,
        "half way down the cosine: {}",
        r[12]
    );
    assert!(r[20].abs() < 1e-12);
    assert!(r[4..].windows(2).all(|w| w[1] <= w[0]));
}

fn scalar_var(x: f64) -> Var {
    Var::from_tensor(&Tensor::new(&[x], &Device::Cpu).unwrap()).unwrap()
}

#[test]
fn one_step_is_adamw_with_each_groups_rate_and_decay() {
    let vars: HashMap<String, Var> = [
        ("layers.0.ssm.lambda_re".to_string(), scalar_var(1.5)),
        ("decoder.weight".to_string(), scalar_var(-2.0)),
        ("layers.0.ssm.b".to_string(), scalar_var(0.7)),
    ]
    .into_iter()
    .collect();
    let c = OptimConfig {
        warmup_steps: 0,
        ..cfg()
    };
    let mut opt = Optimizer::new(c.clone(), &vars, by_name).unwrap();
    let loss = ((vars["layers.0.ssm.lambda_re"].as_tensor() * 3.0).unwrap()
        + (vars["decoder.weight"].as_tensor() * 0.5).unwrap()
        + (vars["layers.0.ssm.b"].as_tensor() * -1.0).unwrap())
    .unwrap()
    .sum_all()
    .unwrap();
    opt.step(&loss.backward().unwrap()).unwrap();
    // t = 1: m̂ = g, v̂ = g², so the Adam part is η g/(|g| + ε) ≈ η sign(g).
    let after = |n: &str| vars[n].as_tensor().to_vec1::<f64>().unwrap()[0];
    let adam = |g: f64| g / ((g * g).sqrt() + c.eps);
    let lr0 = c.rate(c.ssm_lr, 0);
    assert!((after("layers.0.ssm.lambda_re") - (1.5 - lr0 * adam(3.0))).abs() < 1e-12);
    // The SSM learning rate with weight decay.
    let want = 0.7 - lr0 * adam(-1.0) - lr0 * c.weight_decay * 0.7;
    assert!((after("layers.0.ssm.b") - want).abs() < 1e-12);
    let lr0 = c.rate(c.lr, 0);
    assert!(
        (after("decoder.weight") - (-2.0 - lr0 * adam(0.5) - lr0 * c.weight_decay * -2.0)).abs()
            < 1e-12
    );
}

/// The gradient norm, and clipping's effect on the step: with eps far above √v the AdamW
/// update is nearly proportional to the gradient, so clipping a norm of 10 to 1 shrinks it
/// about tenfold; a norm already under the bound is left alone.
#[test]
fn clipping_scales_the_global_norm() {
    let delta = |clip: Option<f64>, slope: f64| {
        let w = scalar_var(0.0);
        let vars: HashMap<String, Var> = [("decoder.weight".to_string(), w.clone())].into();
        let config = OptimConfig {
            clip,
            eps: 1e6,
            weight_decay: 0.0,
            ..cfg()
        };
        let mut opt = Optimizer::new(config, &vars, by_name).unwrap();
        let loss = (w.as_tensor() * slope).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let norm = opt.grad_norm(&grads).unwrap().to_scalar::<f64>().unwrap();
        assert!((norm - slope.abs()).abs() < 1e-12, "norm {norm}");
        opt.step(&grads).unwrap();
        w.as_tensor().to_vec1::<f64>().unwrap()[0]
    };
    let (free, clipped) = (delta(None, 10.0), delta(Some(1.0), 10.0));
    assert!(free < 0.0, "{free}");
    // m̂ = g and √v̂ = |g| after one step: the ratio is 10 (eps + 1) / (eps + 10).
    let want = 10.0 * (1e6 + 1.0) / (1e6 + 10.0);
    assert!((free / clipped - want).abs() < 1e-9, "{free} vs {clipped}");
    assert_eq!(delta(Some(1.0), 0.5), delta(None, 0.5));
}

fn train(opt: &mut Optimizer, w: &Var, steps: usize) {
    let x = Tensor::new(&[[1.0f64, 2.0], [3.0, -1.0]], &Device::Cpu).unwrap();
    for _ in 0..steps {
        let loss = x
            .matmul(w.as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
}

#[test]
fn resumed_optimizer_continues_exactly() {
    let init = Tensor::new(&[[0.3f64], [-0.7]], &Device::Cpu).unwrap();
    let w = Var::from_tensor(&init).unwrap();
    let vars: HashMap<String, Var> = [("encoder.weight".to_string(), w.clone())]
        .into_iter()
        .collect();
    let mut a = Optimizer::new(cfg(), &vars, by_name).unwrap();
    train(&mut a, &w, 3);
    let state: HashMap<String, Tensor> = a
        .state()
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.copy().unwrap()))
        .collect();
    let w_saved = w.as_tensor().copy().unwrap();
    train(&mut a, &w, 4);
    let w2 = Var::from_tensor(&w_saved).unwrap();
    let vars2: HashMap<String, Var> = [("encoder.weight".to_string(), w2.clone())]
        .into_iter()
        .collect();
    let mut b = Optimizer::new(cfg(), &vars2, by_name).unwrap();
    b.load_state(&state).unwrap();
    assert_eq!(b.step_count(), 3);
    train(&mut b, &w2, 4);
    assert_eq!(
        w.as_tensor().to_vec2::<f64>().unwrap(),
        w2.as_tensor().to_vec2::<f64>().unwrap()
    );
    let mut missing = state.clone();
    missing.remove("adam.v.encoder.weight");
    assert!(b
        .load_state(&missing)
        .unwrap_err()
        .to_string()
        .contains("adam.v.encoder.weight"));
}

/// Each layer declares its SSM parameters; the model places every variable in a group.
#[test]
fn parameters_fall_into_the_reference_groups() {
    use candle_nn::{VarBuilder, VarMap};
    use myosotis::nn::*;
    let layers = [
        SeqLayerConfig::S5(S5Config {
            state: 4,
            blocks: 1,
            ..S5Config::default()
        }),
        SeqLayerConfig::Myo(MyoConfig {
            coupling: Coupling::Free,
            ..MyoConfig::new(
                0,
                2,
                TreeSpec::Ragged {
                    leaves: 8,
                    arity: 2,
                },
            )
        }),
        SeqLayerConfig::Ssm2d(Ssm2dConfig {
            d_model: 0,
            state: 2,
            height: 2,
            width: 4,
            directions: 2,
            seed: 0,
        }),
        SeqLayerConfig::MinGru(MinGruConfig {
            d_model: 0,
            hidden: 0,
            tanh_impulse: false,
            seed: 0,
        }),
    ];
    let ssm: [&[&str]; 4] = [
        &["lambda_re", "lambda_im", "b", "log_step"],
        &["coupling_b", "coupling_c", "b_in", "virtual_u"],
        &["dirs.0.a", "dirs.0.b", "dirs.1.a", "dirs.1.b"],
        &[],
    ];
    for (layer, ssm) in layers.into_iter().zip(ssm) {
        let varmap = VarMap::new();
        let cfg = ClassifierConfig {
            encoder: EncoderConfig::Linear { features: 1 },
            d_model: 4,
            layers: 2,
            layer,
            norm: NormKind::Batch,
            prenorm: true,
            activation: Activation::FullGlu,
            dropout: 0.0,
            pooling: Pooling::Mean,
            classes: 3,
            timing: Default::default(),
            pairs: false,
            decoder: Default::default(),
            seed: 0,
            bn_momentum: BN_MOMENTUM,
            dense_init: Default::default(),
        };
        let (cfg_layer, cfg_copy) = (cfg.layer.clone(), cfg.clone());
        let model = SequenceClassifier::new(
            cfg,
            VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu),
        )
        .unwrap();
        let names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
        for name in &names {
            let expected = if name.ends_with("running_mean") || name.ends_with("running_var") {
                ParamGroup::Frozen
            } else if name.contains(".norm.")
                || ssm.iter().any(|p| name.ends_with(&format!(".ssm.{p}")))
            {
                ParamGroup::Ssm
            } else {
                ParamGroup::Regular
            };
            assert_eq!(model.param_group(name), expected, "{name}");
        }
        // S5's other groupings (the reference's opt_config and dt_global): B̃, C̃, D, Δ.
        if let SeqLayerConfig::S5(c) = &cfg_layer {
            use ParamGroup::*;
            for (groups, dt_global, want) in [
                (S5Groups::Standard, true, [Ssm, Regular, Regular, Regular]),
                (
                    S5Groups::BAndCDecay,
                    false,
                    [SsmDecayed, Regular, Regular, Ssm],
                ),
                (
                    S5Groups::BFastAndCDecay,
                    false,
                    [Regular, Regular, Regular, Ssm],
                ),
                (S5Groups::NoBcDecay, false, [Ssm, Ssm, Ssm, Ssm]),
            ] {
                let model = SequenceClassifier::new(
                    ClassifierConfig {
                        layer: SeqLayerConfig::S5(S5Config {
                            groups,
                            dt_global,
                            ..c.clone()
                        }),
                        ..cfg_copy.clone()
                    },
                    VarBuilder::from_varmap(&VarMap::new(), candle_core::DType::F32, &Device::Cpu),
                )
                .unwrap();
                for (p, want) in ["b", "c", "d", "log_step"].iter().zip(want) {
                    let name = format!("layers.1.ssm.{p}");
                    assert_eq!(model.param_group(&name), want, "{groups:?}: {name}");
                }
                assert_eq!(model.param_group("layers.0.ssm.lambda_re"), Ssm);
            }
        }
        // Every declared SSM parameter exists, in both blocks.
        for p in ssm {
            for i in 0..2 {
                let full = format!("layers.{i}.ssm.{p}");
                assert!(names.contains(&full), "{full} not among {names:?}");
            }
        }
    }
}
