//! Criterion benchmark of the CPU linear scan (forward, and forward + backward), with the
//! effective bandwidth as throughput. `myo bench scan` covers CUDA and the candle reference.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use myosotis::ops::{linear_scan, linear_scan_backward, ScanOptions};

fn scan(c: &mut Criterion) {
    let dev = Device::Cpu;
    let (batch, len, chans) = (8, 4096, 256);
    let mut group = c.benchmark_group("linear_scan_cpu");
    group.sample_size(20);
    for complex in [false, true] {
        let opts = ScanOptions {
            complex,
            reverse: false,
        };
        let shape: Vec<usize> = if complex {
            vec![batch, len, chans, 2]
        } else {
            vec![batch, len, chans]
        };
        let b = Tensor::rand(-1f32, 1f32, shape.as_slice(), &dev).unwrap();
        let a = Tensor::rand(0.5f32, 0.99f32, shape.as_slice(), &dev).unwrap();
        let g = Tensor::rand(-1f32, 1f32, shape.as_slice(), &dev).unwrap();
        let bytes = (b.elem_count() * 4) as u64;
        let kind = if complex { "complex" } else { "real" };
        // forward: read a, b; write h
        group.throughput(Throughput::Bytes(3 * bytes));
        group.bench_function(format!("forward/{kind}/8x4096x256"), |bench| {
            bench.iter(|| linear_scan(&a, &b, None, opts).unwrap())
        });
        // + backward: read a, h, g; write db, da
        group.throughput(Throughput::Bytes(8 * bytes));
        group.bench_function(format!("forward_backward/{kind}/8x4096x256"), |bench| {
            bench.iter(|| {
                let h = linear_scan(&a, &b, None, opts).unwrap();
                linear_scan_backward(&a, &h, None, &g, opts).unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, scan);
criterion_main!(benches);
