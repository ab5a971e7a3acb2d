//! An embedding table read at token ids, forward and backward as one op each on the CPU and on
//! CUDA (`kernels/embedding.cu`, whose twin is the arithmetic here): for W (vocab, h),
//!
//!   y[n, :] = W[id_n, :],   ∂W[v, :] = Σ_{n : id_n = v} ∂y[n, :].
//!
//! candle's `index_select` has the same forward, but its gradient is `index_add`, whose CUDA
//! kernel gives each of the h columns one thread that walks every id in turn: a chain of
//! batch × length dependent read-modify-writes, most of a small model's training step on a
//! GPU. Here each (vocab row, 32 columns) is a block that sums its row's positions in a fixed
//! order without atomics, so ∂W is the same on every run and on both devices. The ids travel
//! as values of W's dtype (exact: the vocabulary is at most 2²⁴). f32 and f64 tables on the
//! CPU and CUDA; other dtypes and devices use candle's ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::value::contiguous;

pub mod cuda;

/// Positions the backward kernel stages at a time (EMB_THREADS in `kernels/embedding.cu`).
pub const STAGE: usize = 256;
/// Columns per block and positions per warp and stage (EMB_LANES).
pub const LANES: usize = 32;
/// Warps per block (EMB_SLOTS): position p of a stage belongs to warp (p mod STAGE) / LANES.
pub const SLOTS: usize = STAGE / LANES;
/// The largest vocabulary whose ids are exact in f32.
pub const MAX_VOCAB: usize = 1 << 24;

/// The rows of `w` (vocab, h) at `ids` (any shape, whole numbers in 0..vocab of an integer
/// dtype): shape `ids.dims()` + (h). The CPU checks the ids; on CUDA an id outside the table
/// reads zeros (the data loaders check tokens against the task's vocabulary).
pub fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (vocab, h) = w.dims2()?;
    if ids.dtype().is_float() {
        bail!(
            "embedding: ids of dtype {:?}, expected an integer dtype",
            ids.dtype()
        );
    }
    let mut dims = ids.dims().to_vec();
    dims.push(h);
    let fused = matches!(w.dtype(), DType::F32 | DType::F64)
        && matches!(w.device(), Device::Cpu | Device::Cuda(_))
        && w.device().same_device(ids.device())
        && vocab <= MAX_VOCAB;
    if !fused {
        return w.index_select(&ids.flatten_all()?, 0)?.reshape(dims);
    }
    let op = Embedding {
        n: ids.elem_count(),
        vocab,
        h,
    };
    let ids = ids.flatten_all()?.to_dtype(w.dtype())?.contiguous()?;
    ids.apply_op2(&w.contiguous()?, op)?.reshape(dims)
}

/// The backward of [`embedding`] on its own, ∂W (vocab, h) = Σ over the positions n with
/// `ids[n]` = v of `g[n, :]`, for `ids` (n) of an integer dtype in 0..vocab and `g` (n, h): the
/// sum of rows by index (candle's `index_add` into zeros) as one launch.
pub fn embedding_backward(ids: &Tensor, g: &Tensor, vocab: usize) -> Result<Tensor> {
    let (n, h) = g.dims2()?;
    if ids.dims() != [n] || ids.dtype().is_float() {
        bail!(
            "embedding backward: ids {:?} of {:?} for a gradient {:?}",
            ids.dims(),
            ids.dtype(),
            g.dims()
        );
    }
    let fused = matches!(g.dtype(), DType::F32 | DType::F64)
        && matches!(g.device(), Device::Cpu | Device::Cuda(_))
        && vocab <= MAX_VOCAB;
    if !fused {
        return Tensor::zeros((vocab, h), g.dtype(), g.device())?.index_add(ids, g, 0);
    }
    let ids = ids.to_dtype(g.dtype())?.contiguous()?;
    Embedding { n, vocab, h }.backward(&ids, &g.contiguous()?)
}

#[derive(Clone, Copy)]
struct Embedding {
    n: usize,
    vocab: usize,
    h: usize,
}

/// The row of the table that `id` names, if any.
fn row_of<F: Float>(id: F, vocab: usize) -> Option<usize> {
    id.to_usize().filter(|&v| v < vocab && id >= F::zero())
}

/// The CPU twin of `embedding_fwd`: rows of `w` at `ids`, zeros for an id outside the table.
pub fn forward_cpu<F: Float + Send + Sync>(ids: &[F], w: &[F], vocab: usize, h: usize) -> Vec<F> {
    let mut y = vec![F::zero(); ids.len() * h];
    y.par_chunks_mut(h.max(1))
        .zip(ids.par_iter())
        .for_each(|(yr, &id)| {
            if let Some(v) = row_of(id, vocab) {
                yr.copy_from_slice(&w[v * h..(v + 1) * h]);
            }
        });
    y
}

/// The CPU twin of `embedding_bwd`: ∂W (vocab, h) from ∂y (ids.len(), h), each element summed
/// per warp in position order and then over the warps in order, as the kernel adds.
pub fn backward_cpu<F: Float + Send + Sync>(ids: &[F], g: &[F], vocab: usize, h: usize) -> Vec<F> {
    let n = ids.len();
    let parts: Vec<Vec<F>> = (0..SLOTS)
        .into_par_iter()
        .map(|slot| {
            let mut part = vec![F::zero(); vocab * h];
            for base in (0..n).step_by(STAGE) {
                let first = base + slot * LANES;
                for p in first..(first + LANES).min(n) {
                    if let Some(v) = row_of(ids[p], vocab) {
                        let (acc, gr) = (&mut part[v * h..(v + 1) * h], &g[p * h..(p + 1) * h]);
                        for (a, &x) in acc.iter_mut().zip(gr) {
                            *a = *a + x;
                        }
                    }
                }
            }
            part
        })
        .collect();
    (0..vocab * h)
        .map(|e| parts.iter().fold(F::zero(), |s, part| s + part[e]))
        .collect()
}

impl Embedding {
    fn forward_checked<F: WithDType + Float + Send + Sync>(
        &self,
        ids: &[F],
        w: &[F],
    ) -> Result<Vec<F>> {
        if let Some(p) = ids.iter().position(|&id| row_of(id, self.vocab).is_none()) {
            bail!(
                "embedding: token id {} at position {p} is outside the vocabulary of {}",
                ids[p],
                self.vocab
            );
        }
        Ok(forward_cpu(ids, w, self.vocab, self.h))
    }
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        ids: &CpuStorage,
        il: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = match w.dtype() {
            DType::F32 => {
                CpuStorage::F32(self.forward_checked(contiguous(ids, il)?, contiguous(w, wl)?)?)
            }
            DType::F64 => {
                CpuStorage::F64(self.forward_checked(contiguous(ids, il)?, contiguous(w, wl)?)?)
            }
            dt => bail!("embedding: dtype {dt:?} is not fused"),
        };
        Ok((y, Shape::from((self.n, self.h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        il: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plan = cuda::forward_plan(self.n, self.h, self.vocab, w.dtype())?;
        let module = crate::cuda::EMBEDDING;
        let mut y =
            crate::cuda::launch(w.device(), module, &plan, w.dtype(), &[(ids, il), (w, wl)])?;
        Ok((y.remove(0), Shape::from((self.n, self.h))))
    }

    fn bwd(
        &self,
        ids: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.to_dtype(w.dtype())?.contiguous()?;
        Ok((None, Some(self.backward(ids, &g)?)))
    }
}

impl Embedding {
    /// ∂W from the ids (as values of ∂y's dtype) and ∂y (n, h), both contiguous.
    fn backward(&self, ids: &Tensor, g: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            let plan = cuda::backward_plan(self.n, self.h, self.vocab, g.dtype())?;
            let module = crate::cuda::EMBEDDING;
            let shape = [self.vocab, self.h];
            let mut dw =
                crate::cuda::launch_tensors(module, &plan, g.dtype(), &[ids, g], &[&shape])?;
            return Ok(dw.remove(0));
        }
        let (si, li) = ids.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(si), Storage::Cpu(sg)) = (&*si, &*sg) else {
            bail!("embedding backward: tensors are not all on the CPU")
        };
        let (vocab, h) = (self.vocab, self.h);
        match g.dtype() {
            DType::F32 => Tensor::from_vec(
                backward_cpu::<f32>(contiguous(si, li)?, contiguous(sg, lg)?, vocab, h),
                (vocab, h),
                &Device::Cpu,
            ),
            DType::F64 => Tensor::from_vec(
                backward_cpu::<f64>(contiguous(si, li)?, contiguous(sg, lg)?, vocab, h),
                (vocab, h),
                &Device::Cpu,
            ),
            dt => bail!("embedding backward: dtype {dt:?} is not fused"),
        }
    }
}
