//! A fixed gather of rows, forward and backward as one op each on the CPU and on CUDA
//! (`kernels/gather.cu`, whose twin is the arithmetic here): for x (rows, n) and an index of
//! rows known when the model is built,
//!
//!   y[i, :] = x[idx_i, :],   ∂x[v, :] = Σ_{i : idx_i = v} ∂y[i, :].
//!
//! candle's `index_select` has the same forward, but its gradient is `index_add`, whose CUDA
//! kernel gives each of the n columns one thread that walks the whole index, a chain of
//! dependent read-modify-writes (the frame encoder's im2col: 3,888 per column). With the index
//! fixed, its inverse is built once ([`RowGather::new`]): each element of ∂x is one thread
//! adding its few rows of ∂y in position order, the sums a sequential scatter-add makes (so
//! the gradient is the same bits as `index_add`'s on the CPU). f32 and f64 on the CPU and
//! CUDA; other dtypes and devices use candle's ops.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use num_traits::Float;
use rayon::prelude::*;

use super::plan::Table;
use super::value::contiguous;

pub mod cuda;

/// The index, its inverse, and the number of rows it gathers from.
#[derive(Debug)]
struct Index {
    rows: usize,
    index: Table,
    /// Row v's positions are `positions[starts[v]..starts[v + 1]]`, ascending.
    starts: Table,
    positions: Table,
}

/// A gather of rows by an index fixed at construction. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RowGather {
    index: Arc<Index>,
    /// The index as a tensor, for candle's `index_select` where the op does not apply.
    on_device: Tensor,
}

impl RowGather {
    /// The gather of `index` (each entry below `rows`) from tensors of `rows` rows on `device`.
    pub fn new(index: Vec<u32>, rows: usize, device: &Device) -> Result<Self> {
        if let Some((i, v)) = index.iter().enumerate().find(|(_, &v)| v as usize >= rows) {
            bail!("row gather: index entry {i} is {v}, past the {rows} rows gathered from");
        }
        if index.len() >= i32::MAX as usize || rows >= i32::MAX as usize {
            bail!(
                "row gather: an index of {} entries over {rows} rows is too large",
                index.len()
            );
        }
        // The inverse, by counting: positions ascend within each row.
        let mut starts = vec![0u32; rows + 1];
        for &v in &index {
            starts[v as usize + 1] += 1;
        }
        for v in 0..rows {
            starts[v + 1] += starts[v];
        }
        let mut next = starts.clone();
        let mut positions = vec![0u32; index.len()];
        for (i, &v) in index.iter().enumerate() {
            positions[next[v as usize] as usize] = i as u32;
            next[v as usize] += 1;
        }
        let on_device = Tensor::new(index.as_slice(), device)?;
        Ok(RowGather {
            index: Arc::new(Index {
                rows,
                index: Table::new(index),
                starts: Table::new(starts),
                positions: Table::new(positions),
            }),
            on_device,
        })
    }

    /// Entries of the index: the rows of the output.
    pub fn len(&self) -> usize {
        self.index.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.index.is_empty()
    }

    /// x (rows, n) → (len, n).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, _) = x.dims2()?;
        if rows != self.index.rows {
            bail!(
                "row gather: an input of {rows} rows, expected {}",
                self.index.rows
            );
        }
        match self.fused(x) {
            true => x.apply_op1(Gather(self.index.clone())),
            false => x.index_select(&self.on_device, 0),
        }
    }

    /// Whether the op (rather than candle's `index_select`) gathers from `x`: f32 or f64 on
    /// the CPU or on CUDA, on the device the gather was made for.
    pub fn fused(&self, x: &Tensor) -> bool {
        matches!(x.dtype(), DType::F32 | DType::F64)
            && matches!(x.device(), Device::Cpu | Device::Cuda(_))
            && x.device().same_device(self.on_device.device())
    }

    /// The backward on its own, for layers that compute gradients by hand: ∂x (rows, n) from
    /// ∂y (len, n), where [`RowGather::fused`] holds for ∂y.
    pub fn backward(&self, g: &Tensor) -> Result<Tensor> {
        let (len, _) = g.dims2()?;
        if len != self.len() || !self.fused(g) {
            bail!(
                "row gather backward: a gradient of {:?} ({:?}), expected {} rows in f32 or f64",
                g.dims(),
                g.dtype(),
                self.len()
            );
        }
        Gather(self.index.clone()).backward(&g.contiguous()?)
    }
}

/// The CPU twin of `gather_fwd`: rows of `x` (rows of n) at `index`.
pub fn forward_cpu<F: Float + Send + Sync>(index: &[u32], x: &[F], n: usize) -> Vec<F> {
    let mut y = vec![F::zero(); index.len() * n];
    y.par_chunks_mut(n.max(1))
        .zip(index.par_iter())
        .for_each(|(yr, &v)| yr.copy_from_slice(&x[v as usize * n..(v as usize + 1) * n]));
    y
}

/// The CPU twin of `gather_bwd`: ∂x (starts.len() − 1 rows of n) from ∂y, each element the sum
/// of its rows of ∂y in position order.
pub fn backward_cpu<F: Float + Send + Sync>(
    starts: &[u32],
    positions: &[u32],
    g: &[F],
    n: usize,
) -> Vec<F> {
    let rows = starts.len().saturating_sub(1);
    let mut dx = vec![F::zero(); rows * n];
    dx.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(v, row)| {
            for &i in &positions[starts[v] as usize..starts[v + 1] as usize] {
                let gr = &g[i as usize * n..(i as usize + 1) * n];
                for (d, &x) in row.iter_mut().zip(gr) {
                    *d = *d + x;
                }
            }
        });
    dx
}

struct Gather(Arc<Index>);

impl Gather {
    /// ∂x from ∂y (len, n), contiguous.
    fn backward(&self, g: &Tensor) -> Result<Tensor> {
        let (ix, n) = (&self.0, g.dim(1)?);
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            let plan = cuda::backward_plan(&ix.starts, &ix.positions, n, g.dtype())?;
            let module = crate::cuda::GATHER;
            let shape = [ix.rows, n];
            let mut dx = crate::cuda::launch_tensors(module, &plan, g.dtype(), &[g], &[&shape])?;
            return Ok(dx.remove(0));
        }
        let (s, l) = g.storage_and_layout();
        let Storage::Cpu(s) = &*s else {
            bail!("row gather backward: the gradient is not on the CPU")
        };
        let (starts, positions) = (&ix.starts, &ix.positions);
        match g.dtype() {
            DType::F32 => {
                let dx = backward_cpu::<f32>(starts, positions, contiguous(s, l)?, n);
                Tensor::from_vec(dx, (ix.rows, n), &Device::Cpu)
            }
            DType::F64 => {
                let dx = backward_cpu::<f64>(starts, positions, contiguous(s, l)?, n);
                Tensor::from_vec(dx, (ix.rows, n), &Device::Cpu)
            }
            dt => bail!("row gather backward: dtype {dt:?} is not fused"),
        }
    }
}

impl CustomOp1 for Gather {
    fn name(&self) -> &'static str {
        "row-gather"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<F: WithDType + Float>(ix: &Index, x: &[F], n: usize) -> Vec<F> {
            forward_cpu(&ix.index, x, n)
        }
        let n = l.dims()[1];
        let y = match x {
            CpuStorage::F32(_) => CpuStorage::F32(run(&self.0, contiguous(x, l)?, n)),
            CpuStorage::F64(_) => CpuStorage::F64(run(&self.0, contiguous(x, l)?, n)),
            _ => bail!("row gather: dtype {:?} is not fused", x.dtype()),
        };
        Ok((y, Shape::from((self.0.index.len(), n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = l.dims()[1];
        let plan = cuda::forward_plan(&self.0.index, n, x.dtype())?;
        let mut y =
            crate::cuda::launch(x.device(), crate::cuda::GATHER, &plan, x.dtype(), &[(x, l)])?;
        Ok((y.remove(0), Shape::from((self.0.index.len(), n))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.to_dtype(x.dtype())?.contiguous()?;
        self.backward(&g).map(Some)
    }
}
