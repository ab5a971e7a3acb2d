//! The training loop on generated ListOps: loss goes down, evaluation is consistent, a
//! malformed batch is an error.

use std::collections::HashMap;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use myosotis::data::dataset::Dataset;
use myosotis::data::listops::{generate, tokenize, ListOpsConfig, VOCAB};
use myosotis::nn::*;
use myosotis::train::dist::World;
use myosotis::train::optim::{OptimConfig, Optimizer};
use myosotis::train::trainer::{evaluate, train_epoch, Batching};

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

fn model(layer: SeqLayerConfig, pooling: Pooling, dropout: f64) -> (VarMap, SequenceClassifier) {
    model_with(layer, pooling, dropout, NormKind::Layer)
}

fn model_with(
    layer: SeqLayerConfig,
    pooling: Pooling,
    dropout: f64,
    norm: NormKind,
) -> (VarMap, SequenceClassifier) {
    let cfg = ClassifierConfig {
        encoder: EncoderConfig::Embedding { vocab: VOCAB },
        d_model: 16,
        layers: 2,
        layer,
        norm,
        prenorm: true,
        activation: Activation::HalfGlu1,
        dropout,
        pooling,
        classes: 10,
        timing: Default::default(),
        pairs: false,
        decoder: Default::default(),
        seed: 0,
        bn_momentum: BN_MOMENTUM,
        dense_init: Default::default(),
    };
    let varmap = VarMap::new();
    let m = SequenceClassifier::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    (varmap, m)
}

/// The model's variables by name.
fn vars_of(varmap: &VarMap) -> HashMap<String, candle_core::Var> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn optimizer(model: &SequenceClassifier, varmap: &VarMap, steps: usize) -> Optimizer {
    Optimizer::new(optim_config(steps), &vars_of(varmap), |n| {
        model.param_group(n)
    })
    .unwrap()
}

fn optim_config(steps: usize) -> OptimConfig {
    OptimConfig {
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
    }
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
                coupling: Coupling::Hermitian,
                ..MyoConfig::new(
                    0,
                    4,
                    TreeSpec::Ragged {
                        leaves: 40,
                        arity: 2,
                    },
                )
            }),
            Some(40),
            Pooling::Mean,
        ),
    ];
    for (layer, pad_to, pooling) in layers {
        let (varmap, m) = model(layer.clone(), pooling, 0.0);
        let batching = Batching {
            batch_size: 16,
            pad_to,
            bucketed: false,
            longest: None,
            shards: 2,
            accumulate: 1,
            batch_norm: false,
        };
        let epochs = 12;
        let mut opt = optimizer(&m, &varmap, epochs * 4);
        // Every other step keeps its rate and gradient norm, read back with its batch's loss
        // in groups of 1 to 3, each stamped when its step was queued.
        opt.log_every(2);
        let mut logged = vec![];
        let before = evaluate(&m, &data, batching, &Device::Cpu, &World::single()).unwrap();
        let mut seen = 0;
        for e in 0..epochs {
            train_epoch(
                &m,
                &mut opt,
                &data,
                batching,
                e as u64,
                &Device::Cpu,
                1 + e % 3,
                &std::sync::Arc::new(World::single()),
                |r| {
                    assert!(r.loss.is_finite() && r.correct <= r.samples);
                    seen += r.samples;
                    if let Some((lr, norm)) = r.logged {
                        assert!(lr > 0.0 && norm.is_finite() && norm > 0.0, "{r:?}");
                        logged.push((r.step, r.queued));
                    }
                },
            )
            .unwrap();
        }
        assert_eq!(seen, epochs * 64);
        let steps: Vec<usize> = logged.iter().map(|l| l.0).collect();
        assert_eq!(steps, (1..=epochs * 2).map(|k| 2 * k).collect::<Vec<_>>());
        assert!(
            logged.windows(2).all(|w| w[0].1 < w[1].1),
            "queue times not increasing"
        );
        let after = evaluate(&m, &data, batching, &Device::Cpu, &World::single()).unwrap();
        assert!(
            after.loss < 0.9 * before.loss,
            "{layer:?}: loss {} -> {}",
            before.loss,
            after.loss
        );
        assert!((0.0..=1.0).contains(&after.accuracy.unwrap()));
    }
}

/// Token batches take the batch's longest rounded up to a quarter of the split's longest (at
/// most to it): at most four lengths, one captured step each on CUDA. A tree's padding and
/// sequences of one length are left as they are.
#[test]
fn batches_padded_per_batch_take_at_most_four_lengths() {
    let lens = [10, 17, 33, 64, 50, 1, 48, 49];
    let data = Dataset::Tokens {
        seqs: lens.iter().map(|&n| vec![1; n]).collect(),
        labels: vec![0; lens.len()],
    };
    let batching = |pad_to, bucketed| Batching {
        batch_size: 1,
        pad_to,
        bucketed,
        longest: None,
        shards: 1,
        accumulate: 1,
        batch_norm: false,
    };
    let pads = |b: Batching, data: &Dataset| -> Vec<Option<usize>> {
        let b = b.over(data);
        (0..data.len()).map(|i| b.padding(data, &[i])).collect()
    };
    let expect = |v: &[usize]| v.iter().map(|&n| Some(n)).collect::<Vec<_>>();
    assert_eq!(
        pads(batching(None, true), &data),
        expect(&[16, 32, 48, 64, 64, 16, 48, 64])
    );
    assert_eq!(pads(batching(None, false), &data), expect(&lens));
    assert_eq!(pads(batching(Some(64), true), &data), expect(&[64; 8]));
    // The batch's longest decides, for every shard of it.
    let b = batching(None, true).over(&data);
    assert_eq!(b.padding(&data, &[0, 2]), Some(48));
    // A split whose longest is 50: a quarter rounds up to 13, so 13, 26, 39, then 50.
    let short = Dataset::Pairs {
        first: lens.iter().map(|&n| vec![1; n.min(50)]).collect(),
        second: vec![vec![1; 2]; lens.len()],
        labels: vec![0; lens.len()],
    };
    assert_eq!(
        pads(batching(None, true), &short),
        expect(&[13, 26, 39, 50, 50, 13, 50, 50])
    );
    let real = Dataset::Real {
        values: vec![0.0; 6],
        len: 3,
        features: 1,
        labels: vec![0, 1],
    };
    assert_eq!(pads(batching(None, true), &real), vec![None, None]);
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

/// A batch cut into data-parallel shards (uneven: 6 + 5 + 5) takes the same step as the whole
/// batch, dropout and BatchNorm included: the same loss and correct count, the same gradient
/// (seen through an update that is linear in it: Adam with a large ε, so Δθ ≈ −lr·g) and the
/// same BatchNorm running averages (statistics of each shard alone would move them apart). So do
/// 4 micro-batches of 4 (`accumulate`), alone or in 2 shards each, with LayerNorm (BatchNorm
/// normalises each micro-batch by its own statistics).
#[test]
fn sharded_batches_take_the_same_step() {
    for norm in [NormKind::Layer, NormKind::Batch] {
        sharded_batch_takes_the_same_step(norm);
    }
}

fn sharded_batch_takes_the_same_step(norm: NormKind) {
    let data = listops(16, 7);
    // Bidirectional: the reverse scan sees the padding, so shards must pad as the whole batch.
    let s5 = SeqLayerConfig::S5(S5Config {
        state: 8,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    });
    let mut deltas = Vec::new();
    let mut reports = Vec::new();
    let mut cases = vec![(1, 1, 16), (3, 1, 16)];
    if norm == NormKind::Layer {
        cases.extend([(1, 4, 4), (2, 4, 4)]);
    }
    for &(shards, accumulate, batch_size) in &cases {
        // With dropout: each shard draws the whole batch's masks for its rows.
        let (varmap, m) = model_with(s5.clone(), Pooling::Mean, 0.3, norm);
        let vars = vars_of(&varmap);
        let before: HashMap<String, Vec<f32>> = vars
            .iter()
            .map(|(k, v)| (k.clone(), v.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        let cfg = OptimConfig {
            lr: 1e-3,
            ssm_lr: 1e-3,
            lr_min: 1e-3,
            weight_decay: 0.0,
            warmup_steps: 0,
            total_steps: 1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e3,
            clip: None,
        };
        let mut opt = Optimizer::new(cfg, &vars, |n| m.param_group(n)).unwrap();
        let batching = Batching {
            batch_size,
            pad_to: None,
            bucketed: false,
            longest: None,
            shards,
            accumulate,
            batch_norm: norm == NormKind::Batch,
        };
        train_epoch(
            &m,
            &mut opt,
            &data,
            batching,
            0,
            &Device::Cpu,
            1,
            &std::sync::Arc::new(World::single()),
            |r| reports.push((r.samples, r.loss, r.correct)),
        )
        .unwrap();
        // The trained parameters' update and BatchNorm's running averages, apart: the
        // averages move far more in one step and would hide a difference in the gradient.
        let (mut trained, mut running) = (Vec::new(), Vec::new());
        let mut names: Vec<_> = vars.keys().cloned().collect();
        names.sort();
        for k in names {
            let after: Vec<f32> = vars[&k].flatten_all().unwrap().to_vec1().unwrap();
            let delta = after.iter().zip(&before[&k]).map(|(a, b)| (a - b) as f64);
            if k.contains("running_") {
                running.extend(delta)
            } else {
                trained.extend(delta)
            }
        }
        deltas.push([trained, running]);
    }
    assert_eq!(reports.len(), cases.len());
    assert_eq!(deltas[0][1].is_empty(), norm == NormKind::Layer);
    for (case, (report, delta)) in cases.iter().zip(reports.iter().zip(&deltas)).skip(1) {
        assert_eq!(
            (reports[0].0, reports[0].2),
            (report.0, report.2),
            "{case:?}"
        );
        assert!(
            (reports[0].1 - report.1).abs() < 1e-5 * reports[0].1.abs(),
            "{case:?}"
        );
        for (what, whole, parts) in [
            ("update", &deltas[0][0], &delta[0]),
            ("running averages' change", &deltas[0][1], &delta[1]),
        ] {
            let scale = whole.iter().fold(0f64, |m, v| m.max(v.abs()));
            let diff = whole
                .iter()
                .zip(parts)
                .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                whole.is_empty() || (scale > 0.0 && diff < 1e-3 * scale),
                "{norm:?} {case:?}: {what} differs: {diff:e} of {scale:e}"
            );
        }
    }
}

/// A learning rate of 10³⁸ (for the SSM parameters `ssm_lr`) spoils the parameters in step 1,
/// so step 2's loss is the first non-finite one.
fn diverging(
    vars: &HashMap<String, candle_core::Var>,
    m: &SequenceClassifier,
    ssm_lr: f64,
) -> Optimizer {
    let cfg = OptimConfig {
        lr: 1e38,
        ssm_lr,
        warmup_steps: 0,
        ..optim_config(8)
    };
    Optimizer::new(cfg, vars, |n| m.param_group(n)).unwrap()
}

/// The error of an epoch in batches of 8 (one shard, no BatchNorm) that must fail; `on_batch`
/// sees each reported batch's size and loss.
fn failed_epoch(
    m: &SequenceClassifier,
    opt: &mut Optimizer,
    data: &Dataset,
    pad_to: Option<usize>,
    report_every: usize,
    mut on_batch: impl FnMut(usize, f64),
) -> String {
    let batching = Batching {
        batch_size: 8,
        pad_to,
        bucketed: false,
        longest: None,
        shards: 1,
        accumulate: 1,
        batch_norm: false,
    };
    let world = std::sync::Arc::new(World::single());
    train_epoch(
        m,
        opt,
        data,
        batching,
        0,
        &Device::Cpu,
        report_every,
        &world,
        |r| on_batch(r.samples, r.loss),
    )
    .unwrap_err()
    .to_string()
}

/// The losses are read back in groups (here every 4 batches), and the first non-finite one
/// stops the epoch with its own step number.
#[test]
fn a_non_finite_loss_stops_the_epoch_naming_its_step() {
    let data = listops(64, 3);
    let layer = SeqLayerConfig::S5(S5Config {
        state: 4,
        blocks: 1,
        ..S5Config::default()
    });
    let (varmap, m) = model(layer, Pooling::Mean, 0.0);
    let vars = vars_of(&varmap);
    let mut opt = diverging(&vars, &m, 1e38);
    let mut seen = Vec::new();
    let err = failed_epoch(&m, &mut opt, &data, None, 4, |n, l| seen.push((n, l)));
    assert!(err.contains("training loss is NaN at step 2"), "{err}");
    assert_eq!(
        seen.len(),
        1,
        "the batch before the NaN is reported: {seen:?}"
    );
    assert!(seen[0].1.is_finite());
}

/// The threads of a batch meet at each sum and leave with the parts added in shard order; a
/// shard that fails releases the ones waiting for it with an error naming it. The parts sum to
/// a different f32 in most other orders (in shard order 1 is absorbed by 3·10⁷: 0.75; in
/// arrival order, last shard first: 1), and the shards arrive last first.
#[test]
fn thread_shards_sum_in_order_and_a_failed_shard_releases_the_others() {
    use myosotis::train::shards::ThreadGroup;
    let part = |v: f32| candle_core::Tensor::new(&[v, 2.0 * v], &Device::Cpu).unwrap();
    let values = [1.0f32, 3.0e7, -3.0e7, 0.75];
    let group = ThreadGroup::new(values.len());
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let (shard, t) = (group.shard(i), part(v));
                let wait = std::time::Duration::from_millis(30 * (values.len() - i) as u64);
                s.spawn(move || {
                    std::thread::sleep(wait);
                    shard.sum(&t).unwrap().to_vec1().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![vec![0.75, 1.5]; values.len()]);
    let group = ThreadGroup::new(2);
    let err = std::thread::scope(|s| {
        let waiting = s.spawn(|| group.shard(0).sum(&part(1.0)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        group.fail(1);
        waiting.join().unwrap().unwrap_err().to_string()
    });
    assert!(err.contains("shard 1 of the batch failed"), "{err}");
}

/// A Myo layer's tree solve fails on the parameters a non-finite loss left behind (a singular
/// pivot in step 3, before step 2's loss has been read: the SSM parameters, Myo's couplings
/// among them, stay finite until step 2's NaN gradient): the epoch still stops naming the
/// loss and its step, not the pivot.
#[test]
fn a_pivot_error_after_a_non_finite_loss_names_the_loss() {
    let data = listops(64, 3);
    let tree = TreeSpec::Ragged {
        leaves: 40,
        arity: 2,
    };
    let layer = SeqLayerConfig::Myo(MyoConfig::new(0, 4, tree));
    let (varmap, m) = model(layer, Pooling::Mean, 0.0);
    let vars = vars_of(&varmap);
    let mut opt = diverging(&vars, &m, 1e-3);
    let err = failed_epoch(&m, &mut opt, &data, Some(40), 8, |_, _| {});
    assert!(err.contains("training loss is NaN at step 2"), "{err}");
}
