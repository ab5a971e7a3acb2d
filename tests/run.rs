//! A tiny end-to-end run on generated ListOps: metrics and checkpoints are written, loss goes
//! down, `eval` reloads the best checkpoint to the accuracy the run recorded, and a resumed run
//! equals an uninterrupted one.

mod common;

use candle_core::Device;
use common::runs::{metrics, out, synthetic_mnist};
use myosotis::data::task::{self, DataSource, Generated};
use myosotis::nn::*;
use myosotis::train::config::{Monitor, RunConfig};
use myosotis::train::optim::OptimConfig;
use myosotis::train::progress::Event;
use myosotis::train::run::{eval_checkpoint, train, Exec, Start, TestScore};

/// The ListOps task with sequences of at most `max_len` tokens.
fn listops_task(max_len: usize) -> task::Task {
    task::Task {
        input: task::Input::Listops { max_len },
        ..task::find("listops").unwrap()
    }
}

fn config(epochs: usize) -> RunConfig {
    RunConfig {
        task: listops_task(24),
        data: DataSource::Generated(Generated {
            train: 96,
            val: 32,
            test: 32,
            max_depth: 3,
            max_args: 4,
            min_length: 4,
            max_length: 24,
            seed: 5,
        }),
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
            timing: Default::default(),
            pairs: false,
            decoder: Default::default(),
            seed: 0,
            bn_momentum: BN_MOMENTUM,
            dense_init: Default::default(),
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
        early_stop: None,
        eval_every: None,
        monitor: Default::default(),
        accumulate: 1,
        precision: Default::default(),
    }
}

/// The score of `dir`'s best checkpoint on the first `max` test examples (all with `None`).
fn eval_best(dir: &std::path::Path, max: Option<usize>) -> TestScore {
    eval_checkpoint(
        &dir.join("best.safetensors"),
        None,
        max,
        &Exec::on(&Device::Cpu),
    )
    .unwrap()
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
    let e = eval_best(&dir, None);
    assert!(
        (e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12,
        "eval {} vs run {}",
        e.accuracy.unwrap(),
        summary.test_accuracy.unwrap()
    );
    assert_eq!(e.examples, 32, "the whole test split");
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
        shards: 2,
        ..Exec::on(&Device::Cpu)
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
    let e = train(&other, &b, &Exec::on(&Device::Cpu), Start::Resume, |_| {}).unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("batch_size is 16 in the run, 8 now"), "{e}");
}

#[test]
fn image_tasks_train_from_idx_files() {
    let data = out("mnist-data");
    synthetic_mnist(&data, 300, 100);
    for (task, layer) in [
        (
            "zmnist",
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
            "smnist",
            SeqLayerConfig::S5(S5Config {
                state: 8,
                blocks: 2,
                bidirectional: true,
                ..S5Config::default()
            }),
        ),
    ] {
        let mut cfg = config(4);
        cfg.task = task::find(task).unwrap();
        cfg.data = DataSource::Dir {
            dir: data.to_path_buf(),
        };
        cfg.model.encoder = EncoderConfig::Linear { features: 1 };
        cfg.model.layer = layer;
        let dir = out(task);
        let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
        eprintln!("{task}: test accuracy {}", summary.test_accuracy.unwrap());
        assert!(
            summary.test_accuracy.unwrap() > 0.3,
            "{task}: test accuracy {} (chance 0.1)",
            summary.test_accuracy.unwrap()
        );
        let e = eval_best(&dir, None);
        assert!((e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12);
    }
}

/// A run whose one step per epoch spoils the parameters (a learning rate of 10³⁸) has a finite
/// training loss but a NaN validation loss: it stops there with an error, and the diverged model
/// is saved neither as the best nor as the last checkpoint.
#[test]
fn a_non_finite_validation_loss_stops_the_run() {
    let mut cfg = config(2);
    cfg.max_train_samples = Some(16);
    cfg.optim.lr = 1e38;
    let dir = out("nan-val");
    let err = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.contains("the validation loss is NaN after epoch 1; stopping"),
        "{err}"
    );
    let train_loss = metrics(&dir)
        .iter()
        .find(|r| r["split"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .unwrap();
    assert!(train_loss.is_finite(), "{train_loss}");
    for f in ["best.safetensors", "last.safetensors"] {
        assert!(!dir.join(f).exists(), "{f} was written");
    }
}

/// Trains the run the command-line `flags` describe into a fresh folder `name` (one thread).
fn train_flags(name: &str, flags: &[&str]) -> (myosotis::train::run::Summary, common::Scratch) {
    let cfg = myosotis::train::config::RunArgs::from_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let dir = out(name);
    let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
    (summary, dir)
}

/// The layers and options the command line reaches beyond S5 and Myo's defaults: the 2-D SSM
/// and S5's bilinear discretisation learn the synthetic digits from `myo train`'s flags.
#[test]
fn ssm2d_and_bilinear_s5_learn_digits_from_the_command_line() {
    let data = out("mnist-data-flags");
    synthetic_mnist(&data, 300, 100);
    let data = data.to_str().unwrap();
    let common = [
        "--task",
        "smnist",
        "--data-dir",
        data,
        "--d-model",
        "8",
        "--state-size",
        "4",
        "--layers",
        "1",
        "--epochs",
        "4",
        "--batch-size",
        "16",
        "--lr",
        "0.01",
        "--warmup-steps",
        "5",
    ];
    // The runs' folders stay until the end: the last one's checkpoint is evaluated below.
    let mut runs = Vec::new();
    let mut checkpoint = std::path::PathBuf::new();
    for (name, extra) in [
        ("ssm2d", &["--model", "ssm2d", "--directions", "2"][..]),
        (
            "bilinear",
            &["--model", "s5", "--discretization", "bilinear"][..],
        ),
    ] {
        let flags: Vec<&str> = common.iter().chain(extra).copied().collect();
        let (summary, dir) = train_flags(name, &flags);
        eprintln!("{name}: test accuracy {}", summary.test_accuracy.unwrap());
        assert!(
            summary.test_accuracy.unwrap() > 0.3,
            "{name}: test accuracy {} (chance 0.1)",
            summary.test_accuracy.unwrap()
        );
        let e = eval_best(&dir, None);
        assert!(
            (e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12,
            "{name}"
        );
        assert_eq!(e.examples, 100, "{name}: the whole test split");
        checkpoint = dir.join("best.safetensors");
        runs.push(dir);
    }
    // `myo eval` needs the test files alone, and --max-samples limits what it scores.
    let test_only = out("mnist-test-only");
    std::fs::create_dir_all(&test_only).unwrap();
    for f in ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
        std::fs::copy(std::path::Path::new(data).join(f), test_only.join(f)).unwrap();
    }
    let eval = |extra: &[&str]| -> serde_json::Value {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
            .args(["eval", "--threads", "1", "--checkpoint"])
            .arg(&checkpoint)
            .arg("--data-dir")
            .arg(&test_only)
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{stderr}");
        serde_json::from_slice(&run.stdout).unwrap()
    };
    let (all, first) = (eval(&[]), eval(&["--max-samples", "10"]));
    assert_eq!(all["examples"], 100, "{all}");
    assert_eq!(first["examples"], 10, "{first}");
}

/// Myo with a chain tree (`--tree chain`, Myo as a state-space model) trains on the built-in
/// ListOps generator: finite losses every epoch, and the checkpoint evaluates to the recorded
/// accuracy.
#[test]
fn myo_with_a_chain_tree_trains_on_generated_listops() {
    let (summary, dir) = train_flags(
        "chain",
        &[
            "--model",
            "myo",
            "--tree",
            "chain",
            "--d-model",
            "16",
            "--state-size",
            "8",
            "--layers",
            "1",
            "--epochs",
            "2",
            "--max-train-samples",
            "128",
            "--max-eval-samples",
            "64",
        ],
    );
    let cfg: RunConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    match &cfg.model.layer {
        SeqLayerConfig::Myo(m) => assert_eq!(m.tree, TreeSpec::Chain { len: 64 }),
        other => panic!("{other:?}"),
    }
    for r in metrics(&dir) {
        assert!(r["loss"].as_f64().unwrap().is_finite(), "{r}");
    }
    // The run scored the first 64 test examples; so does eval when told to.
    let e = eval_best(&dir, Some(64));
    assert!((e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12);
    assert_eq!(e.examples, 64);
}

/// A task is one [`task::Task`] value: one defined here (MNIST with the pixels in a random
/// order of its own, normalised differently, under a Myo binary tree) trains end to end and
/// its checkpoint evaluates on it without the registry knowing it.
#[test]
fn a_task_defined_outside_the_registry_is_one_entry() {
    let data = out("mnist-data-custom");
    synthetic_mnist(&data, 200, 60);
    let custom = task::Task {
        name: "shuffled-digits".into(),
        input: task::Input::Pixels(task::Pixels {
            files: task::ImageFiles::Mnist,
            side: 28,
            grey: false,
            mean: vec![0.5],
            std: vec![0.25],
            order: task::Order::Permuted { seed: 3 },
            split: task::Split::HoldOut { seed: 1 },
        }),
        classes: 10,
        tree: task::TreeShape::Ragged { arity: 2 },
        causal: false,
        coupling_init: None,
    };
    let mut cfg = config(3);
    cfg.model.encoder = custom.encoder();
    cfg.model.layer = SeqLayerConfig::Myo(MyoConfig::new(0, 4, custom.tree_spec().unwrap()));
    cfg.task = custom;
    cfg.data = DataSource::Dir {
        dir: data.to_path_buf(),
    };
    let dir = out("custom");
    let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
    assert!(
        summary.test_accuracy.unwrap() > 0.3,
        "test accuracy {} (chance 0.1)",
        summary.test_accuracy.unwrap()
    );
    let e = eval_best(&dir, None);
    assert!((e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12);
}

/// Every `log_every`-th step writes a step record (its batch's loss and accuracy, the learning
/// rate, the gradient norm, samples/s) to metrics.jsonl, and the curves are drawn against the
/// step; keeping them changes nothing in the training.
#[test]
fn step_records_are_written_and_leave_training_unchanged() {
    let (plain, logged) = (out("steps-plain"), out("steps-logged"));
    let cpu = Exec::on(&Device::Cpu);
    train(&config(2), &plain, &cpu, Start::New, |_| {}).unwrap();
    let every_2 = Exec {
        log_every: 2,
        ..Exec::on(&Device::Cpu)
    };
    train(&config(2), &logged, &every_2, Start::New, |_| {}).unwrap();
    let (with, without) = (metrics(&logged), metrics(&plain));
    let steps: Vec<&serde_json::Value> = with.iter().filter(|r| r["split"] == "step").collect();
    // 96 examples in batches of 16: 6 steps per epoch.
    let numbers: Vec<u64> = steps.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, [2, 4, 6, 8, 10, 12]);
    for r in &steps {
        for key in ["lr", "grad_norm", "samples_per_s", "loss", "accuracy"] {
            let v = r[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v >= 0.0, "{key} in {r}");
        }
        assert!(r["grad_norm"].as_f64().unwrap() > 0.0, "{r}");
    }
    // Warm-up over 3 steps from lr 0.01: step 2 trains at 2/3 of it.
    assert!(
        (steps[0]["lr"].as_f64().unwrap() - 0.01 * 2.0 / 3.0).abs() < 1e-12,
        "{}",
        steps[0]
    );
    let epochs = |m: &[serde_json::Value]| -> Vec<String> {
        m.iter()
            .filter(|r| r["split"] != "step")
            .map(|r| {
                format!(
                    "{} {} {} {}",
                    r["epoch"], r["split"], r["loss"], r["accuracy"]
                )
            })
            .collect()
    };
    assert_eq!(epochs(&with), epochs(&without));
    let bytes = |d: &std::path::Path| std::fs::read(d.join("last.safetensors")).unwrap();
    assert!(
        bytes(&plain) == bytes(&logged),
        "the logged run trained differently"
    );
    let svg = std::fs::read_to_string(logged.join("curves.svg")).unwrap();
    assert!(
        svg.contains(">\nstep\n<") || svg.contains(">step<"),
        "no step axis"
    );
}

/// With a learning rate too small to change any prediction the validation accuracy never
/// improves after epoch 1: `--early-stop 2` ends the run of 6 epochs after epoch 3, keeps epoch
/// 1 as the best, and a resumed run stops at once.
#[test]
fn early_stopping_ends_a_run_that_stopped_improving() {
    let dir = out("early-stop");
    let mut cfg = config(6);
    cfg.early_stop = Some(2);
    (cfg.optim.lr, cfg.optim.ssm_lr) = (1e-12, 1e-12);
    let mut stopped = None;
    let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |e| {
        if let Event::StoppedEarly {
            epoch,
            best_epoch,
            patience,
            ..
        } = e
        {
            stopped = Some((epoch, best_epoch, patience));
        }
    })
    .unwrap();
    assert_eq!(stopped, Some((3, 1, 2)));
    assert_eq!((summary.epochs, summary.best_epoch), (3, 1));
    let trained = |d: &std::path::Path| metrics(d).iter().filter(|r| r["split"] == "train").count();
    assert_eq!(trained(&dir), 3);
    let resumed = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::Resume, |_| {}).unwrap();
    assert_eq!((resumed.epochs, trained(&dir)), (3, 3));
    let e = myosotis::train::config::RunArgs::from_flags(["--early-stop", "0"])
        .unwrap()
        .resolve()
        .unwrap_err();
    assert!(format!("{e:#}").contains("--early-stop 0"), "{e:#}");
}

/// `eval_every: 4` validates within the epochs of 6 steps (at steps 4, 8, 16, 20) as well as at
/// their ends, each record with its step; with `Monitor::Loss` the best checkpoint is that of
/// the lowest validation loss, and the test split is scored exactly at each new lowest.
#[test]
fn evaluations_within_epochs_choose_the_best_checkpoint() {
    let dir = out("eval-every");
    let mut cfg = config(4);
    (cfg.eval_every, cfg.monitor) = (Some(4), Monitor::Loss);
    (cfg.optim.lr, cfg.optim.ssm_lr) = (0.3, 0.1);
    let mut within = vec![];
    let summary = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::New, |e| {
        if let Event::Evaluated { epoch, step, .. } = e {
            within.push((epoch, step));
        }
    })
    .unwrap();
    assert_eq!(within, [(1, 4), (2, 8), (3, 16), (4, 20)]);
    let records = metrics(&dir);
    let at = |split: &str| -> Vec<(u64, u64, f64)> {
        records
            .iter()
            .filter(|r| r["split"] == split)
            .map(|r| {
                let n = |k: &str| r[k].as_u64().unwrap();
                (n("epoch"), n("step"), r["loss"].as_f64().unwrap())
            })
            .collect()
    };
    let val = at("val");
    let steps: Vec<(u64, u64)> = val.iter().map(|v| (v.0, v.1)).collect();
    let every = [
        (1, 4),
        (1, 6),
        (2, 8),
        (2, 12),
        (3, 16),
        (3, 18),
        (4, 20),
        (4, 24),
    ];
    assert_eq!(steps, every);
    let mut lowest = f64::INFINITY;
    let new_lows: Vec<u64> = val
        .iter()
        .filter(|v| {
            let new = v.2 < lowest;
            lowest = lowest.min(v.2);
            new
        })
        .map(|v| v.1)
        .collect();
    let tested: Vec<u64> = at("test").iter().map(|t| t.1).collect();
    assert_eq!(tested, new_lows);
    // At this learning rate the loss goes up and down: not every evaluation is a new best.
    assert!(new_lows.len() < val.len(), "{val:?}");
    let best = new_lows.last().copied().unwrap() as usize;
    assert_eq!(summary.best_step, best);
    assert_eq!(summary.best_epoch, best.div_ceil(6));
    assert_eq!(
        eval_best(&dir, None).accuracy.unwrap(),
        summary.test_accuracy.unwrap()
    );
    // A finished run resumed adds nothing.
    let again = train(&cfg, &dir, &Exec::on(&Device::Cpu), Start::Resume, |_| {}).unwrap();
    assert_eq!((again.steps, again.best_step), (24, best));
    assert_eq!(metrics(&dir), records);
}

/// Early stopping counts the evaluations within epochs: at a learning rate too small to change
/// any prediction, patience 1 stops the run at its second evaluation (step 4, mid-epoch),
/// whose checkpoint a resumed run then stops at again.
#[test]
fn early_stopping_counts_evaluations_within_epochs() {
    let dir = out("early-stop-steps");
    let mut cfg = config(3);
    (cfg.eval_every, cfg.early_stop) = (Some(2), Some(1));
    (cfg.optim.lr, cfg.optim.ssm_lr) = (1e-12, 1e-12);
    let stops = |dir: &std::path::Path, start| {
        let mut stopped = None;
        let summary = train(&cfg, dir, &Exec::on(&Device::Cpu), start, |e| {
            if let Event::StoppedEarly {
                epoch,
                step,
                best_step,
                ..
            } = e
            {
                stopped = Some((epoch, step, best_step));
            }
        })
        .unwrap();
        (stopped, summary.steps)
    };
    assert_eq!(stops(&dir, Start::New), (Some((1, 4, 2)), 4));
    assert_eq!(stops(&dir, Start::Resume), (Some((1, 4, 2)), 4));
    let val = metrics(&dir).iter().filter(|r| r["split"] == "val").count();
    assert_eq!(val, 2);
}

/// A panic (in the caller's thread or one it joins) becomes an error naming where it happened,
/// so that `myo` can report it and abort the other ranks as for any error.
#[test]
fn panics_become_errors_that_say_where() {
    use myosotis::fail::catch_panics;
    let e = catch_panics(|| -> anyhow::Result<()> { panic!("boom {}", 7) }).unwrap_err();
    let e = e.to_string();
    assert!(
        e.starts_with("internal error (a panic at tests/run.rs:"),
        "{e}"
    );
    assert!(e.ends_with("): boom 7"), "{e}");
    let e = catch_panics(|| -> anyhow::Result<()> {
        std::thread::scope(|s| {
            let h = s.spawn(|| -> () { panic!("in a shard") });
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
        });
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("): in a shard"), "{e}");
    assert_eq!(catch_panics(|| Ok(5)).unwrap(), 5);
}
