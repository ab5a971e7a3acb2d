//! A tiny end-to-end run on generated ListOps: metrics and checkpoints are written, loss goes
//! down, `eval` reloads the best checkpoint to the accuracy the run recorded, and a resumed run
//! equals an uninterrupted one.

use candle_core::Device;
use myosotis::nn::*;
use myosotis::train::optim::OptimConfig;
use myosotis::train::run::{eval_checkpoint, train, Event, Exec, RunConfig, Start, TaskConfig};

fn config(epochs: usize) -> RunConfig {
    RunConfig {
        task: TaskConfig::ListopsGenerated {
            train: 96,
            val: 32,
            test: 32,
            max_depth: 3,
            max_args: 4,
            min_length: 4,
            max_length: 24,
            seed: 5,
        },
        model: ClassifierConfig {
            encoder: EncoderConfig::Embedding {
                vocab: myosotis::data::listops::VOCAB,
            },
            d_model: 16,
            layers: 1,
            layer: SeqLayerConfig::S5(S5Config {
                state: 8,
                blocks: 2,
                bidirectional: true,
                ..S5Config::default()
            }),
            norm: NormKind::Layer,
            prenorm: true,
            activation: Activation::HalfGlu2,
            dropout: 0.0,
            pooling: Pooling::Mean,
            classes: 10,
            seed: 0,
            bn_momentum: BN_MOMENTUM,
        },
        optim: OptimConfig {
            lr: 0.01,
            ssm_lr: 0.004,
            lr_min: 0.0,
            weight_decay: 0.01,
            warmup_steps: 3,
            total_steps: 0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: None,
        },
        epochs,
        batch_size: 16,
        seed: 3,
        max_train_samples: None,
        max_eval_samples: None,
        warmup_epochs: None,
    }
}

fn out(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("myosotis-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn metrics(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn tiny_run_writes_outputs_and_eval_reproduces_its_accuracy() {
    let dir = out("tiny");
    let summary = train(
        &config(6),
        &dir,
        &Exec::on(&Device::Cpu),
        Start::New,
        |_| {},
    )
    .unwrap();
    for f in [
        "config.json",
        "metrics.jsonl",
        "best.safetensors",
        "last.safetensors",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let m = metrics(&dir);
    let train_losses: Vec<f64> = m
        .iter()
        .filter(|r| r["split"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(train_losses.len(), 6);
    assert!(
        train_losses[5] < train_losses[0],
        "loss went down: {train_losses:?}"
    );
    for r in &m {
        for key in ["epoch", "split", "loss", "accuracy", "step", "seconds"] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
    }
    // The folder now holds a run: a new one there is refused unless it replaces it.
    let cpu = Exec::on(&Device::Cpu);
    let err = train(&config(1), &dir, &cpu, Start::New, |_| {}).unwrap_err();
    assert!(err.to_string().contains("already holds a run"), "{err}");
    let e = eval_checkpoint(&dir.join("best.safetensors"), None, &Exec::on(&Device::Cpu)).unwrap();
    assert!(
        (e.accuracy - summary.test_accuracy).abs() < 1e-12,
        "eval {} vs run {}",
        e.accuracy,
        summary.test_accuracy
    );
    let replaced = train(&config(1), &dir, &cpu, Start::Replace, |_| {}).unwrap();
    assert_eq!(replaced.epochs, 1);
    assert_eq!(
        metrics(&dir)
            .iter()
            .filter(|r| r["split"] == "train")
            .count(),
        1
    );
}

#[test]
fn resumed_run_equals_the_uninterrupted_run() {
    let (a, b) = (out("whole"), out("resumed"));
    // Two data-parallel shards: summation in shard order keeps the run deterministic.
    let two = Exec {
        device: Device::Cpu,
        shards: 2,
    };
    // With dropout: its masks are keyed by the step, so the resumed run draws the same ones.
    let config = |epochs| {
        let mut c = config(epochs);
        c.model.dropout = 0.2;
        c
    };
    train(&config(4), &a, &two, Start::New, |_| {}).unwrap();
    // Interrupt after two epochs: a run asked for 4 epochs that stops early.
    let mut stop = 0;
    let interrupted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train(&config(4), &b, &two, Start::New, |ev| {
            if let Event::EpochEnd { epoch, .. } = ev {
                stop = epoch;
                if epoch == 2 {
                    panic!("interrupted");
                }
            }
        })
    }));
    assert!(interrupted.is_err() && stop == 2);
    train(&config(4), &b, &two, Start::Resume, |_| {}).unwrap();
    let strip = |v: Vec<serde_json::Value>| -> Vec<(String, String, String)> {
        v.into_iter()
            .map(|r| {
                (
                    r["epoch"].to_string(),
                    r["split"].to_string(),
                    format!("{} {}", r["loss"], r["accuracy"]),
                )
            })
            .collect()
    };
    assert_eq!(strip(metrics(&a)), strip(metrics(&b)));
    // The same checkpoint, to the byte.
    let bytes = |d: &std::path::Path| std::fs::read(d.join("last.safetensors")).unwrap();
    assert!(bytes(&a) == bytes(&b), "last.safetensors differs");
    // A different configuration cannot resume this run.
    let other = RunConfig {
        batch_size: 8,
        ..config(4)
    };
    assert!(
        train(&other, &b, &Exec::on(&Device::Cpu), Start::Resume, |_| {})
            .unwrap_err()
            .to_string()
            .contains("different configuration")
    );
}

/// Synthetic MNIST IDX files: class k has pixels around brightness 22k, plus noise (a task any
/// sequence model with mean pooling can learn; the pipeline is under test here, not vision).
fn synthetic_mnist(dir: &std::path::Path, train: usize, test: usize) {
    use rand::{Rng, SeedableRng};
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (split, n) in [("train", train), ("t10k", test)] {
        let (mut images, mut labels) = (vec![], vec![]);
        for x in [2051u32, n as u32, 28, 28] {
            images.extend(x.to_be_bytes());
        }
        for x in [2049u32, n as u32] {
            labels.extend(x.to_be_bytes());
        }
        for _ in 0..n {
            let k: u8 = rng.random_range(0..10);
            labels.push(k);
            for _ in 0..28 * 28 {
                images.push(22 * k + rng.random_range(0..30));
            }
        }
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte")), images).unwrap();
        std::fs::write(dir.join(format!("{split}-labels-idx1-ubyte")), labels).unwrap();
    }
}

#[test]
fn image_tasks_train_from_idx_files() {
    use myosotis::train::run::ImageTask;
    let data = out("mnist-data");
    synthetic_mnist(&data, 300, 100);
    for (task, layer) in [
        (
            ImageTask::Zmnist,
            SeqLayerConfig::Myo(MyoConfig {
                per_level: true,
                coupling: Coupling::Hermitian,
                ..MyoConfig::new(
                    0,
                    4,
                    TreeSpec::Quad {
                        height: 28,
                        width: 28,
                    },
                )
            }),
        ),
        (
            ImageTask::Smnist,
            SeqLayerConfig::S5(S5Config {
                state: 8,
                blocks: 2,
                bidirectional: true,
                ..S5Config::default()
            }),
        ),
    ] {
        let mut cfg = config(4);
        cfg.task = TaskConfig::Image {
            task,
            dir: data.clone(),
        };
        cfg.model.encoder = EncoderConfig::Linear { features: 1 };
        cfg.model.layer = layer;
        let dir = out(&format!("{task:?}"));
        let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
        eprintln!("{task:?}: test accuracy {}", summary.test_accuracy);
        assert!(
            summary.test_accuracy > 0.3,
            "{task:?}: test accuracy {} (chance 0.1)",
            summary.test_accuracy
        );
        let e =
            eval_checkpoint(&dir.join("best.safetensors"), None, &Exec::on(&Device::Cpu)).unwrap();
        assert!((e.accuracy - summary.test_accuracy).abs() < 1e-12);
    }
}
