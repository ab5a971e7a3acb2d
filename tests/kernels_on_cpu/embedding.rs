//! `embedding_fwd_*` and `embedding_bwd_*` of kernels/embedding.cu through the harness: against
//! an f64 loop, and bit for bit against the CPU twin (the op's CPU path, ∂W through candle's
//! autograd), in f32 and f64.

use candle_core::{DType, Device, Var};
use myosotis::ops::embedding;
use myosotis::ops::embedding::cuda::{backward_plan, forward_plan};
use myosotis::ops::embedding::{backward_cpu, forward_cpu};
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

/// (positions, width, vocabulary): one element; odd sizes; more positions than a stage of the
/// backward (256) with a width that is not a multiple of 32; a text-sized vocabulary over
/// several stages and column blocks.
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 1), (5, 7, 3), (300, 33, 18), (700, 70, 258)];

#[test]
fn embedding_kernels_match_the_loop_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("embedding_kernels", 61);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for (n, h, vocab) in SHAPES {
            let what = format!("{dtype:?} {n} x {h}, vocabulary {vocab}");
            let w = round_to(&uniform(&mut rng, vocab * h, -2.0, 2.0), dtype);
            let g = round_to(&uniform(&mut rng, n * h, -1.0, 1.0), dtype);
            // Half the positions take id 0, so that its row sums many positions of every warp.
            let ids: Vec<f64> = (0..n)
                .map(|_| match rng.random_bool(0.5) {
                    true => 0.0,
                    false => rng.random_range(0..vocab) as f64,
                })
                .collect();
            let run = |plan, inputs: &[&[f64]]| {
                run_in_every_order(&plan, dtype, inputs, seed)
                    .outputs
                    .remove(0)
            };
            let y = run(forward_plan(n, h, vocab, dtype).unwrap(), &[&ids, &w]);
            let dw = run(backward_plan(n, h, vocab, dtype).unwrap(), &[&ids, &g]);
            let (mut y_ref, mut dw_ref) = (vec![0.0; n * h], vec![0.0; vocab * h]);
            for (p, &id) in ids.iter().enumerate() {
                let v = id as usize;
                for j in 0..h {
                    y_ref[p * h + j] = w[v * h + j];
                    dw_ref[v * h + j] += g[p * h + j];
                }
            }
            assert_same(&y, &y_ref, &format!("{what}: forward"));
            assert!(rel_err(&dw, &dw_ref) < tol, "{what}: backward");
            let wv = Var::from_tensor(&tensor(&w, &[vocab, h], dtype, &Device::Cpu)).unwrap();
            let it = tensor(&ids, &[n], DType::U32, &Device::Cpu);
            let out = embedding(wv.as_tensor(), &it).unwrap();
            assert_same(&y, &to_vec(&out), &format!("{what}: forward"));
            let gt = tensor(&g, &[n, h], dtype, &Device::Cpu);
            let grads = (out * gt).unwrap().sum_all().unwrap().backward().unwrap();
            assert_same(
                &dw,
                &to_vec(grads.get(&wv).unwrap()),
                &format!("{what}: backward"),
            );
        }
    }
}

/// An id outside the table reads zeros and adds nowhere, on the harness as in the twins.
#[test]
fn embedding_kernels_skip_ids_outside_the_table() {
    let (mut rng, seed) = seeded_rng("embedding_outside", 62);
    let (n, h, vocab) = (40, 9, 4);
    let w = uniform(&mut rng, vocab * h, -2.0, 2.0);
    let g = uniform(&mut rng, n * h, -1.0, 1.0);
    let ids: Vec<f64> = (0..n).map(|p| [0.0, 4.0, 3.0, -1.0, 7.5][p % 5]).collect();
    let dtype = DType::F64;
    let y = run_in_every_order(
        &forward_plan(n, h, vocab, dtype).unwrap(),
        dtype,
        &[&ids, &w],
        seed,
    )
    .outputs
    .remove(0);
    let dw = run_in_every_order(
        &backward_plan(n, h, vocab, dtype).unwrap(),
        dtype,
        &[&ids, &g],
        seed,
    )
    .outputs
    .remove(0);
    assert_same(&y, &forward_cpu(&ids, &w, vocab, h), "forward");
    assert_same(&dw, &backward_cpu(&ids, &g, vocab, h), "backward");
    for p in (0..n).filter(|p| p % 5 != 0 && p % 5 != 2) {
        assert!(y[p * h..(p + 1) * h].iter().all(|&v| v == 0.0), "row {p}");
    }
    let (rows_0, rows_3): (Vec<usize>, Vec<usize>) = (
        (0..n).filter(|p| p % 5 == 0).collect(),
        (0..n).filter(|p| p % 5 == 2).collect(),
    );
    for j in 0..h {
        let sum = |rows: &[usize]| rows.iter().map(|p| g[p * h + j]).sum::<f64>();
        assert!((dw[j] - sum(&rows_0)).abs() < 1e-12);
        assert!((dw[3 * h + j] - sum(&rows_3)).abs() < 1e-12);
        assert_eq!((dw[h + j], dw[2 * h + j]), (0.0, 0.0));
    }
}
