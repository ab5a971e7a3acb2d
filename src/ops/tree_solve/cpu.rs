//! The CPU side of the tree solve: every (batch, head) tree solved in parallel, level by
//! level for scalar blocks (`levels.rs`) or by the blocked path (`blocked.rs`), and the
//! gradient partials reduced over the batch.

use candle_core::{bail, Device, Result, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::pivoting::Scalar;
use super::{Side, TreeSolveOp};
use crate::ops::value::{contiguous, Complex, OutBuf, Re, SharedOut};

impl TreeSolveOp {
    /// Solves every (batch, head) tree in parallel: `rhs` holds u (forward) or g (adjoint) and
    /// the solutions go to `out`.
    pub(super) fn solve_all<F: WithDType, V: Scalar<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        if self.dims.d == 1 {
            self.solve_levels::<F, V>(side, coef, rhs, out)
        } else {
            self.solve_blocks::<F, V>(side, coef, rhs, out)
        }
    }

    pub(super) fn forward_t<F: WithDType>(&self, u: &[F], coef: &[F]) -> Result<Vec<F>> {
        let mut out = OutBuf::new(u.len());
        if self.opts.complex {
            self.solve_all::<F, Complex<F>>(Side::Forward, coef, u, out.ptr())?
        } else {
            self.solve_all::<F, Re<F>>(Side::Forward, coef, u, out.ptr())?
        }
        // SAFETY: the solve succeeded, so every tree's region is written.
        Ok(unsafe { out.assume_filled() })
    }

    pub(super) fn backward_tensors<F: WithDType>(
        &self,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (sc, lc) = coef.storage_and_layout();
        let (sx, lx) = x.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sc), Storage::Cpu(sx), Storage::Cpu(sg)) = (&*sc, &*sx, &*sg) else {
            bail!("tree_solve backward: tensors are not all on the CPU")
        };
        let (coef_s, x_s, g_s) = (
            contiguous::<F>(sc, lc)?,
            contiguous::<F>(sx, lx)?,
            contiguous::<F>(sg, lg)?,
        );
        let dims = self.dims;
        let (du, dcoef) = if dims.d == 1 {
            let (du, dcoef, partials) = if self.opts.complex {
                self.backward_scalar::<F, Complex<F>>(coef_s, x_s, g_s)?
            } else {
                self.backward_scalar::<F, Re<F>>(coef_s, x_s, g_s)?
            };
            (du, self.reduce_partials(dcoef, partials, 1)?)
        } else {
            let (du, dcoef, partials) = if self.opts.complex {
                self.adjoint_and_grads::<F, Complex<F>>(coef_s, x_s, g_s)?
            } else {
                self.adjoint_and_grads::<F, Re<F>>(coef_s, x_s, g_s)?
            };
            (du, self.reduce_partials(dcoef, partials, dims.d)?)
        };
        Ok((Tensor::from_vec(du, g.shape(), &Device::Cpu)?, dcoef))
    }

    /// The stacked coefficient gradient from per-(partial, head) blocks laid out as
    /// (3, partials, heads, nodes, d, d[, 2]): as is for per-sample coefficients (the partials
    /// are the batch), summed over the partials for shared ones.
    pub(super) fn reduce_partials<F: WithDType>(
        &self,
        dcoef: Vec<F>,
        partials: usize,
        d: usize,
    ) -> Result<Tensor> {
        let dims = self.dims;
        let tail: &[usize] = if self.opts.complex { &[2] } else { &[] };
        if !dims.shared {
            let shape = [&[3, partials, dims.heads, dims.nodes, d, d][..], tail].concat();
            return Tensor::from_vec(dcoef, shape, &Device::Cpu);
        }
        let len = dims.heads * dims.nodes * d * d * tail.iter().product::<usize>();
        let summed = match partials {
            1 => dcoef,
            _ => {
                let mut summed = Vec::with_capacity(3 * len);
                for k in 0..3 {
                    let set = &dcoef[k * partials * len..(k + 1) * partials * len];
                    summed.extend(sum_partials(set, partials, len));
                }
                summed
            }
        };
        let shape = [&[3, dims.heads, dims.nodes, d, d][..], tail].concat();
        Tensor::from_vec(summed, shape, &Device::Cpu)
    }
}

/// Sums `count` consecutive blocks of `len` scalars into one (the per-batch or per-group
/// gradient partials of shared coefficients), in parallel over the block.
fn sum_partials<F: WithDType>(partials: &[F], count: usize, len: usize) -> Vec<F> {
    let mut out = partials[..len].to_vec();
    out.par_chunks_mut(4096).enumerate().for_each(|(i, chunk)| {
        for k in 1..count {
            let src = &partials[k * len + i * 4096..][..chunk.len()];
            for (o, s) in chunk.iter_mut().zip(src) {
                *o += *s;
            }
        }
    });
    out
}
