//! LRA's Text and Retrieval tasks on generated files of their layouts: byte tokens, the IMDB
//! folder's splits, the AAN files' pairs and their bad rows, the pair head against the same
//! computation by hand, and runs end to end with S5 and Myo.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use myosotis::data::dataset::Dataset;
use myosotis::data::task::{self, DataSource};
use myosotis::data::text::{self, tokenize, EOS};
use myosotis::nn::*;
use myosotis::train::config::RunArgs;
use myosotis::train::run::{eval_checkpoint, train, Exec, Start};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn dir(name: &str) -> common::Scratch {
    common::scratch(&format!("text-{name}"))
}

/// A text of 5 to 15 words, `cue` among fillers.
fn words(rng: &mut StdRng, cue: &[&str]) -> String {
    const FILLER: [&str; 6] = ["the", "film", "was", "and", "plot", "acting"];
    let n = rng.random_range(5..16);
    (0..n)
        .map(|_| match rng.random_bool(0.4) {
            true => cue[rng.random_range(0..cue.len())],
            false => FILLER[rng.random_range(0..FILLER.len())],
        })
        .collect::<Vec<_>>()
        .join(" ")
}

const NEG: [&str; 3] = ["bad", "awful", "dull"];
const POS: [&str; 3] = ["good", "great", "fun"];

/// An `aclImdb` folder under `d`: `train` and `test` reviews per class, whose words say the
/// class; an unlabelled review and a stray file that are not read.
fn imdb(d: &Path, train: usize, test: usize) {
    let mut rng = StdRng::seed_from_u64(7);
    for (split, n) in [("train", train), ("test", test)] {
        for (class, cue) in [("neg", NEG), ("pos", POS)] {
            let folder = d.join("aclImdb").join(split).join(class);
            std::fs::create_dir_all(&folder).unwrap();
            for i in 0..n {
                let text = words(&mut rng, &cue);
                std::fs::write(folder.join(format!("{i}_{}.txt", i % 10)), text).unwrap();
            }
            std::fs::write(folder.join("notes.md"), "not a review").unwrap();
        }
    }
    let unsup = d.join("aclImdb/train/unsup");
    std::fs::create_dir_all(&unsup).unwrap();
    std::fs::write(unsup.join("0_0.txt"), "unlabelled").unwrap();
}

const TOPICS: [[&str; 3]; 2] = [["graph", "tree", "parse"], ["speech", "audio", "signal"]];

/// A pair row: two texts on a topic each, label 1 when the topics agree (written as the LRA
/// release writes its texts, b'…').
fn aan_row(rng: &mut StdRng, i: usize) -> String {
    let (a, b) = (rng.random_range(0..2), rng.random_range(0..2));
    let label = if i.is_multiple_of(2) { "1" } else { "1.0" };
    let label = if a == b { label } else { "0" };
    let (t1, t2) = (words(rng, &TOPICS[a]), words(rng, &TOPICS[b]));
    format!("{label}\tid{i}a\tid{i}b\tb'{t1}'\tb'{t2}'\n")
}

/// The three AAN files under `d`, `n` pairs each.
fn aan(d: &Path, n: usize) {
    let mut rng = StdRng::seed_from_u64(11);
    for f in text::AAN_FILES {
        let rows: String = (0..n).map(|i| aan_row(&mut rng, i)).collect();
        std::fs::write(d.join(f), rows).unwrap();
    }
}

#[test]
fn a_document_is_its_bytes_then_eos() {
    assert_eq!(tokenize(b"ab", 10), vec![98, 99, EOS]);
    assert_eq!(tokenize(&[0, 255], 10), vec![1, 256, EOS]);
    assert_eq!(tokenize(b"abcdef", 4), vec![98, 99, 100, EOS]);
    assert_eq!(tokenize(b"", 4), vec![EOS]);
    assert_eq!(EOS as usize + 1, text::VOCAB);
}

#[test]
fn the_imdb_folder_gives_the_splits() {
    let d = dir("imdb");
    imdb(&d, 10, 3);
    let task = task::find("text").unwrap();
    let data = DataSource::Dir {
        dir: d.to_path_buf(),
    };
    let [train, val, test] = task.load(&data).unwrap();
    assert_eq!((train.len(), val.len(), test.len()), (18, 2, 6));
    // Test reviews: negative then positive, each in file-name order.
    assert_eq!(test.labels(), &[0, 0, 0, 1, 1, 1]);
    let Dataset::Tokens { seqs, .. } = &test else {
        panic!("reviews are tokens")
    };
    let first = std::fs::read(d.join("aclImdb/test/neg/0_0.txt")).unwrap();
    assert_eq!(seqs[0], tokenize(&first, 4096));
    let Dataset::Tokens { seqs, labels } = task.load_test(&data).unwrap() else {
        panic!("reviews are tokens")
    };
    assert_eq!(labels, test.labels());
    assert_eq!(seqs.len(), 6);
    // The training and validation reviews are the training folder's, each once.
    let mut all = [train.labels(), val.labels()].concat();
    all.sort();
    assert_eq!(all, [vec![0; 10], vec![1; 10]].concat());
    // The aclImdb folder itself reads the same.
    let inner = DataSource::Dir {
        dir: d.join("aclImdb"),
    };
    assert_eq!(task.load_test(&inner).unwrap().labels(), test.labels());
    let e = format!(
        "{:#}",
        task.load(&DataSource::Dir { dir: d.join("no") })
            .unwrap_err()
    );
    assert!(e.contains("no IMDB reviews") && e.contains("/no"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn aan_pairs_batch_as_two_halves_and_bad_rows_are_named() {
    let d = dir("aan");
    aan(&d, 6);
    let task = task::find("retrieval").unwrap();
    let [train, _, test] = task
        .load(&DataSource::Dir {
            dir: d.to_path_buf(),
        })
        .unwrap();
    assert_eq!((train.len(), test.len()), (6, 6));
    let Dataset::Pairs { first, second, .. } = &train else {
        panic!("pairs")
    };
    let row = std::fs::read_to_string(d.join(text::AAN_FILES[0])).unwrap();
    let fields: Vec<&str> = row.lines().next().unwrap().split('\t').collect();
    assert_eq!(first[0], tokenize(fields[3].as_bytes(), 4000));
    assert_eq!(second[0], tokenize(fields[4].as_bytes(), 4000));
    let width = train.padding(&[2, 0], None).unwrap();
    let b = train.batch(&[2, 0], None, &Device::Cpu).unwrap();
    assert_eq!(b.x.dims(), &[4, width]);
    let rows: Vec<Vec<u32>> = b.x.to_vec2().unwrap();
    let lengths: Vec<u32> = b.lengths.to_vec1().unwrap();
    for (r, s) in [&first[2], &first[0], &second[2], &second[0]]
        .iter()
        .enumerate()
    {
        assert_eq!(&rows[r][..s.len()], &s[..]);
        assert!(rows[r][s.len()..].iter().all(|&t| t == 0));
        assert_eq!(lengths[r] as usize, s.len());
    }
    let padded = train.batch(&[1], Some(200), &Device::Cpu).unwrap();
    assert_eq!(padded.x.dims(), &[2, 200]);

    let path = d.join("bad.tsv");
    let bad = |rows: &str| {
        std::fs::write(&path, rows).unwrap();
        format!("{:#}", text::read_aan(&path, 4000).unwrap_err())
    };
    let e = bad("1\ta\tb\tx\ty\n0\ta\tb\tx\n");
    assert!(
        e.contains("bad.tsv:2") && e.contains("4 tab-separated fields"),
        "{e}"
    );
    let e = bad("2\ta\tb\tx\ty\n");
    assert!(e.contains("bad.tsv:1") && e.contains("label '2'"), "{e}");
    let e = bad("\n");
    assert!(e.contains("no pairs"), "{e}");
    let e = format!("{:#}", text::read_aan(&d.join("none.tsv"), 9).unwrap_err());
    assert!(e.contains("none.tsv"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

fn pair_config(layer: SeqLayerConfig, pooling: Pooling) -> ClassifierConfig {
    ClassifierConfig {
        encoder: EncoderConfig::Embedding { vocab: text::VOCAB },
        d_model: 6,
        layers: 2,
        layer,
        norm: NormKind::Layer,
        prenorm: true,
        activation: Activation::HalfGlu2,
        dropout: 0.0,
        pooling,
        classes: 2,
        timing: Default::default(),
        pairs: true,
        decoder: Default::default(),
        seed: 3,
        bn_momentum: BN_MOMENTUM,
        dense_init: Default::default(),
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    common::to_vec(t)
}

/// Dense layer `name` of `varmap` on the row `x`, in f64.
fn dense64(varmap: &VarMap, name: &str, x: &[f64]) -> Vec<f64> {
    let vars = varmap.data().lock().unwrap();
    let w = f64s(vars[&format!("{name}.weight")].as_tensor());
    let b = f64s(vars[&format!("{name}.bias")].as_tensor());
    (0..b.len())
        .map(|o| b[o] + (0..x.len()).map(|i| w[o * x.len() + i] * x[i]).sum::<f64>())
        .collect()
}

/// GELU, tanh form.
fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// The pair model's features are each document's own, and its log-probabilities are the head's
/// MLP on [u, v, u ⊙ v, u − v] computed by hand; every parameter gets a gradient.
#[test]
fn the_pair_head_reads_both_documents() {
    let d = dir("head");
    aan(&d, 5);
    let pairs = text::read_aan(&d.join(text::AAN_FILES[0]), 64).unwrap();
    let idx = [0, 1, 2, 3, 4];
    let s5 = SeqLayerConfig::S5(S5Config {
        state: 4,
        blocks: 2,
        bidirectional: true,
        ..S5Config::default()
    });
    let myo = SeqLayerConfig::Myo(MyoConfig::new(
        0,
        3,
        TreeSpec::Ragged {
            leaves: 64,
            arity: 2,
        },
    ));
    for (layer, pooling, pad_to) in [
        (s5, Pooling::Mean, None),
        (myo.clone(), Pooling::Root, Some(64)),
        (myo, Pooling::Mean, Some(64)),
    ] {
        let cfg = pair_config(layer, pooling);
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let model = SequenceClassifier::new(cfg.clone(), vb).unwrap();
        let width = pairs.padding(&idx, pad_to);
        let batch = pairs.batch(&idx, width, &Device::Cpu).unwrap();
        let features = model
            .features(&batch.x, Some(&batch.lengths), Mode::Eval)
            .unwrap();
        assert_eq!(features.dims(), &[10, 6]);
        // Each half alone, padded alike, gives the same features.
        let Dataset::Pairs { first, second, .. } = &pairs else {
            panic!("pairs")
        };
        for (half, docs) in [first, second].iter().enumerate() {
            let alone = Dataset::Tokens {
                seqs: docs.to_vec(),
                labels: vec![0; docs.len()],
            };
            let b = alone.batch(&idx, width, &Device::Cpu).unwrap();
            let f = model.features(&b.x, Some(&b.lengths), Mode::Eval).unwrap();
            let want = f64s(&features.narrow(0, 5 * half, 5).unwrap());
            let err = common::rel_err(&f64s(&f), &want);
            assert!(err < 1e-6, "{cfg:?}: half {half} alone differs by {err}");
        }
        let out = model
            .forward(&batch.x, Some(&batch.lengths), Mode::Eval)
            .unwrap();
        assert_eq!(out.dims(), &[5, 2]);
        let (f, out) = (f64s(&features), f64s(&out));
        for e in 0..5 {
            let (u, v) = (&f[e * 6..e * 6 + 6], &f[(e + 5) * 6..(e + 6) * 6]);
            let x: Vec<f64> = [
                u.to_vec(),
                v.to_vec(),
                u.iter().zip(v).map(|(a, b)| a * b).collect(),
                u.iter().zip(v).map(|(a, b)| a - b).collect(),
            ]
            .concat();
            let hidden: Vec<f64> = dense64(&varmap, "pair", &x).into_iter().map(gelu).collect();
            let z = dense64(&varmap, "decoder", &hidden);
            let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            for c in 0..2 {
                let got = out[e * 2 + c];
                assert!(
                    (got - (z[c] - lse)).abs() < 1e-5,
                    "{cfg:?}: example {e} class {c}: {got} against {}",
                    z[c] - lse
                );
            }
        }
        let y = Tensor::new(pairs.labels(), &Device::Cpu).unwrap();
        let train = Mode::Train(
            DropoutKey {
                seed: 0,
                step: 0,
                first_row: 0,
                key_on_device: false,
            },
            None,
            None,
        );
        let logp = model
            .forward(&batch.x, Some(&batch.lengths), train)
            .unwrap();
        let grads = candle_nn::loss::nll(&logp, &y).unwrap().backward().unwrap();
        // Pooling the root alone leaves the last Myo layer's leaf skip D unused.
        let unused: &[&str] = match pooling {
            Pooling::Root => &["layers.1.ssm.d"],
            _ => &[],
        };
        common::assert_all_gradients(&varmap, &grads, unused, &format!("{cfg:?}"));
    }
    let e = SequenceClassifier::new(
        pair_config(
            SeqLayerConfig::MinGru(MinGruConfig::default()),
            Pooling::None,
        ),
        VarBuilder::zeros(DType::F32, &Device::Cpu),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("pooling none"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

fn run_args(task: &str, d: &Path, extra: &[&str]) -> myosotis::train::config::RunConfig {
    let data = d.to_string_lossy().to_string();
    let mut flags = vec![
        "--task",
        task,
        "--data-dir",
        &data,
        "--d-model",
        "16",
        "--layers",
        "1",
        "--batch-size",
        "8",
    ];
    flags.extend_from_slice(extra);
    RunArgs::from_flags(flags).unwrap().resolve().unwrap()
}

/// `myo train --task text` and `--task retrieval` end to end: the reviews' words and the pairs'
/// topic agreement are learned, and the checkpoint's test accuracy is the run's.
#[test]
fn text_and_retrieval_train_end_to_end() {
    let d = dir("runs");
    imdb(&d, 40, 20);
    aan(&d, 120);
    let exec = Exec::on(&Device::Cpu);
    let cases: [(&str, &[&str], f64); 3] = [
        ("text", &["--state-size", "8", "--epochs", "4"], 0.9),
        ("retrieval", &["--state-size", "8", "--epochs", "12"], 0.85),
        (
            "retrieval",
            &["--model", "myo", "--heads", "4", "--epochs", "1"],
            0.0,
        ),
    ];
    for (task, flags, want) in cases {
        let cfg = run_args(task, &d, flags);
        assert_eq!(cfg.model.pairs, task == "retrieval");
        let out = d.join(format!("out-{task}-{}", flags[1]));
        let summary = train(&cfg, &out, &exec, Start::New, |_| {}).unwrap();
        let acc = summary.test_accuracy.unwrap();
        assert!(acc >= want, "{task} {flags:?}: test accuracy {acc}");
        let e = eval_checkpoint(&out.join("best.safetensors"), None, None, &exec).unwrap();
        assert_eq!(e.accuracy, Some(acc));
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn text_tasks_need_their_folder() {
    let resolve = |task: &str| {
        let e = RunArgs::from_flags(["--task", task]).unwrap().resolve();
        format!("{:#}", e.unwrap_err())
    };
    assert!(resolve("text").contains("aclImdb"));
    assert!(resolve("retrieval").contains("new_aan_pairs.train.tsv"));
}
