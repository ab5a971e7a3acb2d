//! The linear scan h_t = a_t ⊙ h_{t-1} + b_t along the length axis of b: (batch, length, channels).
//!
//! * `a` is the full shape of b, or shared: (length, channels) or (channels), never broadcast
//!   in memory.
//! * Real, or complex with a trailing dimension of 2 (re, im).
//! * Forward or reverse direction (reverse: h_t = a_t ⊙ h_{t+1} + b_t), optional h_0.
//! * Exact backward by the op's own reverse scan (docs/reference.md, "Gradients"):
//!   λ_t = g_t + conj(a_{t+1}) ⊙ λ_{t+1},  ∂b_t = λ_t,  ∂a_t = λ_t ⊙ conj(h_{t-1}),
//!   ∂h_0 = conj(a_first) ⊙ λ_first, with ∂a summed over the axes along which a is shared.
//!
//! # Algorithm (shared by the CUDA kernel and its CPU twin)
//! Work is split into independent sequences of one batch element and a tile of channels
//! ([`TILE`] per CUDA thread block; [`CPU_TILE`] per rayon task). The length is walked in chunks of
//! [`SEGMENTS`] × [`SEG_LEN`] steps with a carried state. Inside a chunk every segment first
//! reduces its steps to one affine map h ↦ A h + B (pass 1); the maps are composed in order onto
//! the carry, which gives each segment its incoming state; each segment then re-runs its steps
//! from that state and writes them (pass 2). On the GPU a segment is one warp (lane = channel,
//! so every load is a coalesced row of 32 channels) and the composition goes through shared
//! memory; each element is read once and written once, so the kernel is a single pass. The CPU
//! twin does the same arithmetic in the same order for every lane, but runs a chunk's segments
//! one after another (pass 1, the composition step, pass 2), so that pass 2 re-reads rows that
//! pass 1 has just brought into the L1 cache: the composition is a sequential fold over the
//! segments, so segment s needs only the maps of segments before it.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

mod cpu;
pub mod cuda;
mod reference;

pub use reference::linear_scan_reference;

/// Channels per sequence tile: one warp's lanes on the GPU.
pub const TILE: usize = 32;
/// Segments per chunk: warps per block on the GPU.
pub const SEGMENTS: usize = 8;
/// Steps per segment and chunk: values each GPU thread holds in registers.
pub const SEG_LEN: usize = 8;
/// Steps per chunk.
pub const CHUNK: usize = SEGMENTS * SEG_LEN;
/// Channels per rayon task on the CPU: several GPU tiles side by side, so that each step's row
/// is one contiguous run of memory (channels are independent; only the chunking along the
/// length is part of the algorithm).
pub const CPU_TILE: usize = 8 * TILE;

/// Options of [`linear_scan`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanOptions {
    /// Complex values: every tensor has a trailing dimension of 2 (re, im).
    pub complex: bool,
    /// Run from the last step to the first: h_t = a_t ⊙ h_{t+1} + b_t.
    pub reverse: bool,
}

/// The form of the gate `a`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateShape {
    /// (batch, length, channels): one gate per element.
    Full,
    /// (length, channels): shared across the batch.
    PerStep,
    /// (channels): shared across batch and length.
    PerChannel,
}

impl GateShape {
    /// Element index of a_t for batch `b` and channel `d`.
    #[inline(always)]
    fn index(self, b: usize, t: usize, d: usize, dims: Dims) -> usize {
        match self {
            GateShape::Full => (b * dims.len + t) * dims.chans + d,
            GateShape::PerStep => t * dims.chans + d,
            GateShape::PerChannel => d,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    batch: usize,
    len: usize,
    chans: usize,
}

/// h_t = a_t ⊙ h_{t-1} + b_t over the length axis of `b` (see the module docs for shapes).
///
/// `h0`, if given, is (batch, channels[, 2]); it defaults to zeros. Returns h with b's shape.
/// CPU computes f32 and f64 (f16/bf16 are computed in f32); CUDA computes f32 and f64, and
/// f16/bf16 with f32 accumulation.
pub fn linear_scan(
    a: &Tensor,
    b: &Tensor,
    h0: Option<&Tensor>,
    opts: ScanOptions,
) -> Result<Tensor> {
    let (dims, gate) = check_args(a, b, h0, opts)?;
    let dtype = b.dtype();
    if b.device().is_cpu() && matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        let h0 = h0.map(up).transpose()?;
        return linear_scan(&up(a)?, &up(b)?, h0.as_ref(), opts)?.to_dtype(dtype);
    }
    let h0 = match h0 {
        Some(h0) => h0.contiguous()?,
        None => Tensor::zeros(state_shape(dims, opts), dtype, b.device())?,
    };
    let op = ScanOp { dims, gate, opts };
    b.contiguous()?.apply_op3(&a.contiguous()?, &h0, op)
}

fn state_shape(dims: Dims, opts: ScanOptions) -> Vec<usize> {
    let mut s = vec![dims.batch, dims.chans];
    if opts.complex {
        s.push(2);
    }
    s
}

fn check_args(
    a: &Tensor,
    b: &Tensor,
    h0: Option<&Tensor>,
    opts: ScanOptions,
) -> Result<(Dims, GateShape)> {
    let kind = if opts.complex { "complex" } else { "real" };
    let tail: &[usize] = if opts.complex { &[2] } else { &[] };
    let with_tail = |d: &[usize]| [d, tail].concat();
    let bd = b.dims();
    if bd.len() != 3 + tail.len() || bd[3..] != *tail {
        bail!(
            "linear_scan: b must be (batch, length, channels{}) for a {kind} scan, got shape {bd:?}",
            if opts.complex { ", 2" } else { "" }
        );
    }
    let dims = Dims {
        batch: bd[0],
        len: bd[1],
        chans: bd[2],
    };
    if dims.batch == 0 || dims.len == 0 || dims.chans == 0 {
        bail!("linear_scan: b has an empty dimension, shape {bd:?}");
    }
    let ad = a.dims();
    let gate = if ad == bd {
        GateShape::Full
    } else if ad == with_tail(&[dims.len, dims.chans]) {
        GateShape::PerStep
    } else if ad == with_tail(&[dims.chans]) {
        GateShape::PerChannel
    } else {
        bail!(
            "linear_scan: a has shape {ad:?}; with b of shape {bd:?} it must be {bd:?}, {:?} or {:?}",
            with_tail(&[dims.len, dims.chans]),
            with_tail(&[dims.chans])
        );
    };
    let mut named = vec![("a", a)];
    if let Some(h0) = h0 {
        let want = with_tail(&[dims.batch, dims.chans]);
        if h0.dims() != want {
            bail!(
                "linear_scan: h0 has shape {:?}, expected (batch, channels{}) = {want:?}",
                h0.dims(),
                if opts.complex { ", 2" } else { "" }
            );
        }
        named.push(("h0", h0));
    }
    for (name, t) in named {
        if t.dtype() != b.dtype() {
            bail!(
                "linear_scan: {name} has dtype {:?} but b has {:?}",
                t.dtype(),
                b.dtype()
            );
        }
        if !t.device().same_device(b.device()) {
            bail!(
                "linear_scan: {name} is on {:?} but b is on {:?}",
                t.device().location(),
                b.device().location()
            );
        }
    }
    match (b.device(), b.dtype()) {
        (Device::Cpu, DType::F32 | DType::F64 | DType::F16 | DType::BF16) => {}
        (Device::Cuda(_), DType::F32 | DType::F64 | DType::F16 | DType::BF16) => {}
        (dev, dt) => bail!(
            "linear_scan: dtype {dt:?} on {:?} is not supported",
            dev.location()
        ),
    }
    Ok((dims, gate))
}

struct ScanOp {
    dims: Dims,
    gate: GateShape,
    opts: ScanOptions,
}

impl ScanOp {
    /// Shape of the per-batch ∂a partials the backward writes (summed over batch afterwards
    /// for the shared forms).
    fn da_partial_shape(&self) -> Vec<usize> {
        let Dims { batch, len, chans } = self.dims;
        let mut s = match self.gate {
            GateShape::Full | GateShape::PerStep => vec![batch, len, chans],
            GateShape::PerChannel => vec![batch, chans],
        };
        if self.opts.complex {
            s.push(2);
        }
        s
    }
}

fn width(opts: ScanOptions) -> usize {
    if opts.complex {
        2
    } else {
        1
    }
}

impl CustomOp3 for ScanOp {
    fn name(&self) -> &'static str {
        "linear-scan"
    }

    fn cpu_fwd(
        &self,
        sb: &CpuStorage,
        lb: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sh: &CpuStorage,
        lh: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = ((sb, lb), (sa, la), (sh, lh));
        let out = match sb.dtype() {
            DType::F32 => self.cpu_fwd_t::<f32>(args.0, args.1, args.2)?,
            DType::F64 => self.cpu_fwd_t::<f64>(args.0, args.1, args.2)?,
            dt => bail!("linear_scan: dtype {dt:?} is not supported on the CPU"),
        };
        Ok((out, lb.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
        sa: &candle_core::CudaStorage,
        la: &Layout,
        sh: &candle_core::CudaStorage,
        lh: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::forward(self, (sb, lb), (sa, la), (sh, lh))?;
        Ok((out, lb.shape().clone()))
    }

    fn bwd(
        &self,
        _b: &Tensor,
        a: &Tensor,
        h0: &Tensor,
        h: &Tensor,
        grad_h: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grads = self.backward(a, h, h0, grad_h)?;
        Ok((Some(grads.b), Some(grads.a), Some(grads.h0)))
    }
}

impl ScanOp {
    /// The adjoint scan on contiguous `a`, `h`, `h0` (as the forward saw them) and any `g`.
    fn backward(&self, a: &Tensor, h: &Tensor, h0: &Tensor, g: &Tensor) -> Result<ScanGrads> {
        let g = g.contiguous()?;
        let (db, da, dh0) = match g.device() {
            Device::Cpu => match g.dtype() {
                DType::F32 => self.cpu_bwd_t::<f32>(a, h, h0, &g)?,
                DType::F64 => self.cpu_bwd_t::<f64>(a, h, h0, &g)?,
                dt => bail!("linear_scan backward: dtype {dt:?} is not supported on the CPU"),
            },
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => cuda::backward(self, a, h, h0, &g)?,
            dev => bail!(
                "linear_scan backward: device {:?} is not supported",
                dev.location()
            ),
        };
        let da = match self.gate {
            GateShape::Full => da,
            GateShape::PerStep | GateShape::PerChannel => da.sum(0)?,
        };
        Ok(ScanGrads {
            b: db,
            a: da,
            h0: dh0,
        })
    }
}

/// Gradients of a loss with respect to the inputs of [`linear_scan`].
#[derive(Debug, Clone)]
pub struct ScanGrads {
    /// ∂L/∂b, shaped like b.
    pub b: Tensor,
    /// ∂L/∂a, shaped like a (summed over the axes along which a is shared).
    pub a: Tensor,
    /// ∂L/∂h_0, (batch, channels[, 2]).
    pub h0: Tensor,
}

/// The backward of [`linear_scan`] on its own: given the forward's inputs, its output `h` and
/// the upstream gradient `grad_h` = ∂L/∂h, returns ∂L/∂b, ∂L/∂a and ∂L/∂h_0 by one adjoint
/// scan. Autograd through [`linear_scan`] calls the same code; this entry point exists for
/// benchmarks and for callers that manage gradients themselves.
pub fn linear_scan_backward(
    a: &Tensor,
    h: &Tensor,
    h0: Option<&Tensor>,
    grad_h: &Tensor,
    opts: ScanOptions,
) -> Result<ScanGrads> {
    let (dims, gate) = check_args(a, h, h0, opts)?;
    if grad_h.dims() != h.dims() {
        bail!(
            "linear_scan_backward: grad_h has shape {:?} but h has {:?}",
            grad_h.dims(),
            h.dims()
        );
    }
    if grad_h.dtype() != h.dtype() || !grad_h.device().same_device(h.device()) {
        bail!("linear_scan_backward: grad_h must have h's dtype and device");
    }
    if h.device().is_cpu() && matches!(h.dtype(), DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        let h0 = h0.map(up).transpose()?;
        let g = linear_scan_backward(&up(a)?, &up(h)?, h0.as_ref(), &up(grad_h)?, opts)?;
        let down = |t: Tensor| t.to_dtype(h.dtype());
        return Ok(ScanGrads {
            b: down(g.b)?,
            a: down(g.a)?,
            h0: down(g.h0)?,
        });
    }
    let h0 = match h0 {
        Some(h0) => h0.contiguous()?,
        None => Tensor::zeros(state_shape(dims, opts), h.dtype(), h.device())?,
    };
    let op = ScanOp { dims, gate, opts };
    op.backward(&a.contiguous()?, &h.contiguous()?, &h0, grad_h)
}
