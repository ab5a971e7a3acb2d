//! The CPU twin of `kernels/scan.cu`: the kernel's chunked algorithm (see the module docs of
//! `ops::scan`), one (batch, channel tile) per rayon task, AVX2 when the CPU has it.

use candle_core::{bail, CpuStorage, Device, Layout, Result, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{width, Dims, GateShape, ScanOp, CHUNK, CPU_TILE, SEGMENTS, SEG_LEN};
use crate::ops::value::{
    best_simd, contiguous, has_avx2, store_fence, streams, Complex, OutBuf, Re, SharedOut, Value,
};

impl ScanOp {
    pub(super) fn cpu_fwd_t<F: WithDType>(
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

    pub(super) fn cpu_bwd_t<F: WithDType>(
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
