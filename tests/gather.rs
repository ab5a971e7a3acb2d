//! The fixed gather of rows (`ops::RowGather`, the frame encoder's im2col): forward and
//! gradient against an f64 loop, against candle's `index_select` and its gradient (the same
//! bits: the backward adds in the order a sequential scatter-add does), and against central
//! differences; a bad index or input is refused with its place named.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{seeded_rng, tensor, to_vec, uniform};
use myosotis::ops::RowGather;
use rand::Rng;

/// (rows gathered from, index entries, columns): one element; rows no entry names; many
/// entries per row; columns past a block of threads.
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 1), (7, 3, 5), (20, 300, 9), (50, 130, 300)];

#[test]
fn row_gather_matches_the_loop_and_index_select_to_the_bit() {
    let (mut rng, seed) = seeded_rng("row gather", 141);
    for (rows, len, n) in SHAPES {
        // Row 0 takes a third of the entries, so its gradient adds many rows.
        let index: Vec<u32> = (0..len)
            .map(|_| match rng.random_range(0..3) {
                0 => 0,
                _ => rng.random_range(0..rows) as u32,
            })
            .collect();
        let x = uniform(&mut rng, rows * n, -2.0, 2.0);
        let g = uniform(&mut rng, len * n, -1.0, 1.0);
        let (mut y_ref, mut dx_ref) = (vec![0.0; len * n], vec![0.0; rows * n]);
        for (i, &v) in index.iter().enumerate() {
            for c in 0..n {
                y_ref[i * n + c] = x[v as usize * n + c];
                dx_ref[v as usize * n + c] += g[i * n + c];
            }
        }
        let gather = RowGather::new(index.clone(), rows, &Device::Cpu).unwrap();
        assert_eq!(gather.len(), len);
        for dtype in [DType::F64, DType::F32] {
            let what = format!("{dtype:?}: {len} of {rows} rows of {n} (seed {seed})");
            let xv = Var::from_tensor(&tensor(&x, &[rows, n], dtype, &Device::Cpu)).unwrap();
            let gt = tensor(&g, &[len, n], dtype, &Device::Cpu);
            let y = gather.forward(xv.as_tensor()).unwrap();
            let dx = (&y * &gt).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = to_vec(dx.get(&xv).unwrap());
            let it = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
            let want = xv.as_tensor().index_select(&it, 0).unwrap();
            let dwant = (&want * &gt)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            assert_eq!(to_vec(&y), to_vec(&want), "{what}: forward");
            assert_eq!(dx, to_vec(dwant.get(&xv).unwrap()), "{what}: backward");
            if dtype == DType::F64 {
                assert_eq!(to_vec(&y), y_ref, "{what}: forward, the loop");
                let e = common::rel_err(&dx, &dx_ref);
                assert!(e < 1e-14, "{what}: backward against the loop, {e:e}");
            }
        }
    }
    // Central differences of Σ g ⊙ y.
    let (rows, len, n) = (6, 10, 4);
    let index: Vec<u32> = (0..len).map(|i| (i * 7 % 5) as u32).collect();
    let gather = RowGather::new(index, rows, &Device::Cpu).unwrap();
    let xv = Var::from_tensor(&common::randn(
        &mut rng,
        &[rows, n],
        DType::F64,
        &Device::Cpu,
    ))
    .unwrap();
    let g = common::randn(&mut rng, &[len, n], DType::F64, &Device::Cpu);
    let loss = || {
        let y = gather.forward(xv.as_tensor()).unwrap();
        (y * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let y = gather.forward(xv.as_tensor()).unwrap();
    let grads = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    common::assert_central_differences(&[("x", &xv)], &grads, loss, "row gather");
}

#[test]
fn a_bad_index_or_input_is_refused() {
    let e = RowGather::new(vec![0, 3, 4], 4, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("index entry 2 is 4, past the 4 rows"), "{e}");
    let gather = RowGather::new(vec![0, 3], 4, &Device::Cpu).unwrap();
    let x = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap();
    let e = gather.forward(&x).unwrap_err().to_string();
    assert!(e.contains("an input of 5 rows, expected 4"), "{e}");
    // Other dtypes take candle's index_select.
    let x = Tensor::arange(0u32, 8, &Device::Cpu)
        .unwrap()
        .reshape((4, 2))
        .unwrap();
    let y = gather.forward(&x).unwrap();
    assert_eq!(y.to_vec2::<u32>().unwrap(), [[0, 1], [6, 7]]);
}
