//! `myo`: train, evaluate and benchmark myosotis models. A thin shell over the library: the
//! flags, the progress display and the printing; what a run is lives in `myosotis::train`.

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use myosotis::bench::{copy_bandwidth, HeadBench, ScanBench, StepArgs, TreeBench};
use myosotis::data::generate::Generate;
use myosotis::device::{describe, parse_device, rank_cuda_device};
use myosotis::fail::message;
use myosotis::train::config::RunArgs;
use myosotis::train::dist::World;
use myosotis::train::precision::Precision;
use myosotis::train::progress::{significant, Event, Progress};
use myosotis::train::run::{eval_checkpoint_at, train, Exec, Origin, Start};
use myosotis::train::start::{fresh_run_dir, given_flags, point_latest_at, recorded_flags};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Counts the heap's bytes, so that `myo bench step` can report a step's peak memory on the CPU.
#[global_allocator]
static HEAP: myosotis::bench::memory::Heap = myosotis::bench::memory::Heap;

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
    /// Evaluate a checkpoint on its task's whole test split; prints JSON (loss, accuracy and
    /// the number of examples).
    Eval {
        /// A run's best.safetensors or last.safetensors.
        #[arg(long, value_name = "FILE")]
        checkpoint: PathBuf,
        /// Read the task's files from here instead of the checkpoint's own task (the test files
        /// alone suffice where the task has them).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Evaluate the first N test examples only. [default: all]
        #[arg(long, value_name = "N")]
        max_samples: Option<usize>,
        /// Audio (speech): test at this sampling rate, one that divides the recordings' 16000
        /// Hz, without retraining: the clips decimated and S5's Δ rescaled by the ratio.
        /// [default: the recordings' rate]
        #[arg(long, value_name = "HZ")]
        rate: Option<u32>,
        /// The dtype the model computes in (the checkpoint's f32 parameters cast to it).
        #[arg(long, value_enum, default_value_t)]
        precision: Precision,
        /// cpu, cuda or cuda:N.
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
        which: Generate,
    },
}

/// `myo train`: the run's definition plus where and how it executes.
#[derive(Args)]
struct TrainCmd {
    #[command(flatten)]
    run: RunArgs,
    /// cpu, cuda or cuda:N (under mpirun: cuda, one GPU per rank).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads: each batch is cut into this many data-parallel shards, one per thread, with
    /// candle's own ops single-threaded inside each (default: RAYON_NUM_THREADS, else all cores).
    /// BatchNorm's batch statistics are summed over the shards.
    #[arg(long)]
    threads: Option<usize>,
    /// Output folder; one that holds a run needs --resume or --overwrite. [default: a new
    /// runs/TASK-MODEL-TIME, linked as runs/latest; with --resume: runs/latest]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint, with its own settings: flags given
    /// too must agree with them, except a larger --epochs, which extends the run.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Start from the flags of an earlier run's config.json; flags given too override them.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    config: Option<PathBuf>,
    /// Delete the run files that --out holds (checkpoints, metrics, config, curves) and start a
    /// new run there.
    #[arg(long)]
    overwrite: bool,
    /// Under mpirun or srun: seconds a rank waits for the others in one exchange before it
    /// stops them all (a rank that died or cannot be reached).
    #[arg(long, default_value_t = 300)]
    rank_timeout: u64,
    /// Where standard error is not a terminal (a log file, a pipe): seconds between progress
    /// lines within an epoch (on a terminal a progress bar shows it).
    #[arg(long, default_value_t = 30.0)]
    progress_every: f64,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The linear scan h_t = a_t ⊙ h_{t-1} + b_t over (batch, len, channels).
    Scan(Kernel<ScanBench>),
    /// The Myo tree solve x = T_G⁻¹ u over (batch, heads) trees.
    Tree(Kernel<TreeBench>),
    /// The Myo layer's solve (scalar complex heads, unit diagonal, skew couplings) in the
    /// model's (batch, node, head) layout; the reference is the general tree solve.
    Heads(Kernel<HeadBench>),
    /// A training step (forward, loss, backward, AdamW) of the model `myo train` would build
    /// from the same flags, on random inputs of the task's shape: its time, the time in its
    /// sequence layers, and the tensor ops each part executes.
    Step(Box<StepArgs>),
    /// The device's copy bandwidth (bytes read + written per second).
    Copy {
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Millions of f32 elements copied.
        #[arg(long, default_value_t = 64)]
        mega_elems: usize,
    },
}

/// A kernel benchmark, where it runs and how it prints.
#[derive(Args)]
struct Kernel<B: Args> {
    #[command(flatten)]
    bench: B,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Prints a benchmark's report as text, or as one JSON object.
fn emit<R: serde::Serialize + std::fmt::Display>(report: &R, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

fn main() {
    myosotis::device::keep_large_allocations();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The run flags given (for config.json, --resume and --config).
    let given = matches
        .subcommand_matches("train")
        .map(given_flags)
        .unwrap_or_default();
    // The ranks of `mpirun` / `srun`, before any thread starts; one rank otherwise.
    let world = match &cli.command {
        Command::Train(a) => World::from_env(Duration::from_secs(a.rank_timeout)),
        _ => Ok(World::single()),
    };
    let world = match world {
        Ok(world) => Arc::new(world),
        Err(e) => {
            eprintln!("error: {}", message(&e));
            std::process::exit(1);
        }
    };
    // A panic too ends every rank, with its message.
    if let Err(e) = myosotis::fail::catch_panics(|| run(cli, given, world.clone())) {
        // The message chain only: users read it, backtraces are for debuggers.
        if world.size() > 1 {
            eprintln!("error: rank {}: {}", world.rank(), message(&e));
            // The other ranks would wait for this one until their timeout.
            world.abort_others();
        } else {
            eprintln!("error: {}", message(&e));
        }
        std::process::exit(1);
    }
}

fn run(cli: Cli, given: Vec<String>, world: Arc<World>) -> Result<()> {
    match cli.command {
        Command::Bench { which } => match which {
            BenchCmd::Scan(k) => {
                let r = k.bench.run(&parse_device(&k.device)?);
                emit(&r.context("scan benchmark failed")?, k.json)?;
            }
            BenchCmd::Tree(k) => {
                let r = k.bench.run(&parse_device(&k.device)?);
                emit(&r.context("tree benchmark failed")?, k.json)?;
            }
            BenchCmd::Heads(k) => {
                let r = k.bench.run(&parse_device(&k.device)?);
                emit(&r.context("head-solve benchmark failed")?, k.json)?;
            }
            BenchCmd::Step(a) => {
                emit(&a.run().context("step benchmark failed")?, a.json)?;
            }
            BenchCmd::Copy { device, mega_elems } => {
                let dev = parse_device(&device)?;
                let gbps = copy_bandwidth(&dev, mega_elems << 20, 20)?;
                println!(
                    "copy  device={}  {} MiB f32  {} GB/s (read + write)",
                    describe(&dev),
                    mega_elems * 4,
                    significant(gbps)
                );
            }
        },
        Command::Train(a) => {
            // Each rank of a machine on its own GPU.
            let device = match a.device.as_str() {
                "cuda" if world.size() > 1 => rank_cuda_device(world.local_rank())?,
                d => parse_device(d)?,
            };
            // Without --out: --resume continues the newest run, a new run gets its own folder.
            let latest = (a.out.is_none() && a.resume).then(|| PathBuf::from("runs/latest"));
            let out = a.out.clone().or(latest);
            // The run flags: those of the run resumed or of --config (rank 0 reads them), then
            // the ones given now, which override them.
            let mut base = Vec::new();
            if world.is_root() {
                let flags = match (&a.config, a.resume) {
                    (Some(file), _) => recorded_flags(file).context("--config")?,
                    (None, true) => out
                        .as_ref()
                        .and_then(|o| recorded_flags(&o.join("config.json")).ok())
                        .unwrap_or_default(),
                    (None, false) => vec![],
                };
                base = serde_json::to_vec(&flags)?;
            }
            world.broadcast_bytes(&mut base)?;
            let mut flags: Vec<String> = serde_json::from_slice(&base)?;
            flags.extend(given);
            let args = RunArgs::from_flags(&flags)?;
            let cfg = args.resolve()?;
            let origin = Origin {
                command_line: std::env::args().collect(),
                flags: Some(flags),
            };
            let exec = Exec {
                log_every: args.log_every,
                save_every: args.save_every,
                cuda_graph: args.cuda_graph,
                ..Exec::for_process(&device, a.threads)?
                    .in_world(world.clone())
                    .started_by(origin)
            };
            let start = match (a.resume, a.overwrite) {
                (true, _) => Start::Resume,
                (false, true) => Start::Replace,
                (false, false) => Start::New,
            };
            let out = out.unwrap_or_else(|| fresh_run_dir(Path::new("runs"), &cfg));
            if !(a.progress_every.is_finite() && a.progress_every >= 0.0) {
                anyhow::bail!(
                    "--progress-every {}: expected seconds ≥ 0",
                    a.progress_every
                );
            }
            let mut progress = Progress::new(Duration::from_secs_f64(a.progress_every));
            let summary = train(&cfg, &out, &exec, start, |ev| {
                if matches!(ev, Event::Start(_)) && a.out.is_none() && !a.resume {
                    // A convenience: a link that cannot be made does not stop the run.
                    if let Err(e) = point_latest_at(&out) {
                        eprintln!("warning: {e:#}");
                    }
                }
                progress.show(ev)
            })?;
            if !world.is_root() {
                return Ok(());
            }
            let (val, test) = match (summary.best_val_accuracy, summary.test_accuracy) {
                (Some(v), Some(t)) => (format!("accuracy {v:.4}"), format!("accuracy {t:.4}")),
                _ => (
                    format!("mse {:.3e}", summary.best_val_loss),
                    format!("mse {:.3e}", summary.test_loss),
                ),
            };
            println!(
                "done: {} epochs, {} steps in {:.0} s; best val {val} (epoch {}, step {}), test {test}; outputs in {}",
                summary.epochs,
                summary.steps,
                summary.seconds,
                summary.best_epoch,
                summary.best_step,
                out.display()
            );
        }
        Command::Eval {
            checkpoint,
            data_dir,
            max_samples,
            rate,
            precision,
            device,
            threads,
        } => {
            let device = parse_device(&device)?;
            let exec = Exec::for_process(&device, threads)?;
            let (data, max) = (data_dir.as_deref(), max_samples);
            let e = eval_checkpoint_at(&checkpoint, data, max, rate, precision, &exec)?;
            let mut report = serde_json::json!({"checkpoint": checkpoint, "split": "test",
                "examples": e.examples});
            match e.accuracy {
                Some(a) => {
                    report["loss"] = e.loss.into();
                    report["accuracy"] = a.into();
                }
                None => report["mse"] = e.loss.into(),
            }
            if let Some(rate) = rate {
                report["rate"] = rate.into();
            }
            if precision.is_mixed() {
                report["precision"] = precision.to_string().into();
            }
            println!("{report}");
        }
        Command::Data { which } => println!("{}", which.run()?),
    }
    Ok(())
}

/// The command line's own checks (every flag documented).
#[cfg(test)]
#[path = "myo_tests.rs"]
mod tests;
