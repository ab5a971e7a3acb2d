//! The LRA Pathfinder reader against small folders written here in the real layout, each
//! malformed case, and a short training run on them.

mod common;

use std::path::{Path, PathBuf};

use candle_core::Device;
use myosotis::data::pathfinder::{locate, read_pathfinder, DIFFICULTY};
use myosotis::data::task::{find, DataSource};
use myosotis::nn::*;
use myosotis::train::config::RunConfig;
use myosotis::train::run::{eval_checkpoint, train, Exec, Start};
use rand::{Rng, SeedableRng};

fn tmp(name: &str) -> common::Scratch {
    common::scratch(&format!("pf-{name}"))
}

fn write_png(path: &Path, side: u32, pixels: &[u8], color: png::ColorType) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut e = png::Encoder::new(w, side, side);
    e.set_color(color);
    e.set_depth(png::BitDepth::Eight);
    e.write_header().unwrap().write_image_data(pixels).unwrap();
}

/// `per_file` images in each of `files` metadata files under `base/pathfinder32/DIFFICULTY`:
/// label 1 images are brighter. Returns the difficulty folder and the pixels in reading order.
fn synthetic(base: &Path, files: usize, per_file: usize) -> (PathBuf, Vec<(Vec<u8>, u8)>) {
    let root = base.join("pathfinder32").join(DIFFICULTY);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut all = Vec::new();
    // Write files 10, 9, …: reading must order them numerically (2 before 10).
    for k in (0..files).rev().map(|k| if k == 0 { 10 } else { k }) {
        let mut meta = String::new();
        let mut imgs = Vec::new();
        for n in 0..per_file {
            let label: u8 = rng.random_range(0..2);
            let px: Vec<u8> = (0..32 * 32)
                .map(|_| 60 * label + rng.random_range(0..120))
                .collect();
            write_png(
                &root.join(format!("imgs/{k}/sample_{n}.png")),
                32,
                &px,
                png::ColorType::Grayscale,
            );
            meta.push_str(&format!("imgs/{k} sample_{n}.png {n} {label} 9 1\n"));
            imgs.push((px, label));
        }
        std::fs::create_dir_all(root.join("metadata")).unwrap();
        std::fs::write(root.join(format!("metadata/{k}.npy")), meta).unwrap();
        all.push((k, imgs));
    }
    all.sort_by_key(|(k, _)| *k);
    (root, all.into_iter().flat_map(|(_, v)| v).collect())
}

#[test]
fn reads_images_in_metadata_order() {
    let base = tmp("read");
    let (root, want) = synthetic(&base, 3, 4);
    for dir in [&*base, &*root] {
        assert_eq!(locate(dir, 32).unwrap(), root);
    }
    let set = read_pathfinder(&root, 32).unwrap();
    assert_eq!(
        (set.len(), set.height, set.width, set.channels),
        (12, 32, 32, 1)
    );
    for (i, (px, label)) in want.iter().enumerate() {
        assert_eq!(set.image(i), px.as_slice(), "image {i}");
        assert_eq!(set.labels[i], *label);
    }
    assert!(locate(&base.join("imgs"), 32).is_err());
}

#[test]
fn malformed_folders_are_errors_naming_the_place() {
    type Breaker = fn(&Path);
    let cases: [(&str, Breaker); 6] = [
        ("missing image", |r| {
            std::fs::remove_file(r.join("imgs/1/sample_1.png")).unwrap()
        }),
        ("bad label", |r| {
            std::fs::write(r.join("metadata/1.npy"), "imgs/1 sample_0.png 0 7\n").unwrap()
        }),
        ("short row", |r| {
            std::fs::write(r.join("metadata/1.npy"), "imgs/1 sample_0.png\n").unwrap()
        }),
        ("wrong size", |r| {
            write_png(
                &r.join("imgs/1/sample_0.png"),
                16,
                &[0; 256],
                png::ColorType::Grayscale,
            )
        }),
        ("colour image", |r| {
            write_png(
                &r.join("imgs/1/sample_0.png"),
                32,
                &[0; 3072],
                png::ColorType::Rgb,
            )
        }),
        ("not a png", |r| {
            std::fs::write(r.join("imgs/1/sample_0.png"), b"hello").unwrap()
        }),
    ];
    for (i, (what, break_it)) in cases.iter().enumerate() {
        let base = tmp(&format!("bad{i}"));
        let (root, _) = synthetic(&base, 2, 2);
        break_it(&root);
        let e = format!("{:#}", read_pathfinder(&root, 32).unwrap_err());
        assert!(e.contains("1.npy") || e.contains("sample_"), "{what}: {e}");
        eprintln!("{what}: {e}");
    }
    let empty = tmp("empty");
    std::fs::create_dir_all(empty.join("metadata")).unwrap();
    let e = read_pathfinder(&empty, 32).unwrap_err().to_string();
    assert!(e.contains("no .npy"), "{e}");
}

#[test]
fn pathfinder_trains_and_evaluates() {
    let base = tmp("train");
    synthetic(&base, 4, 50);
    let cfg = RunConfig {
        task: find("pathfinder").unwrap(),
        data: DataSource::Dir {
            dir: base.to_path_buf(),
        },
        model: ClassifierConfig {
            encoder: EncoderConfig::Linear { features: 1 },
            d_model: 8,
            layers: 1,
            layer: SeqLayerConfig::S5(S5Config {
                state: 8,
                blocks: 1,
                ..S5Config::default()
            }),
            norm: NormKind::Layer,
            prenorm: true,
            activation: Activation::HalfGlu2,
            dropout: 0.0,
            pooling: Pooling::Mean,
            classes: 2,
            timing: Default::default(),
            pairs: false,
            decoder: Default::default(),
            seed: 0,
            bn_momentum: BN_MOMENTUM,
            dense_init: Default::default(),
        },
        optim: myosotis::train::optim::OptimConfig {
            lr: 0.01,
            ssm_lr: 0.003,
            lr_min: 0.0,
            weight_decay: 0.0,
            warmup_steps: 2,
            total_steps: 0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: None,
        },
        epochs: 4,
        batch_size: 16,
        seed: 0,
        max_train_samples: None,
        max_eval_samples: None,
        warmup_epochs: None,
        early_stop: None,
        eval_every: None,
        monitor: Default::default(),
        accumulate: 1,
        precision: Default::default(),
    };
    let out = tmp("train-out");
    let summary = train(&cfg, &out, &Exec::on(&Device::Cpu), Start::New, |_| {}).unwrap();
    // 200 images: 160 / 20 / 20; brightness separates the classes.
    assert!(
        summary.test_accuracy.unwrap() > 0.75,
        "{}",
        summary.test_accuracy.unwrap()
    );
    let e = eval_checkpoint(
        &out.join("best.safetensors"),
        None,
        None,
        &Exec::on(&Device::Cpu),
    )
    .unwrap();
    assert!((e.accuracy.unwrap() - summary.test_accuracy.unwrap()).abs() < 1e-12);
}
