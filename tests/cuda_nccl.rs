//! NCCL on one GPU (a world of one rank): the id, the communicator on candle's stream and the
//! sum the data-parallel trainer uses for gradients, which over one rank is the input itself,
//! f32 and f64, at an offset into a larger buffer. Compiled with `--features nccl` (which links
//! libnccl); skipped, with a message, when no CUDA device can be opened.
#![cfg(feature = "nccl")]

mod common;

use candle_core::{DType, Tensor};
use common::*;
use myosotis::train::nccl::{unique_id, Nccl};

#[test]
fn one_rank_nccl_sum_is_the_input() {
    let Some(dev) = gpu("one_rank_nccl_sum_is_the_input") else {
        return;
    };
    let nccl = Nccl::new(&dev, 0, 1, unique_id().unwrap()).unwrap();
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
        let want: Vec<f64> = view.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        let got: Vec<f64> = sum.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        assert_eq!(got, want, "{dtype:?}");
    }
}
