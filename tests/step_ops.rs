//! The tensor operations of a training step (`myo bench step`, counted on the CPU, where CI
//! runs): S5 and Myo at the default size execute at least 5× fewer than their steps did as
//! chains of candle ops (1,217 and 716, counted the same way before the fused ops and the
//! backward passes written out), the pendulum preset's step and the bf16 and f16 steps stay
//! near their counts. An op that creeps back into a step fails this test. The gradient norm, which a
//! captured `myo train` step takes every step, is a few ops too.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use myosotis::bench::{StepArgs, StepReport};
use myosotis::nn::ParamGroup;
use myosotis::train::optim::{OptimConfig, Optimizer};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    step: StepArgs,
}

fn bench(flags: &[&str]) -> StepReport {
    let args = ["bench", "--threads", "1", "--warmup", "0", "--repeats", "1"];
    Cli::parse_from(args.iter().chain(flags))
        .step
        .run()
        .expect("the step benchmark runs")
}

/// A reading of candle's tensor counter (as the bench reads it): two readings differ by the
/// tensors made in between, plus one.
fn tensors_made() -> usize {
    let id = format!(
        "{:?}",
        Tensor::zeros((), DType::U8, &Device::Cpu).unwrap().id()
    );
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .unwrap()
}

/// The gradient norm over 23 gradients (S5's at the default size): the square, sum, cast and
/// add per gradient of candle ops made 115 tensors (about 90 launches on CUDA).
fn gradient_norm_makes_few_tensors() {
    let vars: HashMap<String, Var> = (0..23)
        .map(|k| {
            let v = Tensor::arange(0f32, (k + 1) as f32, &Device::Cpu).unwrap();
            (format!("layers.{k}.weight"), Var::from_tensor(&v).unwrap())
        })
        .collect();
    let loss = vars
        .values()
        .map(|v| v.as_tensor().sqr().unwrap().sum_all().unwrap())
        .reduce(|a, b| (a + b).unwrap())
        .unwrap();
    let grads = loss.backward().unwrap();
    let cfg = OptimConfig {
        lr: 0.01,
        ssm_lr: 0.01,
        lr_min: 0.0,
        weight_decay: 0.0,
        warmup_steps: 0,
        total_steps: 1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        clip: None,
    };
    let opt = Optimizer::new(cfg, &vars, |_| ParamGroup::Regular).unwrap();
    let before = tensors_made();
    let norm = opt.grad_norm(&grads).unwrap();
    let made = tensors_made() - before - 1;
    // ∂(Σ v²)/∂v = 2v for v = 0, 1, ..., k: ‖g‖² = 4 Σ_k Σ_{i ≤ k} i².
    let want: f64 = (0..23u32)
        .flat_map(|k| 0..=k)
        .map(|i| 4.0 * f64::from(i * i))
        .sum::<f64>()
        .sqrt();
    let norm = norm.to_scalar::<f64>().unwrap();
    assert!((norm - want).abs() < 1e-6 * want, "{norm} vs {want}"); // f32 sums
    println!("gradient norm of 23 gradients: {made} tensor ops (as candle ops: 115)");
    assert!(made <= 3, "the gradient norm made {made} tensors");
}

#[test]
fn default_steps_and_the_gradient_norm_execute_few_ops() {
    // One test in this file: the count is of every tensor the process makes meanwhile.
    gradient_norm_makes_few_tensors();
    for (model, composed) in [("s5", 1217), ("myo", 716)] {
        let ops = bench(&["--model", model]).ops;
        let total = ops.total();
        println!("{model}: {total} tensor ops per step (as candle ops: {composed})");
        assert!(
            5 * total <= composed,
            "{model}: {total} tensor ops per step, more than a fifth of {composed}"
        );
    }
    // In bf16 and f16 the layers and blocks run by hand too (their fused ops take f16 and
    // bf16, computing in f32; BatchNorm's statistics in f32), and AdamW reads the half
    // gradients and writes the compute copy (no cast per parameter each way; f16's finite
    // check is the gradient norm): at the default size (LayerNorm) bf16 211 and 163 tensor ops
    // per step, f16 220 and 172; 257 / 184 and 266 / 193 with the pooling and head under
    // autograd, 289 / 192 with the layers' parameter-side ops in f32 (casts around them), 335 / 234 and 434 / 325 with a cast per parameter each way too, S5 1,138
    // and Myo 568 with the layers under autograd; at the sMNIST preset (BatchNorm) in bf16 S5
    // 355 and Myo 331, 401 / 352 with the pooling and head under autograd, 441 / 392 with
    // BatchNorm's rows cast to f32 and back too, 593 / 488 with the casts above too, S5 1,325
    // with its blocks under autograd.
    for (model, precision, preset, most) in [
        ("s5", "bf16", None, 225),
        ("myo", "bf16", None, 175),
        ("s5", "f16", None, 235),
        ("myo", "f16", None, 185),
        ("s5", "bf16", Some("smnist"), 375),
        ("myo", "f16", Some("smnist"), 355),
    ] {
        let mut flags = vec!["--model", model, "--precision", precision];
        if let Some(p) = preset {
            flags.extend(["--preset", p, "--batch-size", "2"]);
        }
        let total = bench(&flags).ops.total();
        println!("{model} {preset:?} in {precision}: {total} tensor ops per step");
        assert!(
            total <= most,
            "{model} {preset:?} in {precision}: {total} tensor ops per step"
        );
    }
    // The pendulum preset: 2,112 as candle ops; 421 with its timed S5 blocks, frame encoder,
    // Gaussian decoder and likelihood by hand. Any one of them back under autograd adds 40 or
    // more.
    let total = bench(&["--preset", "pendulum", "--batch-size", "2"])
        .ops
        .total();
    println!("pendulum: {total} tensor ops per step (as candle ops: 2,112)");
    assert!(total <= 450, "pendulum: {total} tensor ops per step");
}
