//! `--hub`: the Hub's Parquet files (written here in the layout of hf-hub's cache), offline
//! reads, the fallback to the cache and the errors when the Hub is out of reach. No test
//! touches the network: the "unreachable" endpoint is a closed local port.

mod common;

use std::path::{Path, PathBuf};

use common::files::{png, write_parquet};
use myosotis::data::hub::{read_parquet_images, Hub, HubDataset, PARQUET_REVISION};
use myosotis::data::images::ImageSet;
use rand::{Rng, SeedableRng};

fn temp_dir(name: &str) -> common::Scratch {
    common::scratch(&format!("hub-{name}"))
}

/// Random images of `dataset`'s shape with labels 0–9.
fn random_set(dataset: HubDataset, n: usize, seed: u64) -> ImageSet {
    let (side, channels) = dataset.shape();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    ImageSet {
        pixels: (0..n * side * side * channels)
            .map(|_| rng.random())
            .collect(),
        labels: (0..n).map(|_| rng.random_range(0..10)).collect(),
        height: side,
        width: side,
        channels,
    }
}

fn write_set(path: &Path, dataset: HubDataset, set: &ImageSet) {
    let (side, _) = dataset.shape();
    let (col, colour) = match dataset {
        HubDataset::Mnist => ("image", png::ColorType::Grayscale),
        HubDataset::Cifar10 => ("img", png::ColorType::Rgb),
    };
    let pngs: Vec<Vec<u8>> = (0..set.len())
        .map(|i| png(set.image(i), side as u32, colour))
        .collect();
    let labels: Vec<i64> = set.labels.iter().map(|&l| l as i64).collect();
    write_parquet(path, col, &pngs, &labels);
}

/// hf-hub's cache layout for the Parquet revision: refs/<revision> holds the commit,
/// snapshots/<commit>/<file> the files. Returns the split's folder in the snapshot.
fn cache_split(cache: &Path, dataset: HubDataset, split: &str) -> PathBuf {
    let repo = cache.join(format!("datasets--{}", dataset.repo().replace('/', "--")));
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let refs = repo.join("refs").join(PARQUET_REVISION);
    std::fs::create_dir_all(refs.parent().unwrap()).unwrap();
    std::fs::write(&refs, commit).unwrap();
    let dir = repo
        .join("snapshots")
        .join(commit)
        .join(dataset.split_dir(split));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn concat(a: &ImageSet, b: &ImageSet) -> ImageSet {
    let mut c = a.clone();
    c.pixels.extend(&b.pixels);
    c.labels.extend(&b.labels);
    c
}

/// A closed local port: connecting fails at once, as with no network.
const UNREACHABLE: &str = "http://127.0.0.1:9";

#[test]
fn offline_cache_reads_back_mnist_and_cifar_with_sharded_splits() {
    let cache = temp_dir("cache");
    for (k, dataset) in [HubDataset::Mnist, HubDataset::Cifar10]
        .into_iter()
        .enumerate()
    {
        let seed = 10 * k as u64;
        let (train0, train1) = (
            random_set(dataset, 7, seed),
            random_set(dataset, 5, seed + 1),
        );
        let test = random_set(dataset, 4, seed + 2);
        let dir = cache_split(&cache, dataset, "train");
        write_set(&dir.join("0000.parquet"), dataset, &train0);
        write_set(&dir.join("0001.parquet"), dataset, &train1);
        let dir = cache_split(&cache, dataset, "test");
        write_set(&dir.join("0000.parquet"), dataset, &test);

        for (endpoint, offline) in [(None, true), (Some(UNREACHABLE.to_string()), false)] {
            let hub = Hub {
                cache: cache.to_path_buf(),
                endpoint,
                offline,
            };
            let (train, got_test) = hub.load(dataset).unwrap();
            assert_eq!(train, concat(&train0, &train1), "{dataset:?} train");
            assert_eq!(got_test, test, "{dataset:?} test");
        }
    }
}

#[test]
fn out_of_reach_hub_with_empty_cache_points_to_data_dir() {
    let cache = temp_dir("empty");
    for (endpoint, offline, says) in [
        (Some(UNREACHABLE.to_string()), false, "cannot reach"),
        (None, true, "HF_HUB_OFFLINE"),
    ] {
        let hub = Hub {
            cache: cache.to_path_buf(),
            endpoint,
            offline,
        };
        for dataset in [HubDataset::Mnist, HubDataset::Cifar10] {
            let e = format!("{:#}", hub.load(dataset).unwrap_err());
            assert!(e.contains(says), "{e}");
            assert!(e.contains("--data-dir"), "{e}");
            assert!(e.contains(dataset.repo()), "{e}");
        }
    }
}

#[test]
fn malformed_parquet_files_are_errors_naming_file_and_row() {
    let dir = temp_dir("bad");
    let good = random_set(HubDataset::Mnist, 3, 5);
    let good_pngs: Vec<Vec<u8>> = (0..3)
        .map(|i| png(good.image(i), 28, png::ColorType::Grayscale))
        .collect();
    let expect_err = |name: &str, write: &dyn Fn(&Path), says: &[&str]| {
        let path = dir.join(name);
        write(&path);
        let e = format!("{:#}", read_parquet_images(&path, (28, 1)).unwrap_err());
        assert!(e.contains(&path.display().to_string()), "{name}: {e}");
        for s in says {
            assert!(e.contains(s), "{name}: {e}");
        }
    };
    expect_err(
        "garbage.parquet",
        &|p| std::fs::write(p, b"not parquet at all").unwrap(),
        &["Parquet"],
    );
    let mut truncated = vec![];
    write_set(&dir.join("whole.parquet"), HubDataset::Mnist, &good);
    truncated.extend_from_slice(&std::fs::read(dir.join("whole.parquet")).unwrap());
    truncated.truncate(truncated.len() / 2);
    expect_err(
        "truncated.parquet",
        &|p| std::fs::write(p, &truncated).unwrap(),
        &[],
    );
    let mut bad_png = good_pngs.clone();
    bad_png[1] = b"\x89PNG but not really".to_vec();
    expect_err(
        "bad-png.parquet",
        &|p| write_parquet(p, "image", &bad_png, &[1, 2, 3]),
        &["row 1"],
    );
    let small: Vec<Vec<u8>> = vec![png(&[0; 16 * 16], 16, png::ColorType::Grayscale)];
    expect_err(
        "small.parquet",
        &|p| write_parquet(p, "image", &small, &[4]),
        &["row 0", "16 × 16"],
    );
    expect_err(
        "label.parquet",
        &|p| write_parquet(p, "image", &good_pngs, &[1, 12, 3]),
        &["row 1", "label 12"],
    );
    let rgb = vec![png(&[7; 28 * 28 * 3], 28, png::ColorType::Rgb)];
    expect_err(
        "colour.parquet",
        &|p| write_parquet(p, "image", &rgb, &[0]),
        &["row 0", "greyscale"],
    );
    expect_err("missing.parquet", &|_| {}, &["cannot read"]);
}

/// A task's `DataSource::Hub` end to end through the environment (`HF_HOME`, `HF_HUB_OFFLINE`):
/// the only test in this binary that sets them.
#[test]
fn image_hub_task_loads_splits_from_the_environment_cache() {
    use myosotis::data::task::{find, DataSource};
    let home = temp_dir("home");
    let cache = home.join("hub");
    let train = random_set(HubDataset::Mnist, 20, 7);
    let test = random_set(HubDataset::Mnist, 6, 8);
    write_set(
        &cache_split(&cache, HubDataset::Mnist, "train").join("0000.parquet"),
        HubDataset::Mnist,
        &train,
    );
    write_set(
        &cache_split(&cache, HubDataset::Mnist, "test").join("0000.parquet"),
        HubDataset::Mnist,
        &test,
    );
    std::env::set_var("HF_HOME", &home);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let [tr, va, te] = find("smnist").unwrap().load(&DataSource::Hub).unwrap();
    // 10% of the training images for validation, all test images.
    assert_eq!((tr.len(), va.len(), te.len()), (18, 2, 6));
    let e = format!(
        "{:#}",
        find("scifar").unwrap().load(&DataSource::Hub).unwrap_err()
    );
    assert!(
        e.contains("HF_HUB_OFFLINE") && e.contains("--data-dir"),
        "{e}"
    );
}
