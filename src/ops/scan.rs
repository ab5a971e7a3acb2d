//! The linear scan h_t = a_t ⊙ h_{t-1} + b_t along the length axis of b: (batch, length, channels).
//!
//! * `a` is the full shape of b, or shared: (length, channels) or (channels), never broadcast
//!   in memory.
//! * Real, or complex with a trailing dimension of 2 (re, im).
//! * Forward or reverse direction (reverse: h_t = a_t ⊙ h_{t+1} + b_t), optional h_0.
//! * Exact backward by the op's own reverse scan (anchors.md):
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
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;

use super::value::{
    best_simd, contiguous, has_avx2, store_fence, streams, Complex, OutBuf, Re, SharedOut, Value,
};

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

    /// The code the CUDA kernels take.
    #[cfg(feature = "cuda")]
    fn code(self) -> i32 {
        match self {
            GateShape::Full => 0,
            GateShape::PerStep => 1,
            GateShape::PerChannel => 2,
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

    fn cpu_fwd_t<F: WithDType>(
        &self,
        b: (&CpuStorage, &Layout),
        a: (&CpuStorage, &Layout),
        h0: (&CpuStorage, &Layout),
    ) -> Result<CpuStorage> {
        let b = contiguous::<F>(b.0, b.1)?;
        let a = contiguous::<F>(a.0, a.1)?;
        let h0 = contiguous::<F>(h0.0, h0.1)?;
        let n = self.dims.batch * self.dims.len * self.dims.chans * width(self.opts);
        let mut out = OutBuf::new(n);
        if self.opts.complex {
            forward_cpu::<F, Complex<F>>(self, a, b, h0, out.ptr())
        } else {
            forward_cpu::<F, Re<F>>(self, a, b, h0, out.ptr())
        }
        // SAFETY: the scan writes every element of its output.
        Ok(F::to_cpu_storage_owned(unsafe { out.assume_filled() }))
    }

    fn cpu_bwd_t<F: WithDType>(
        &self,
        a: &Tensor,
        h: &Tensor,
        h0: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (sa, la) = a.storage_and_layout();
        let (sh, lh) = h.storage_and_layout();
        let (sh0, lh0) = h0.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sa), Storage::Cpu(sh), Storage::Cpu(sh0), Storage::Cpu(sg)) =
            (&*sa, &*sh, &*sh0, &*sg)
        else {
            bail!("linear_scan backward: tensors are not all on the CPU")
        };
        let bufs = BwdIn {
            a: contiguous::<F>(sa, la)?,
            h: contiguous::<F>(sh, lh)?,
            h0: contiguous::<F>(sh0, lh0)?,
            g: contiguous::<F>(sg, lg)?,
        };
        let da_shape = self.da_partial_shape();
        let mut db = OutBuf::new(g.elem_count());
        let mut da = OutBuf::new(da_shape.iter().product());
        let mut dh0 = OutBuf::new(h0.elem_count());
        let outs = (db.ptr(), da.ptr(), dh0.ptr());
        if self.opts.complex {
            backward_cpu::<F, Complex<F>>(self, &bufs, outs.0, outs.1, outs.2)
        } else {
            backward_cpu::<F, Re<F>>(self, &bufs, outs.0, outs.1, outs.2)
        }
        // SAFETY: the adjoint scan writes every element of all three outputs.
        let (db, da, dh0) =
            unsafe { (db.assume_filled(), da.assume_filled(), dh0.assume_filled()) };
        Ok((
            Tensor::from_vec(db, g.shape(), &Device::Cpu)?,
            Tensor::from_vec(da, da_shape, &Device::Cpu)?,
            Tensor::from_vec(dh0, h0.shape(), &Device::Cpu)?,
        ))
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

/// A tile's worth of per-lane values on the stack, aligned to a cache line: with the scalar
/// alignment alone, every other vector load or store of them straddled two lines (measured on
/// the (8, 4096, 256) scan forward: complex 9.2 → 7.4 ms, real ~5%).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes<V>([V; CPU_TILE]);

impl<V> std::ops::Deref for Lanes<V> {
    type Target = [V; CPU_TILE];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<V> std::ops::DerefMut for Lanes<V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// One (batch, channel-tile) sequence of the chunked scan, with the arithmetic of one CUDA
/// block and its segments taken in turn (see the module docs). `carry` holds each lane's
/// incoming state and is left holding the final state. For traversal step p, `gate(p)` is the
/// row of `lanes` gates (conjugated when `CONJ`; `None` for a zero gate) and `input(p)` the row
/// of inputs; `emit(p, states)` receives the row of states.
#[inline(always)]
fn chunked_scan<'s, F: WithDType, V: Value<F>, const CONJ: bool>(
    len: usize,
    lanes: usize,
    carry: &mut Lanes<V>,
    gate: impl Fn(usize) -> Option<&'s [F]>,
    input: impl Fn(usize) -> &'s [F],
    mut emit: impl FnMut(usize, &[V]),
) {
    let w = lanes * V::WIDTH;
    let (mut agg_a, mut agg_b) = (Lanes([V::one(); CPU_TILE]), Lanes([V::zero(); CPU_TILE]));
    let mut h = Lanes([V::zero(); CPU_TILE]);
    for c0 in (0..len).step_by(CHUNK) {
        for s in 0..SEGMENTS {
            let steps = (c0 + s * SEG_LEN).min(len)..(c0 + (s + 1) * SEG_LEN).min(len);
            // Pass 1: the segment's steps composed into one affine map h ↦ A h + B.
            let (aa, bb) = (&mut agg_a[..lanes], &mut agg_b[..lanes]);
            aa.fill(V::one());
            bb.fill(V::zero());
            for p in steps.clone() {
                let x = &input(p)[..w];
                match gate(p) {
                    Some(g) => {
                        let g = &g[..w];
                        for l in 0..lanes {
                            let gl = V::load_c::<CONJ>(g, l);
                            aa[l] = gl.mul(aa[l]);
                            bb[l] = gl.fma(bb[l], V::load(x, l));
                        }
                    }
                    None => {
                        for l in 0..lanes {
                            aa[l] = V::zero();
                            bb[l] = V::load(x, l);
                        }
                    }
                }
            }
            // The composition: the carry is this segment's incoming state; the map takes it
            // on to the next segment's.
            let h = &mut h[..lanes];
            for l in 0..lanes {
                h[l] = carry[l];
                carry[l] = aa[l].fma(carry[l], bb[l]);
            }
            // Pass 2: the segment re-runs its steps from its incoming state.
            for p in steps {
                let x = &input(p)[..w];
                match gate(p) {
                    Some(g) => {
                        let g = &g[..w];
                        for (l, hl) in h.iter_mut().enumerate() {
                            *hl = V::load_c::<CONJ>(g, l).fma(*hl, V::load(x, l));
                        }
                    }
                    None => {
                        for (l, hl) in h.iter_mut().enumerate() {
                            *hl = V::load(x, l);
                        }
                    }
                }
                emit(p, h);
            }
        }
    }
}

/// Runs `task(batch, first channel, lanes)` for every (batch, channel tile) in parallel.
fn for_each_tile(dims: Dims, task: impl Fn(usize, usize, usize) + Sync + Send) {
    let tiles = dims.chans.div_ceil(CPU_TILE);
    (0..dims.batch * tiles).into_par_iter().for_each(|i| {
        let (bi, d0) = (i / tiles, (i % tiles) * CPU_TILE);
        task(bi, d0, CPU_TILE.min(dims.chans - d0));
    });
}

/// Row accessors of one (batch, tile): element offsets of the row at time t.
#[derive(Clone, Copy)]
struct Rows {
    dims: Dims,
    gate: GateShape,
    reverse: bool,
    bi: usize,
    d0: usize,
}

impl Rows {
    fn new(op: &ScanOp, bi: usize, d0: usize) -> Self {
        Rows {
            dims: op.dims,
            gate: op.gate,
            reverse: op.opts.reverse,
            bi,
            d0,
        }
    }

    /// Time of scan step j (scan order is reversed time order for a reverse scan).
    #[inline(always)]
    fn time(&self, j: usize) -> usize {
        if self.reverse {
            self.dims.len - 1 - j
        } else {
            j
        }
    }
    /// Element offset of (bi, time of scan step j, d0) in a (batch, len, chans) tensor.
    #[inline(always)]
    fn elem(&self, j: usize) -> usize {
        (self.bi * self.dims.len + self.time(j)) * self.dims.chans + self.d0
    }
    /// Element offset of the gate row of scan step j.
    #[inline(always)]
    fn gate_elem(&self, j: usize) -> usize {
        self.gate.index(self.bi, self.time(j), self.d0, self.dims)
    }
    /// Element offset of (bi, d0) in a (batch, chans) state tensor.
    #[inline(always)]
    fn state_elem(&self) -> usize {
        self.bi * self.dims.chans + self.d0
    }
}

fn forward_cpu<F: WithDType, V: Value<F>>(
    op: &ScanOp,
    a: &[F],
    b: &[F],
    h0: &[F],
    out: SharedOut<F>,
) {
    let avx2 = has_avx2();
    for_each_tile(op.dims, |bi, d0, lanes| {
        best_simd!(
            avx2,
            forward_tile::<F, V>(op, a, b, h0, out, Tile { bi, d0, lanes })
        )
    });
}

/// One (batch, channel tile) of the CPU forward.
#[derive(Clone, Copy)]
struct Tile {
    bi: usize,
    d0: usize,
    lanes: usize,
}

#[inline(always)]
fn forward_tile<F: WithDType, V: Value<F>>(
    op: &ScanOp,
    a: &[F],
    b: &[F],
    h0: &[F],
    out: SharedOut<F>,
    Tile { bi, d0, lanes }: Tile,
) {
    let (dims, w) = (op.dims, V::WIDTH);
    let stream = streams::<F>(b.len());
    let r = Rows::new(op, bi, d0);
    let h0 = &h0[r.state_elem() * w..];
    let mut carry = Lanes(std::array::from_fn(|l| {
        if l < lanes {
            V::load(h0, l)
        } else {
            V::zero()
        }
    }));
    chunked_scan::<F, V, false>(
        dims.len,
        lanes,
        &mut carry,
        |p| Some(&a[r.gate_elem(p) * w..]),
        |p| &b[r.elem(p) * w..],
        |p, h| {
            // SAFETY: this task alone writes the elements of its (batch, tile).
            unsafe { out.write(r.elem(p) * w, h, stream) };
        },
    );
    store_fence();
}

struct BwdIn<'a, F> {
    a: &'a [F],
    h: &'a [F],
    h0: &'a [F],
    g: &'a [F],
}

/// The adjoint scan: traversal step p is scan step j = len-1-p, so the recurrence
/// λ_j = conj(a_{j+1}) λ_{j+1} + g_j runs through the same chunked scan with the gate shifted by
/// one step (zero at the last step); every emitted λ_j also yields ∂b_j = λ_j,
/// ∂a_j = λ_j ⊙ conj(h_{j-1}) (h_{-1} = h_0) and, at j = 0, ∂h_0 = conj(a_0) λ_0.
fn backward_cpu<F: WithDType, V: Value<F>>(
    op: &ScanOp,
    x: &BwdIn<F>,
    db: SharedOut<F>,
    da: SharedOut<F>,
    dh0: SharedOut<F>,
) {
    let avx2 = has_avx2();
    for_each_tile(op.dims, |bi, d0, lanes| {
        best_simd!(
            avx2,
            backward_tile::<F, V>(op, x, [db, da, dh0], Tile { bi, d0, lanes })
        )
    });
}

#[inline(always)]
fn backward_tile<F: WithDType, V: Value<F>>(
    op: &ScanOp,
    x: &BwdIn<F>,
    [db, da, dh0]: [SharedOut<F>; 3],
    Tile { bi, d0, lanes }: Tile,
) {
    let (w, len) = (V::WIDTH, op.dims.len);
    let stream = streams::<F>(x.g.len());
    let r = Rows::new(op, bi, d0);
    let mut carry = Lanes([V::zero(); CPU_TILE]);
    let mut da_sum = Lanes([V::zero(); CPU_TILE]);
    let mut da_row = Lanes([V::zero(); CPU_TILE]);
    chunked_scan::<F, V, true>(
        len,
        lanes,
        &mut carry,
        |p| (p > 0).then(|| &x.a[r.gate_elem(len - p) * w..]),
        |p| &x.g[r.elem(len - 1 - p) * w..],
        // Inlined, so that it is compiled with the AVX2 of the task that calls it.
        #[inline(always)]
        |p, lam| {
            let j = len - 1 - p;
            let row = r.elem(j);
            let h_prev = if j > 0 {
                &x.h[r.elem(j - 1) * w..]
            } else {
                &x.h0[r.state_elem() * w..]
            };
            let n = lam.len() * w;
            let h_prev = &h_prev[..n];
            // SAFETY (all rows below): this task alone writes the elements of its (batch, tile).
            unsafe { db.write(row * w, lam, stream) };
            if op.gate == GateShape::PerChannel {
                for (l, (sum, &lam_l)) in da_sum.iter_mut().zip(lam).enumerate() {
                    *sum = sum.add(lam_l.mul(V::load(h_prev, l).conj()));
                }
            } else {
                let da_row = &mut da_row[..lam.len()];
                for (l, (d, &lam_l)) in da_row.iter_mut().zip(lam).enumerate() {
                    *d = lam_l.mul(V::load(h_prev, l).conj());
                }
                unsafe { da.write(row * w, da_row, stream) };
            }
            if j == 0 {
                let a0 = &x.a[r.gate_elem(0) * w..][..n];
                let dh0 = unsafe { dh0.row(r.state_elem() * w, n) };
                for (l, &lam_l) in lam.iter().enumerate() {
                    V::put(dh0, l, V::load(a0, l).conj().mul(lam_l));
                }
            }
        },
    );
    store_fence();
    if op.gate == GateShape::PerChannel {
        // SAFETY: as above; the (batch, channel) partials belong to this task.
        let da = unsafe { da.row(r.state_elem() * w, lanes * w) };
        for (l, v) in da_sum.iter().enumerate().take(lanes) {
            V::put(da, l, *v);
        }
    }
}

/// The same recurrence written as a loop over the length of plain candle ops (complex
/// products spelled out on the re/im parts). It is differentiable by candle's autograd, and
/// serves as the benchmark baseline and as an independent check of the op's backward.
pub fn linear_scan_reference(
    a: &Tensor,
    b: &Tensor,
    h0: Option<&Tensor>,
    opts: ScanOptions,
) -> Result<Tensor> {
    let (dims, gate) = check_args(a, b, h0, opts)?;
    let mut h = match h0 {
        Some(h0) => h0.clone(),
        None => Tensor::zeros(state_shape(dims, opts), b.dtype(), b.device())?,
    };
    let mut states = Vec::with_capacity(dims.len);
    for p in 0..dims.len {
        let t = if opts.reverse { dims.len - 1 - p } else { p };
        let a_t = match gate {
            GateShape::Full => a.narrow(1, t, 1)?.squeeze(1)?,
            GateShape::PerStep => a.narrow(0, t, 1)?,
            GateShape::PerChannel => a.unsqueeze(0)?,
        };
        let b_t = b.narrow(1, t, 1)?.squeeze(1)?;
        let ah = if opts.complex {
            let part = |x: &Tensor, i| x.narrow(2, i, 1);
            let (ar, ai, hr, hi) = (part(&a_t, 0)?, part(&a_t, 1)?, part(&h, 0)?, part(&h, 1)?);
            let re = (ar.broadcast_mul(&hr)? - ai.broadcast_mul(&hi)?)?;
            let im = (ar.broadcast_mul(&hi)? + ai.broadcast_mul(&hr)?)?;
            Tensor::cat(&[re, im], 2)?
        } else {
            a_t.broadcast_mul(&h)?
        };
        h = (ah + b_t)?;
        states.push(h.clone());
    }
    if opts.reverse {
        states.reverse();
    }
    Tensor::stack(&states, 1)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launches of `kernels/scan.cu` on candle's CUDA stream.
    use super::{ScanOp, SEGMENTS, TILE};
    use crate::cuda::{dtype_suffix, slice_at, CudaElem, SCAN_MODULE, SCAN_PTX};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage, Tensor};

    fn launch_config(op: &ScanOp) -> Result<LaunchConfig> {
        let tiles = op.dims.chans.div_ceil(TILE);
        if op.dims.batch > 65_535 || tiles > i32::MAX as usize {
            bail!(
                "linear_scan: batch {} exceeds the CUDA grid limit of 65535",
                op.dims.batch
            );
        }
        Ok(LaunchConfig {
            grid_dim: (tiles as u32, op.dims.batch as u32, 1),
            block_dim: (TILE as u32, SEGMENTS as u32, 1),
            shared_mem_bytes: 0,
        })
    }

    fn int_args(op: &ScanOp) -> Result<[i32; 5]> {
        let n = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("linear_scan: {what} {v} is too large"))
            })
        };
        Ok([
            n(op.dims.batch, "batch")?,
            n(op.dims.len, "length")?,
            n(op.dims.chans, "channels")?,
            op.gate.code(),
            op.opts.reverse as i32,
        ])
    }

    fn name(stem: &str, op: &ScanOp, dtype: DType) -> Result<String> {
        let c = if op.opts.complex { "_c" } else { "" };
        Ok(format!("{stem}_{}{c}", dtype_suffix(dtype)?))
    }

    pub(super) fn forward(
        op: &ScanOp,
        b: (&CudaStorage, &Layout),
        a: (&CudaStorage, &Layout),
        h0: (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        fn run<T: CudaElem>(
            op: &ScanOp,
            b: (&CudaStorage, &Layout),
            a: (&CudaStorage, &Layout),
            h0: (&CudaStorage, &Layout),
        ) -> Result<CudaStorage> {
            let dev = b.0.device().clone();
            let (bs, as_, hs) = (slice_at::<T>(b)?, slice_at::<T>(a)?, slice_at::<T>(h0)?);
            let out = unsafe { dev.alloc::<T>(b.1.shape().elem_count()) }?;
            let func = dev.get_or_load_custom_func(
                &name("scan_fwd", op, T::DTYPE)?,
                SCAN_MODULE,
                SCAN_PTX,
            )?;
            let ints = int_args(op)?;
            let mut builder = func.builder();
            builder.arg(&as_).arg(&bs).arg(&hs).arg(&out);
            for v in &ints {
                builder.arg(v);
            }
            unsafe { builder.launch(launch_config(op)?) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match b.0.dtype() {
            DType::F32 => run::<f32>(op, b, a, h0),
            DType::F64 => run::<f64>(op, b, a, h0),
            DType::F16 => run::<half::f16>(op, b, a, h0),
            DType::BF16 => run::<half::bf16>(op, b, a, h0),
            dt => bail!("linear_scan: dtype {dt:?} is not supported on CUDA"),
        }
    }

    pub(super) fn backward(
        op: &ScanOp,
        a: &Tensor,
        h: &Tensor,
        h0: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        fn run<T: CudaElem>(
            op: &ScanOp,
            a: &Tensor,
            h: &Tensor,
            h0: &Tensor,
            g: &Tensor,
        ) -> Result<(Tensor, Tensor, Tensor)> {
            let (sa, la) = a.storage_and_layout();
            let (sh, lh) = h.storage_and_layout();
            let (sh0, lh0) = h0.storage_and_layout();
            let (sg, lg) = g.storage_and_layout();
            let (Storage::Cuda(sa), Storage::Cuda(sh), Storage::Cuda(sh0), Storage::Cuda(sg)) =
                (&*sa, &*sh, &*sh0, &*sg)
            else {
                bail!("linear_scan backward: tensors are not all on the same CUDA device")
            };
            let dev = sg.device().clone();
            let da_shape = op.da_partial_shape();
            let db = unsafe { dev.alloc::<T>(g.elem_count()) }?;
            let da = unsafe { dev.alloc::<T>(da_shape.iter().product()) }?;
            let dh0 = unsafe { dev.alloc::<T>(h0.elem_count()) }?;
            let func = dev.get_or_load_custom_func(
                &name("scan_bwd", op, T::DTYPE)?,
                SCAN_MODULE,
                SCAN_PTX,
            )?;
            let ints = int_args(op)?;
            let (va, vh, vh0, vg) = (
                slice_at::<T>((sa, la))?,
                slice_at::<T>((sh, lh))?,
                slice_at::<T>((sh0, lh0))?,
                slice_at::<T>((sg, lg))?,
            );
            let mut builder = func.builder();
            builder
                .arg(&va)
                .arg(&vh)
                .arg(&vh0)
                .arg(&vg)
                .arg(&db)
                .arg(&da)
                .arg(&dh0);
            for v in &ints {
                builder.arg(v);
            }
            unsafe { builder.launch(launch_config(op)?) }.w()?;
            let wrap = |s, shape: &[usize]| {
                Tensor::from_storage(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                    shape,
                    BackpropOp::none(),
                    false,
                )
            };
            Ok((
                wrap(db, g.dims()),
                wrap(da, &da_shape),
                wrap(dh0, h0.dims()),
            ))
        }
        match g.dtype() {
            DType::F32 => run::<f32>(op, a, h, h0, g),
            DType::F64 => run::<f64>(op, a, h, h0, g),
            DType::F16 => run::<half::f16>(op, a, h, h0, g),
            DType::BF16 => run::<half::bf16>(op, a, h, h0, g),
            dt => bail!("linear_scan backward: dtype {dt:?} is not supported on CUDA"),
        }
    }
}
