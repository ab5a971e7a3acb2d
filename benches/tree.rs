//! Criterion benchmark of the CPU tree solve (forward, and forward + backward) at the shape of
//! the acceptance check: (batch 16, heads 64, 1024 leaves, 4-ary, d = 1, r = 1), shared
//! coefficients. `myo bench tree` covers CUDA and the Listing-1 reference. Also the host side of
//! a CUDA tree-solve launch: its plans and the lookups of its tables in an upload cache like the
//! CUDA runtime's (`src/cuda.rs`), which an eager training step waits for.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use myosotis::ops::plan::{DeviceLimits, Table};
use myosotis::ops::tree_solve::cuda::forward_plans;
use myosotis::ops::{tree_solve, tree_solve_backward, TreeSolveOptions};
use myosotis::tree::Tree;
use std::collections::HashMap;

fn tree(c: &mut Criterion) {
    let dev = Device::Cpu;
    let tree = Tree::perfect(1024, 4).unwrap();
    let n = tree.len();
    let (batch, heads) = (16, 64);
    // Diagonally dominant: |off-diagonal| <= 1/12 per entry, 1 <= A <= 1.5.
    let a = Tensor::rand(1f32, 1.5, (heads, n, 1, 1), &dev).unwrap();
    let b = Tensor::rand(-0.08f32, 0.08, (heads, n, 1, 1), &dev).unwrap();
    let cc = Tensor::rand(-0.08f32, 0.08, (heads, n, 1, 1), &dev).unwrap();
    let u = Tensor::rand(-1f32, 1., (batch, heads, n, 1, 1), &dev).unwrap();
    let g = Tensor::rand(-1f32, 1., (batch, heads, n, 1, 1), &dev).unwrap();
    let opts = TreeSolveOptions::default();
    let bytes = (u.elem_count() * 4) as u64;
    let mut group = c.benchmark_group("tree_solve_cpu");
    group.sample_size(30);
    group.throughput(Throughput::Bytes(2 * bytes));
    group.bench_function("forward/16x64x1024-4ary", |bench| {
        bench.iter(|| tree_solve(&tree, &a, &b, &cc, &u, opts).unwrap())
    });
    group.throughput(Throughput::Bytes(5 * bytes));
    group.bench_function("forward_backward/16x64x1024-4ary", |bench| {
        bench.iter(|| {
            let x = tree_solve(&tree, &a, &b, &cc, &u, opts).unwrap();
            tree_solve_backward(&tree, &a, &b, &cc, &x, &g, opts).unwrap()
        })
    });
    group.finish();
}

fn launch_plan(c: &mut Criterion) {
    let mut group = c.benchmark_group("tree_solve_plan");
    for (leaves, arity) in [(1024, 4), (2048, 2), (16384, 2)] {
        let tree = Tree::perfect(leaves, arity).unwrap();
        let n = tree.len();
        // Plans read the tensors' shapes and dtype only.
        let coef = Tensor::zeros((64, n, 1, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
        let u = Tensor::zeros((16, 64, n, 1, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
        let opts = TreeSolveOptions::default();
        let mut uploaded: HashMap<Table, usize> = HashMap::new();
        group.bench_function(format!("forward/{leaves}-{arity}ary"), |bench| {
            bench.iter(|| {
                let plans = forward_plans(&tree, &coef, &coef, &coef, &u, opts, DeviceLimits::H100);
                let mut found = 0;
                for t in plans.unwrap().iter().flat_map(|p| &p.tables) {
                    found += *uploaded.entry(t.clone()).or_insert(t.len());
                }
                found
            })
        });
    }
    group.finish();
}

criterion_group!(benches, tree, launch_plan);
criterion_main!(benches);
