//! What a training step holds: the heap counter (`myosotis::bench::memory`) that `myo bench
//! step` reports from, and what the Myo layer keeps for its backward.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use myosotis::bench::memory::{heap_held, peak_of, Heap};
use myosotis::bench::StepArgs;
use myosotis::nn::{GradSink, Myo, MyoConfig, S5Config, TreeSpec, S5};

#[global_allocator]
static HEAP: Heap = Heap;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    step: StepArgs,
}

const MIB: usize = 1 << 20;

/// One test in this file: the counter counts every thread's allocations.
#[test]
fn a_step_reports_its_peak_and_the_layers_keep_what_their_backward_reads() {
    // The counter follows what is held: a buffer of 8 MiB held shows, its release does too.
    let before = heap_held().expect("the heap is counted");
    let ((), peak) = peak_of(&Device::Cpu, || {
        let buffer = vec![1u8; 8 * MIB];
        assert!(heap_held().unwrap() >= before + 8 * MIB);
        drop(buffer);
        Ok(())
    })
    .unwrap();
    let peak = peak.expect("a peak on the CPU");
    assert!((8 * MIB..9 * MIB).contains(&peak.above), "{peak:?}");

    // The layers run on a pool of one thread: the gemm crate keeps scratch memory per thread,
    // made the first time a thread multiplies, so on a pool of several the second call could
    // take a thread that the first did not use, and hold its scratch too.
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one_thread.install(|| {
        // The Myo layer by hand (skew scalar heads over all nodes) keeps its input x, which the
        // caller holds too, and the solution xs for its backward, and returns y: u = x B_in, as
        // large as xs, is released after the solve (its backward needs only its shape).
        let (batch, h, heads) = (16, 16, 32);
        let cfg = MyoConfig {
            all_nodes: true,
            ..MyoConfig::new(
                h,
                heads,
                TreeSpec::Ragged {
                    leaves: 256,
                    arity: 4,
                },
            )
        };
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let layer = Myo::new(cfg, vb).unwrap();
        let n = layer.tree().len();
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (batch, n, h), &Device::Cpu).unwrap())
            .unwrap();
        let sink = GradSink::new();
        // A first call makes what every later call shares (the tree's tables, thread pools).
        drop(layer.forward_by_hand(x.as_tensor(), &sink).unwrap());
        let held = heap_held().unwrap();
        let y = layer.forward_by_hand(x.as_tensor(), &sink).unwrap();
        let kept = heap_held().unwrap() - held;
        let (y_bytes, xs_bytes) = (4 * batch * n * h, 4 * batch * n * heads * 2);
        println!("Myo by hand keeps {kept} bytes: y {y_bytes}, xs {xs_bytes}");
        assert!(
            kept >= y_bytes + xs_bytes && kept < y_bytes + xs_bytes + xs_bytes / 4,
            "Myo by hand keeps {kept} bytes, not y's {y_bytes} and xs's {xs_bytes} (+ parameters)"
        );
        drop(y);

        // S5 by hand, bidirectional: each direction's states (conj_sym: P/2 complex per position)
        // and y; not also the states side by side, as the forward's readout took them.
        let (len, p) = (256, 64);
        let cfg = S5Config {
            d_model: h,
            state: p,
            blocks: 1,
            bidirectional: true,
            ..S5Config::default()
        };
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let layer = S5::new(cfg, vb).unwrap();
        let u = Var::from_tensor(&Tensor::randn(0f32, 1., (batch, len, h), &Device::Cpu).unwrap())
            .unwrap();
        drop(layer.forward_by_hand(u.as_tensor(), &sink).unwrap());
        let held = heap_held().unwrap();
        let y = layer.forward_by_hand(u.as_tensor(), &sink).unwrap();
        let kept = heap_held().unwrap() - held;
        let (y_bytes, states_bytes) = (4 * batch * len * h, 2 * 4 * batch * len * p);
        println!("S5 by hand keeps {kept} bytes: y {y_bytes}, states {states_bytes}");
        assert!(
            kept >= y_bytes + states_bytes && kept < y_bytes + states_bytes + states_bytes / 4,
            "S5 by hand keeps {kept} bytes, not y's {y_bytes} and the states' {states_bytes} \
             (+ parameters)"
        );
        drop(y);
    });

    // `myo bench step` reports a step's memory from the counter.
    let args = ["bench", "--model", "myo", "--warmup", "0", "--repeats", "1"];
    let report = Cli::parse_from(args).step.run().unwrap();
    let m = report.memory.expect("the step's memory on the CPU");
    println!("{m:?}");
    assert!(m.held_mib > 0.0 && m.peak_mib > 0.0, "{m:?}");
}
