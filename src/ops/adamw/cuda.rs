//! The launches of `kernels/adamw.cu`: their plans (a pure function, executed by the CUDA
//! launch, `crate::cuda::launch_in_place`, and by the host harness in `tests/kernels_on_cpu`).

use candle_core::Result;

use super::StepDtypes;
use crate::ops::plan::{int_arg, KernelArg, LaunchPlan};

/// Threads per block (ADAMW_THREADS in the kernel).
pub const THREADS: u32 = 256;
/// Parameters per launch (ADAMW_SEGMENTS).
pub const SEGMENTS: usize = 32;
/// The most blocks a launch gives one parameter; each thread takes every (grid × block)-th
/// element.
const MAX_BLOCKS: usize = 1024;

/// `adamw_step` of parameters with `sizes` elements in hyper-parameter rows `groups`, a plan
/// per [`SEGMENTS`] of them. With N parameters the targets are θ₀ … θ_{N−1}, then their
/// moments [m; v], then (where `dtypes` has them) their compute copies; the inputs the N
/// gradients, the hyper-parameter rows and, if `scaled`, the clipping factor.
pub fn step_plans(
    sizes: &[usize],
    groups: &[usize],
    dtypes: StepDtypes,
    scaled: bool,
) -> Result<Vec<LaunchPlan>> {
    let n = sizes.len();
    if groups.len() != n {
        candle_core::bail!("adamw: {n} parameters but {} groups", groups.len());
    }
    let kernel = dtypes.kernel()?;
    let copies = dtypes.copy.is_some();
    let mut plans = Vec::new();
    for first in (0..n).step_by(SEGMENTS) {
        let end = (first + SEGMENTS).min(n);
        // The parameter in struct entry k, if any.
        let slot = |k: usize| Some(first + k).filter(|&p| p < end);
        let most = sizes[first..end].iter().copied().max().unwrap_or(0);
        let target =
            |k: usize, at: usize| slot(k).map_or(KernelArg::Null, |p| KernelArg::Target(at + p));
        let mut fields: Vec<KernelArg> = Vec::with_capacity(6 * SEGMENTS);
        fields.extend((0..SEGMENTS).map(|k| target(k, 0)));
        fields.extend((0..SEGMENTS).map(|k| target(k, n)));
        fields.extend((0..SEGMENTS).map(|k| slot(k).map_or(KernelArg::Null, KernelArg::Input)));
        fields.extend((0..SEGMENTS).map(|k| match copies {
            true => target(k, 2 * n),
            false => KernelArg::Null,
        }));
        fields
            .extend((0..SEGMENTS).map(|k| KernelArg::U64(slot(k).map_or(0, |p| sizes[p] as u64))));
        for k in 0..SEGMENTS {
            let group = slot(k).map_or(0, |p| groups[p]);
            fields.push(KernelArg::I32(int_arg("adamw", "group", group)?));
        }
        plans.push(LaunchPlan {
            kernel: kernel.clone(),
            grid: [
                most.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
                (end - first) as u32,
                1,
            ],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
            args: vec![
                KernelArg::Struct(fields),
                KernelArg::Input(n),
                match scaled {
                    true => KernelArg::Input(n + 1),
                    false => KernelArg::Null,
                },
            ],
            outputs: vec![],
            tables: vec![],
            workspace_bytes: 0,
        });
    }
    Ok(plans)
}
