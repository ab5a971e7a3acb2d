//! The PTX compiled from `kernels/*.cu` by build.rs, and the execution of a [`LaunchPlan`] on
//! candle's CUDA device (its stream, its custom-module cache).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute_enum, CUfunction_attribute_enum,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, WithDType};

use crate::ops::plan::{KernelArg, LaunchPlan, SharedMemory};

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

/// Element types our kernels are instantiated for.
pub trait CudaElem: CudaDType + DeviceRepr + WithDType {}
impl CudaElem for f32 {}
impl CudaElem for f64 {}
impl CudaElem for half::f16 {}
impl CudaElem for half::bf16 {}

/// The dynamic shared memory the device grants a block.
pub fn shared_memory(dev: &CudaDevice) -> Result<SharedMemory> {
    let opt_in = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .w()?;
    Ok(SharedMemory {
        per_block: (opt_in as usize).max(SharedMemory::DEFAULT),
    })
}

/// What a launch produced: its outputs (in the plan's order) and its status word (0 when the
/// plan has none).
pub struct Launched {
    pub outputs: Vec<CudaStorage>,
    pub status: i32,
}

/// Executes `plan` on `dev` with `inputs` (contiguous, all of one dtype, in the plan's input
/// order): allocates the outputs, tables, workspace and status word the plan names, opts in
/// to large dynamic shared memory, launches on candle's stream, and reads the status word back
/// when there is one.
pub fn launch(
    dev: &CudaDevice,
    module: Module,
    plan: &LaunchPlan,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Launched> {
    let Some(&(first, _)) = inputs.first() else {
        bail!("internal error: {} launched without inputs", plan.kernel)
    };
    match first.dtype() {
        DType::F32 => run::<f32>(dev, module, plan, inputs),
        DType::F64 => run::<f64>(dev, module, plan, inputs),
        DType::F16 => run::<half::f16>(dev, module, plan, inputs),
        DType::BF16 => run::<half::bf16>(dev, module, plan, inputs),
        dt => bail!("{}: dtype {dt:?} is not supported on CUDA", plan.kernel),
    }
}

fn run<T: CudaElem>(
    dev: &CudaDevice,
    module: Module,
    plan: &LaunchPlan,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Launched> {
    let views: Vec<CudaView<T>> = inputs.iter().map(|&i| slice_at(i)).collect::<Result<_>>()?;
    // SAFETY (outputs, workspace): the kernel writes every output element, and every workspace
    // element before reading it (the host harness runs the kernels on poisoned memory).
    let outputs: Vec<CudaSlice<T>> = plan
        .outputs
        .iter()
        .map(|&n| unsafe { dev.alloc::<T>(n) })
        .collect::<Result<_>>()?;
    let tables: Vec<CudaSlice<u32>> = plan
        .tables
        .iter()
        .map(|t| dev.clone_htod(t))
        .collect::<Result<_>>()?;
    let workspace = match plan.workspace_bytes {
        0 => None,
        n => Some(unsafe { dev.alloc::<u8>(n) }?),
    };
    let has_status = plan.args.contains(&KernelArg::Status);
    let status = if has_status {
        Some(dev.alloc_zeros::<i32>(1)?)
    } else {
        None
    };
    let null = 0usize;
    let func = dev.get_or_load_custom_func(&plan.kernel, module.name, module.ptx)?;
    if plan.opts_in_to_shared() {
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            plan.shared_bytes as i32,
        )
        .w()?;
    }
    let mut b = func.builder();
    for arg in &plan.args {
        match arg {
            KernelArg::Input(i) => b.arg(&views[*i]),
            KernelArg::Output(i) => b.arg(&outputs[*i]),
            KernelArg::Table(i) => b.arg(&tables[*i]),
            KernelArg::Workspace => match &workspace {
                Some(w) => b.arg(w),
                None => bail!("internal error: {} has no workspace", plan.kernel),
            },
            KernelArg::Null => b.arg(&null),
            KernelArg::Status => b.arg(status.as_ref().expect("allocated above")),
            KernelArg::I32(v) => b.arg(v),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: (plan.grid[0], plan.grid[1], plan.grid[2]),
        block_dim: (plan.block[0], plan.block[1], plan.block[2]),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    unsafe { b.launch(cfg) }.w()?;
    let status = match &status {
        Some(s) => dev.clone_dtoh(s)?[0],
        None => 0,
    };
    Ok(Launched {
        outputs: outputs
            .into_iter()
            .map(|s| CudaStorage::wrap_cuda_slice(s, dev.clone()))
            .collect(),
        status,
    })
}

/// The contiguous region of a storage that a layout addresses, as a typed view.
fn slice_at<'a, T: CudaElem>((s, l): (&'a CudaStorage, &Layout)) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("internal error: CUDA kernel input is not contiguous")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}
