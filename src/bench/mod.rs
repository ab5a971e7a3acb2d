//! Kernel and training-step benchmarks behind `myo bench` and `benches/`.
//!
//! Kernels here are memory-bound, so each benchmark counts the bytes that must move (every
//! input read once, every output written once), reports them over the median time as effective
//! GB/s, measures the device's copy bandwidth on a buffer of the same size for comparison, and
//! times a plain-candle reference of the same computation on the same device.

use crate::device::describe;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use serde::Serialize;

use crate::nn::{ClassifierConfig, DropoutKey, EncoderConfig, Mode, SequenceClassifier};

use crate::ops::{
    head_solve_skew, head_solve_skew_backward, linear_scan, linear_scan_backward,
    linear_scan_reference, tree_solve, tree_solve_backward, tree_solve_reference, ScanOptions,
    TreeLayout, TreeSolveOptions,
};
use crate::train::progress::significant;
use crate::tree::Tree;

mod captured;
mod kernels;
pub mod memory;
mod step;

pub use captured::{Captured, GraphMemory, GraphNodes};
pub use kernels::{HeadBench, ScanBench, TreeBench};
pub use step::{StepArgs, StepBench, StepMemory, StepReport};

/// Median and minimum of repeated timings, in milliseconds per call.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Timing {
    pub median_ms: f64,
    pub min_ms: f64,
    /// Timed samples.
    pub repeats: usize,
    /// Calls per sample (short calls are batched between device synchronisations).
    pub calls_per_sample: usize,
}

/// Times `f`: `warmup` untimed calls, then `repeats` samples. Each sample runs `f` enough times
/// to last about 20 ms and synchronises the device before reading the clock, so asynchronous
/// GPU work is counted and launch gaps are amortised. A call that takes over a second is timed
/// once (the slow references).
pub fn time_median(
    device: &Device,
    warmup: usize,
    repeats: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    for _ in 0..warmup {
        f()?;
    }
    device.synchronize()?;
    let probe = Instant::now();
    f()?;
    device.synchronize()?;
    let once = probe.elapsed().as_secs_f64();
    if once > 1.0 {
        return Ok(Timing {
            median_ms: once * 1e3,
            min_ms: once * 1e3,
            repeats: 1,
            calls_per_sample: 1,
        });
    }
    let calls = ((0.02 / once.max(1e-9)) as usize).clamp(1, 1000);
    let mut samples = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        device.synchronize()?;
        samples.push(start.elapsed().as_secs_f64() * 1e3 / calls as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Timing {
        median_ms: samples[samples.len() / 2],
        min_ms: samples[0],
        repeats: samples.len(),
        calls_per_sample: calls,
    })
}

/// Device copy bandwidth in GB/s (bytes read + written), measured with a copy of `elems` f32:
/// on CUDA a device-to-device copy into a buffer allocated once, on the CPU a tensor copy.
pub fn copy_bandwidth(device: &Device, elems: usize, repeats: usize) -> Result<f64> {
    let x = Tensor::rand(0f32, 1f32, elems, device)?;
    let t = match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let mut copy = crate::cuda::BufferCopy::new(dev, &x)?;
            time_median(device, 2, repeats, || copy.run())?
        }
        _ => time_median(device, 2, repeats, || x.copy().map(drop))?,
    };
    Ok(2.0 * (elems * 4) as f64 / (t.median_ms * 1e-3) / 1e9)
}

/// What every kernel benchmark takes besides its shape.
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct TimingArgs {
    /// Time forward + backward instead of forward alone.
    #[arg(long)]
    pub backward: bool,
    /// f32, f64, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = parse_float_dtype)]
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    /// Untimed calls first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed samples (the median is reported).
    #[arg(long, default_value_t = 15)]
    pub repeats: usize,
    /// Also time the plain-candle reference (a loop over the length or the levels; slow).
    /// `--no-reference` skips it.
    #[arg(long = "no-reference", action = clap::ArgAction::SetFalse)]
    pub reference: bool,
}

/// `f32`, `f64`, `f16` or `bf16`.
pub fn parse_float_dtype(s: &str) -> std::result::Result<DType, String> {
    Ok(match s {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        _ => return Err(format!("'{s}': expected f32, f64, f16 or bf16")),
    })
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.as_str())
}

/// What one benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub op: &'static str,
    pub device: String,
    /// The shape and options in one line.
    pub shape: String,
    pub backward: bool,
    pub config: serde_json::Value,
    pub median_ms: f64,
    pub min_ms: f64,
    pub repeats: usize,
    /// Bytes that must move per timed call.
    pub bytes: u64,
    /// Effective bandwidth: bytes / median time.
    pub gbps: f64,
    /// Device copy bandwidth measured on a buffer the size of b (read + write).
    pub copy_gbps: f64,
    /// gbps / copy_gbps × 100.
    pub pct_of_copy: f64,
    pub reference_median_ms: Option<f64>,
    /// What the reference is.
    pub reference: &'static str,
    pub speedup: Option<f64>,
    /// Why no reference was timed, when none was.
    pub reference_note: Option<String>,
}

/// What a benchmark hands to [`BenchReport::new`].
struct Measured {
    ours: Timing,
    bytes: u64,
    reference_ms: Option<f64>,
    /// What the reference is.
    reference: &'static str,
    reference_note: Option<String>,
    /// Elements (f32) of the copy used to measure the copy bandwidth.
    copy_elems: usize,
}

impl BenchReport {
    fn new<C: Serialize>(
        op: &'static str,
        device: &Device,
        shape: String,
        backward: bool,
        config: &C,
        repeats: usize,
        m: Measured,
    ) -> Result<BenchReport> {
        let gbps = m.bytes as f64 / (m.ours.median_ms * 1e-3) / 1e9;
        let copy_gbps = copy_bandwidth(device, m.copy_elems, repeats)?;
        Ok(BenchReport {
            op,
            device: describe(device),
            shape,
            backward,
            config: serde_json::to_value(config).map_err(candle_core::Error::wrap)?,
            median_ms: m.ours.median_ms,
            min_ms: m.ours.min_ms,
            repeats: m.ours.repeats,
            bytes: m.bytes,
            gbps,
            copy_gbps,
            pct_of_copy: 100.0 * gbps / copy_gbps,
            reference_median_ms: m.reference_ms,
            speedup: m.reference_ms.map(|r| r / m.ours.median_ms),
            reference: m.reference,
            reference_note: m.reference_note,
        })
    }
}

/// Times the plain-candle reference `f` (already differentiable) on `device`: one warm-up on a
/// GPU (kernel loading), none on the CPU, where one call can take minutes.
fn time_reference(device: &Device, f: impl FnMut() -> Result<()>) -> Result<f64> {
    let warmup = usize::from(!device.is_cpu());
    Ok(time_median(device, warmup, 3, f)?.median_ms)
}

impl std::fmt::Display for BenchReport {
    /// The report as `myo bench` prints it: the op, then our time and bandwidth, then the
    /// reference's time and the speed-up.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pass = if self.backward {
            "forward+backward"
        } else {
            "forward"
        };
        writeln!(
            f,
            "{} {pass}  device={}  {}",
            self.op, self.device, self.shape
        )?;
        let g = significant;
        writeln!(
            f,
            "  myosotis   median {:>8} ms  (min {}, {} samples)  {:>6} GB/s = {}% of copy ({} GB/s)",
            g(self.median_ms),
            g(self.min_ms),
            self.repeats,
            g(self.gbps),
            g(self.pct_of_copy),
            g(self.copy_gbps)
        )?;
        if let (Some(ms), Some(s)) = (self.reference_median_ms, self.speedup) {
            writeln!(
                f,
                "  reference  median {:>8} ms  ({})  speed-up {}x",
                g(ms),
                self.reference,
                g(s)
            )?;
        }
        if let Some(note) = &self.reference_note {
            writeln!(f, "  reference  not timed: {note}")?;
        }
        Ok(())
    }
}
