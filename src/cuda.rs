//! The PTX compiled from `kernels/*.cu` by build.rs, and the execution of a [`LaunchPlan`] on
//! candle's CUDA device (its stream, its custom-module cache).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute_enum, CUfunction_attribute_enum,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::DeviceId;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor, WithDType};

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use crate::ops::plan::{pack_struct, DeviceLimits, KernelArg, LaunchPlan, Table};

mod address;
pub mod graph;

use address::{address, address_mut};

/// The words a struct argument is passed in: CUDA's 4 KiB of kernel parameters. The driver
/// copies as many bytes as the kernel's parameter has.
const STRUCT_WORDS: usize = 512;

/// A PTX module and the name candle caches it under.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    pub name: &'static str,
    pub ptx: &'static str,
}

/// `kernels/scan.cu`.
pub const SCAN: Module = Module {
    name: "myosotis_scan",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/scan.ptx")),
};

/// `kernels/tree_solve.cu`.
pub const TREE_SOLVE: Module = Module {
    name: "myosotis_tree_solve",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/tree_solve.ptx")),
};

/// `kernels/tree_lanes.cu`.
pub const TREE_LANES: Module = Module {
    name: "myosotis_tree_lanes",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/tree_lanes.ptx")),
};

/// `kernels/tree_sweep.cu`.
pub const TREE_SWEEP: Module = Module {
    name: "myosotis_tree_sweep",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/tree_sweep.ptx")),
};

/// `kernels/head_solve.cu`.
pub const HEAD_SOLVE: Module = Module {
    name: "myosotis_head_solve",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/head_solve.ptx")),
};

/// `kernels/adamw.cu`.
pub const ADAMW: Module = Module {
    name: "myosotis_adamw",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx")),
};

/// `kernels/dropout.cu`.
pub const DROPOUT: Module = Module {
    name: "myosotis_dropout",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/dropout.ptx")),
};

/// `kernels/gelu.cu`.
pub const GELU: Module = Module {
    name: "myosotis_gelu",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/gelu.ptx")),
};

/// `kernels/layer_norm.cu`.
pub const LAYER_NORM: Module = Module {
    name: "myosotis_layer_norm",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/layer_norm.ptx")),
};

/// `kernels/batch_norm.cu`.
pub const BATCH_NORM: Module = Module {
    name: "myosotis_batch_norm",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/batch_norm.ptx")),
};

/// `kernels/channel.cu`.
pub const CHANNEL: Module = Module {
    name: "myosotis_channel",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/channel.ptx")),
};

/// `kernels/s5_discretize.cu`.
pub const S5_DISCRETIZE: Module = Module {
    name: "myosotis_s5_discretize",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/s5_discretize.ptx")),
};

/// `kernels/s5_timed.cu`.
pub const S5_TIMED: Module = Module {
    name: "myosotis_s5_timed",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/s5_timed.ptx")),
};

/// `kernels/s5_readout.cu`.
pub const S5_READOUT: Module = Module {
    name: "myosotis_s5_readout",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/s5_readout.ptx")),
};

/// `kernels/epilogue.cu`.
pub const EPILOGUE: Module = Module {
    name: "myosotis_epilogue",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/epilogue.ptx")),
};

/// `kernels/masked_mean.cu`.
pub const MASKED_MEAN: Module = Module {
    name: "myosotis_masked_mean",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/masked_mean.ptx")),
};

/// `kernels/embedding.cu`.
pub const EMBEDDING: Module = Module {
    name: "myosotis_embedding",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/embedding.ptx")),
};

/// `kernels/gather.cu`.
pub const GATHER: Module = Module {
    name: "myosotis_gather",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/gather.ptx")),
};

/// `kernels/grad_norm.cu`.
pub const GRAD_NORM: Module = Module {
    name: "myosotis_grad_norm",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/grad_norm.ptx")),
};

/// `kernels/cross_entropy.cu`.
pub const CROSS_ENTROPY: Module = Module {
    name: "myosotis_cross_entropy",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/cross_entropy.ptx")),
};

/// Element types our kernels are instantiated for.
pub trait CudaElem: CudaDType + DeviceRepr + WithDType {}
impl CudaElem for f32 {}
impl CudaElem for f64 {}
impl CudaElem for half::f16 {}
impl CudaElem for half::bf16 {}

/// What the runtime keeps per device across launches, so that a launch allocates only its
/// outputs and never waits for the device.
struct DeviceState {
    /// Alive while the device is: every clone of a `CudaDevice`, and so every tensor on it,
    /// holds its cuBLAS handle, and this state holds none.
    device: Weak<candle_core::cuda_backend::cudarc::cublas::CudaBlas>,
    limits: DeviceLimits,
    /// Tables uploaded so far (a few per tree shape: training uses one or two trees).
    tables: HashMap<Table, CudaSlice<u32>>,
    /// One workspace, grown to the largest launch so far; launches on candle's one stream run
    /// in order, so they can share it.
    workspace: Option<CudaSlice<u8>>,
    /// The status words every launch with a status argument reports to (zeros: no error);
    /// read and cleared by [`take_status`].
    status: CudaSlice<i32>,
    /// The dropout key of the training step, which launches with [`KernelArg::DropoutKey`]
    /// read, written by [`set_dropout_key`].
    dropout_key: CudaSlice<u64>,
    /// Counts the times memory that launches point to (the workspace, the tables) was freed:
    /// a captured CUDA graph made before the last one must not be replayed ([`generation`]).
    generation: u64,
    /// Steps captured as CUDA graphs on this device ([`graph::captures`]).
    captures: u64,
}

/// Tables cached per device before the cache is cleared (a sweep over many tree shapes).
const MAX_TABLES: usize = 64;

static STATE: LazyLock<Mutex<HashMap<DeviceId, DeviceState>>> = LazyLock::new(Default::default);

/// Runs `f` on `dev`'s state, creating it on first use (and dropping then the states of
/// devices that are gone, with their workspaces).
fn with_state<R>(dev: &CudaDevice, f: impl FnOnce(&mut DeviceState) -> Result<R>) -> Result<R> {
    let mut all = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if !all.contains_key(&dev.id()) {
        all.retain(|_, s| s.device.strong_count() > 0);
    }
    let state = match all.entry(dev.id()) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(DeviceState {
            device: Arc::downgrade(&dev.cublas_handle()),
            limits: query_limits(dev)?,
            tables: HashMap::new(),
            workspace: None,
            status: dev.alloc_zeros::<i32>(2)?,
            dropout_key: dev.alloc_zeros::<u64>(1)?,
            generation: 0,
            captures: 0,
        }),
    };
    f(state)
}

/// The shared memory the device grants a block, its multiprocessors, and a workspace budget
/// of an eighth of the memory free now (at most [`DeviceLimits::MAX_WORKSPACE`]).
fn query_limits(dev: &CudaDevice) -> Result<DeviceLimits> {
    let opt_in = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .w()?;
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    let (free, _total) = dev.cuda_stream().context().mem_get_info().w()?;
    Ok(DeviceLimits {
        shared_per_block: (opt_in as usize).max(DeviceLimits::DEFAULT_SHARED),
        workspace_bytes: (free / 8).min(DeviceLimits::MAX_WORKSPACE),
        sms: (sms as usize).max(1),
    })
}

/// The compute capability this build's kernels (candle's and ours) were compiled for, as
/// `CUDA_COMPUTE_CAP` writes it (70, 90); 0 when the build did not say.
pub fn built_for() -> u32 {
    option_env!("MYO_CUDA_COMPUTE_CAP")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// The device's (free, total) memory in bytes.
pub fn memory_info(dev: &CudaDevice) -> Result<(usize, usize)> {
    dev.cuda_stream().context().mem_get_info().w()
}

/// Bytes in use in the device's default memory pool, the one candle's stream-ordered
/// allocations come from: (now, the most since the last reset); `reset_peak` first restarts the
/// most from now. Memory of captured CUDA graphs is not the pool's ([`graph::graph_memory`]).
pub fn pool_memory(dev: &CudaDevice, reset_peak: bool) -> Result<(usize, usize)> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use sys::CUmemPool_attribute as A;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().w()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: the context's device, and out-pointers to values of the types the attributes have
    // (cuuint64_t).
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .w()?;
    let get = |attr: A| -> Result<usize> {
        let mut v = 0u64;
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
            .result()
            .w()?;
        Ok(v as usize)
    };
    if reset_peak {
        let mut zero = 0u64;
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .w()?;
    }
    Ok((
        get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    ))
}

/// The device's compute capability (major, minor).
pub fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let major = ctx
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = ctx
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok((major, minor))
}

/// What the device grants a launch (queried once per device).
pub fn limits(dev: &CudaDevice) -> Result<DeviceLimits> {
    with_state(dev, |s| Ok(s.limits))
}

/// Reads the device's status words and clears them: (0, 0), or the first error a kernel
/// reported since the last call (for a tree solve: 1 + the node of a bad pivot, and for the
/// layer's head solve 1 + its head; 0 for a solve without heads). This waits for the device, so
/// callers do it where they read a result back anyway.
pub fn take_status(dev: &CudaDevice) -> Result<(i32, i32)> {
    // Under the lock only enqueued work: a snapshot of the word, then its reset (in stream
    // order, after every launch so far). The wait for the snapshot holds no lock.
    let snapshot = with_state(dev, |s| {
        let stream = dev.cuda_stream();
        let mut snapshot = unsafe { stream.alloc::<i32>(2) }.w()?;
        stream.memcpy_dtod(&s.status, &mut snapshot).w()?;
        stream.memset_zeros(&mut s.status).w()?;
        Ok(snapshot)
    })?;
    let words = dev.clone_dtoh(&snapshot)?;
    Ok((words[0], words[1]))
}

/// Writes a step's dropout key (`DropoutKey::step_key` in `crate::nn`) into the device's key
/// word, in stream order (after every launch so far, before every later one): the dropout masks
/// of the launches that read it ([`KernelArg::DropoutKey`]; see
/// [`crate::ops::epilogue::Dropout::key_word`]) are then those of that seed and step. Outside a
/// captured CUDA graph, so that each replay reads the key written before it.
pub fn set_dropout_key(dev: &CudaDevice, key: u64) -> Result<()> {
    with_state(dev, |s| {
        dev.cuda_stream()
            .memcpy_htod(&[key], &mut s.dropout_key)
            .w()?;
        Ok(())
    })
}

/// How many times the device's launches have had memory they pointed to freed: the workspace
/// replaced by a larger one, the tables cleared. A CUDA graph captured before the count changed
/// may point to freed memory and must be captured again.
pub fn generation(dev: &CudaDevice) -> Result<u64> {
    with_state(dev, |s| Ok(s.generation))
}

/// Adds `n` to the device's count of captured steps and returns it.
fn count_captures(dev: &CudaDevice, n: u64) -> Result<u64> {
    with_state(dev, |s| {
        s.captures += n;
        Ok(s.captures)
    })
}

/// Launches of our kernels so far, on every device (candle's own kernels are not counted).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many of our kernels [`launch`] has launched in this process.
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Executes `plan` on `dev` in `dtype` with `inputs` (contiguous, all of that dtype, in the
/// plan's input order): allocates the outputs, uploads the tables the device does not have
/// yet, grows the device's workspace if the plan needs more, opts in to large dynamic shared
/// memory and launches on candle's stream. Nothing is read back: a status the kernel sets
/// waits for [`take_status`].
pub fn launch(
    dev: &CudaDevice,
    module: Module,
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<CudaStorage>> {
    if let Some((s, _)) = inputs.iter().find(|(s, _)| s.dtype() != dtype) {
        bail!(
            "internal error: {} launched in {dtype:?} with a {:?} input",
            plan.kernel,
            s.dtype()
        )
    }
    launch_into(dev, module, plan, dtype, inputs)
}

/// [`launch`] with inputs of whatever dtypes the kernel reads (the op has checked them) and
/// outputs of `dtype`: a kernel that reads f16 gradients and writes f32 sums.
pub fn launch_into(
    dev: &CudaDevice,
    module: Module,
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<CudaStorage>> {
    match dtype {
        DType::F32 => run::<f32>(dev, module, plan, &mut [], inputs),
        DType::F64 => run::<f64>(dev, module, plan, &mut [], inputs),
        DType::F16 => run::<half::f16>(dev, module, plan, &mut [], inputs),
        DType::BF16 => run::<half::bf16>(dev, module, plan, &mut [], inputs),
        dt => bail!("{}: dtype {dt:?} is not supported on CUDA", plan.kernel),
    }
}

/// Executes `plan` as [`launch`] does, for an in-place op: `targets` are the tensors it
/// updates ([`KernelArg::Target`]; contiguous, distinct). Targets and inputs may be of
/// several dtypes (f32 parameters and their f16 compute copy): the op checks them against
/// what its kernel reads. Launches on the first target's device.
pub fn launch_in_place(
    module: Module,
    plan: &LaunchPlan,
    targets: &mut [(&mut CudaStorage, &Layout)],
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<()> {
    let Some((first, _)) = targets.first() else {
        bail!("internal error: {} updates nothing", plan.kernel)
    };
    let dev = first.device().clone();
    if !plan.outputs.is_empty() {
        bail!(
            "internal error: the in-place {} allocates outputs",
            plan.kernel
        )
    }
    run::<f32>(&dev, module, plan, targets, inputs)?;
    Ok(())
}

/// Launches `plan` with its inputs and targets passed by address (of any dtype) and its
/// outputs allocated as `T`.
fn run<T: CudaElem>(
    dev: &CudaDevice,
    module: Module,
    plan: &LaunchPlan,
    targets: &mut [(&mut CudaStorage, &Layout)],
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<CudaStorage>> {
    // SAFETY (outputs, workspace): the kernel writes every output element, and every workspace
    // element before reading it (the host harness runs the kernels on poisoned memory).
    let outputs: Vec<CudaSlice<T>> = plan
        .outputs
        .iter()
        .map(|&n| unsafe { dev.alloc::<T>(n) })
        .collect::<Result<_>>()?;
    let func = dev.get_or_load_custom_func(&plan.kernel, module.name, module.ptx)?;
    with_state(dev, |state| {
        // Under the lock: another thread's launch of this kernel with less shared memory
        // cannot lower the limit between this opt-in and this launch.
        if plan.opts_in_to_shared() {
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                plan.shared_bytes as i32,
            )
            .w()?;
        }
        if state.tables.len() + plan.tables.len() > MAX_TABLES {
            state.tables.clear();
            state.generation += 1;
        }
        for t in &plan.tables {
            if !state.tables.contains_key(t) {
                state.tables.insert(t.clone(), dev.clone_htod(&t[..])?);
            }
        }
        let have = state.workspace.as_ref().map_or(0, |w| w.len());
        if plan.workspace_bytes > have {
            state.workspace = None; // freed in stream order before the larger one is made
            state.workspace = Some(unsafe { dev.alloc::<u8>(plan.workspace_bytes) }?);
            state.generation += 1;
        }
        let DeviceState {
            tables,
            workspace,
            status,
            dropout_key,
            ..
        } = state;
        let null = 0usize;
        // The operands' addresses; their guards live until the launch is enqueued.
        let stream = dev.cuda_stream();
        let mut guards = Vec::new();
        let mut ins = Vec::with_capacity(inputs.len());
        for &(s, l) in inputs {
            let (p, g) = address(s, l, &stream, &plan.kernel)?;
            ins.push(p);
            guards.push(g);
        }
        // Each target is taken by the launch once.
        let mut outs: Vec<Option<u64>> = Vec::with_capacity(targets.len());
        for (s, l) in targets.iter_mut() {
            let (p, g) = address_mut(s, l, &stream, &plan.kernel)?;
            outs.push(Some(p));
            guards.push(g);
        }
        let mut target = |i: usize| match outs.get_mut(i).and_then(Option::take) {
            Some(p) => Ok(p),
            None => bail!("internal error: {} has no target {i}", plan.kernel),
        };
        let input = |i: usize| match ins.get(i) {
            Some(&p) => Ok(p),
            None => bail!("internal error: {} has no input {i}", plan.kernel),
        };
        // The structs passed by value and the addresses passed alone, made before the launch's
        // argument list borrows them.
        let mut structs: Vec<[u64; STRUCT_WORDS]> = Vec::new();
        let mut addrs: Vec<u64> = Vec::new();
        for arg in &plan.args {
            match arg {
                KernelArg::Input(i) => addrs.push(input(*i)?),
                KernelArg::Target(i) => addrs.push(target(*i)?),
                KernelArg::Struct(fields) => {
                    let words = pack_struct(fields, |f| match f {
                        KernelArg::Input(i) => input(*i),
                        KernelArg::Target(i) => target(*i),
                        other => bail!(
                            "internal error: {} passes {other:?} in a struct",
                            plan.kernel
                        ),
                    })?;
                    if words.len() > STRUCT_WORDS {
                        bail!(
                            "internal error: {} passes a struct of over 4 KiB",
                            plan.kernel
                        );
                    }
                    let mut w = [0u64; STRUCT_WORDS];
                    w[..words.len()].copy_from_slice(&words);
                    structs.push(w);
                }
                _ => {}
            }
        }
        let (mut structs, mut addrs) = (structs.iter(), addrs.iter());
        let mut b = func.builder();
        for arg in &plan.args {
            match arg {
                KernelArg::Input(_) | KernelArg::Target(_) => {
                    b.arg(addrs.next().expect("taken above"))
                }
                KernelArg::Output(i) => b.arg(&outputs[*i]),
                KernelArg::Table(i) => b.arg(&tables[&plan.tables[*i]]),
                KernelArg::Workspace => match workspace.as_ref() {
                    Some(w) => b.arg(w),
                    None => bail!("internal error: {} has no workspace", plan.kernel),
                },
                KernelArg::Null => b.arg(&null),
                KernelArg::Status => b.arg(&*status),
                KernelArg::DropoutKey => b.arg(&*dropout_key),
                KernelArg::I32(v) => b.arg(v),
                KernelArg::U64(v) => b.arg(v),
                KernelArg::Struct(_) => b.arg(structs.next().expect("packed above")),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (plan.grid[0], plan.grid[1], plan.grid[2]),
            block_dim: (plan.block[0], plan.block[1], plan.block[2]),
            shared_mem_bytes: plan.shared_bytes as u32,
        };
        unsafe { b.launch(cfg) }.w()?;
        drop(guards);
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(outputs
        .into_iter()
        .map(|s| CudaStorage::wrap_cuda_slice(s, dev.clone()))
        .collect())
}

/// The contiguous region of a storage that a layout addresses, as a typed view.
fn slice_at<'a, T: CudaElem>((s, l): (&'a CudaStorage, &Layout)) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("internal error: CUDA kernel input is not contiguous")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// A device-to-device copy of a contiguous f32 tensor into a buffer allocated once, on
/// candle's stream: the yardstick of the kernel benchmarks' bandwidth. A tensor copy allocates
/// its output each time, which made the measured bandwidth vary by 2.6× on large buffers.
pub struct BufferCopy {
    src: Tensor,
    dst: CudaSlice<f32>,
    dev: CudaDevice,
}

impl BufferCopy {
    pub fn new(dev: &CudaDevice, src: &Tensor) -> Result<Self> {
        let dst = dev.alloc_zeros::<f32>(src.elem_count())?;
        Ok(BufferCopy {
            src: src.contiguous()?,
            dst,
            dev: dev.clone(),
        })
    }

    /// Enqueues one copy (nothing waits for it).
    pub fn run(&mut self) -> Result<()> {
        let (storage, layout) = self.src.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            bail!("BufferCopy: the tensor is not on a CUDA device")
        };
        let view = slice_at::<f32>((s, layout))?;
        self.dev.cuda_stream().memcpy_dtod(&view, &mut self.dst).w()
    }
}

/// Executes `plan` on tensors: `inputs` (made contiguous; all of `dtype`, on one CUDA device)
/// in the plan's input order, and returns its outputs as tensors of `shapes` (no gradient).
pub fn launch_tensors(
    module: Module,
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[&Tensor],
    shapes: &[&[usize]],
) -> Result<Vec<Tensor>> {
    if let Some(t) = inputs.iter().find(|t| t.dtype() != dtype) {
        bail!(
            "internal error: {} launched in {dtype:?} with a {:?} input",
            plan.kernel,
            t.dtype()
        )
    }
    launch_tensors_into(module, plan, dtype, inputs, shapes)
}

/// [`launch_tensors`] with inputs of whatever dtypes the kernel reads (the op has checked
/// them) and outputs of `dtype` ([`launch_into`]).
pub fn launch_tensors_into(
    module: Module,
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[&Tensor],
    shapes: &[&[usize]],
) -> Result<Vec<Tensor>> {
    let inputs: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<_>>()?;
    let guards: Vec<_> = inputs.iter().map(|t| t.storage_and_layout()).collect();
    let mut storages = Vec::with_capacity(guards.len());
    for (s, l) in &guards {
        match &**s {
            candle_core::Storage::Cuda(s) => storages.push((s, *l)),
            _ => bail!("{}: every input must be on the CUDA device", plan.kernel),
        }
    }
    let Some((first, _)) = storages.first() else {
        bail!("internal error: {} launched without inputs", plan.kernel)
    };
    let dev = first.device().clone();
    let outs = launch_into(&dev, module, plan, dtype, &storages)?;
    Ok(outs
        .into_iter()
        .zip(shapes)
        .map(|(s, shape)| {
            Tensor::from_storage(
                candle_core::Storage::Cuda(s),
                *shape,
                candle_core::op::BackpropOp::none(),
                false,
            )
        })
        .collect())
}
