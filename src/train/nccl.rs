//! NCCL on candle's CUDA stream: the sum over ranks of a tensor on every rank's GPU, for the
//! gradients of data-parallel training ([`super::dist`]). The ranks meet through an id that
//! one of them makes ([`unique_id`]) and the others receive (over MPI in `myo train`).
//! Feature `nccl`, which links libnccl.

use anyhow::{bail, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::nccl::{Comm, Id, ReduceOp};

/// The bytes of a new NCCL id, to hand to every rank.
pub fn unique_id() -> Result<[u8; 128]> {
    let id = Id::new().map_err(|e| anyhow::anyhow!("NCCL: cannot make an id: {e:?}"))?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's NCCL communicator, on its device's stream.
pub struct Nccl {
    comm: Comm,
    dev: CudaDevice,
}

impl Nccl {
    /// Rank `rank` of `size` on `device`, meeting the others through `id` (from [`unique_id`]
    /// on one rank). Returns when every rank has joined.
    pub fn new(device: &Device, rank: usize, size: usize, id: [u8; 128]) -> Result<Nccl> {
        let Device::Cuda(dev) = device else {
            bail!("NCCL needs a CUDA device, not {device:?}");
        };
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(dev.cuda_stream(), rank, size, id)
            .map_err(|e| anyhow::anyhow!("NCCL: rank {rank} of {size} cannot join: {e:?}"))?;
        Ok(Nccl {
            comm,
            dev: dev.clone(),
        })
    }

    /// The element-wise sum over the ranks of `t` (f32 or f64, on this rank's device), the same
    /// on every rank; queued on the device's stream, the host does not wait.
    pub fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.contiguous()?;
        let out = {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(s) = &*storage else {
                bail!("NCCL: the tensor is not on a CUDA device");
            };
            let range = layout.start_offset()..layout.start_offset() + t.elem_count();
            match t.dtype() {
                DType::F32 => self.reduce(s.as_cuda_slice::<f32>()?.slice(range))?,
                DType::F64 => self.reduce(s.as_cuda_slice::<f64>()?.slice(range))?,
                d => bail!("NCCL: sums f32 and f64 tensors, not {d:?}"),
            }
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            t.shape().clone(),
            BackpropOp::none(),
            false,
        ))
    }

    fn reduce<T>(&self, src: cudarc::driver::CudaView<'_, T>) -> Result<CudaStorage>
    where
        T: cudarc::nccl::NcclType + candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
        T: cudarc::driver::ValidAsZeroBits,
    {
        let mut dst = self
            .dev
            .cuda_stream()
            .alloc_zeros::<T>(src.len())
            .context("NCCL: allocating the sum")?;
        self.comm
            .all_reduce(&src, &mut dst, &ReduceOp::Sum)
            .map_err(|e| anyhow::anyhow!("NCCL: all-reduce failed: {e:?}"))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, self.dev.clone()))
    }
}
