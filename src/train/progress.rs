//! What a run reports while it runs ([`Event`]s), and how `myo train` shows it on standard
//! error: a start banner, then on a terminal a progress bar per epoch, elsewhere (a log file, a
//! pipe) a progress line every few seconds; and a line per evaluation.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use super::trainer::{EpochSoFar, Evaluation};

/// What [`train`](super::run::train) reports while it runs (for progress bars and logs).
#[derive(Clone, Debug)]
pub enum Event {
    /// The run is set up: what it trains, where, on what data, into where.
    Start(RunInfo),
    /// An epoch (1-based) of `batches` batches over `samples` examples begins, or continues
    /// after a resume from a mid-epoch checkpoint: `trained` examples of it already trained,
    /// with the sums `so_far`.
    EpochStart {
        epoch: usize,
        epochs: usize,
        samples: usize,
        batches: usize,
        trained: usize,
        so_far: EpochSoFar,
    },
    /// A training batch: its size, mean loss and number of correct predictions (none in
    /// regression).
    Batch {
        samples: usize,
        loss: f64,
        correct: Option<usize>,
    },
    /// The run stops at step `step`, in or after epoch `epoch`: the validation result has not
    /// improved in `patience` evaluations, since step `best_step` (epoch `best_epoch`).
    StoppedEarly {
        epoch: usize,
        step: usize,
        best_epoch: usize,
        best_step: usize,
        patience: usize,
    },
    /// A validation within epoch `epoch` at step `step` (`--eval-every`), with `test` when it
    /// is the best so far.
    Evaluated {
        epoch: usize,
        step: usize,
        val: Evaluation,
        test: Option<Evaluation>,
    },
    /// Evaluation of a split ("val", "test") begins.
    Evaluating { split: &'static str },
    /// Epoch `epoch` of `epochs` ended (`test` when validation improved), `seconds` since the
    /// run began.
    EpochEnd {
        epoch: usize,
        epochs: usize,
        train: Evaluation,
        val: Evaluation,
        test: Option<Evaluation>,
        seconds: f64,
    },
}

/// What a run trains, where, on what, into where (the start banner).
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The classifier in a few words (layers, width, sequence layer).
    pub model: String,
    pub parameters: usize,
    /// `cpu`, `cuda:N`.
    pub device: String,
    /// Data-parallel shards (threads) per process, and processes (ranks).
    pub threads: usize,
    pub ranks: usize,
    pub task: String,
    /// Examples in the training, validation and test splits used.
    pub splits: [usize; 3],
    pub out: std::path::PathBuf,
    /// The optimiser step a resumed run continues from (0 for a new run).
    pub resumed_at: usize,
}

/// The display of one run's events.
pub struct Progress {
    /// Progress lines instead of a bar (the output is not a terminal), at most one per `every`.
    lines: Option<Duration>,
    bar: Option<ProgressBar>,
    last_line: Instant,
    epoch_start: Instant,
    /// The epoch (1-based), of how many, and its training examples.
    epoch: (usize, usize, usize),
    samples: usize,
    /// Of them, those trained before this process (a resumed epoch).
    trained_before: usize,
    loss_sum: f64,
    correct: usize,
}

impl Progress {
    /// A bar where standard error is a terminal, else a line every `every`.
    pub fn new(every: Duration) -> Self {
        Progress::with_lines((!std::io::stderr().is_terminal()).then_some(every))
    }

    /// Progress lines every `every` (`Some`), or a bar (`None`), whatever standard error is.
    pub fn with_lines(every: Option<Duration>) -> Self {
        Progress {
            lines: every,
            bar: None,
            last_line: Instant::now(),
            epoch_start: Instant::now(),
            epoch: (0, 0, 0),
            samples: 0,
            trained_before: 0,
            loss_sum: 0.0,
            correct: 0,
        }
    }

    pub fn show(&mut self, ev: Event) {
        match ev {
            Event::Start(info) => eprint!("{}", banner(&info)),
            Event::EpochStart {
                epoch,
                epochs,
                samples,
                trained,
                so_far,
                ..
            } => {
                (self.epoch, self.samples, self.trained_before) =
                    ((epoch, epochs, samples), trained, trained);
                (self.loss_sum, self.correct) = (so_far.loss_sum, so_far.correct);
                (self.epoch_start, self.last_line) = (Instant::now(), Instant::now());
                self.bar = self.lines.is_none().then(|| {
                    let bar = ProgressBar::new(samples as u64)
                        .with_prefix(format!("epoch {epoch}/{epochs}"));
                    bar.set_style(
                        ProgressStyle::with_template(
                            "{prefix} [{bar:30}] {pos}/{len} {msg} {per_sec} ETA {eta}",
                        )
                        .expect("a valid template")
                        .progress_chars("=> "),
                    );
                    bar.set_position(trained as u64);
                    bar.reset_eta();
                    bar
                });
            }
            Event::Batch {
                samples,
                loss,
                correct,
            } => {
                self.samples += samples;
                self.loss_sum += loss * samples as f64;
                self.correct += correct.unwrap_or(0);
                let so_far = Evaluation {
                    loss: self.loss_sum / self.samples as f64,
                    accuracy: correct.map(|_| self.correct as f64 / self.samples as f64),
                };
                if let Some(bar) = &self.bar {
                    bar.inc(samples as u64);
                    bar.set_message(so_far.brief());
                }
                if self
                    .lines
                    .is_some_and(|every| self.last_line.elapsed() >= every)
                {
                    self.last_line = Instant::now();
                    let (epoch, epochs, total) = self.epoch;
                    let now = self.samples - self.trained_before;
                    let rate = now as f64 / self.epoch_start.elapsed().as_secs_f64();
                    eprintln!(
                        "epoch {epoch}/{epochs}  {}/{total} samples  {}  {} samples/s",
                        self.samples,
                        so_far.brief(),
                        significant(rate)
                    );
                }
            }
            Event::StoppedEarly {
                epoch,
                step,
                best_epoch,
                best_step,
                patience,
            } => eprintln!(
                "stopping at step {step} (epoch {epoch}): no better validation result in \
                 {patience} evaluation{} (best: step {best_step}, epoch {best_epoch})",
                if patience == 1 { "" } else { "s" }
            ),
            Event::Evaluated {
                epoch,
                step,
                val,
                test,
            } => {
                let line = format!(
                    "step {step} (epoch {epoch})  val {}{}",
                    val.brief(),
                    best(test)
                );
                match &self.bar {
                    Some(bar) => bar.println(line),
                    None => eprintln!("{line}"),
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
                eprintln!(
                    "epoch {epoch:>3}/{epochs}  train {}  val {}{}  [{seconds:.0} s]",
                    train.brief(),
                    val.brief(),
                    best(test)
                );
                tracing::info!(
                    epoch,
                    train_loss = train.loss,
                    val_loss = val.loss,
                    seconds,
                    "epoch done"
                );
            }
        }
    }
}

/// The test result shown with a validation result that is the best so far.
fn best(test: Option<Evaluation>) -> String {
    let score = |t: Evaluation| match t.accuracy {
        Some(a) => format!("acc {a:.4}"),
        None => format!("mse {:.3e}", t.loss),
    };
    test.map(|t| format!("  test {} (new best val)", score(t)))
        .unwrap_or_default()
}

/// The start banner: the model and its size, where it runs, the data and the outputs.
pub fn banner(info: &RunInfo) -> String {
    let threads = match (info.threads, info.ranks) {
        (1, 1) => "1 thread".to_string(),
        (t, 1) => format!("{t} threads"),
        (t, r) => format!("{r} ranks of {t} thread{}", if t == 1 { "" } else { "s" }),
    };
    let [train, val, test] = info.splits;
    let resumed = match info.resumed_at {
        0 => String::new(),
        step => format!("; resuming from step {step}"),
    };
    format!(
        "model   {} ({} parameters)\ndevice  {}, {threads}\ntask    {}: {train} training, {val} \
         validation, {test} test examples\nout     {}{resumed}\n",
        info.model,
        info.parameters,
        info.device,
        info.task,
        info.out.display()
    )
}

/// `x` to three significant digits (a rate: 1234 → "1230", 45.67 → "45.7", 0.1234 → "0.123").
pub fn significant(x: f64) -> String {
    if !x.is_finite() || x == 0.0 {
        return format!("{x}");
    }
    let magnitude = x.abs().log10().floor() as i32;
    let decimals = (2 - magnitude).max(0) as usize;
    let scale = 10f64.powi(magnitude - 2);
    let rounded = if magnitude > 2 {
        (x / scale).round() * scale
    } else {
        x
    };
    format!("{rounded:.decimals$}")
}
