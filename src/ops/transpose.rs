//! Swapping dimensions 1 and 2 of a (B, M, N, K) tensor into a contiguous (B, N, M, K) one, K
//! small (the (re, im) pair of complex values): the layout change between a channel-last
//! (batch, length, heads, 2) projection and the tree solve's per-head (batch, heads, nodes, 2).
//!
//! candle's CPU backend copies such a transposed view element by element with strided index
//! arithmetic; this op copies K-element runs in tiles of the output, in parallel, and its
//! backward is the same swap of the gradient. The input may be any view whose last dimension
//! is contiguous (a `narrow` along M or N costs no copy). Elsewhere: candle's transpose.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

/// Output rows (b, n) per rayon task.
const ROWS_PER_TASK: usize = 16;

/// (B, M, N, K) → (B, N, M, K), contiguous.
pub fn swap_dims12(x: &Tensor) -> Result<Tensor> {
    if x.rank() != 4 {
        bail!(
            "swap_dims12: expected a 4-D tensor, got shape {:?}",
            x.dims()
        );
    }
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        let x = if x.stride()[3] == 1 {
            x.clone()
        } else {
            x.contiguous()?
        };
        x.apply_op1(Swap12)
    } else {
        x.transpose(1, 2)?.contiguous()
    }
}

struct Swap12;

fn swap_t<F: WithDType>(src: &[F], l: &Layout) -> Vec<F> {
    let (b, m, n, k) = {
        let d = l.dims();
        (d[0], d[1], d[2], d[3])
    };
    let s = l.stride();
    let off = l.start_offset();
    let mut out = vec![F::zero(); b * m * n * k];
    let row = m * k;
    if row == 0 {
        return out;
    }
    out.par_chunks_mut(row * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (r, dst) in chunk.chunks_exact_mut(row).enumerate() {
                let (bi, ni) = (
                    (task * ROWS_PER_TASK + r) / n,
                    (task * ROWS_PER_TASK + r) % n,
                );
                let base = off + bi * s[0] + ni * s[2];
                // Consecutive rows read neighbouring elements of the same source lines, which
                // stay cached across the task's rows.
                if k == 2 {
                    for (mi, d) in dst.chunks_exact_mut(2).enumerate() {
                        let f = base + mi * s[1];
                        d[0] = src[f];
                        d[1] = src[f + 1];
                    }
                } else {
                    for (mi, d) in dst.chunks_exact_mut(k).enumerate() {
                        let f = base + mi * s[1];
                        for (j, v) in d.iter_mut().enumerate() {
                            *v = src[f + j];
                        }
                    }
                }
            }
        });
    out
}

impl CustomOp1 for Swap12 {
    fn name(&self) -> &'static str {
        "swap-dims-1-2"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims();
        let shape = Shape::from((d[0], d[2], d[1], d[3]));
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(swap_t(s.as_slice::<f32>()?, l)),
            DType::F64 => CpuStorage::F64(swap_t(s.as_slice::<f64>()?, l)),
            dt => bail!("swap_dims12: dtype {dt:?} is not fused on the CPU"),
        };
        Ok((out, shape))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(swap_dims12(g)?.detach()))
    }
}
