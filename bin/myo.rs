//! `myo`: train, evaluate and benchmark myosotis models. A thin shell over the library: the
//! flags, the progress display and the printing; what a run is lives in `myosotis::train`.

use anyhow::{Context, Result};
use candle_core::DType;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use myosotis::bench::{
    copy_bandwidth, BenchReport, HeadBench, ScanBench, StepBench, StepReport, TreeBench,
};
use myosotis::device::{describe, parse_device};
use myosotis::train::config::RunArgs;
use myosotis::train::run::{eval_checkpoint, train, Event, Exec, Start};
use std::path::PathBuf;

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
    Train(Box<TrainCmd>),
    /// Evaluate a checkpoint on its task's test split; prints JSON.
    Eval {
        #[arg(long)]
        checkpoint: PathBuf,
        /// Read the task's files from here instead of the checkpoint's own task.
        #[arg(long)]
        data_dir: Option<PathBuf>,
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

/// `myo train`: the run's definition plus where and how it executes.
#[derive(Args)]
struct TrainCmd {
    #[command(flatten)]
    run: RunArgs,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads: each batch is cut into this many data-parallel shards, one per thread, with
    /// candle's own ops single-threaded inside each (default: RAYON_NUM_THREADS, else all cores).
    /// BatchNorm models train with one shard (their statistics need the whole batch).
    #[arg(long)]
    threads: Option<usize>,
    /// Output folder. A folder that holds a run needs --resume or --overwrite; the default,
    /// runs/latest, is replaced by each run that leaves --out unset. [default: runs/latest]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Delete the run files that --out holds (checkpoints, metrics, config, curves) and start a
    /// new run there.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Synthetic 28 × 28 digits in the MNIST IDX format, for the MNIST tasks without a
    /// download: class k is a bar (horizontal for k < 5, vertical otherwise) whose position is
    /// k, with jitter and noise.
    Strokes {
        #[arg(long)]
        out: PathBuf,
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
        out: PathBuf,
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
    run: RunArgs,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads (see `myo train --threads`).
    #[arg(long, default_value_t = 1)]
    threads: usize,
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

fn print_step(r: &StepReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
        return Ok(());
    }
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
    Ok(())
}

/// Shows a run's [`Event`]s: a progress bar per epoch with the running loss and accuracy, and
/// a line per finished epoch.
#[derive(Default)]
struct Progress {
    bar: Option<ProgressBar>,
    samples: usize,
    loss_sum: f64,
    correct: usize,
}

impl Progress {
    fn show(&mut self, ev: Event) {
        match ev {
            Event::EpochStart {
                epoch,
                epochs,
                samples,
                ..
            } => {
                let bar =
                    ProgressBar::new(samples as u64).with_prefix(format!("epoch {epoch}/{epochs}"));
                bar.set_style(
                    ProgressStyle::with_template(
                        "{prefix} [{bar:30}] {pos}/{len} {msg} {per_sec} ETA {eta}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                *self = Progress {
                    bar: Some(bar),
                    ..Progress::default()
                };
            }
            Event::Batch {
                samples,
                loss,
                correct,
            } => {
                self.samples += samples;
                self.loss_sum += loss * samples as f64;
                self.correct += correct;
                if let Some(bar) = &self.bar {
                    bar.inc(samples as u64);
                    bar.set_message(format!(
                        "loss {:.4} acc {:.3}",
                        self.loss_sum / self.samples as f64,
                        self.correct as f64 / self.samples as f64
                    ));
                }
            }
            Event::Evaluating { split } => {
                if let Some(bar) = &self.bar {
                    bar.set_message(format!("evaluating {split}"));
                }
            }
            Event::EpochEnd {
                epoch,
                epochs,
                train,
                val,
                test,
                seconds,
            } => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
                let test = test
                    .map(|t| format!("  test acc {:.4} (new best val)", t.accuracy))
                    .unwrap_or_default();
                eprintln!(
                    "epoch {epoch:>3}/{epochs}  train loss {:.4} acc {:.4}  val loss {:.4} acc {:.4}{test}  [{seconds:.0} s]",
                    train.loss, train.accuracy, val.loss, val.accuracy
                );
                tracing::info!(
                    epoch,
                    train_loss = train.loss,
                    val_accuracy = val.accuracy,
                    seconds,
                    "epoch done"
                );
            }
        }
    }
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
                let device = parse_device(&a.device)?;
                Exec::for_process(&device, Some(a.threads))?;
                // Only the task's shape is used: no data is read.
                let mut run = a.run;
                if run.data_dir.is_none() && !run.hub && run.task != "listops" {
                    run.data_dir = Some("(not read)".into());
                }
                let cfg = run.resolve()?;
                let bench = StepBench {
                    len: cfg.task.max_len(),
                    model: cfg.model,
                    batch: cfg.batch_size,
                    warmup: a.warmup,
                    repeats: a.repeats,
                };
                print_step(
                    &bench.run(&device).context("step benchmark failed")?,
                    a.json,
                )?;
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
            let exec = Exec::for_process(&device, a.threads)?;
            let cfg = a.run.resolve()?;
            let out = a.out.clone().unwrap_or_else(|| "runs/latest".into());
            let start = match (a.resume, a.overwrite || a.out.is_none()) {
                (true, _) => Start::Resume,
                (false, true) => Start::Replace,
                (false, false) => Start::New,
            };
            let mut progress = Progress::default();
            let summary = train(&cfg, &out, &exec, start, |ev| progress.show(ev))?;
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
            let exec = Exec::for_process(&device, threads)?;
            let e = eval_checkpoint(&checkpoint, data_dir.as_deref(), &exec)?;
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
