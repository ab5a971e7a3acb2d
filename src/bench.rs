//! Kernel benchmark harness behind `myo bench` and `benches/`.
//!
//! Kernels here are memory-bound, so each benchmark counts the bytes that must move (every
//! input read once, every output written once), reports them over the median time as effective
//! GB/s, measures the device's copy bandwidth on a buffer of the same size for comparison, and
//! times a plain-candle reference of the same computation on the same device.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use serde::Serialize;

use crate::ops::{linear_scan, linear_scan_backward, linear_scan_reference, ScanOptions};

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

/// Device copy bandwidth in GB/s (bytes read + written), measured with a copy of `elems` f32.
pub fn copy_bandwidth(device: &Device, elems: usize, repeats: usize) -> Result<f64> {
    let x = Tensor::rand(0f32, 1f32, elems, device)?;
    let t = time_median(device, 2, repeats, || x.copy().map(drop))?;
    Ok(2.0 * (elems * 4) as f64 / (t.median_ms * 1e-3) / 1e9)
}

/// Shape and options of a scan benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct ScanBench {
    pub batch: usize,
    pub channels: usize,
    pub len: usize,
    pub complex: bool,
    /// Gate shared across batch and length: shape (channels), as S5's Λ̄.
    pub shared_a: bool,
    /// Time forward + backward instead of forward alone.
    pub backward: bool,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
    /// Also time the plain-candle reference (a loop over the length; slow).
    pub reference: bool,
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.as_str())
}

/// What one benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub op: &'static str,
    pub device: String,
    pub config: ScanBench,
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
    pub speedup: Option<f64>,
}

impl ScanBench {
    fn opts(&self) -> ScanOptions {
        ScanOptions {
            complex: self.complex,
            reverse: false,
        }
    }

    fn width(&self) -> usize {
        if self.complex {
            2
        } else {
            1
        }
    }

    fn b_shape(&self) -> Vec<usize> {
        let mut s = vec![self.batch, self.len, self.channels];
        if self.complex {
            s.push(2);
        }
        s
    }

    fn a_shape(&self) -> Vec<usize> {
        if self.shared_a {
            let mut s = vec![self.channels];
            if self.complex {
                s.push(2);
            }
            s
        } else {
            self.b_shape()
        }
    }

    /// Bytes the timed unit must move at the least.
    /// Forward: read a, b, h_0; write h. Backward: read a, h, h_0 and ∂h; write ∂b, ∂a (per-batch
    /// partials when a is shared), ∂h_0.
    pub fn bytes(&self) -> u64 {
        let s = self.dtype.size_in_bytes() * self.width();
        let n = self.batch * self.len * self.channels * s;
        let state = self.batch * self.channels * s;
        let a = if self.shared_a { self.channels * s } else { n };
        let fwd = a + 2 * n + state;
        let da = if self.shared_a { state } else { n };
        let bwd = a + 3 * n + state + da + state;
        (if self.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Random inputs: b ~ U(-1, 1); a with modulus below 1 so the recurrence stays bounded.
    fn inputs(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let b = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.dtype)?;
        let (lo, hi) = if self.complex {
            (-0.7f32, 0.7)
        } else {
            (0.5, 0.99)
        };
        let a = Tensor::rand(lo, hi, self.a_shape(), device)?.to_dtype(self.dtype)?;
        Ok((a, b))
    }

    /// Runs the benchmark on `device`.
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        let (a, b) = self.inputs(device)?;
        let opts = self.opts();
        let g = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.dtype)?;
        let ours = time_median(device, self.warmup, self.repeats, || {
            let h = linear_scan(&a, &b, None, opts)?;
            if self.backward {
                linear_scan_backward(&a, &h, None, &g, opts)?;
            }
            Ok(())
        })?;
        let reference = if self.reference {
            let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
            // One warm-up on a GPU (kernel loading); none on the CPU, where it can take minutes.
            let warmup = usize::from(!device.is_cpu());
            let t = time_median(device, warmup, 3, || {
                let h = linear_scan_reference(va.as_tensor(), vb.as_tensor(), None, opts)?;
                if self.backward {
                    (h * &g)?.sum_all()?.backward()?;
                }
                Ok(())
            })?;
            Some(t.median_ms)
        } else {
            None
        };
        let bytes = self.bytes();
        let gbps = bytes as f64 / (ours.median_ms * 1e-3) / 1e9;
        let copy_gbps = copy_bandwidth(device, b.elem_count(), self.repeats)?;
        Ok(BenchReport {
            op: "scan",
            device: describe(device),
            config: self.clone(),
            median_ms: ours.median_ms,
            min_ms: ours.min_ms,
            repeats: ours.repeats,
            bytes,
            gbps,
            copy_gbps,
            pct_of_copy: 100.0 * gbps / copy_gbps,
            reference_median_ms: reference,
            speedup: reference.map(|r| r / ours.median_ms),
        })
    }
}

/// A short name for a device: `cpu` or `cuda:N`.
pub fn describe(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Parses `cpu`, `cuda` or `cuda:N` into a device, with a clear error when this build or this
/// machine has no CUDA.
pub fn parse_device(s: &str) -> Result<Device> {
    let ordinal = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => candle_core::bail!("unknown device '{s}': expected cpu, cuda or cuda:N"),
        },
    };
    if !cfg!(feature = "cuda") {
        candle_core::bail!(
            "device '{s}' asked for, but this build has no CUDA support: rebuild with `--features cuda` (see README, \"Building with CUDA\")"
        );
    }
    Device::new_cuda(ordinal).map_err(|e| {
        candle_core::Error::Msg(format!("cannot open CUDA device {ordinal} ('{s}'): {e}"))
    })
}
