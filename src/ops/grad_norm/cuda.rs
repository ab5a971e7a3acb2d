//! The launches of `kernels/grad_norm.cu`: plans (pure functions, executed by the CUDA launch
//! and by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

/// Threads per block (NORM_THREADS in the kernel).
pub const THREADS: usize = 256;
/// Gradients per launch of the partial sums (NORM_SEGMENTS).
pub const SEGMENTS: usize = 32;
/// Elements a thread takes at least before blocks are added, and the most blocks per gradient.
const PER_THREAD: usize = 16;
const MAX_BLOCKS: usize = 64;

/// Blocks per gradient of a launch whose largest gradient has `most` elements.
pub fn blocks_for(most: usize) -> usize {
    most.div_ceil(THREADS * PER_THREAD).clamp(1, MAX_BLOCKS)
}

/// The dtype of the partial sums and the norm of `dtype` gradients: f64 for f64, else f32.
pub fn sums_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `grad_norm_parts` of `dtype` gradients with `sizes` elements, a plan per [`SEGMENTS`] of
/// them. The inputs are the gradients in order; plan k's output is its gradients' partial
/// sums in [`sums_dtype`], (gradients, blocks) in that order.
pub fn parts_plans(sizes: &[usize], dtype: DType) -> Result<Vec<LaunchPlan>> {
    let kernel = kernel_name("grad_norm_parts", dtype, false)?;
    let mut plans = Vec::new();
    for first in (0..sizes.len()).step_by(SEGMENTS) {
        let end = (first + SEGMENTS).min(sizes.len());
        let slot = |k: usize| Some(first + k).filter(|&p| p < end);
        let blocks = blocks_for(sizes[first..end].iter().copied().max().unwrap_or(0));
        let mut fields: Vec<KernelArg> = Vec::with_capacity(2 * SEGMENTS);
        fields.extend((0..SEGMENTS).map(|k| slot(k).map_or(KernelArg::Null, KernelArg::Input)));
        fields
            .extend((0..SEGMENTS).map(|k| KernelArg::U64(slot(k).map_or(0, |p| sizes[p] as u64))));
        plans.push(LaunchPlan {
            kernel: kernel.clone(),
            grid: [blocks as u32, (end - first) as u32, 1],
            block: [THREADS as u32, 1, 1],
            shared_bytes: 0,
            args: vec![KernelArg::Struct(fields), KernelArg::Output(0)],
            outputs: vec![(end - first) * blocks],
            tables: vec![],
            workspace_bytes: 0,
        });
    }
    Ok(plans)
}

/// `grad_norm_sum`: input the `count` partial sums (of dtype `dtype`, f32 or f64); output the
/// norm (one value).
pub fn sum_plan(count: usize, dtype: DType) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: kernel_name("grad_norm_sum", dtype, false)?,
        grid: [1, 1, 1],
        block: [THREADS as u32, 1, 1],
        shared_bytes: 0,
        args: vec![
            KernelArg::Input(0),
            KernelArg::Output(0),
            KernelArg::I32(int_arg("grad_norm", "partial sums", count)?),
        ],
        outputs: vec![1],
        tables: vec![],
        workspace_bytes: 0,
    })
}
