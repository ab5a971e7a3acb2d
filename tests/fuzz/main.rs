//! Structure-aware fuzzing of every file format the program reads. Each target starts from valid
//! files written here (the seed corpus), mutates them with proptest — bit flips, overwritten
//! bytes, header words set to boundary values (0, 1, 2³¹, 2³² − 1, …), truncation, insertion
//! and spliced copies — and feeds them to the library entry point `myo` uses (a task's loader,
//! the Parquet reader, the checkpoint reader and loaders). Every outcome must be `Ok` or an
//! error that names the file; a panic fails the target and proptest shrinks it to a minimal
//! mutation list.
//!
//! proptest rather than a coverage-guided engine: only stable Rust is available (cargo-fuzz
//! needs nightly), the formats are structured (a header whose fields size what follows), so
//! mutations aimed at those fields reach the interesting paths without coverage feedback, and
//! the targets run inside `cargo test` with no extra toolchain. `MYO_FUZZ_CASES` sets the cases
//! per target (default 64; CI runs more in its fuzz step), `MYO_FUZZ_SEED` the generator's seed
//! (default: fixed per target, so CI is deterministic).

#[path = "../common/mod.rs"]
mod common;
mod mutate;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use common::files::{png, write_parquet};
use mutate::{cases, contents, fuzz, names, runner, temp};
use myosotis::data::task::{find, DataSource};
use myosotis::nn::SequenceClassifier;
use myosotis::train::config::{RunArgs, RunConfig};
use myosotis::train::optim::Optimizer;
use myosotis::train::{checkpoint, run};
use proptest::prelude::*;

fn idx_images(n: usize, side: u32) -> Vec<u8> {
    let mut b: Vec<u8> = [2051u32, n as u32, side, side]
        .iter()
        .flat_map(|x| x.to_be_bytes())
        .collect();
    b.extend((0..n * (side * side) as usize).map(|i| (i * 37 % 256) as u8));
    b
}

fn idx_labels(n: usize) -> Vec<u8> {
    let mut b: Vec<u8> = [2049u32, n as u32]
        .iter()
        .flat_map(|x| x.to_be_bytes())
        .collect();
    b.extend((0..n).map(|i| (i % 10) as u8));
    b
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn load(task: &str, dir: &Path) -> anyhow::Result<()> {
    find(task)?
        .load(&DataSource::Dir {
            dir: dir.to_path_buf(),
        })
        .map(|_| ())
}

/// MNIST IDX files, plain and gzip-compressed (the mutations hit the compressed bytes too).
#[test]
fn fuzz_mnist_idx() {
    for gz in [false, true] {
        let dir = temp(if gz { "idx-gz" } else { "idx" });
        let mut paths = vec![];
        for (split, n) in [("train", 20), ("t10k", 3)] {
            for (kind, bytes) in [
                ("images-idx3", idx_images(n, 28)),
                ("labels-idx1", idx_labels(n)),
            ] {
                let name = format!("{split}-{kind}-ubyte{}", if gz { ".gz" } else { "" });
                let bytes = if gz { gzip(&bytes) } else { bytes };
                std::fs::write(dir.join(&name), bytes).unwrap();
                paths.push(dir.join(name));
            }
        }
        let name = if gz { "mnist idx gz" } else { "mnist idx" };
        fuzz(name, 0x1d_0001 + gz as u64, &dir, contents(&paths), |d| {
            load("smnist", d)
        });
    }
}

/// CIFAR-10 binary batches.
#[test]
fn fuzz_cifar10() {
    let dir = temp("cifar");
    let record = |label: u8| {
        let mut r = vec![label];
        r.extend((0..3 * 1024).map(|i| (i * 13 % 256) as u8));
        r
    };
    let mut paths = vec![];
    for (k, name) in myosotis::data::images::CIFAR_TRAIN
        .iter()
        .chain(&myosotis::data::images::CIFAR_TEST)
        .enumerate()
    {
        let bytes: Vec<u8> = (0..3).flat_map(|i| record(((k + i) % 10) as u8)).collect();
        std::fs::write(dir.join(name), bytes).unwrap();
        paths.push(dir.join(name));
    }
    fuzz("cifar-10", 0xc1fa, &dir, contents(&paths), |d| {
        load("scifar", d)
    });
}

/// LRA ListOps TSV files.
#[test]
fn fuzz_listops_tsv() {
    let dir = temp("listops");
    let cfg = myosotis::data::listops::ListOpsConfig {
        max_depth: 3,
        max_args: 4,
        min_length: 4,
        max_length: 40,
        seed: 1,
    };
    let splits = myosotis::data::listops::Splits {
        train: 12,
        val: 4,
        test: 4,
    };
    myosotis::data::listops::write_dataset(&dir, &cfg, splits).unwrap();
    let paths: Vec<PathBuf> = ["train", "val", "test"]
        .iter()
        .map(|s| dir.join(format!("basic_{s}.tsv")))
        .collect();
    fuzz("listops tsv", 0x715d, &dir, contents(&paths), |d| {
        load("listops", d)
    });
}

/// The pendulum benchmark's npz file (a zip archive of npy arrays), every split read.
#[test]
fn fuzz_pendulum_npz() {
    use myosotis::data::pendulum::{read_split, write_dataset, PendulumConfig, FILE};
    let dir = temp("pendulum");
    let cfg = PendulumConfig {
        train: 2,
        valid: 1,
        test: 1,
        frames: 3,
        seed: 1,
    };
    let path = write_dataset(&dir, &cfg).unwrap();
    fuzz("pendulum npz", 0x9e4d, &dir, contents(&[path]), |d| {
        for split in ["train", "valid", "test"] {
            read_split(&d.join(FILE), split)?;
        }
        Ok(())
    });
}

/// A Speech Commands folder: WAV clips and the list files.
#[test]
fn fuzz_speech_wav() {
    use myosotis::data::speech::{load, WORDS};
    let dir = temp("speech");
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut paths = vec![];
    for (c, word) in WORDS.iter().enumerate() {
        std::fs::create_dir_all(dir.join(word)).unwrap();
        if c < 2 {
            for i in 0..2 {
                let path = dir.join(format!("{word}/c{i}.wav"));
                let mut w = hound::WavWriter::create(&path, spec).unwrap();
                for t in 0..200 {
                    w.write_sample(((t * 97 + i * 13 + c) % 4000) as i16 - 2000)
                        .unwrap();
                }
                w.finalize().unwrap();
                paths.push(path);
            }
        }
    }
    for (name, line) in [
        ("validation_list.txt", "backward/c1.wav\n"),
        ("testing_list.txt", "bed/c1.wav\n"),
    ] {
        std::fs::write(dir.join(name), line).unwrap();
        paths.push(dir.join(name));
    }
    fuzz("speech wav", 0x5c0d, &dir, contents(&paths), |d| {
        load(d).map(drop)
    });
}

/// LRA's text files: the Retrieval task's three TSV files of pairs and IMDB reviews, whose
/// bytes are any text.
#[test]
fn fuzz_text() {
    use myosotis::data::text::AAN_FILES;
    let dir = temp("text");
    let mut paths = vec![];
    for (k, f) in AAN_FILES.iter().enumerate() {
        let rows = format!("1\tp{k}\tq{k}\tb'a parser'\tb'a tree'\n0.0\tr\ts\tb'x'\tb'y z'\n");
        std::fs::write(dir.join(f), rows).unwrap();
        paths.push(dir.join(f));
    }
    for split in ["train", "test"] {
        for class in ["neg", "pos"] {
            let folder = dir.join("aclImdb").join(split).join(class);
            std::fs::create_dir_all(&folder).unwrap();
            std::fs::write(folder.join("0_1.txt"), format!("a {class} film")).unwrap();
            paths.push(folder.join("0_1.txt"));
        }
    }
    fuzz("text", 0x7e47, &dir, contents(&paths), |d| {
        load("retrieval", d)?;
        load("text", d)
    });
}

/// An LRA Pathfinder folder: metadata files and PNGs.
#[test]
fn fuzz_pathfinder() {
    let base = temp("pathfinder");
    let root = base
        .join("pathfinder32")
        .join(myosotis::data::pathfinder::DIFFICULTY);
    let mut paths = vec![];
    for k in 0..2 {
        let mut meta = String::new();
        for n in 0..5 {
            let px: Vec<u8> = (0..32 * 32)
                .map(|i| ((i + n * 7 + k) % 256) as u8)
                .collect();
            let png_path = root.join(format!("imgs/{k}/sample_{n}.png"));
            std::fs::create_dir_all(png_path.parent().unwrap()).unwrap();
            std::fs::write(&png_path, png(&px, 32, png::ColorType::Grayscale)).unwrap();
            paths.push(png_path);
            meta.push_str(&format!("imgs/{k} sample_{n}.png {n} {} 9 1\n", n % 2));
        }
        let meta_path = root.join(format!("metadata/{k}.npy"));
        std::fs::create_dir_all(meta_path.parent().unwrap()).unwrap();
        std::fs::write(&meta_path, meta).unwrap();
        paths.push(meta_path);
    }
    fuzz("pathfinder", 0x9a7f, &base, contents(&paths), |d| {
        load("pathfinder", d)
    });
}

/// The Hub's Parquet shards (MNIST's layout).
#[test]
fn fuzz_parquet() {
    let dir = temp("parquet");
    let path = dir.join("0000.parquet");
    let pngs: Vec<Vec<u8>> = (0..4)
        .map(|k| {
            let px: Vec<u8> = (0..28 * 28).map(|i| ((i * 3 + k) % 256) as u8).collect();
            png(&px, 28, png::ColorType::Grayscale)
        })
        .collect();
    write_parquet(&path, "image", &pngs, &[0, 1, 2, 3]);
    let paths = [path.clone()];
    fuzz("parquet", 0x9a2e, &dir, contents(&paths), |_| {
        myosotis::data::hub::read_parquet_images(&path, (28, 1)).map(|_| ())
    });
}

/// A run's `last.safetensors`: the safetensors header and tensors, the metadata's config JSON,
/// and the optimiser's state, read as `myo eval` and `--resume` read them (a config that still
/// parses builds its model from the file; the optimiser's state loads when the config is
/// unchanged, as `--resume` requires).
#[test]
fn fuzz_checkpoint() {
    let dir = temp("checkpoint");
    let path = dir.join("last.safetensors");
    let flags = [
        "--d-model",
        "4",
        "--state-size",
        "4",
        "--layers",
        "1",
        "--max-train-samples",
        "8",
    ];
    let cfg = RunArgs::from_flags(flags).unwrap().resolve().unwrap();
    let (varmap, model) = fresh_model(&cfg);
    let vars = model_vars(&varmap);
    let opt = Optimizer::new(cfg.optim.clone(), &vars, |n| model.param_group(n)).unwrap();
    checkpoint::save_resumable(&varmap, &cfg, &opt.state().unwrap(), &[], &path).unwrap();
    let paths = [path.clone()];
    fuzz("checkpoint", 0xc4e7, &dir, contents(&paths), |_| {
        let ck = checkpoint::read::<RunConfig>(&path)?;
        run::checkpoint_model(&ck.tensors, &ck.config, &path, &Device::Cpu)?;
        if ck.config != cfg {
            return Ok(());
        }
        checkpoint::load_into(&varmap, &ck.tensors, &path)?;
        let mut opt = Optimizer::new(cfg.optim.clone(), &vars, |n| model.param_group(n))?;
        opt.load_state(&ck.optimizer)
            .map_err(|e| anyhow::anyhow!("{}: optimiser state: {e}", path.display()))
    });
}

fn fresh_model(cfg: &RunConfig) -> (VarMap, SequenceClassifier) {
    let varmap = VarMap::new();
    let model = SequenceClassifier::new(
        cfg.model.clone(),
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    (varmap, model)
}

fn model_vars(varmap: &VarMap) -> std::collections::HashMap<String, candle_core::Var> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Every number of a checkpoint's config (sizes, counts, rates, seeds), one model of each kind:
/// a case sets one to four of them to boundary values (0, 1, 2³¹, 2⁶⁴ − 1, …) and rewrites the
/// file with a valid header, so the config parses and builds its model. The model must come
/// out of the file's tensors or be an error naming the file, before anything is sized by a
/// number the tensors do not hold (a config asking for 2⁶⁴ − 1 heads must not allocate them).
#[test]
fn fuzz_checkpoint_config() {
    let dir = temp("checkpoint-config");
    let kinds: [&[&str]; 6] = [
        &["--model", "s5", "--bidirectional", "true"],
        &["--model", "myo"],
        &[
            "--model",
            "myo",
            "--task",
            "zmnist",
            "--data-dir",
            "/nowhere",
            "--block-size",
            "2",
            "--coupling",
            "free",
            "--per-level",
        ],
        &[
            "--model",
            "ssm2d",
            "--task",
            "smnist",
            "--data-dir",
            "/nowhere",
        ],
        &["--model", "mingru", "--norm", "batch"],
        &[
            "--model",
            "s5",
            "--task",
            "scifar",
            "--data-dir",
            "/nowhere",
            "--blocks",
            "2",
        ],
    ];
    let seeds: Vec<(PathBuf, Vec<u8>)> = kinds
        .iter()
        .enumerate()
        .map(|(k, extra)| {
            let mut flags = vec!["--d-model", "4", "--layers", "2"];
            if !extra.contains(&"mingru") {
                flags.extend(["--state-size", "4"]);
            }
            flags.extend_from_slice(extra);
            let cfg = RunArgs::from_flags(flags).unwrap().resolve().unwrap();
            let (varmap, _) = fresh_model(&cfg);
            let path = dir.join(format!("model-{k}.safetensors"));
            checkpoint::save(&varmap, &cfg, &path).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    for (path, _) in &seeds {
        let ck = checkpoint::read::<RunConfig>(path).unwrap();
        run::checkpoint_model(&ck.tensors, &ck.config, path, &Device::Cpu).unwrap();
    }
    let value = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(3),
        Just(1 << 20),
        Just((1 << 20) + 1),
        Just(1 << 31),
        Just(u32::MAX as u64),
        Just(1 << 40),
        Just(u64::MAX),
        any::<u64>(),
    ];
    let strategy = (
        0..seeds.len(),
        prop::collection::vec((any::<usize>(), value), 1..5),
    );
    let (mut runner, seed) = runner(0xc0f1);
    let started = std::time::Instant::now();
    let (runs, built) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let result = runner.run(&strategy, |(k, edits)| {
        let (path, valid) = &seeds[k];
        runs.set(runs.get() + 1);
        let ck = checkpoint::read::<RunConfig>(path).unwrap();
        let mut config = serde_json::to_value(&ck.config).unwrap();
        let mut numbers = Vec::new();
        number_paths(&config, String::new(), &mut numbers);
        for (at, v) in &edits {
            *config.pointer_mut(&numbers[at % numbers.len()]).unwrap() = (*v).into();
        }
        let Ok(mutated) = serde_json::from_value::<RunConfig>(config) else {
            return Ok(()); // a value out of its field's range: the reader's error, tested above
        };
        checkpoint::save_tensors(&sorted(&ck.tensors), &mutated, path).unwrap();
        let outcome = checkpoint::read::<RunConfig>(path)
            .and_then(|ck| run::checkpoint_model(&ck.tensors, &ck.config, path, &Device::Cpu));
        std::fs::write(path, valid).unwrap();
        match outcome {
            Ok(_) => {
                built.set(built.get() + 1);
                Ok(())
            }
            Err(e) => names(&e, path),
        }
    });
    eprintln!(
        "checkpoint config: {} cases in {:.1} s (seed {seed}): {} configs built of {} runs",
        cases(),
        started.elapsed().as_secs_f64(),
        built.get(),
        runs.get()
    );
    if let Err(e) = result {
        panic!("checkpoint config: {e}");
    }
}

/// The JSON pointers of every number in `v`.
fn number_paths(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Number(_) => out.push(at),
        serde_json::Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                number_paths(x, format!("{at}/{i}"), out);
            }
        }
        serde_json::Value::Object(map) => {
            for (key, x) in map {
                number_paths(
                    x,
                    format!("{at}/{}", key.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        _ => {}
    }
}

fn sorted(
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Vec<(String, candle_core::Tensor)> {
    let mut named: Vec<_> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// The inputs the fuzz targets found bugs with (`tests/fuzz_corpus/TARGET/`), kept as
/// regression tests: each must read as an error naming the file.
#[test]
fn corpus_of_found_bugs_reads_as_errors() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus.join("parquet"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    for path in files {
        // The parquet crate panics on each of these; the reader must turn that into an error.
        let e = myosotis::data::hub::read_parquet_images(&path, (28, 1))
            .err()
            .unwrap_or_else(|| panic!("{} read without an error", path.display()));
        let msg = format!("{e:#}");
        assert!(msg.contains(&*path.to_string_lossy()), "{msg}");
    }
}

/// Found by reading the IDX reader against the task: MNIST files of another image size (here
/// 56 × 14, the same bytes per image as 28 × 28) were read and then indexed as 28 × 28.
#[test]
fn mnist_files_of_another_image_size_are_an_error() {
    let dir = temp("idx-size");
    let mut images: Vec<u8> = [2051u32, 2, 56, 14]
        .iter()
        .flat_map(|x| x.to_be_bytes())
        .collect();
    images.extend(vec![7u8; 2 * 784]);
    for split in ["train", "t10k"] {
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte")), &images).unwrap();
        std::fs::write(
            dir.join(format!("{split}-labels-idx1-ubyte")),
            idx_labels(2),
        )
        .unwrap();
    }
    let e = format!("{:#}", load("smnist", &dir).unwrap_err());
    assert!(
        e.contains(&*dir.to_string_lossy()) && e.contains("56 x 14"),
        "{e}"
    );
}

/// A task description whose image side disagrees with its files (as a config edited or
/// corrupted in a checkpoint could say) is an error naming the folder, found before the pixel
/// order of that side is built (10¹² entries here).
#[test]
fn a_task_side_that_disagrees_with_the_files_is_an_error() {
    let dir = temp("cifar-side");
    let record: Vec<u8> = std::iter::once(3u8).chain(vec![9u8; 3 * 1024]).collect();
    for name in myosotis::data::images::CIFAR_TRAIN
        .iter()
        .chain(&myosotis::data::images::CIFAR_TEST)
    {
        std::fs::write(dir.join(name), &record).unwrap();
    }
    let mut task = find("scifar").unwrap();
    if let myosotis::data::task::Input::Pixels(p) = &mut task.input {
        p.side = 1_000_000;
    }
    let source = DataSource::Dir {
        dir: dir.to_path_buf(),
    };
    let e = format!("{:#}", task.load(&source).unwrap_err());
    assert!(
        e.contains(&*dir.to_string_lossy()) && e.contains("32 x 32"),
        "{e}"
    );
}
