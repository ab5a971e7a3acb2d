//! The device address of an operand of any dtype: the launches pass inputs and targets by
//! address, so that one kernel may read f16 gradients and update f32 parameters.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// Runs `$body` with `$T` the element type of `$dtype` (a float dtype the kernels take).
macro_rules! with_elem {
    ($dtype:expr, $kernel:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            dt => bail!("{}: an operand of dtype {dt:?}", $kernel),
        }
    };
}

/// The first element of the contiguous region `l` addresses.
fn start(l: &Layout, kernel: &str) -> Result<usize> {
    match l.contiguous_offsets() {
        Some((start, _)) => Ok(start),
        None => bail!("internal error: {kernel} takes a non-contiguous tensor"),
    }
}

/// The address of the contiguous region `l` addresses in `s`, and the guard that records the
/// launch's read of it on `stream` when dropped (after the launch is enqueued).
pub(super) fn address<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    kernel: &str,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let start = start(l, kernel)?;
    with_elem!(s.dtype(), kernel, T => {
        let (p, g) = s.as_cuda_slice::<T>()?.device_ptr(stream);
        Ok((p + (start * std::mem::size_of::<T>()) as u64, g))
    })
}

/// [`address`] of a target, whose guard records the launch's write.
pub(super) fn address_mut<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    kernel: &str,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let start = start(l, kernel)?;
    with_elem!(s.dtype(), kernel, T => {
        let (p, g) = s.as_cuda_slice_mut::<T>()?.device_ptr_mut(stream);
        Ok((p + (start * std::mem::size_of::<T>()) as u64, g))
    })
}
