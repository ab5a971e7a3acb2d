//! NCCL on one GPU (a world of one rank): the id, the non-blocking communicator on candle's
//! stream and the sum the data-parallel trainer uses for gradients, which over one rank is the
//! input itself, f32 and f64, at an offset into a larger buffer; and the deadline, with a rank
//! alone in a world of two. Compiled with `--features nccl` (which links libnccl); skipped,
//! with a message, when no CUDA device can be opened.
#![cfg(feature = "nccl")]

mod common;

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use common::*;
use myosotis::train::nccl::{unique_id, Nccl};

#[test]
fn one_rank_nccl_sum_is_the_input() {
    let Some(dev) = gpu("one_rank_nccl_sum_is_the_input") else {
        return;
    };
    let timeout = Duration::from_secs(60);
    let nccl = Nccl::new(&dev, 0, 1, unique_id().unwrap(), timeout).unwrap();
    let (mut rng, _) = seeded_rng("one_rank_nccl_sum_is_the_input", 0x9cc1);
    for dtype in [DType::F32, DType::F64] {
        let values: Vec<f64> = (0..10_000)
            .map(|_| rand::Rng::random::<f64>(&mut rng))
            .collect();
        let t = Tensor::new(values.as_slice(), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // A view at an offset, as a bucket of gradients is.
        let view = t.narrow(0, 123, 4567).unwrap();
        let sum = nccl.sum(&view).unwrap();
        nccl.wait().unwrap();
        let want: Vec<f64> = view.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        let got: Vec<f64> = sum.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        assert_eq!(got, want, "{dtype:?}");
    }
}

/// Rank 0 of two, with no rank 1: setting up gives up after the deadline with an error that
/// says what it waited for, instead of waiting without end.
#[test]
fn a_rank_alone_stops_waiting_at_the_deadline() {
    let Some(dev) = gpu("a_rank_alone_stops_waiting_at_the_deadline") else {
        return;
    };
    let start = Instant::now();
    let timeout = Duration::from_secs(3);
    let err = match Nccl::new(&dev, 0, 2, unique_id().unwrap(), timeout) {
        Ok(_) => panic!("a communicator of two ranks was set up by one"),
        Err(e) => format!("{e:#}"),
    };
    let waited = start.elapsed();
    assert!(
        err.contains("rank 0 of 2: no answer from the other ranks for 3 s while joining"),
        "{err}"
    );
    assert!(
        waited >= timeout && waited < Duration::from_secs(30),
        "{waited:?}"
    );
}
