//! Checkpoints: an exact round trip, atomic replacement, and each corruption case's error.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{randn, to_vec};
use myosotis::nn::{S5Config, S5};
use myosotis::train::checkpoint::{load_into, read, save, save_tensors, CONFIG_KEY, FORMAT_KEY};

fn dir(test: &str) -> common::Scratch {
    common::scratch(&format!("ckpt-{test}"))
}

fn cfg() -> S5Config {
    S5Config {
        d_model: 3,
        state: 8,
        blocks: 2,
        bidirectional: true,
        seed: 7,
        ..S5Config::default()
    }
}

fn model(cfg: &S5Config) -> (VarMap, S5) {
    let varmap = VarMap::new();
    let layer = S5::new(
        cfg.clone(),
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("layers.0.ssm"),
    )
    .unwrap();
    (varmap, layer)
}

#[test]
fn round_trip_reproduces_outputs_exactly() {
    let (mut rng, _) = common::seeded_rng("round_trip_reproduces_outputs_exactly", 131);
    let d = dir("roundtrip");
    let path = d.join("model.safetensors");
    let (varmap, layer) = model(&cfg());
    save(&varmap, &cfg(), &path).unwrap();
    // Rebuild from the checkpoint's own config; a different seed shows nothing comes from it.
    let ck = read::<S5Config>(&path).unwrap();
    assert_eq!(ck.config, cfg());
    let (varmap2, layer2) = model(&S5Config {
        seed: 1,
        ..ck.config.clone()
    });
    load_into(&varmap2, &ck.tensors, &path).unwrap();
    let u = randn(&mut rng, &[2, 11, 3], DType::F32, &Device::Cpu);
    assert_eq!(
        to_vec(&layer.forward(&u).unwrap()),
        to_vec(&layer2.forward(&u).unwrap())
    );
    let mut names: Vec<_> = ck.tensors.keys().cloned().collect();
    names.sort();
    assert_eq!(
        names,
        ["b", "c", "d", "lambda_im", "lambda_re", "log_step"].map(|n| format!("layers.0.ssm.{n}"))
    );
    // Saving again replaces the file and leaves no temporary file behind.
    save(&varmap2, &ck.config, &path).unwrap();
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

/// The same model and config always give the same bytes (the metadata of the safetensors
/// header would otherwise follow a hash map's order, which changes from map to map).
#[test]
fn checkpoints_of_the_same_model_are_the_same_bytes() {
    let d = dir("bytes");
    let (varmap, _) = model(&cfg());
    let files: Vec<Vec<u8>> = (0..8)
        .map(|i| {
            let path = d.join(format!("model{i}.safetensors"));
            save(&varmap, &cfg(), &path).unwrap();
            std::fs::read(&path).unwrap()
        })
        .collect();
    for (i, f) in files.iter().enumerate() {
        assert!(f == &files[0], "save {i} differs from save 0");
    }
    // And they still read back.
    read::<S5Config>(&d.join("model7.safetensors")).unwrap();
}

fn expect_err(path: &Path, varmap: &VarMap, needles: &[&str]) {
    let err = read::<S5Config>(path)
        .and_then(|ck| load_into(varmap, &ck.tensors, path))
        .map(|_| ())
        .unwrap_err();
    let msg = format!("{err:#}");
    for n in needles {
        assert!(msg.contains(n), "'{msg}' lacks '{n}'");
    }
}

#[test]
fn corrupt_and_mismatched_checkpoints_are_clear_errors() {
    let d = dir("corrupt");
    let (varmap, _) = model(&cfg());
    let tensors: Vec<(String, Tensor)> = {
        let data = varmap.data().lock().unwrap();
        let mut v: Vec<_> = data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let p = |n: &str| d.join(n);

    let missing: Vec<_> = tensors
        .iter()
        .filter(|(k, _)| !k.ends_with(".d"))
        .cloned()
        .collect();
    save_tensors(&missing, &cfg(), &p("missing.safetensors")).unwrap();
    expect_err(
        &p("missing.safetensors"),
        &varmap,
        &["missing.safetensors", "'layers.0.ssm.d'", "missing"],
    );

    let mut extra = tensors.clone();
    extra.push((
        "layers.9.ssm.d".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    ));
    save_tensors(&extra, &cfg(), &p("extra.safetensors")).unwrap();
    expect_err(
        &p("extra.safetensors"),
        &varmap,
        &["extra.safetensors", "'layers.9.ssm.d'", "unexpected"],
    );

    let mut shaped = tensors.clone();
    shaped[0].1 = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
    save_tensors(&shaped, &cfg(), &p("shape.safetensors")).unwrap();
    expect_err(
        &p("shape.safetensors"),
        &varmap,
        &["shape.safetensors", &format!("'{}'", shaped[0].0), "[2, 2]"],
    );

    // Written by candle without our metadata.
    let plain: std::collections::HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle_core::safetensors::save(&plain, p("plain.safetensors")).unwrap();
    expect_err(
        &p("plain.safetensors"),
        &varmap,
        &["plain.safetensors", "no model config"],
    );

    // Another format version, and none (as the first checkpoints were written).
    let config = serde_json::to_string(&cfg()).unwrap();
    for (name, format, says) in [
        ("format1.safetensors", Some("1"), "checkpoint format 1"),
        ("unversioned.safetensors", None, "no checkpoint format"),
    ] {
        let mut metadata =
            std::collections::HashMap::from([(CONFIG_KEY.to_string(), config.clone())]);
        if let Some(f) = format {
            metadata.insert(FORMAT_KEY.to_string(), f.to_string());
        }
        let bytes =
            safetensors::serialize(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(metadata))
                .unwrap();
        std::fs::write(p(name), bytes).unwrap();
        expect_err(&p(name), &varmap, &[name, says]);
    }

    std::fs::write(p("garbage.safetensors"), b"not a checkpoint at all").unwrap();
    expect_err(
        &p("garbage.safetensors"),
        &varmap,
        &["garbage.safetensors", "not a valid safetensors"],
    );

    let good = p("good.safetensors");
    save(&varmap, &cfg(), &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(p("truncated.safetensors"), &bytes[..bytes.len() - 10]).unwrap();
    expect_err(
        &p("truncated.safetensors"),
        &varmap,
        &["truncated.safetensors"],
    );

    expect_err(
        &p("absent.safetensors"),
        &varmap,
        &["absent.safetensors", "cannot read"],
    );
}
