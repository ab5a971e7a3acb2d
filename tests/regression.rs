//! Regression at every step on irregularly sampled series (the pendulum task, S5 §6.3): the
//! task's splits from the benchmark's file, the model's timings (continuous, drop, append), a
//! run end to end with its mean squared error in the metrics and `myo eval`, and the flags that
//! do not suit a regression refused.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use myosotis::data::dataset::Dataset;
use myosotis::data::pendulum::{read_split, write_dataset, PendulumConfig, FILE, SIDE};
use myosotis::data::task::{self, DataSource};
use myosotis::nn::{Decoder, Mode, SequenceClassifier, Timing};
use myosotis::train::checkpoint::read_metrics;
use myosotis::train::config::{RunArgs, RunConfig};
use myosotis::train::run::{eval_checkpoint, train, Exec, Start};
use myosotis::train::trainer::score;

fn dir(name: &str) -> common::Scratch {
    common::unmade(&format!("regression-{name}"))
}

/// A small pendulum file: 12 / 4 / 4 sequences of 60 frames (the task keeps 50).
fn small_file(d: &std::path::Path) {
    let cfg = PendulumConfig {
        train: 12,
        valid: 4,
        test: 4,
        frames: 60,
        seed: 3,
    };
    write_dataset(d, &cfg).unwrap();
}

fn resolve(flags: &[&str]) -> anyhow::Result<RunConfig> {
    RunArgs::from_flags(flags.iter().copied())?.resolve()
}

/// The splits keep 50 frames in time order, with each step's interval since the one before
/// (the first one time unit) and the targets of the frames kept; without `valid_*` arrays the
/// last third of the training sequences validates.
#[test]
fn the_splits_are_the_files_series() {
    let d = dir("splits");
    small_file(&d);
    let task = task::find("pendulum").unwrap();
    let [train, val, test] = task
        .load(&DataSource::Dir {
            dir: d.to_path_buf(),
        })
        .unwrap();
    assert_eq!([train.len(), val.len(), test.len()], [12, 4, 4]);
    let full = read_split(&d.join(FILE), "test").unwrap();
    let Dataset::Series {
        values,
        dt,
        targets,
        len,
        features,
        outputs,
    } = &test
    else {
        panic!("the pendulum task's split is a series")
    };
    assert_eq!((*len, *features, *outputs), (50, SIDE * SIDE, 2));
    for i in 0..4 {
        // Recover each kept frame's time from the intervals, and check it is that frame.
        let mut t = full.ts[i * 60] - 1.0;
        let mut last = -1.0;
        for k in 0..50 {
            assert!(dt[i * 50 + k] > 0.0, "intervals are positive");
            t = if k == 0 {
                // The first kept frame is any of the first 11 (50 of 60 kept).
                let first = (0..60).find(|&f| {
                    let px = &full.obs[(i * 60 + f) * SIDE * SIDE..][..SIDE * SIDE];
                    px.iter()
                        .zip(&values[(i * 50) * SIDE * SIDE..][..SIDE * SIDE])
                        .all(|(&p, &v)| (p as f32 / 255.0 - v).abs() < 1e-7)
                });
                full.ts[i * 60 + first.expect("the first kept frame is in the file")]
            } else {
                t + dt[i * 50 + k] as f64
            };
            assert!(t > last, "frames in time order");
            last = t;
            let f = i * 60 + t as usize;
            assert_eq!(
                &targets[(i * 50 + k) * 2..][..2],
                &[full.targets[f * 2] as f32, full.targets[f * 2 + 1] as f32]
            );
        }
        assert_eq!(dt[i * 50], 1.0);
    }
    // Only training and test arrays, as the benchmark's own file: a third of the training
    // sequences validate.
    let only = dir("no-valid");
    std::fs::create_dir_all(&only).unwrap();
    let ep = read_split(&d.join(FILE), "train").unwrap();
    let cpu = &Device::Cpu;
    let arrays = |e: &myosotis::data::pendulum::Episodes| {
        [
            Tensor::from_vec(e.obs.clone(), (e.n, e.frames, SIDE, SIDE, 1), cpu).unwrap(),
            Tensor::from_vec(e.targets.clone(), (e.n, e.frames, 2), cpu).unwrap(),
            Tensor::from_vec(e.ts.clone(), (e.n, e.frames), cpu).unwrap(),
        ]
    };
    let [o, t, s] = arrays(&ep);
    let [to, tt, ts] = arrays(&full);
    Tensor::write_npz(
        &[
            ("train_obs", &o),
            ("train_targets", &t),
            ("train_ts", &s),
            ("test_obs", &to),
            ("test_targets", &tt),
            ("test_ts", &ts),
        ],
        only.join(FILE),
    )
    .unwrap();
    let [train2, val2, _] = task
        .load(&DataSource::Dir {
            dir: only.to_path_buf(),
        })
        .unwrap();
    assert_eq!([train2.len(), val2.len()], [8, 4]);
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(&only);
}

/// With every interval 1 the continuous model is the model that drops the times; with others
/// it is not; the appending model reads them too; and a model that needs them says so.
#[test]
fn the_timings_use_the_intervals_as_they_say() {
    let cfg = resolve(&[
        "--task",
        "pendulum",
        "--data-dir",
        "(not read)",
        "--d-model",
        "6",
        "--state-size",
        "4",
        "--layers",
        "2",
    ])
    .unwrap();
    assert_eq!(cfg.model.timing, Timing::Continuous);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let continuous = SequenceClassifier::new(cfg.model.clone(), vb.clone()).unwrap();
    let mut drop_cfg = cfg.model.clone();
    drop_cfg.timing = Timing::Drop;
    let dropped = SequenceClassifier::new(drop_cfg, vb).unwrap();
    let (b, l) = (2, 7);
    let cpu = &Device::Cpu;
    let x = Tensor::rand(0f64, 1., (b, l, SIDE * SIDE), cpu).unwrap();
    let ones = Tensor::ones((b, l), DType::F64, cpu).unwrap();
    let uneven = Tensor::rand(0.5f64, 3., (b, l), cpu).unwrap();
    let out = |m: &SequenceClassifier, dt: Option<&Tensor>| {
        let y = m.forward_timed(&x, None, dt, Mode::Eval).unwrap();
        assert_eq!(y.dims(), [b, l, 2]);
        y.flatten_all().unwrap().to_vec1::<f64>().unwrap()
    };
    let diff = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    let base = out(&dropped, None);
    assert!(diff(&out(&continuous, Some(&ones)), &base) < 1e-12);
    assert!(diff(&out(&continuous, Some(&uneven)), &base) > 1e-6);
    assert!(diff(&out(&dropped, Some(&uneven)), &base) < 1e-15);
    let e = continuous
        .forward_timed(&x, None, None, Mode::Eval)
        .unwrap_err()
        .to_string();
    assert!(e.contains("time intervals"), "{e}");

    let mut append_cfg = cfg.model.clone();
    append_cfg.timing = Timing::Append;
    let vm = VarMap::new();
    let appended =
        SequenceClassifier::new(append_cfg, VarBuilder::from_varmap(&vm, DType::F64, cpu)).unwrap();
    assert_eq!(
        vm.data().lock().unwrap()["encoder.dense2.weight"].dims(),
        [6, 31]
    );
    let a1 = out(&appended, Some(&ones));
    assert!(diff(&a1, &out(&appended, Some(&uneven))) > 1e-6);
}

/// Row `x` through the dense layer `name` of `varmap`, in f64.
fn dense64(varmap: &VarMap, name: &str, x: &[f64]) -> Vec<f64> {
    let vars = varmap.data().lock().unwrap();
    let w: Vec<f64> = vars[&format!("{name}.weight")]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f64> = vars[&format!("{name}.bias")].to_vec1().unwrap();
    (0..b.len())
        .map(|o| b[o] + (0..x.len()).map(|i| w[o * x.len() + i] * x[i]).sum::<f64>())
        .collect()
}

/// The Gaussian decoder's objective is its negative log-likelihood computed by hand from the
/// last block's features (σ² clamped at 1e-6), the loss the mean squared error of its mean, and
/// the objective's gradient matches finite differences.
#[test]
fn the_gaussian_decoder_trains_its_likelihood() {
    let d = dir("gaussian");
    small_file(&d);
    let data = d.to_string_lossy().to_string();
    let flags = [
        "--task",
        "pendulum",
        "--data-dir",
        &data,
        "--decoder",
        "gaussian",
        "--d-model",
        "6",
        "--state-size",
        "4",
        "--layers",
        "1",
    ];
    let cfg = resolve(&flags).unwrap();
    assert_eq!(cfg.model.decoder, Decoder::Gaussian);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let model = SequenceClassifier::new(cfg.model.clone(), vb).unwrap();
    let [_, _, test] = cfg.task.load(&cfg.data).unwrap();
    let batch = test.batch(&[0, 2], None, &Device::Cpu).unwrap();
    let batch = myosotis::data::dataset::Batch {
        x: batch.x.to_dtype(DType::F64).unwrap(),
        dt: batch.dt.map(|t| t.to_dtype(DType::F64).unwrap()),
        target: match batch.target {
            myosotis::data::dataset::Target::Values(y) => {
                myosotis::data::dataset::Target::Values(y.to_dtype(DType::F64).unwrap())
            }
            other => other,
        },
        ..batch
    };
    let myosotis::data::dataset::Target::Values(y) = &batch.target else {
        panic!("values")
    };
    let y: Vec<f64> = y.flatten_all().unwrap().to_vec1().unwrap();
    let by_hand = || {
        let f: Vec<f64> = model
            .features_timed(&batch.x, None, batch.dt.as_ref(), Mode::Eval)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (mut nll, mut sq) = (0.0, 0.0);
        let rows = f.len() / 6;
        for r in 0..rows {
            let h = &f[r * 6..r * 6 + 6];
            let mlp = |name: &str| {
                let hidden: Vec<f64> = dense64(&varmap, &format!("decoder.{name}.0"), h)
                    .into_iter()
                    .map(f64::tanh)
                    .collect();
                dense64(&varmap, &format!("decoder.{name}.1"), &hidden)
            };
            let (mean, v) = (mlp("mean"), mlp("var"));
            for o in 0..2 {
                let var = if v[o] < 0.0 { v[o].exp() } else { v[o] + 1.0 }.max(1e-6);
                let e = (mean[o] - y[r * 2 + o]).powi(2);
                sq += e;
                nll += 0.5 * (var.ln() + e / var + (2.0 * std::f64::consts::PI).ln());
            }
        }
        (nll / rows as f64, sq / (rows * 2) as f64)
    };
    let check = || {
        let s = score(&model, &batch, Mode::Eval).unwrap();
        let (objective, loss) = (
            s.objective.to_scalar::<f64>().unwrap(),
            s.loss.to_scalar::<f64>().unwrap(),
        );
        let (nll, mse) = by_hand();
        assert!(
            (objective - nll).abs() < 1e-9 * nll.abs().max(1.0),
            "{objective} vs {nll}"
        );
        assert!((loss - mse).abs() < 1e-12, "{loss} vs {mse}");
        s
    };
    let s = check();
    // The gradient of the objective against central differences.
    let grads = s.objective.backward().unwrap();
    for (name, at) in [
        ("decoder.var.1.bias", 0),
        ("decoder.var.0.weight", 3),
        ("decoder.mean.0.weight", 5),
        ("decoder.mean.1.bias", 1),
        ("layers.0.ssm.log_step", 0),
        ("encoder.dense2.weight", 7),
    ] {
        let var = varmap.data().lock().unwrap()[name].clone();
        let analytic: Vec<f64> = grads
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let values: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let shape = var.as_tensor().shape().clone();
        let eps = 1e-6;
        let at_value = |delta: f64| {
            let mut v = values.clone();
            v[at] += delta;
            var.set(&Tensor::from_vec(v, shape.clone(), &Device::Cpu).unwrap())
                .unwrap();
            let o = score(&model, &batch, Mode::Eval).unwrap().objective;
            o.to_scalar::<f64>().unwrap()
        };
        let numeric = (at_value(eps) - at_value(-eps)) / (2.0 * eps);
        at_value(0.0);
        let err = (numeric - analytic[at]).abs() / numeric.abs().max(1e-3);
        assert!(
            err < 1e-5,
            "{name}[{at}]: {} against {numeric}",
            analytic[at]
        );
    }
    // A variance decoder far below zero for the second output: its σ² is clamped.
    {
        let vars = varmap.data().lock().unwrap();
        let bias = &vars["decoder.var.1.bias"];
        bias.set(&Tensor::new(&[0.0f64, -40.0], &Device::Cpu).unwrap())
            .unwrap();
    }
    check();
    let _ = std::fs::remove_dir_all(&d);
}

/// A pendulum run end to end: the mean squared error at every step is its loss, in the
/// metrics (no accuracy), the summary, and `myo eval` of its best checkpoint, for each timing.
#[test]
fn a_pendulum_run_reports_its_mean_squared_error() {
    let d = dir("run");
    small_file(&d);
    let data = d.to_string_lossy().to_string();
    for (timing, decoder) in [
        ("continuous", "linear"),
        ("drop", "linear"),
        ("append", "linear"),
        ("continuous", "gaussian"),
    ] {
        let cfg = resolve(&[
            "--task",
            "pendulum",
            "--data-dir",
            &data,
            "--timing",
            timing,
            "--decoder",
            decoder,
            "--d-model",
            "8",
            "--state-size",
            "4",
            "--layers",
            "1",
            "--batch-size",
            "4",
            "--epochs",
            "2",
        ])
        .unwrap();
        assert_eq!(cfg.monitor, myosotis::train::config::Monitor::Loss);
        let out = d.join(format!("out-{timing}-{decoder}"));
        let summary = train(&cfg, &out, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
        assert_eq!(
            (summary.best_val_accuracy, summary.test_accuracy),
            (None, None)
        );
        assert!(summary.test_loss.is_finite() && summary.test_loss > 0.0);
        let metrics = read_metrics(&out.join("metrics.jsonl")).unwrap();
        let test: Vec<_> = metrics.iter().filter(|r| r.split == "test").collect();
        assert!(!test.is_empty());
        for r in &metrics {
            assert_eq!(r.accuracy, None, "{timing}: {r:?}");
            assert_eq!(r.mse, Some(r.loss), "{timing}: {r:?}");
        }
        let e = eval_checkpoint(
            &out.join("best.safetensors"),
            None,
            None,
            &Exec::on(&Device::Cpu),
        )
        .unwrap();
        assert_eq!((e.accuracy, e.examples), (None, 4));
        assert!(
            (e.loss - summary.test_loss).abs() < 1e-12,
            "{timing}: eval {} vs run {}",
            e.loss,
            summary.test_loss
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Flags that do not suit the task are refused, naming them.
#[test]
fn unsuitable_flags_are_refused() {
    let p = ["--task", "pendulum", "--data-dir", "(not read)"];
    for (extra, says) in [
        (&["--monitor", "accuracy"][..], "--monitor accuracy"),
        (&["--pooling", "mean"][..], "--pooling mean"),
        (&["--bidirectional", "true"][..], "causal"),
        (&["--timing", "continuous", "--model", "mingru"][..], "S5"),
    ] {
        let flags: Vec<&str> = p.iter().chain(extra).copied().collect();
        let e = match resolve(&flags) {
            Ok(cfg) => SequenceClassifier::new(
                cfg.model,
                VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu),
            )
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default(),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains(says), "{extra:?}: {e}");
    }
    for (flags, says) in [
        (&["--task", "listops", "--timing", "drop"][..], "--timing"),
        (
            &["--task", "listops", "--decoder", "gaussian"][..],
            "--decoder applies to a regression",
        ),
        (
            &["--task", "listops", "--pooling", "none"][..],
            "--pooling none",
        ),
    ] {
        let e = format!("{:#}", resolve(flags).unwrap_err());
        assert!(e.contains(says), "{flags:?}: {e}");
    }
    let e = format!("{:#}", resolve(&["--task", "pendulum"]).unwrap_err());
    assert!(e.contains(FILE), "{e}");
}
