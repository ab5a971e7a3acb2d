//! `myo`: benchmark (and, in later versions, train and evaluate) myosotis models.
//! A thin shell over the library: argument parsing and printing only.

use anyhow::{Context, Result};
use candle_core::DType;
use candle_core::Device;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use myosotis::bench::{
    copy_bandwidth, describe, parse_device, BenchReport, HeadBench, ScanBench, StepBench, TreeBench,
};
use myosotis::train::run::{Event, Exec, Start};

#[derive(Parser)]
#[command(
    name = "myo",
    version,
    about = "Structured state-space sequence models on candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a sequence classifier (with no options: S5 on generated ListOps, a few minutes on a
    /// CPU).
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint on its task's test split; prints JSON.
    Eval {
        #[arg(long)]
        checkpoint: std::path::PathBuf,
        /// Read the task's files from here instead of the checkpoint's own task.
        #[arg(long)]
        data_dir: Option<std::path::PathBuf>,
        #[arg(long, default_value = "cpu")]
        device: String,
        /// CPU threads (data-parallel shards; see `myo train --threads`).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Benchmark a kernel against its plain-candle reference.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// Generate datasets.
    Data {
        #[command(subcommand)]
        which: DataCmd,
    },
}

#[derive(Args)]
struct TrainArgs {
    /// s5, myo or mingru.
    #[arg(long, default_value = "s5")]
    model: String,
    /// listops (generated unless --data-dir has basic_{train,val,test}.tsv), or with --data-dir:
    /// smnist, psmnist, zmnist (MNIST IDX), scifar, zcifar, lra-image (CIFAR-10 binary),
    /// pathfinder, pathx (LRA folders).
    #[arg(long, default_value = "listops")]
    task: String,
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
    /// MNIST / CIFAR-10 tasks: fetch the data from the Hugging Face Hub (ylecun/mnist,
    /// uoft-cs/cifar10) into its cache instead of reading --data-dir; honours HF_HOME,
    /// HF_ENDPOINT and HF_HUB_OFFLINE.
    #[arg(long, conflicts_with = "data_dir")]
    hub: bool,
    /// Start from the reference's hyper-parameters for this task (S5 Table 11 and run scripts:
    /// listops, pathfinder, pathx, lra-image, scifar, zcifar, smnist, zmnist, psmnist); the
    /// flags below override it. Without a preset the defaults are a small, quick model.
    #[arg(long)]
    preset: Option<String>,
    /// [default: 10]
    #[arg(long)]
    epochs: Option<usize>,
    /// [default: 32]
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Output folder. A folder that holds a run needs --resume or --overwrite; the default,
    /// runs/latest, is replaced by each run that leaves --out unset. [default: runs/latest]
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Delete the run files that --out holds (checkpoints, metrics, config, curves) and start a
    /// new run there.
    #[arg(long)]
    overwrite: bool,
    /// Width H. [default: 64]
    #[arg(long)]
    d_model: Option<usize>,
    /// S5 latent size P. [default: 32]
    #[arg(long)]
    state_size: Option<usize>,
    /// [default: 2]
    #[arg(long)]
    layers: Option<usize>,
    /// Myo heads. [default: the state size]
    #[arg(long)]
    heads: Option<usize>,
    /// Myo block size d (1: scalar complex heads). [default: 1]
    #[arg(long)]
    block_size: Option<usize>,
    /// Myo: how the couplings enter T_G: skew (the paper's solve: I + skew-Hermitian, B
    /// unbounded), hermitian (C = B†, diagonally dominant: |B| < 1/(1 + children)) or free (C
    /// its own parameter, dominant). [default: skew]
    #[arg(long)]
    coupling: Option<String>,
    /// Myo, skew coupling: the range LOW:HIGH of the heads' initial |B|. [default: 0.1:10]
    #[arg(long)]
    coupling_init: Option<String>,
    /// Myo, skew coupling: start every coupling of a head with the same phase instead of one
    /// that grows with the node's offset in its parent (siblings then start interchangeable).
    #[arg(long)]
    uniform_phase: bool,
    /// Myo: couplings per BFS level instead of per node.
    #[arg(long)]
    per_level: bool,
    /// Myo: run the blocks over all tree nodes in BFS order (paper §3.2), so the virtual nodes
    /// carry features from layer to layer, instead of over the leaves with learned constant
    /// inputs on the virtual nodes (a third more positions; slower to learn on zMNIST).
    #[arg(long)]
    all_nodes: bool,
    /// S5 HiPPO-N blocks J. [default: state size / 8]
    #[arg(long)]
    blocks: Option<usize>,
    /// S5: also scan in reverse. [default: false for smnist and psmnist (causal, as S5), else true]
    #[arg(long)]
    bidirectional: Option<bool>,
    /// S5: trunc_standard_normal, lecun_normal or complex_normal. [default: trunc_standard_normal]
    #[arg(long)]
    c_init: Option<String>,
    /// S5: clamp Re(λ) ≤ −1e-4.
    #[arg(long)]
    clip_eigs: Option<bool>,
    /// layer or batch. [default: layer; presets: batch]
    #[arg(long)]
    norm: Option<String>,
    /// Normalise after the residual instead of before the layer.
    #[arg(long)]
    postnorm: Option<bool>,
    /// BatchNorm's running-average decay m (running = m·running + (1−m)·batch).
    /// [default: 0.95; pathfinder preset: 0.9]
    #[arg(long)]
    bn_momentum: Option<f64>,
    /// gelu, full_glu, half_glu1 or half_glu2. [default: half_glu2]
    #[arg(long)]
    activation: Option<String>,
    /// mean, last, root (Myo) or top:K (Myo: the mean over the top K BFS levels, paper §3.2).
    /// [default: root for Myo (the paper's classification node; on zMNIST it learned twice as
    /// fast as mean pooling), mean otherwise]
    #[arg(long)]
    pooling: Option<String>,
    /// [default: 0]
    #[arg(long)]
    dropout: Option<f64>,
    /// Learning rate of the SSM parameters. [default: 0.003]
    #[arg(long)]
    ssm_lr: Option<f64>,
    /// Learning rate of the other parameters. [default: 3 x --ssm-lr]
    #[arg(long)]
    lr: Option<f64>,
    /// [default: 0.04]
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Linear warm-up steps. [default: 50; presets: one epoch]
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// Clip the global gradient norm.
    #[arg(long)]
    clip: Option<f64>,
    #[arg(long)]
    max_train_samples: Option<usize>,
    #[arg(long)]
    max_eval_samples: Option<usize>,
    /// CPU threads: each batch is cut into this many data-parallel shards, one per thread, with
    /// candle's own ops single-threaded inside each (default: RAYON_NUM_THREADS, else all cores).
    /// BatchNorm models train with one shard (their statistics need the whole batch).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Synthetic 28 × 28 digits in the MNIST IDX format, for the MNIST tasks without a
    /// download: class k is a bar (horizontal for k < 5, vertical otherwise) whose position is
    /// k, with jitter and noise.
    Strokes {
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long, default_value_t = 6_000)]
        train: usize,
        #[arg(long, default_value_t = 1_000)]
        test: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// ListOps in the LRA TSV format (basic_{train,val,test}.tsv) from the built-in generator.
    Listops {
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long, default_value_t = 96_000)]
        train: usize,
        #[arg(long, default_value_t = 2_000)]
        val: usize,
        #[arg(long, default_value_t = 2_000)]
        test: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 10)]
        max_depth: usize,
        #[arg(long, default_value_t = 10)]
        max_args: usize,
        /// Lengths strictly between --min-length and --max-length are kept.
        #[arg(long, default_value_t = 500)]
        min_length: usize,
        #[arg(long, default_value_t = 2000)]
        max_length: usize,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The linear scan h_t = a_t ⊙ h_{t-1} + b_t over (batch, len, channels).
    Scan(ScanArgs),
    /// The Myo tree solve x = T_G⁻¹ u over (batch, heads) trees.
    Tree(TreeArgs),
    /// The Myo layer's solve (scalar complex heads, unit diagonal, skew couplings) in the
    /// model's (batch, node, head) layout; the reference is the general tree solve.
    Heads(HeadArgs),
    /// A training step (forward, loss, backward) of the model `myo train` would build from the
    /// same flags, on random inputs of the task's shape; also the time in its sequence layers.
    Step(Box<StepArgs>),
    /// The device's copy bandwidth (bytes read + written per second).
    Copy {
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Millions of f32 elements copied.
        #[arg(long, default_value_t = 64)]
        mega_elems: usize,
    },
}

#[derive(Args)]
struct StepArgs {
    #[command(flatten)]
    model: TrainArgs,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Flags every kernel benchmark takes.
#[derive(Args)]
struct BenchFlags {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Complex values (trailing dimension 2).
    #[arg(long)]
    complex: bool,
    /// Time forward + backward.
    #[arg(long)]
    backward: bool,
    /// f32, f64, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 15)]
    repeats: usize,
    /// Skip the plain-candle reference (slow: a loop over the length or the levels).
    #[arg(long)]
    no_reference: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ScanArgs {
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 256)]
    channels: usize,
    #[arg(long, default_value_t = 4096)]
    len: usize,
    /// Gate shared over batch and length, shape (channels), as in S5.
    #[arg(long)]
    shared_a: bool,
    #[command(flatten)]
    flags: BenchFlags,
}

#[derive(Args)]
struct HeadArgs {
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    heads: usize,
    /// Leaves of the tree (perfect when a power of --arity, else ragged).
    #[arg(long, default_value_t = 784)]
    leaves: usize,
    #[arg(long, default_value_t = 4)]
    arity: usize,
    #[command(flatten)]
    flags: BenchFlags,
}

#[derive(Args)]
struct TreeArgs {
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    heads: usize,
    /// Leaves of the tree (perfect when a power of --arity, else ragged).
    #[arg(long, default_value_t = 1024)]
    leaves: usize,
    #[arg(long, default_value_t = 4)]
    arity: usize,
    /// Block size d.
    #[arg(long, default_value_t = 1)]
    block: usize,
    /// Right-hand sides r.
    #[arg(long, default_value_t = 1)]
    rhs: usize,
    /// Coefficients per sample instead of shared across the batch.
    #[arg(long)]
    per_sample: bool,
    #[command(flatten)]
    flags: BenchFlags,
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        _ => anyhow::bail!("--dtype {s}: expected f32, f64, f16 or bf16"),
    })
}

fn print_report(r: &BenchReport) {
    println!(
        "{} {}  device={}  {}",
        r.op,
        if r.backward {
            "forward+backward"
        } else {
            "forward"
        },
        r.device,
        r.shape
    );
    println!(
        "  myosotis   median {:>10.3} ms  (min {:.3}, {} samples)  {:>8.1} GB/s = {:.0}% of copy ({:.1} GB/s)",
        r.median_ms, r.min_ms, r.repeats, r.gbps, r.pct_of_copy, r.copy_gbps
    );
    if let (Some(ref_ms), Some(s)) = (r.reference_median_ms, r.speedup) {
        println!(
            "  reference  median {ref_ms:>10.3} ms  ({})  speed-up {s:.1}x",
            r.reference
        );
    }
    if let Some(note) = &r.reference_note {
        println!("  reference  not timed: {note}");
    }
}

fn emit(report: &BenchReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_report(report);
    }
    Ok(())
}

/// Keeps large freed blocks in the heap for reuse. By default glibc serves every tensor of
/// 32 MiB or more with a fresh `mmap`, so each op's output is page-faulted and zeroed by the
/// kernel again on every call; in a training or benchmark loop that costs more than the op.
fn keep_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// How `myo train`/`myo eval` use the CPU: `threads` data-parallel shards per batch (default
/// RAYON_NUM_THREADS, else every core), each running candle's ops single-threaded. Measured on
/// a 2-core machine (S5 and Myo, 4 layers, d_model 64, batch 32 of MNIST): two single-threaded
/// shards take 0.6x the time of one shard whose ops use both cores, as candle's per-op
/// parallelism (a barrier pool for element-wise ops, rayon inside gemm) leaves cores idle
/// between small ops. On CUDA: one shard.
fn executor(device: &Device, threads: Option<usize>) -> Result<Exec> {
    if !device.is_cpu() {
        return Ok(Exec::on(device));
    }
    let from_env = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok());
    let n = threads
        .or(from_env)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if n == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    // Our own ops (and the shards) run on rayon's global pool of `n` threads; candle reads its
    // thread count from these variables when it first needs it, which is after this point.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    // SAFETY (of the environment write): no other thread reads the environment here; rayon's
    // workers do not, and candle has not started its pools yet.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    Ok(Exec {
        device: device.clone(),
        shards: n,
    })
}

fn main() {
    keep_large_allocations();
    if let Err(e) = run() {
        // The message chain only: users read it, backtraces are for RUST_BACKTRACE debugging.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { which } => match which {
            BenchCmd::Scan(a) => {
                let device = parse_device(&a.flags.device)?;
                let bench = ScanBench {
                    batch: a.batch,
                    channels: a.channels,
                    len: a.len,
                    complex: a.flags.complex,
                    shared_a: a.shared_a,
                    backward: a.flags.backward,
                    dtype: parse_dtype(&a.flags.dtype)?,
                    warmup: a.flags.warmup,
                    repeats: a.flags.repeats,
                    reference: !a.flags.no_reference,
                };
                emit(
                    &bench.run(&device).context("scan benchmark failed")?,
                    a.flags.json,
                )?;
            }
            BenchCmd::Tree(a) => {
                let device = parse_device(&a.flags.device)?;
                let bench = TreeBench {
                    batch: a.batch,
                    heads: a.heads,
                    leaves: a.leaves,
                    arity: a.arity,
                    block: a.block,
                    rhs: a.rhs,
                    complex: a.flags.complex,
                    per_sample: a.per_sample,
                    backward: a.flags.backward,
                    dtype: parse_dtype(&a.flags.dtype)?,
                    warmup: a.flags.warmup,
                    repeats: a.flags.repeats,
                    reference: !a.flags.no_reference,
                };
                emit(
                    &bench.run(&device).context("tree benchmark failed")?,
                    a.flags.json,
                )?;
            }
            BenchCmd::Heads(a) => {
                let device = parse_device(&a.flags.device)?;
                let bench = HeadBench {
                    batch: a.batch,
                    heads: a.heads,
                    leaves: a.leaves,
                    arity: a.arity,
                    backward: a.flags.backward,
                    dtype: parse_dtype(&a.flags.dtype)?,
                    warmup: a.flags.warmup,
                    repeats: a.flags.repeats,
                    reference: !a.flags.no_reference,
                };
                emit(
                    &bench.run(&device).context("head-solve benchmark failed")?,
                    a.flags.json,
                )?;
            }
            BenchCmd::Step(a) => {
                let device = parse_device(&a.model.device)?;
                executor(&device, Some(a.model.threads.unwrap_or(1)))?;
                // Only the task's shape is used: no data is read.
                let mut args = a.model;
                args.hub = args.data_dir.is_none() && args.task != "listops";
                let cfg = run_config(&args)?;
                let bench = StepBench {
                    len: cfg.task.max_tokens(),
                    model: cfg.model,
                    batch: cfg.batch_size,
                    warmup: a.warmup,
                    repeats: a.repeats,
                };
                let r = bench.run(&device).context("step benchmark failed")?;
                if a.json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!("step  device={}  {}", r.device, r.shape);
                    for (what, t) in [
                        ("forward + backward", r.step),
                        ("  in the layers   ", r.layers),
                        ("forward           ", r.forward),
                    ] {
                        println!(
                            "  {what}  median {:>9.2} ms  (min {:.2}, {} samples)",
                            t.median_ms, t.min_ms, t.repeats
                        );
                    }
                }
            }
            BenchCmd::Copy { device, mega_elems } => {
                let dev = parse_device(&device)?;
                let gbps = copy_bandwidth(&dev, mega_elems << 20, 20)?;
                println!(
                    "copy  device={}  {} MiB f32  {gbps:.1} GB/s (read + write)",
                    describe(&dev),
                    mega_elems * 4
                );
            }
        },
        Command::Train(a) => {
            let device = parse_device(&a.device)?;
            let exec = executor(&device, a.threads)?;
            let cfg = run_config(&a)?;
            let mut bar: Option<ProgressBar> = None;
            let mut seen = (0usize, 0.0f64, 0usize);
            let out = a.out.clone().unwrap_or_else(|| "runs/latest".into());
            let start = match (a.resume, a.overwrite || a.out.is_none()) {
                (true, _) => Start::Resume,
                (false, true) => Start::Replace,
                (false, false) => Start::New,
            };
            let summary = myosotis::train::run::train(&cfg, &out, &exec, start, |ev| match ev {
                Event::EpochStart {
                    epoch,
                    epochs,
                    samples,
                    ..
                } => {
                    let b = ProgressBar::new(samples as u64)
                        .with_prefix(format!("epoch {epoch}/{epochs}"));
                    b.set_style(
                        ProgressStyle::with_template(
                            "{prefix} [{bar:30}] {pos}/{len} {msg} {per_sec} ETA {eta}",
                        )
                        .expect("valid template")
                        .progress_chars("=> "),
                    );
                    bar = Some(b);
                    seen = (0, 0.0, 0);
                }
                Event::Batch {
                    samples,
                    loss,
                    correct,
                } => {
                    seen = (
                        seen.0 + samples,
                        seen.1 + loss * samples as f64,
                        seen.2 + correct,
                    );
                    if let Some(b) = &bar {
                        b.inc(samples as u64);
                        b.set_message(format!(
                            "loss {:.4} acc {:.3}",
                            seen.1 / seen.0 as f64,
                            seen.2 as f64 / seen.0 as f64
                        ));
                    }
                }
                Event::Evaluating { split } => {
                    if let Some(b) = &bar {
                        b.set_message(format!("evaluating {split}"));
                    }
                }
                Event::EpochEnd {
                    epoch,
                    train,
                    val,
                    test,
                    seconds,
                } => {
                    if let Some(b) = bar.take() {
                        b.finish_and_clear();
                    }
                    let test = test
                        .map(|t| format!("  test acc {:.4} (new best val)", t.accuracy))
                        .unwrap_or_default();
                    eprintln!(
                            "epoch {epoch:>3}/{}  train loss {:.4} acc {:.4}  val loss {:.4} acc {:.4}{test}  [{seconds:.0} s]",
                            cfg.epochs, train.loss, train.accuracy, val.loss, val.accuracy
                        );
                    tracing::info!(
                        epoch,
                        train_loss = train.loss,
                        val_accuracy = val.accuracy,
                        seconds,
                        "epoch done"
                    );
                }
            })?;
            println!(
                "done: {} epochs, {} steps in {:.0} s; best val accuracy {:.4} (epoch {}), test accuracy {:.4}; outputs in {}",
                summary.epochs,
                summary.steps,
                summary.seconds,
                summary.best_val_accuracy,
                summary.best_epoch,
                summary.test_accuracy,
                out.display()
            );
        }
        Command::Eval {
            checkpoint,
            data_dir,
            device,
            threads,
        } => {
            let device = parse_device(&device)?;
            let exec = executor(&device, threads)?;
            let e = myosotis::train::run::eval_checkpoint(&checkpoint, data_dir.as_deref(), &exec)?;
            println!(
                "{}",
                serde_json::json!({"checkpoint": checkpoint, "split": "test", "loss": e.loss, "accuracy": e.accuracy})
            );
        }
        Command::Data { which } => match which {
            DataCmd::Strokes {
                out,
                train,
                test,
                seed,
            } => {
                myosotis::data::strokes::write_dataset(&out, train, test, seed)
                    .context("generating the stroke digits")?;
                println!(
                    "Stroke digits written to {} ({train} / {test} images, MNIST IDX)",
                    out.display()
                );
            }
            DataCmd::Listops {
                out,
                train,
                val,
                test,
                seed,
                max_depth,
                max_args,
                min_length,
                max_length,
            } => {
                let cfg = myosotis::data::listops::ListOpsConfig {
                    max_depth,
                    max_args,
                    min_length,
                    max_length,
                    seed,
                };
                let splits = myosotis::data::listops::Splits { train, val, test };
                myosotis::data::listops::write_dataset(&out, &cfg, splits)
                    .context("generating ListOps")?;
                println!(
                    "ListOps written to {} ({train} / {val} / {test} examples)",
                    out.display()
                );
            }
        },
    }
    Ok(())
}

/// The run a `myo train` command line describes: flags over the preset over the quick defaults.
fn run_config(a: &TrainArgs) -> Result<myosotis::train::run::RunConfig> {
    use myosotis::nn::*;
    use myosotis::train::run::{RunConfig, TaskConfig};
    let preset = match &a.preset {
        Some(p) => Some(myosotis::train::preset::preset(p).with_context(|| {
            format!(
                "--preset {p}: expected one of {}",
                myosotis::train::preset::TASKS.join(", ")
            )
        })?),
        None => None,
    };
    let pick = |flag: Option<usize>, from_preset: Option<usize>, quick: usize| {
        flag.or(from_preset).unwrap_or(quick)
    };
    let pickf = |flag: Option<f64>, from_preset: Option<f64>, quick: f64| {
        flag.or(from_preset).unwrap_or(quick)
    };
    let p = preset.as_ref();
    let d_model = pick(a.d_model, p.map(|p| p.d_model), 64);
    let state = pick(a.state_size, p.map(|p| p.state), 32);
    let layers = pick(a.layers, p.map(|p| p.layers), 2);
    let epochs = pick(a.epochs, p.map(|p| p.epochs), 10);
    let batch_size = pick(a.batch_size, p.map(|p| p.batch_size), 32);
    let dropout = pickf(a.dropout, p.map(|p| p.dropout), 0.0);
    let bn_momentum = pickf(a.bn_momentum, p.map(|p| p.bn_momentum), BN_MOMENTUM);
    if !(0.0..1.0).contains(&bn_momentum) {
        anyhow::bail!("--bn-momentum {bn_momentum}: expected a decay in [0, 1)");
    }
    let ssm_lr = pickf(a.ssm_lr, p.map(|p| p.ssm_lr), 0.003);
    let lr = a.lr.or(p.map(|p| p.lr)).unwrap_or(3.0 * ssm_lr);
    let weight_decay = pickf(a.weight_decay, p.map(|p| p.weight_decay), 0.04);
    for (name, v) in [
        ("--d-model", d_model),
        ("--state-size", state),
        ("--layers", layers),
        ("--epochs", epochs),
        ("--batch-size", batch_size),
    ] {
        if v == 0 {
            anyhow::bail!("{name} must be at least 1");
        }
    }
    if !(0.0..1.0).contains(&dropout) {
        anyhow::bail!("--dropout {dropout}: expected a rate in [0, 1)");
    }
    let image = myosotis::train::run::ImageTask::parse(&a.task);
    if a.hub && image.and_then(|t| t.hub_dataset()).is_none() {
        anyhow::bail!("--hub serves the MNIST and CIFAR-10 tasks (smnist, psmnist, zmnist, scifar, zcifar, lra-image); --task {} reads --data-dir{}", a.task, if a.task == "listops" { " or the built-in generator" } else { "" });
    }
    let task = match (a.task.as_str(), image, &a.data_dir) {
        (_, Some(task), None) if a.hub => TaskConfig::ImageHub { task },
        ("listops", _, Some(dir)) => TaskConfig::ListopsTsv { dir: dir.clone() },
        // The embedded default: short expressions, so that a CPU run takes minutes.
        ("listops", _, None) => TaskConfig::ListopsGenerated { train: 4000, val: 500, test: 500, max_depth: 4, max_args: 5, min_length: 8, max_length: 64, seed: a.seed },
        (_, Some(task), Some(dir)) => TaskConfig::Image { task, dir: dir.clone() },
        (t, Some(_), None) => anyhow::bail!("--task {t} needs --data-dir (or --hub for MNIST and CIFAR-10): MNIST IDX files (train-images-idx3-ubyte, …), CIFAR-10 binary files (data_batch_1.bin, …) or the LRA Pathfinder folder (pathfinder32/curv_contour_length_14 with metadata/ and imgs/)"),
        (t, None, _) => anyhow::bail!("--task {t}: expected listops, smnist, psmnist, zmnist, scifar, zcifar, lra-image, pathfinder or pathx"),
    };
    let leaves = task.max_tokens();
    let tree = match image {
        Some(t) if t.morton() => TreeSpec::Quad {
            height: t.shape().0,
            width: t.shape().0,
        },
        // Binary trees for Path-X, 4-ary for the other images (Myosotis §5).
        Some(myosotis::train::run::ImageTask::Pathx) => TreeSpec::Ragged { leaves, arity: 2 },
        Some(_) => TreeSpec::Ragged { leaves, arity: 4 },
        None => TreeSpec::Ragged { leaves, arity: 2 },
    };
    let encoder = match image {
        Some(t) => EncoderConfig::Linear {
            features: t.shape().1,
        },
        None => EncoderConfig::Embedding {
            vocab: myosotis::data::listops::VOCAB,
        },
    };
    // S5 used causal models for sMNIST and psMNIST (S5 Appendix G.2.2), bidirectional ones
    // elsewhere.
    let causal_task = matches!(a.task.as_str(), "smnist" | "psmnist");
    let bidirectional = a
        .bidirectional
        .or(p.map(|p| p.bidirectional))
        .unwrap_or(!causal_task);
    let c_init = match a.c_init.as_deref() {
        None => p.map_or(CInit::TruncStandardNormal, |p| p.c_init),
        Some("trunc_standard_normal") => CInit::TruncStandardNormal,
        Some("lecun_normal") => CInit::LecunNormal,
        Some("complex_normal") => CInit::ComplexNormal,
        Some(o) => anyhow::bail!(
            "--c-init {o}: expected trunc_standard_normal, lecun_normal or complex_normal"
        ),
    };
    let layer = match a.model.as_str() {
        "s5" => SeqLayerConfig::S5(S5Config {
            d_model,
            state,
            blocks: a
                .blocks
                .or(p.map(|p| p.blocks))
                .unwrap_or((state / 8).max(1)),
            bidirectional,
            c_init,
            clip_eigs: a.clip_eigs.or(p.map(|p| p.clip_eigs)).unwrap_or(false),
            seed: a.seed,
            ..S5Config::default()
        }),
        "myo" => SeqLayerConfig::Myo({
            let defaults = MyoConfig::new(d_model, a.heads.unwrap_or(state), tree);
            MyoConfig {
                per_level: a.per_level,
                coupling: match a.coupling.as_deref() {
                    None | Some("skew") => Coupling::Skew,
                    Some("hermitian") => Coupling::Hermitian,
                    Some("free") => Coupling::Free,
                    Some(o) => anyhow::bail!("--coupling {o}: expected skew, hermitian or free"),
                },
                coupling_init: match a.coupling_init.as_deref() {
                    None => defaults.coupling_init,
                    Some(r) => r
                        .split_once(':')
                        .and_then(|(lo, hi)| Some([lo.parse().ok()?, hi.parse().ok()?]))
                        .filter(|[lo, hi]: &[f64; 2]| *lo > 0.0 && lo <= hi && hi.is_finite())
                        .with_context(|| {
                            format!("--coupling-init {r}: expected LOW:HIGH with 0 < LOW ≤ HIGH")
                        })?,
                },
                position_phase: !a.uniform_phase,
                all_nodes: a.all_nodes,
                block: a.block_size.unwrap_or(1),
                seed: a.seed,
                ..defaults
            }
        }),
        "mingru" => SeqLayerConfig::MinGru(MinGruConfig {
            d_model,
            hidden: d_model,
            tanh_impulse: false,
            seed: a.seed,
        }),
        m => anyhow::bail!("--model {m}: expected s5, myo or mingru"),
    };
    let norm = match a.norm.as_deref() {
        None => p.map_or(NormKind::Layer, |p| p.norm),
        Some("layer") => NormKind::Layer,
        Some("batch") => NormKind::Batch,
        Some(o) => anyhow::bail!("--norm {o}: expected layer or batch"),
    };
    let activation = match a.activation.as_deref() {
        None => p.map_or(Activation::HalfGlu2, |p| p.activation),
        Some("gelu") => Activation::Gelu,
        Some("full_glu") => Activation::FullGlu,
        Some("half_glu1") => Activation::HalfGlu1,
        Some("half_glu2") => Activation::HalfGlu2,
        Some(o) => {
            anyhow::bail!("--activation {o}: expected gelu, full_glu, half_glu1 or half_glu2")
        }
    };
    let pooling = match a.pooling.as_deref() {
        None if a.model == "myo" => Pooling::Root,
        None | Some("mean") => Pooling::Mean,
        Some("last") => Pooling::Last,
        Some("root") => Pooling::Root,
        Some(t) if t.starts_with("top:") => Pooling::TopLevels {
            k: t[4..]
                .parse()
                .ok()
                .filter(|&k| k >= 1)
                .with_context(|| format!("--pooling {t}: expected top:K with K ≥ 1"))?,
        },
        Some(o) => anyhow::bail!("--pooling {o}: expected mean, last, root or top:K"),
    };
    let prenorm = !a.postnorm.unwrap_or(p.is_some_and(|p| !p.prenorm));
    Ok(RunConfig {
        task,
        model: ClassifierConfig {
            encoder,
            d_model,
            layers,
            layer,
            norm,
            prenorm,
            activation,
            dropout,
            pooling,
            classes: image.map_or(10, |t| t.classes()),
            seed: a.seed,
            bn_momentum,
        },
        optim: myosotis::train::optim::OptimConfig {
            lr,
            ssm_lr,
            lr_min: 0.0,
            weight_decay,
            warmup_steps: a.warmup_steps.unwrap_or(50),
            total_steps: 0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: a.clip,
        },
        epochs,
        batch_size,
        seed: a.seed,
        max_train_samples: a.max_train_samples,
        max_eval_samples: a.max_eval_samples,
        // Presets warm up over one epoch, as the reference's warmup_end = 1.
        warmup_epochs: match (a.warmup_steps, p) {
            (None, Some(p)) => Some(p.warmup_epochs),
            _ => None,
        },
    })
}
