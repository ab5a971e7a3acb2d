//! Speech Commands (S5 §6.2) on a generated folder of its layout: tones whose pitch is the
//! class. The splits from the list files, the normalisation, bad files named, a run end to end,
//! and the zero-shot test at 8 kHz: decimated clips with S5's Δ doubled give the outputs of the
//! same continuous-time model.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use myosotis::data::dataset::Dataset;
use myosotis::data::speech::{self, read_clip, WORDS};
use myosotis::nn::{S5Config, S5};
use myosotis::train::checkpoint;
use myosotis::train::config::RunArgs;
use myosotis::train::config::RunConfig;
use myosotis::train::dist::World;
use myosotis::train::run::{checkpoint_model, eval_checkpoint_at, train, Exec, Start};
use myosotis::train::trainer::evaluate;

fn dir(name: &str) -> common::Scratch {
    common::unmade(&format!("speech-{name}"))
}

fn write_wav(path: &Path, samples: &[i16], rate: u32, channels: u16) {
    let spec = hound::WavSpec {
        channels,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for &s in samples {
        w.write_sample(s).unwrap();
    }
    w.finalize().unwrap();
}

/// A tone of `hz` for `len` samples at 16 kHz.
fn tone(hz: f64, len: usize, phase: f64) -> Vec<i16> {
    (0..len)
        .map(|i| (12000.0 * (std::f64::consts::TAU * hz * i as f64 / 16000.0 + phase).sin()) as i16)
        .collect()
}

/// The first three words get `per_word` tones each (50, 110 and 230 Hz: they survive
/// decimation to 8 kHz) of 0.5 to 1 s; every other word an empty folder. Of each word's clips
/// the first is a test clip, the second a validation clip.
fn dataset(d: &Path, per_word: usize) {
    std::fs::create_dir_all(d.join("_background_noise_")).unwrap();
    write_wav(
        &d.join("_background_noise_/noise.wav"),
        &tone(1000.0, 100, 0.0),
        16000,
        1,
    );
    let (mut val, mut test) = (String::new(), String::new());
    for (c, word) in WORDS.iter().enumerate() {
        std::fs::create_dir_all(d.join(word)).unwrap();
        if c >= 3 {
            continue;
        }
        for i in 0..per_word {
            let name = format!("{word}/clip{i:02}.wav");
            let len = 8000 + (i * 997) % 8001;
            write_wav(
                &d.join(&name),
                &tone([50.0, 110.0, 230.0][c], len, i as f64),
                16000,
                1,
            );
            match i {
                0 => test.push_str(&format!("{name}\n")),
                1 => val.push_str(&format!("{name}\n")),
                _ => {}
            }
        }
    }
    std::fs::write(d.join("validation_list.txt"), val).unwrap();
    std::fs::write(d.join("testing_list.txt"), test).unwrap();
}

#[test]
fn the_splits_follow_the_lists_and_are_normalised() {
    let d = dir("splits");
    dataset(&d, 6);
    let [train, val, test] = speech::load(&d).unwrap();
    assert_eq!([train.len(), val.len(), test.len()], [12, 3, 3]);
    assert_eq!(test.labels(), &[0, 1, 2]);
    let Dataset::Real { values, len, .. } = &train else {
        panic!("audio is real sequences")
    };
    assert_eq!(*len, 16000);
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
    let std = (values
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    assert!(
        mean.abs() < 1e-6 && (std - 0.2).abs() < 1e-5,
        "mean {mean}, std {std}"
    );
    // The clip itself, scaled as the others, then the padding.
    let clip = read_clip(&d.join("backward/clip02.wav")).unwrap();
    let scale = (values[1] - values[0]) as f64 / (clip[1] - clip[0]) as f64;
    assert!(((values[100] - values[0]) as f64 - scale * (clip[100] - clip[0]) as f64).abs() < 1e-5);
    let pad = values[15999];
    assert!(values[clip.len()..16000].iter().all(|&v| v == pad));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_files_are_named() {
    let d = dir("bad");
    dataset(&d, 3);
    let bad = d.join("bed/clip01.wav");
    for (samples, rate, channels, says) in [
        (tone(50.0, 100, 0.0), 8000, 1, "8000 Hz"),
        (tone(50.0, 100, 0.0), 16000, 2, "2 channel(s)"),
        (tone(50.0, 16001, 0.0), 16000, 1, "more than one second"),
    ] {
        write_wav(&bad, &samples, rate, channels);
        let e = format!("{:#}", speech::load(&d).unwrap_err());
        assert!(e.contains("bed/clip01.wav") && e.contains(says), "{e}");
    }
    std::fs::write(&bad, b"RIFF....").unwrap();
    let e = format!("{:#}", speech::load(&d).unwrap_err());
    assert!(e.contains("bed/clip01.wav"), "{e}");
    write_wav(&bad, &tone(50.0, 100, 0.0), 16000, 1);
    std::fs::remove_file(d.join("testing_list.txt")).unwrap();
    let e = format!("{:#}", speech::load(&d).unwrap_err());
    assert!(e.contains("testing_list.txt"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// An S5 layer on a slow input at 16 kHz, and with Δ doubled on every second sample: the same
/// continuous-time system, so the outputs agree at the common samples; without the doubled Δ
/// they do not.
#[test]
fn doubling_delta_at_half_the_rate_keeps_the_outputs() {
    let cpu = &Device::Cpu;
    let cfg = S5Config {
        d_model: 4,
        state: 8,
        blocks: 1,
        bidirectional: true,
        ..S5Config::default()
    };
    let varmap = VarMap::new();
    let layer = S5::new(
        cfg.clone(),
        VarBuilder::from_varmap(&varmap, DType::F64, cpu),
    )
    .unwrap();
    let len = 4000;
    let x: Vec<f64> = (0..len * 4)
        .map(|i| {
            let (t, h) = ((i / 4) as f64 / len as f64, (i % 4) as f64);
            (std::f64::consts::TAU * (2.0 + h) * t).sin()
        })
        .collect();
    let x = Tensor::from_vec(x, (1, len, 4), cpu).unwrap();
    let full = layer.forward(&x).unwrap();
    let half_x = x
        .reshape((1, len / 2, 2, 4))
        .unwrap()
        .narrow(2, 0, 1)
        .unwrap()
        .squeeze(2)
        .unwrap();
    let want = full
        .reshape((1, len / 2, 2, 4))
        .unwrap()
        .narrow(2, 0, 1)
        .unwrap()
        .squeeze(2)
        .unwrap();
    let rel = |y: &Tensor| {
        let d = (y - &want)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let n = want
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        (d / n).sqrt()
    };
    let plain = rel(&layer.forward(&half_x).unwrap());
    {
        let data = varmap.data().lock().unwrap();
        let step = &data["log_step"];
        step.set(&(step.as_tensor() + 2f64.ln()).unwrap()).unwrap();
    }
    let rescaled = rel(&layer.forward(&half_x).unwrap());
    assert!(
        rescaled < 0.02 && plain > 5.0 * rescaled,
        "rescaled {rescaled}, plain {plain}"
    );
}

/// `myo train --task speech` end to end, then the test at 16 kHz and, zero-shot, at 8 kHz.
#[test]
fn a_speech_run_is_tested_at_another_rate() {
    let d = dir("run");
    dataset(&d, 5);
    let data = d.to_string_lossy().to_string();
    let cfg = RunArgs::from_flags([
        "--task",
        "speech",
        "--data-dir",
        &data,
        "--d-model",
        "8",
        "--state-size",
        "8",
        "--layers",
        "1",
        "--batch-size",
        "4",
        "--epochs",
        "2",
    ])
    .unwrap()
    .resolve()
    .unwrap();
    let out = d.join("out");
    let exec = Exec::on(&Device::Cpu);
    let summary = train(&cfg, &out, &exec, Start::New, |_| {}).unwrap();
    let best = out.join("best.safetensors");
    let at = |rate| eval_checkpoint_at(&best, None, None, rate, Default::default(), &exec);
    let e16 = at(None).unwrap();
    assert_eq!(e16.accuracy, summary.test_accuracy);
    let e8 = at(Some(8000)).unwrap();
    assert_eq!(e8.examples, 3);
    assert!(e8.loss.is_finite());
    assert!(
        (e8.loss - e16.loss).abs() < 0.05 * e16.loss,
        "8 kHz loss {} against 16 kHz {}",
        e8.loss,
        e16.loss
    );
    // The same by hand: the checkpoint's model with every log Δ + ln 2, on every second sample.
    let by_hand = |shift: f64| {
        let ck = checkpoint::read::<RunConfig>(&best).unwrap();
        let mut tensors = ck.tensors;
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("log_step") {
                *t = (&*t + shift).unwrap();
            }
        }
        let (_, model) = checkpoint_model(&tensors, &ck.config, &best, &Device::Cpu).unwrap();
        let test = ck.config.task.load_test(&ck.config.data).unwrap();
        let test = speech::decimated(&test, 2).unwrap();
        let batching = ck.config.batching(1, false);
        evaluate(&model, &test, batching, &Device::Cpu, &World::single())
            .unwrap()
            .loss
    };
    assert!((by_hand(2f64.ln()) - e8.loss).abs() < 1e-12);
    assert!((by_hand(0.0) - e8.loss).abs() > 1e-9, "Δ rescaled");
    let e = format!("{:#}", at(Some(7000)).unwrap_err());
    assert!(e.contains("--rate 7000"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
