//! The PTX compiled from `kernels/*.cu` by build.rs, and small helpers for launching it on
//! candle's CUDA device (its stream, its custom-module cache).

use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaStorage, DType, Layout, Result, WithDType};

/// Module name under which candle caches `kernels/scan.cu`.
pub const SCAN_MODULE: &str = "myosotis_scan";
/// PTX of `kernels/scan.cu`.
pub const SCAN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/scan.ptx"));

/// Module name under which candle caches `kernels/tree_solve.cu`.
pub const TREE_MODULE: &str = "myosotis_tree_solve";
/// PTX of `kernels/tree_solve.cu`.
pub const TREE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/tree_solve.ptx"));

/// Element types our kernels are instantiated for.
pub trait CudaElem: CudaDType + DeviceRepr + WithDType {}
impl CudaElem for f32 {}
impl CudaElem for f64 {}
impl CudaElem for half::f16 {}
impl CudaElem for half::bf16 {}

/// Kernel-name suffix of a dtype (`scan_fwd_f32`, ...).
pub fn dtype_suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        dt => bail!("no CUDA kernel for dtype {dt:?}"),
    })
}

/// The contiguous region of a storage that a layout addresses, as a typed view.
pub fn slice_at<'a, T: CudaElem>((s, l): (&'a CudaStorage, &Layout)) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("internal error: CUDA kernel input is not contiguous")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}
