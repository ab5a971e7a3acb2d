//! The training step captured as a CUDA graph (`myo bench step` on CUDA): S5 and Myo at the
//! default size are captured, and after replays their parameters are those of as many eager
//! steps from the same parameters and inputs, to the bit; a model with dropout is not captured
//! (its masks' keys change every step), and says why. Compiled with `--features cuda`; skipped,
//! saying so, without a CUDA device.
#![cfg(feature = "cuda")]

mod common;

use clap::Parser;
use myosotis::bench::{StepArgs, StepReport};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    step: StepArgs,
}

fn bench(flags: &[&str]) -> StepReport {
    let mut args = vec![
        "bench",
        "--device",
        "cuda",
        "--warmup",
        "1",
        "--repeats",
        "3",
    ];
    args.extend_from_slice(flags);
    Cli::parse_from(args)
        .step
        .run()
        .expect("the step benchmark runs")
}

#[test]
fn cuda_graph_replays_the_eager_step() {
    if common::gpu("cuda_graph_replays_the_eager_step").is_none() {
        return;
    }
    for model in ["s5", "myo"] {
        let report = bench(&["--model", model]);
        println!("{report}");
        match report.captured {
            Some(Ok(c)) => {
                assert!(c.nodes.kernels > 0, "{model}: a graph without kernels");
                assert_eq!(
                    c.max_difference, 0.0,
                    "{model}: the replays' parameters differ from the eager steps'"
                );
            }
            other => panic!("{model}: not captured: {other:?}"),
        }
    }
    let report = bench(&["--model", "s5", "--dropout", "0.1"]);
    match report.captured {
        Some(Err(why)) => assert!(why.contains("dropout"), "{why}"),
        other => panic!("a step with dropout was captured: {other:?}"),
    }
    let report = bench(&["--model", "s5", "--cuda-graph", "false"]);
    assert!(report.captured.is_none());
}
