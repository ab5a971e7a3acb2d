//! MNIST IDX and CIFAR-10 binary readers against small files written here, and each
//! malformed case.

mod common;

use std::io::Write;
use std::path::Path;

use myosotis::data::images::{read_cifar10, read_mnist};

fn idx_images(n: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
    let mut v = vec![];
    for x in [2051u32, n, rows, cols] {
        v.extend(x.to_be_bytes());
    }
    v.extend(pixels);
    v
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut v = vec![];
    v.extend(2049u32.to_be_bytes());
    v.extend((labels.len() as u32).to_be_bytes());
    v.extend(labels);
    v
}

fn dir(name: &str) -> common::Scratch {
    common::scratch(&format!("images-{name}"))
}

fn write(d: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(d.join(name), bytes).unwrap();
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(vec![], flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn mnist_reads_plain_and_gzip_idx() {
    let d = dir("mnist");
    let pixels: Vec<u8> = (0..3 * 4 * 5).map(|i| i as u8).collect();
    write(&d, "train-images-idx3-ubyte", &idx_images(3, 4, 5, &pixels));
    write(&d, "train-labels-idx1-ubyte", &idx_labels(&[7, 0, 9]));
    let set = read_mnist(&d, "train").unwrap();
    assert_eq!(
        (set.len(), set.height, set.width, set.channels),
        (3, 4, 5, 1)
    );
    assert_eq!(set.labels, [7, 0, 9]);
    assert_eq!(set.image(1), &pixels[20..40]);
    write(
        &d,
        "t10k-images-idx3-ubyte.gz",
        &gzip(&idx_images(3, 4, 5, &pixels)),
    );
    write(
        &d,
        "t10k-labels-idx1-ubyte.gz",
        &gzip(&idx_labels(&[7, 0, 9])),
    );
    assert_eq!(read_mnist(&d, "t10k").unwrap(), set);
}

#[test]
fn mnist_malformed_files_are_errors_naming_the_file() {
    let pixels = vec![1u8; 2 * 2 * 2];
    let cases: Vec<(&str, Vec<u8>, Vec<u8>, &str)> = vec![
        (
            "magic",
            {
                let mut v = idx_images(2, 2, 2, &pixels);
                v[3] = 1;
                v
            },
            idx_labels(&[1, 2]),
            "magic number",
        ),
        (
            "truncated",
            idx_images(2, 2, 2, &pixels[..6]),
            idx_labels(&[1, 2]),
            "image 1 is truncated",
        ),
        (
            "counts",
            idx_images(2, 2, 2, &pixels),
            idx_labels(&[1, 2, 3]),
            "has 3 labels",
        ),
        (
            "label",
            idx_images(2, 2, 2, &pixels),
            idx_labels(&[1, 12]),
            "record 1",
        ),
        (
            "header",
            vec![0, 0, 8],
            idx_labels(&[1]),
            "truncated header",
        ),
    ];
    for (name, images, labels, needle) in cases {
        let d = dir(name);
        write(&d, "train-images-idx3-ubyte", &images);
        write(&d, "train-labels-idx1-ubyte", &labels);
        let err = format!("{:#}", read_mnist(&d, "train").unwrap_err());
        assert!(err.contains("idx") && err.contains(needle), "{name}: {err}");
    }
    let err = format!("{:#}", read_mnist(&dir("missing"), "train").unwrap_err());
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("not found"),
        "{err}"
    );
}

#[test]
fn cifar_reads_planes_into_pixels_and_rejects_bad_records() {
    let d = dir("cifar");
    let mut rec = vec![3u8];
    rec.extend((0..1024).map(|_| 10u8)); // R
    rec.extend((0..1024).map(|_| 20u8)); // G
    rec.extend((0..1024).map(|_| 30u8)); // B
    let two: Vec<u8> = [rec.clone(), rec.clone()].concat();
    write(&d, "data_batch_1.bin", &two);
    let set = read_cifar10(&d, &["data_batch_1.bin"]).unwrap();
    assert_eq!((set.len(), set.channels), (2, 3));
    assert_eq!(&set.image(1)[..6], &[10, 20, 30, 10, 20, 30]);
    write(&d, "short.bin", &two[..5000]);
    let err = format!("{:#}", read_cifar10(&d, &["short.bin"]).unwrap_err());
    assert!(
        err.contains("short.bin") && err.contains("record 1 is truncated"),
        "{err}"
    );
    let mut bad = two.clone();
    bad[3073] = 11;
    write(&d, "label.bin", &bad);
    let err = format!("{:#}", read_cifar10(&d, &["label.bin"]).unwrap_err());
    assert!(
        err.contains("label.bin") && err.contains("record 1 has label 11"),
        "{err}"
    );
    assert!(format!("{:#}", read_cifar10(&d, &["absent.bin"]).unwrap_err()).contains("absent.bin"));
}

/// The synthetic stroke digits are written as MNIST IDX files the reader accepts, and the
/// class is in the image: the bar's rows (or columns) are the brightest.
#[test]
fn stroke_digits_read_back_as_mnist() {
    use myosotis::data::strokes::{generate, write_dataset, SIDE};
    let d = dir("strokes");
    write_dataset(&d, 30, 20, 7).unwrap();
    let train = read_mnist(&d, "train").unwrap();
    assert_eq!(train, generate(30, 7));
    assert_eq!(read_mnist(&d, "t10k").unwrap().len(), 20);
    for i in 0..train.len() {
        let img = train.image(i);
        let class = train.labels[i] as usize;
        let line = |k: usize| -> u32 {
            (0..SIDE)
                .map(|j| {
                    img[if class < 5 {
                        k * SIDE + j
                    } else {
                        j * SIDE + k
                    }] as u32
                })
                .sum()
        };
        let brightest = (0..SIDE).max_by_key(|&k| line(k)).unwrap();
        let at = 3 + 5 * (class % 5);
        assert!(
            (at - 1..at + 4).contains(&brightest),
            "image {i}, class {class}: line {brightest}"
        );
    }
}
