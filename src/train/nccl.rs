//! NCCL on candle's CUDA stream: the sum over ranks of a tensor on every rank's GPU, for the
//! gradients of data-parallel training ([`super::dist`]). The ranks meet through an id that
//! one of them makes ([`unique_id`]) and the others receive (over MPI in `myo train`).
//! Feature `nccl`, which links libnccl.
//!
//! The communicator is non-blocking, so that no NCCL call waits without end for a rank that
//! stalled: setting it up, queueing a sum and the sums' completion ([`Nccl::wait`]) are each
//! polled for at most the run's timeout, and past it the communicator is aborted (which also
//! stops its kernels still waiting on the device) and the rank fails with an error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{CudaEvent, DevicePtr};
use cudarc::nccl::sys::{self, ncclResult_t};
use cudarc::nccl::{Id, NcclType};

/// The bytes of a new NCCL id, to hand to every rank.
pub fn unique_id() -> Result<[u8; 128]> {
    let id = Id::new().map_err(|e| anyhow::anyhow!("NCCL: cannot make an id: {e:?}"))?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's NCCL communicator, on its device's stream.
pub struct Nccl {
    comm: sys::ncclComm_t,
    dev: CudaDevice,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Recorded on the stream after the last sum queued: done once every queued sum is.
    last: Mutex<Option<CudaEvent>>,
    /// Set once the communicator is aborted: it is not used, nor aborted, again.
    aborted: AtomicBool,
}

impl Nccl {
    /// Rank `rank` of `size` on `device`, meeting the others through `id` (from [`unique_id`]
    /// on one rank). Returns when every rank has joined, or fails once `timeout` has passed
    /// without them.
    pub fn new(
        device: &Device,
        rank: usize,
        size: usize,
        id: [u8; 128],
        timeout: Duration,
    ) -> Result<Nccl> {
        let Device::Cuda(dev) = device else {
            bail!("NCCL needs a CUDA device, not {device:?}");
        };
        let (Ok(nranks), Ok(me)) = (i32::try_from(size), i32::try_from(rank)) else {
            bail!("NCCL: rank {rank} of {size} is out of range");
        };
        dev.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("NCCL: cannot use the device: {e:?}"))?;
        let mut config = non_blocking_config();
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for the call; NCCL copies the config.
        let started =
            unsafe { sys::ncclCommInitRankConfig(&mut comm, nranks, id, me, &mut config) };
        if comm.is_null() {
            bail!(
                "NCCL: rank {rank} of {size} cannot join: {}",
                describe(started)
            );
        }
        let nccl = Nccl {
            comm,
            dev: dev.clone(),
            rank,
            size,
            timeout,
            last: Mutex::new(None),
            aborted: AtomicBool::new(false),
        };
        // On failure `nccl` is dropped, which aborts the half-made communicator.
        nccl.settle(started, "joining the other ranks")?;
        Ok(nccl)
    }

    /// The element-wise sum over the ranks of `t` (f32 or f64, on this rank's device), the same
    /// on every rank; queued on the device's stream, the host does not wait for it.
    pub fn sum(&self, t: &Tensor) -> Result<Tensor> {
        self.usable()?;
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

    /// Waits until every sum queued so far has finished on the device, at most the timeout
    /// (counted from now): past it, or on an error NCCL reports meanwhile (a rank that died, a
    /// network failure), the communicator is aborted and the rank fails.
    pub fn wait(&self) -> Result<()> {
        self.usable()?;
        let last = self
            .last
            .lock()
            .map_err(|_| anyhow::anyhow!("NCCL: state poisoned"))?;
        let Some(event) = last.as_ref() else {
            return Ok(());
        };
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => bail!("NCCL: rank {}: the device failed: {e:?}", self.rank),
            }
            let state = self.async_state();
            if state != ncclResult_t::ncclSuccess && state != ncclResult_t::ncclInProgress {
                self.abort();
                bail!(
                    "NCCL: rank {}: a sum failed: {}",
                    self.rank,
                    describe(state)
                );
            }
            if start.elapsed() > self.timeout {
                self.abort();
                bail!(
                    "NCCL: rank {} of {}: a sum did not finish within {} s (another rank stopped \
                     or cannot be reached)",
                    self.rank,
                    self.size,
                    self.timeout.as_secs_f64()
                );
            }
            pause(start);
        }
    }

    fn reduce<T>(&self, src: cudarc::driver::CudaView<'_, T>) -> Result<CudaStorage>
    where
        T: NcclType + candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
        T: cudarc::driver::ValidAsZeroBits,
    {
        let stream = self.dev.cuda_stream();
        let mut dst = stream
            .alloc_zeros::<T>(src.len())
            .context("NCCL: allocating the sum")?;
        {
            let (from, _read) = src.device_ptr(&stream);
            let (to, _write) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &stream);
            // SAFETY: both buffers hold `src.len()` values of T on this communicator's device,
            // and stay alive on the stream until the sum is done (candle frees on the stream).
            let queued = unsafe {
                sys::ncclAllReduce(
                    from as *const _,
                    to as *mut _,
                    src.len(),
                    T::as_nccl_type(),
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            };
            self.settle(queued, "queueing a sum")?;
        }
        let event = stream
            .record_event(None)
            .map_err(|e| anyhow::anyhow!("NCCL: recording the sum: {e:?}"))?;
        *self
            .last
            .lock()
            .map_err(|_| anyhow::anyhow!("NCCL: state poisoned"))? = Some(event);
        Ok(CudaStorage::wrap_cuda_slice(dst, self.dev.clone()))
    }

    /// Polls a call that returned `result` until the communicator has done it, at most the
    /// timeout; past it, or on an error, aborts the communicator and fails naming `what`.
    fn settle(&self, result: ncclResult_t, what: &str) -> Result<()> {
        let start = Instant::now();
        let mut state = result;
        while state == ncclResult_t::ncclInProgress {
            if start.elapsed() > self.timeout {
                self.abort();
                bail!(
                    "NCCL: rank {} of {}: no answer from the other ranks for {} s while {what} \
                     (a rank stopped or cannot be reached)",
                    self.rank,
                    self.size,
                    self.timeout.as_secs_f64()
                );
            }
            pause(start);
            state = self.async_state();
        }
        if state != ncclResult_t::ncclSuccess {
            self.abort();
            bail!(
                "NCCL: rank {} of {}: failed while {what}: {}",
                self.rank,
                self.size,
                describe(state)
            );
        }
        Ok(())
    }

    /// The communicator's state: in progress, success, or the error of an operation.
    fn async_state(&self) -> ncclResult_t {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is valid until dropped; `state` is written once.
        let called = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if called != ncclResult_t::ncclSuccess {
            return called;
        }
        state
    }

    /// Fails once the communicator has been aborted.
    fn usable(&self) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            bail!(
                "NCCL: rank {}: the communicator was aborted after an error",
                self.rank
            );
        }
        Ok(())
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: aborting is allowed in any state, also while the communicator sets up,
            // and happens once: the handle is not used afterwards (see `usable`).
            unsafe { sys::ncclCommAbort(self.comm) };
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // Every sum the trainer queued has been read back by now (or the run failed): nothing
        // is left to finish, and aborting cannot wait on a rank that stopped.
        self.abort();
    }
}

/// NCCL's default configuration (every field unset), except that calls return at once and
/// report progress through `ncclCommGetAsyncError`.
fn non_blocking_config() -> sys::ncclConfig_t {
    const UNSET: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // The layout of NCCL 2.30's config; a library of another version reads the fields it
        // knows (the size says how many there are).
        version: 2 * 10_000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNSET,
        minCTAs: UNSET,
        maxCTAs: UNSET,
        netName: std::ptr::null(),
        splitShare: UNSET,
        trafficClass: UNSET,
        commName: std::ptr::null(),
        collnetEnable: UNSET,
        CTAPolicy: UNSET,
        shrinkShare: UNSET,
        nvlsCTAs: UNSET,
        nChannelsPerNetPeer: UNSET,
        nvlinkCentricSched: UNSET,
        graphUsageMode: UNSET,
        numRmaCtx: UNSET,
        maxP2pPeers: UNSET,
    }
}

/// NCCL's words for a result.
fn describe(result: ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string for every result value.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(result)) };
    format!("{} ({result:?})", text.to_string_lossy())
}

/// Between two polls: spin for the first millisecond, then sleep briefly.
fn pause(start: Instant) {
    if start.elapsed() > Duration::from_millis(1) {
        std::thread::sleep(Duration::from_micros(200));
    }
}
