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

/// A CUDA device's compute capability (major, minor); `None` for other devices.
pub fn compute_capability(device: &Device) -> Result<Option<(i32, i32)>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => crate::cuda::compute_capability(dev).map(Some),
        _ => Ok(None),
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
            "device '{s}' asked for, but this build has no CUDA support: rebuild with `--features cuda` (see the README's \"Install\")"
        );
    }
    Device::new_cuda(ordinal).map_err(|e| {
        candle_core::Error::Msg(format!("cannot open CUDA device {ordinal} ('{s}'): {e}"))
    })
}

/// The CUDA ordinal of a rank that is `local_rank`-th among its machine's ranks, when the
/// process sees `visible` GPUs: its own when every rank sees them all (`mpirun` on a machine of
/// GPUs), 0 when each rank is bound to one (`srun --gpus-per-task=1`, or a launcher that sets
/// `CUDA_VISIBLE_DEVICES` per rank). More ranks than visible GPUs is an error: ranks sharing a
/// GPU would halve its speed unannounced.
pub fn rank_ordinal(local_rank: usize, visible: usize) -> Result<usize> {
    match visible {
        0 => candle_core::bail!("--device cuda: this process sees no CUDA device"),
        1 => Ok(0),
        v if local_rank < v => Ok(local_rank),
        v => candle_core::bail!(
            "--device cuda: this machine's rank {local_rank} has no GPU of its own ({v} visible \
             to each rank, and ranks 0..{v} take them); start at most {v} ranks per machine, or \
             give each rank one GPU (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)"
        ),
    }
}

/// The device of a rank that is `local_rank`-th among its machine's ranks (see
/// [`rank_ordinal`]) for `--device cuda`.
pub fn rank_cuda_device(local_rank: usize) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let visible = CudaContext::device_count().map_err(|e| {
            candle_core::Error::Msg(format!("--device cuda: cannot count the CUDA devices: {e}"))
        })?;
        let ordinal = rank_ordinal(local_rank, visible.max(0) as usize)?;
        parse_device(&format!("cuda:{ordinal}"))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = local_rank;
        parse_device("cuda")
    }
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
