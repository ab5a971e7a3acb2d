//! The training step captured as a CUDA graph (`myo bench step` on CUDA): S5 and Myo at the
//! default size, and with dropout, are captured, and after replays their parameters are those of
//! as many eager steps from the same parameters and inputs, to the bit (the replays' dropout
//! masks keyed by the seed and step written to the device before each); `myo train` with steps
//! captured trains as it does eagerly, its graphs kept from epoch to epoch. Compiled with
//! `--features cuda`; skipped, saying so, without a CUDA device.
#![cfg(feature = "cuda")]

mod common;

use candle_core::Device;
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
    // Dropout: the replays read their step from the device's key word, the eager steps take
    // it by value; their masks must agree.
    for flags in [
        &["--model", "s5"][..],
        &["--model", "myo"],
        &["--model", "s5", "--dropout", "0.1"],
        &[
            "--model",
            "myo",
            "--dropout",
            "0.1",
            "--activation",
            "half_glu1",
        ],
    ] {
        let model = flags.join(" ");
        let report = bench(flags);
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
    let report = bench(&["--model", "s5", "--cuda-graph", "false"]);
    assert!(report.captured.is_none());
}

/// `myo train` on CUDA with its steps captured and replayed against the same run with every
/// step eager: the same losses, gradient norms and final checkpoint, to the bit. ListOps padded
/// in up to four lengths (several batch shapes, so several graphs), a short last batch (eager),
/// dropout and BatchNorm's running statistics; S5 with clipping and a gradient norm logged
/// every step, Myo without clipping and a norm logged every third step.
#[test]
fn cuda_graph_trains_as_the_eager_steps() {
    use myosotis::train::args::RunArgs;
    use myosotis::train::run::{train, Exec, Start};
    let Some(gpu) = common::gpu("cuda_graph_trains_as_the_eager_steps") else {
        return;
    };
    // The graphs last the run (its epochs and the parts between evaluations): Myo's batches
    // have one shape, captured once; S5's ListOps batches take at most PAD_LENGTHS (4) lengths,
    // each captured once.
    for (model, log_every, captures) in [
        (&["--model", "s5", "--clip", "1.0"][..], 1, 4),
        (&["--model", "myo", "--activation", "half_glu1"], 3, 1),
    ] {
        let mut flags = vec![
            "--epochs",
            "2",
            "--eval-every",
            "4",
            "--max-train-samples",
            "150",
            "--max-eval-samples",
            "40",
            "--batch-size",
            "16",
            "--dropout",
            "0.1",
            "--norm",
            "batch",
        ];
        flags.extend_from_slice(model);
        let cfg = RunArgs::from_flags(&flags).unwrap().resolve().unwrap();
        let Device::Cuda(dev) = &gpu else {
            unreachable!("a CUDA device")
        };
        let run = |cuda_graph: bool| {
            let dir = common::runs::out(&format!("cuda-graph-{}-{cuda_graph}", model[1]));
            let exec = Exec {
                cuda_graph,
                log_every,
                ..Exec::on(&gpu)
            };
            let before = myosotis::cuda::graph::captures(dev).unwrap();
            train(&cfg, &dir, &exec, Start::New, |_| {}).unwrap();
            let captured = myosotis::cuda::graph::captures(dev).unwrap() - before;
            let want = if cuda_graph { 1..=captures } else { 0..=0 };
            assert!(
                want.contains(&captured),
                "{model:?}: {captured} steps captured in a run, not {want:?}"
            );
            let records: Vec<String> = common::runs::metrics(&dir)
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    // Times differ between the runs; the values must not.
                    for t in ["seconds", "samples_per_s"] {
                        r.as_object_mut().unwrap().remove(t);
                    }
                    r.to_string()
                })
                .collect();
            let bytes = std::fs::read(dir.join("last.safetensors")).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            (records, bytes)
        };
        let (eager, captured) = (run(false), run(true));
        assert!(eager.0.len() > 6, "{model:?}: {} records", eager.0.len());
        assert_eq!(eager.0, captured.0, "{model:?}: the metrics differ");
        assert!(eager.1 == captured.1, "{model:?}: the checkpoints differ");
    }
}
