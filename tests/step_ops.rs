//! The tensor operations of a training step (`myo bench step`, counted on the CPU, where CI
//! runs): S5 and Myo at the default size execute at least 5× fewer than their steps did as
//! chains of candle ops (1,217 and 716, counted the same way before the fused ops and the
//! backward passes written out). An op that creeps back into a step fails this test.

use clap::Parser;
use myosotis::bench::{StepArgs, StepReport};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    step: StepArgs,
}

fn bench(model: &str) -> StepReport {
    let args = [
        "bench",
        "--model",
        model,
        "--threads",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
    ];
    Cli::parse_from(args)
        .step
        .run()
        .expect("the step benchmark runs")
}

#[test]
fn default_steps_execute_five_times_fewer_ops_than_candle_chains() {
    // One test in this file: the count is of every tensor the process makes meanwhile.
    for (model, composed) in [("s5", 1217), ("myo", 716)] {
        let ops = bench(model).ops;
        let total = ops.total();
        println!("{model}: {total} tensor ops per step (as candle ops: {composed})");
        assert!(
            5 * total <= composed,
            "{model}: {total} tensor ops per step, more than a fifth of {composed}"
        );
    }
}
