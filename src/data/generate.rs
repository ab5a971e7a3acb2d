//! `myo data`: the built-in generators, each writing a dataset in its benchmark's own file
//! layout, which `--data-dir` then reads like the real one.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::listops::{self, ListOpsConfig, Splits};
use super::pendulum::{self, PendulumConfig};

/// What `myo data` writes.
#[derive(clap::Subcommand, Clone, Debug)]
pub enum Generate {
    /// Synthetic 28 × 28 digits in the MNIST IDX format, for the MNIST tasks without a
    /// download: class k is a bar (horizontal for k < 5, vertical otherwise) whose position is
    /// k, with jitter and noise.
    Strokes {
        /// The folder to write the IDX files into.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Training images.
        #[arg(long, default_value_t = 6_000)]
        train: usize,
        /// Test images.
        #[arg(long, default_value_t = 1_000)]
        test: usize,
        /// Seeds the jitter and noise.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// ListOps in the LRA TSV format (basic_{train,val,test}.tsv) from the built-in generator.
    Listops {
        /// The folder to write the TSV files into.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        #[command(flatten)]
        splits: Splits,
        #[command(flatten)]
        generator: ListOpsConfig,
    },
    /// The pendulum regression benchmark's file (pend_regression.npz: noisy 24 × 24 frames of
    /// a pendulum and the sine and cosine of its angle, with the frames' times), from a
    /// generator that follows the benchmark's.
    Pendulum {
        /// The folder to write pend_regression.npz into.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        #[command(flatten)]
        cfg: PendulumConfig,
    },
}

impl Generate {
    /// Writes the dataset; returns a line saying what and where.
    pub fn run(&self) -> Result<String> {
        Ok(match self {
            Generate::Strokes {
                out,
                train,
                test,
                seed,
            } => {
                super::strokes::write_dataset(out, *train, *test, *seed)
                    .context("generating the stroke digits")?;
                format!(
                    "Stroke digits written to {} ({train} / {test} images, MNIST IDX)",
                    out.display()
                )
            }
            Generate::Listops {
                out,
                splits,
                generator,
            } => {
                listops::write_dataset(out, generator, *splits).context("generating ListOps")?;
                format!(
                    "ListOps written to {} ({} / {} / {} examples)",
                    out.display(),
                    splits.train,
                    splits.val,
                    splits.test
                )
            }
            Generate::Pendulum { out, cfg } => {
                let path = pendulum::write_dataset(out, cfg).context("generating the pendulum")?;
                format!(
                    "Pendulum written to {} ({} / {} / {} sequences of {} frames)",
                    path.display(),
                    cfg.train,
                    cfg.valid,
                    cfg.test,
                    cfg.frames
                )
            }
        })
    }
}
