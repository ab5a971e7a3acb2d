//! Devices as the command line names them: `cpu`, `cuda`, `cuda:N`.

use candle_core::{Device, Result};

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

/// Keeps large freed blocks in the heap for reuse. By default glibc serves every tensor of
/// 32 MiB or more with a fresh `mmap`, so each op's output is page-faulted and zeroed by the
/// kernel again on every call; in a training or benchmark loop that costs more than the op.
pub fn keep_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
