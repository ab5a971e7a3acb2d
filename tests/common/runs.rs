//! Run folders for the tests that train: fresh temporary folders, a run's metrics, and
//! synthetic MNIST files.

/// A fresh (emptied, not made) temporary folder named after `name` and the process, removed
/// when dropped.
pub fn out(name: &str) -> super::Scratch {
    super::unmade(&format!("run-{name}"))
}

/// The records of `dir`'s `metrics.jsonl`.
pub fn metrics(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Synthetic MNIST IDX files: class k has pixels around brightness 22k, plus noise (a task any
/// sequence model with mean pooling can learn; the pipeline is under test here, not vision).
pub fn synthetic_mnist(dir: &std::path::Path, train: usize, test: usize) {
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
