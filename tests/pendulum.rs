//! The pendulum benchmark's generator and file: the physics against an independent integration
//! of the same equation, the images against the angle, the noise's clean start, and the npz
//! file read back exactly (deflated too, as NumPy writes it), with bad files named; `myo data
//! pendulum`.

mod common;

use myosotis::data::pendulum::{
    advance, generate, read_split, render, subsample, write_dataset, PendulumConfig, FILE, SIDE,
};

fn dir(name: &str) -> common::Scratch {
    common::unmade(&format!("pendulum-{name}"))
}

/// One frame of θ'' = 3g sin θ − 0.1 θ' by classical Runge–Kutta in 1,000 steps: the
/// generator's 100 semi-implicit Euler steps must agree to their own order (h = 1e-4).
#[test]
fn a_frame_follows_the_pendulum_equation() {
    let f = |t: f64, w: f64| (w, 3.0 * 9.81 * t.sin() - 0.1 * w);
    for (theta, omega) in [
        (0.3, 0.0),
        (3.0, 1.5),
        (5.5, -4.0),
        (std::f64::consts::PI, 0.2),
    ] {
        let (mut t, mut w) = (theta, omega);
        let h = 0.01 / 1000.0;
        for _ in 0..1000 {
            let k1 = f(t, w);
            let k2 = f(t + h / 2.0 * k1.0, w + h / 2.0 * k1.1);
            let k3 = f(t + h / 2.0 * k2.0, w + h / 2.0 * k2.1);
            let k4 = f(t + h * k3.0, w + h * k3.1);
            t += h / 6.0 * (k1.0 + 2.0 * k2.0 + 2.0 * k3.0 + k4.0);
            w += h / 6.0 * (k1.1 + 2.0 * k2.1 + 2.0 * k3.1 + k4.1);
        }
        let (gt, gw) = advance(theta, omega);
        assert!(
            (gt - t).abs() < 2e-4 && (gw - w).abs() < 2e-3,
            "{theta} {omega}: ({gt}, {gw}) vs ({t}, {w})"
        );
        // A frame moves the pendulum: not a no-op.
        assert!((gt - theta).abs() + (gw - omega).abs() > 1e-3);
    }
}

/// The image's brightness is centred on the rod: its centroid, seen from the image's centre,
/// points along (sin, cos) of the angle, at about half the rod's length.
#[test]
fn the_image_shows_the_rod_at_its_angle() {
    for k in 0..12 {
        let angle = 0.1 + k as f64 * std::f64::consts::TAU / 12.0;
        let img = render(angle.sin(), angle.cos());
        assert_eq!(img.len(), SIDE * SIDE);
        assert!(img.iter().all(|v| (0.0..=1.0).contains(v)));
        let (mut m, mut cx, mut cy) = (0.0, 0.0, 0.0);
        for (i, v) in img.iter().enumerate() {
            let (row, col) = ((i / SIDE) as f64 + 0.5, (i % SIDE) as f64 + 0.5);
            m += *v as f64;
            cx += *v as f64 * (col - SIDE as f64 / 2.0);
            cy += *v as f64 * (row - SIDE as f64 / 2.0);
        }
        let (cx, cy) = (cx / m, cy / m);
        let seen = cx.atan2(cy);
        let off = (seen - angle).rem_euclid(std::f64::consts::TAU);
        assert!(
            off.min(std::f64::consts::TAU - off) < 0.05,
            "angle {angle}: seen {seen}"
        );
        // Half of 55/128 of the side.
        let r = (cx * cx + cy * cy).sqrt();
        assert!(
            (r - 0.5 * 55.0 * 24.0 / 128.0).abs() < 1.0,
            "angle {angle}: centroid at {r}"
        );
        // A line 8/128 of the side wide and 55/128 long covers about 8·55/128² of the image.
        let area = m / (SIDE * SIDE) as f64;
        assert!(
            (area - 8.0 * 55.0 / (128.0 * 128.0)).abs() < 0.006,
            "area {area}"
        );
    }
}

/// Sequences: deterministic, targets on the unit circle that follow the frames' physics, the
/// first 5 frames clean (the rendering of their angle, up to the observation noise).
#[test]
fn generated_sequences_are_seeded_and_clean_at_first() {
    let ep = generate(6, 20, 3);
    assert_eq!(ep, generate(6, 20, 3));
    assert_ne!(ep.obs, generate(6, 20, 4).obs);
    assert_eq!(
        (ep.obs.len(), ep.targets.len(), ep.ts.len()),
        (6 * 20 * 576, 6 * 20 * 2, 6 * 20)
    );
    for (i, t) in ep.ts.iter().enumerate() {
        assert_eq!(*t, (i % 20) as f64);
    }
    for s in ep.targets.chunks(2) {
        assert!((s[0] * s[0] + s[1] * s[1] - 1.0).abs() < 1e-12);
    }
    let px = SIDE * SIDE;
    let mut noisy_later = 0;
    for seq in 0..6 {
        for k in 0..20 {
            let at = seq * 20 + k;
            let (x, y) = (ep.targets[2 * at], ep.targets[2 * at + 1]);
            let clean: Vec<u8> = render(x, y)
                .iter()
                .map(|v| (255.0 * *v as f64) as u8)
                .collect();
            let frame = &ep.obs[at * px..(at + 1) * px];
            let differ = frame
                .iter()
                .zip(&clean)
                .filter(|(a, b)| a.abs_diff(**b) > 2)
                .count();
            if k < 5 {
                assert_eq!(differ, 0, "sequence {seq} frame {k} is not clean");
            } else if differ > px / 4 {
                noisy_later += 1;
            }
        }
    }
    assert!(
        noisy_later > 10,
        "the noise hardly shows: {noisy_later} noisy frames"
    );
}

/// `write_dataset` writes the benchmark's layout, and `read_split` reads each split back
/// exactly; subsampling keeps frames in time order, seeded.
#[test]
fn the_file_reads_back_and_subsamples() {
    let d = dir("file");
    let cfg = PendulumConfig {
        train: 3,
        valid: 2,
        test: 2,
        frames: 10,
        seed: 7,
    };
    let path = write_dataset(&d, &cfg).unwrap();
    assert_eq!(path, d.join(FILE));
    for (k, (split, n)) in [("train", 3), ("valid", 2), ("test", 2)]
        .into_iter()
        .enumerate()
    {
        let ep = read_split(&path, split).unwrap();
        assert_eq!(ep, generate(n, 10, 7 + k as u64), "{split}");
    }
    let ep = read_split(&path, "train").unwrap();
    let half = subsample(&ep, 5, 1).unwrap();
    assert_eq!(half, subsample(&ep, 5, 1).unwrap());
    assert_eq!((half.n, half.frames, half.obs.len()), (3, 5, 3 * 5 * 576));
    for (i, seq) in half.ts.chunks(5).enumerate() {
        assert!(seq.windows(2).all(|w| w[0] < w[1]), "{seq:?}");
        for (j, t) in seq.iter().enumerate() {
            let k = *t as usize;
            let (from, to) = ((i * 10 + k) * 576, (i * 5 + j) * 576);
            assert_eq!(ep.obs[from..from + 576], half.obs[to..to + 576]);
            assert_eq!(ep.targets[2 * (i * 10 + k)], half.targets[2 * (i * 5 + j)]);
        }
    }
    assert!(subsample(&ep, 11, 1).is_err());
    // NumPy's savez_compressed deflates each array: deflated, the file reads the same.
    let deflated = d.join("deflated.npz");
    deflated_copy(&path, &deflated);
    assert_ne!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&deflated).unwrap()
    );
    assert_eq!(
        read_split(&deflated, "test").unwrap(),
        read_split(&path, "test").unwrap()
    );
    let e = read_split(&path, "validation").unwrap_err().to_string();
    assert!(e.contains(FILE) && e.contains("validation_obs"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A copy of the zip archive `from` with every entry deflated.
fn deflated_copy(from: &std::path::Path, to: &std::path::Path) {
    use std::io::{Read, Write};
    let mut src = zip::ZipArchive::new(std::fs::File::open(from).unwrap()).unwrap();
    let mut dst = zip::ZipWriter::new(std::fs::File::create(to).unwrap());
    let deflate = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for i in 0..src.len() {
        let mut entry = src.by_index(i).unwrap();
        let mut bytes = vec![];
        entry.read_to_end(&mut bytes).unwrap();
        dst.start_file(entry.name().unwrap().to_string(), deflate)
            .unwrap();
        dst.write_all(&bytes).unwrap();
    }
    dst.finish().unwrap();
}

/// A file with an array of the wrong shape or type is refused naming the file and the array.
#[test]
fn a_malformed_file_is_named() {
    use candle_core::{Device, Tensor};
    let d = dir("bad");
    std::fs::create_dir_all(&d).unwrap();
    let path = d.join(FILE);
    let cpu = &Device::Cpu;
    let ts = Tensor::zeros((2, 4), candle_core::DType::F64, cpu).unwrap();
    let targets = Tensor::zeros((2, 4, 2), candle_core::DType::F64, cpu).unwrap();
    for (obs, says) in [
        (
            Tensor::zeros((2, 4, 24, 24, 1), candle_core::DType::F32, cpu).unwrap(),
            "train_obs holds",
        ),
        (
            Tensor::zeros((2, 3, 24, 24, 1), candle_core::DType::U8, cpu).unwrap(),
            "train_obs has shape",
        ),
    ] {
        Tensor::write_npz(
            &[
                ("train_obs", &obs),
                ("train_targets", &targets),
                ("train_ts", &ts),
            ],
            &path,
        )
        .unwrap();
        let e = read_split(&path, "train").unwrap_err().to_string();
        assert!(e.contains(FILE) && e.contains(says), "{e}");
    }
    std::fs::write(&path, b"not a zip").unwrap();
    let e = read_split(&path, "train").unwrap_err().to_string();
    assert!(e.contains(FILE), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `myo data pendulum` writes the file with the sizes asked for.
#[test]
fn myo_data_pendulum_writes_the_file() {
    let d = dir("cli");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_myo"))
        .args([
            "data", "pendulum", "--train", "2", "--valid", "1", "--test", "1",
        ])
        .args(["--frames", "4", "--seed", "5", "--out"])
        .arg(&d)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(said.contains("(2 / 1 / 1 sequences of 4 frames)"), "{said}");
    let valid = read_split(&d.join(FILE), "valid").unwrap();
    assert_eq!(valid, generate(1, 4, 6));
    let _ = std::fs::remove_dir_all(&d);
}
