//! Criterion benchmark of the CPU tree solve (forward, and forward + backward) at the shape of
//! the acceptance check: (batch 16, heads 64, 1024 leaves, 4-ary, d = 1, r = 1), shared
//! coefficients. `myo bench tree` covers CUDA and the Listing-1 reference.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use myosotis::ops::{tree_solve, tree_solve_backward, TreeSolveOptions};
use myosotis::tree::Tree;

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

criterion_group!(benches, tree);
criterion_main!(benches);
