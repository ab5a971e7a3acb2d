//! `gather_fwd_*` and `gather_bwd_*` of kernels/gather.cu through the harness: against an f64
//! loop, and bit for bit against the CPU twin (the op's CPU path, ∂x through candle's
//! autograd), in f32 and f64.

use candle_core::{DType, Device, Var};
use myosotis::ops::gather::cuda::{backward_plan, forward_plan};
use myosotis::ops::plan::Table;
use myosotis::ops::RowGather;
use rand::Rng;

use crate::assert_same;
use crate::common::{rel_err, seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

/// The index inverted as the op inverts it: each row's positions, ascending.
fn inverse(index: &[u32], rows: usize) -> (Vec<u32>, Vec<u32>) {
    let mut starts = vec![0u32];
    let mut positions = vec![];
    for v in 0..rows as u32 {
        positions.extend((0..index.len() as u32).filter(|&i| index[i as usize] == v));
        starts.push(positions.len() as u32);
    }
    (starts, positions)
}

#[test]
fn gather_kernels_match_the_loop_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("gather_kernels", 63);
    // (rows, index entries, columns): one element; rows no entry names; a grid of several
    // blocks with many entries per row.
    for (rows, len, n) in [(1, 1, 1), (9, 4, 3), (30, 700, 70)] {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            let what = format!("{dtype:?} {len} of {rows} rows of {n}");
            let index: Vec<u32> = (0..len)
                .map(|_| match rng.random_bool(0.4) {
                    true => 0,
                    false => rng.random_range(0..rows) as u32,
                })
                .collect();
            let (starts, positions) = inverse(&index, rows);
            let x = round_to(&uniform(&mut rng, rows * n, -2.0, 2.0), dtype);
            let g = round_to(&uniform(&mut rng, len * n, -1.0, 1.0), dtype);
            let run = |plan, input: &[f64]| {
                run_in_every_order(&plan, dtype, &[input], seed)
                    .outputs
                    .remove(0)
            };
            let y = run(
                forward_plan(&Table::new(index.clone()), n, dtype).unwrap(),
                &x,
            );
            let (starts, positions) = (Table::new(starts), Table::new(positions));
            let dx = run(backward_plan(&starts, &positions, n, dtype).unwrap(), &g);
            let (mut y_ref, mut dx_ref) = (vec![0.0; len * n], vec![0.0; rows * n]);
            for (i, &v) in index.iter().enumerate() {
                for c in 0..n {
                    y_ref[i * n + c] = x[v as usize * n + c];
                    dx_ref[v as usize * n + c] += g[i * n + c];
                }
            }
            assert_same(&y, &y_ref, &format!("{what}: forward"));
            assert!(rel_err(&dx, &dx_ref) < tol, "{what}: backward");
            let gather = RowGather::new(index, rows, &Device::Cpu).unwrap();
            let xv = Var::from_tensor(&tensor(&x, &[rows, n], dtype, &Device::Cpu)).unwrap();
            let out = gather.forward(xv.as_tensor()).unwrap();
            assert_same(&y, &to_vec(&out), &format!("{what}: forward, the twin"));
            let gt = tensor(&g, &[len, n], dtype, &Device::Cpu);
            let grads = (out * gt).unwrap().sum_all().unwrap().backward().unwrap();
            let twin = to_vec(grads.get(&xv).unwrap());
            assert_same(&dx, &twin, &format!("{what}: backward, the twin"));
        }
    }
}
