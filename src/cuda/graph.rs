//! A training step captured once as a CUDA graph and replayed: the step's hundreds of launches
//! become one graph launch, so the GPU no longer waits on the host between kernels.
//!
//! What a replay may not contain: host-to-device copies of values that change between steps,
//! reads back to the host, and synchronisation. The step's small uploads that never change
//! (candle's dims and strides of strided ops, our launch tables) come from candle's cache of
//! uploads, filled by an eager run of the same step with the cache on; the values that change
//! (AdamW's hyper-parameter rows) are written into buffers that stay where they are before each
//! replay ([`crate::train::optim::Optimizer::prepare`]). Memory the step allocates is the
//! graph's, freed inside it (or, if a tensor outlives the captured run, at the next launch).

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use crate::nn::DropoutKey;
use crate::train::optim::Optimizer;

pub use crate::bench::{GraphMemory, GraphNodes};

/// A step captured as a CUDA graph.
pub struct StepGraph {
    graph: CudaGraph,
    pub nodes: GraphNodes,
}

impl StepGraph {
    /// Runs `step` once eagerly with candle's upload cache on (the caller prepares that run
    /// as an ordinary step), then once more under stream capture (which executes nothing) and
    /// instantiates the graph. `step` must issue the same work on the same buffers each time
    /// it runs: everything that changes between steps lives in device buffers written before
    /// each [`StepGraph::replay`]. Nor may it drop a tensor made before it (a device result
    /// kept from the last step): a graph frees only memory it allocated, and the driver
    /// refuses the capture with CUDA_ERROR_INVALID_VALUE.
    pub fn capture(dev: &CudaDevice, mut step: impl FnMut() -> Result<()>) -> Result<StepGraph> {
        let _cache = dev.enable_cuda_graph_htod_cache();
        step()?;
        dev.synchronize()?;
        let stream = dev.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let ran = step();
        let ended = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        if let Err(e) = ran {
            candle_core::bail!("the step failed under capture: {e}");
        }
        let Some(graph) = ended.w()? else {
            candle_core::bail!("the captured step launched nothing");
        };
        let nodes = count_nodes(&graph)?;
        super::count_captures(dev, 1)?;
        Ok(StepGraph { graph, nodes })
    }

    /// Launches the captured step on candle's stream (nothing waits for it).
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// The steps captured so far on this device (this `CudaDevice`: each made by
/// `Device::new_cuda` counts apart).
pub fn captures(dev: &CudaDevice) -> Result<u64> {
    super::count_captures(dev, 0)
}

/// The host's part of a step whose device part is captured (or being captured): AdamW's rows
/// ([`Optimizer::prepare`]) and the key of its dropout masks (their seed and step), written to
/// the device's key word ([`crate::cuda::set_dropout_key`]).
pub fn prepare_step(dev: &CudaDevice, opt: &mut Optimizer, dropout: DropoutKey) -> Result<()> {
    opt.prepare()?;
    crate::cuda::set_dropout_key(dev, dropout.step_key())
}

/// The graph's nodes by kind, and the bytes its allocation nodes ask for.
fn count_nodes(graph: &CudaGraph) -> Result<GraphNodes> {
    use sys::CUgraphNodeType as T;
    let g = graph.cu_graph();
    let mut n = 0usize;
    // SAFETY: a null array asks for the count only; then an array of that many.
    unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
        .result()
        .w()?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
        .result()
        .w()?;
    let mut out = GraphNodes::default();
    for node in nodes.into_iter().take(n) {
        let mut kind = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of this graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
            .result()
            .w()?;
        if kind == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
            let mut p = std::mem::MaybeUninit::<sys::CUDA_MEM_ALLOC_NODE_PARAMS>::uninit();
            // SAFETY: an allocation node of this graph; the call fills `p`.
            unsafe { sys::cuGraphMemAllocNodeGetParams(node, p.as_mut_ptr()) }
                .result()
                .w()?;
            out.allocated_bytes += unsafe { p.assume_init() }.bytesize;
        }
        let slot = match kind {
            T::CU_GRAPH_NODE_TYPE_KERNEL => &mut out.kernels,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => &mut out.copies,
            T::CU_GRAPH_NODE_TYPE_MEMSET => &mut out.memsets,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => &mut out.allocations,
            T::CU_GRAPH_NODE_TYPE_MEM_FREE => &mut out.frees,
            _ => &mut out.other,
        };
        *slot += 1;
    }
    Ok(out)
}

/// Device memory that captured graphs' allocations hold, in bytes: the most in use and the most
/// reserved since the last reset; `reset` first restarts both from now.
pub fn graph_memory(dev: &CudaDevice, reset: bool) -> Result<GraphMemory> {
    use sys::CUgraphMem_attribute as A;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().w()?;
    let device = ctx.cu_device();
    // SAFETY: the context's device; the values are cuuint64_t.
    let get = |attr: A| -> Result<usize> {
        let mut v = 0u64;
        unsafe { sys::cuDeviceGetGraphMemAttribute(device, attr, (&mut v as *mut u64).cast()) }
            .result()
            .w()?;
        Ok(v as usize)
    };
    if reset {
        for attr in [
            A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
            A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero = 0u64;
            unsafe {
                sys::cuDeviceSetGraphMemAttribute(device, attr, (&mut zero as *mut u64).cast())
            }
            .result()
            .w()?;
        }
    }
    Ok(GraphMemory {
        used_high: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
        reserved_high: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
    })
}
