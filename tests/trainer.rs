//! The training loop on generated ListOps: loss goes down, evaluation is consistent, a
//! malformed batch is an error.

use std::collections::HashMap;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use myosotis::data::listops::{generate, tokenize, ListOpsConfig, VOCAB};
use myosotis::nn::*;
use myosotis::train::optim::{OptimConfig, Optimizer};
use myosotis::train::trainer::{evaluate, train_epoch, Batching, Dataset};

fn listops(n: usize, seed: u64) -> Dataset {
    let cfg = ListOpsConfig {
        max_depth: 4,
        max_args: 4,
        min_length: 4,
        max_length: 40,
        seed,
    };
    let exprs = generate(&cfg, n).unwrap();
    Dataset::Tokens {
        seqs: exprs.iter().map(|e| tokenize(&e.to_lra_string())).collect(),
        labels: exprs.iter().map(|e| e.value() as u32).collect(),
    }
}

fn model(layer: SeqLayerConfig, pooling: Pooling) -> (VarMap, SequenceClassifier) {
    let cfg = ClassifierConfig {
        encoder: EncoderConfig::Embedding { vocab: VOCAB },
        d_model: 16,
        layers: 2,
        layer,
        norm: NormKind::Layer,
        prenorm: true,
        activation: Activation::HalfGlu1,
        dropout: 0.0,
        pooling,
        classes: 10,
        seed: 0,
    };
    let varmap = VarMap::new();
    let m = SequenceClassifier::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    (varmap, m)
}

fn optimizer(varmap: &VarMap, steps: usize) -> Optimizer {
    let vars: HashMap<_, _> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let cfg = OptimConfig {
        lr: 0.01,
        ssm_lr: 0.003,
        lr_min: 0.0,
        weight_decay: 0.01,
        warmup_steps: 2,
        total_steps: steps,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        clip: Some(5.0),
    };
    Optimizer::new(cfg, &vars, |n| {
        n.ends_with("running_mean") || n.ends_with("running_var")
    })
    .unwrap()
}

#[test]
fn training_on_listops_lowers_the_loss() {
    let data = listops(64, 1);
    let layers = [
        (
            SeqLayerConfig::S5(S5Config {
                state: 8,
                blocks: 2,
                bidirectional: true,
                ..S5Config::default()
            }),
            None,
            Pooling::Mean,
        ),
        (
            SeqLayerConfig::Myo(MyoConfig {
                d_model: 0,
                heads: 4,
                tree: TreeSpec::Ragged {
                    leaves: 40,
                    arity: 2,
                },
                per_level: false,
                symmetric: true,
                block: 1,
                dt_min: 0.001,
                dt_max: 0.1,
                seed: 0,
            }),
            Some(40),
            Pooling::Mean,
        ),
    ];
    for (layer, pad_to, pooling) in layers {
        let (varmap, m) = model(layer.clone(), pooling);
        let batching = Batching {
            batch_size: 16,
            pad_to,
        };
        let epochs = 12;
        let mut opt = optimizer(&varmap, epochs * 4);
        let before = evaluate(&m, &data, batching, &Device::Cpu).unwrap();
        let mut seen = 0;
        for e in 0..epochs {
            train_epoch(
                &m,
                &mut opt,
                &data,
                batching,
                e as u64,
                &Device::Cpu,
                |n, loss| {
                    assert!(loss.is_finite());
                    seen += n;
                },
            )
            .unwrap();
        }
        assert_eq!(seen, epochs * 64);
        let after = evaluate(&m, &data, batching, &Device::Cpu).unwrap();
        assert!(
            after.loss < 0.9 * before.loss,
            "{layer:?}: loss {} -> {}",
            before.loss,
            after.loss
        );
        assert!((0.0..=1.0).contains(&after.accuracy));
    }
}

#[test]
fn sequences_longer_than_the_padding_are_errors() {
    let data = listops(8, 2);
    let err = data
        .batch(&[0, 1, 2], Some(3), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokens"), "{err}");
}
