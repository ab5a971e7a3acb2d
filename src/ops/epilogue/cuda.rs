//! The launches of `kernels/epilogue.cu`: plans (pure functions, executed by the CUDA launch and
//! by the host harness in `tests/kernels_on_cpu`).

use candle_core::{DType, Result};

use super::{Activation, Epilogue};
use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};
use crate::ops::rows::{element_blocks, ELEMENT_THREADS};

/// `epilogue_fwd`: inputs y and, with `residual`, r; output r + k ⊙ act(y).
pub fn forward_plan(e: &Epilogue, residual: bool, dtype: DType) -> Result<LaunchPlan> {
    let second = match residual {
        true => KernelArg::Input(1),
        false => KernelArg::Null,
    };
    plan("epilogue_fwd", e, second, dtype)
}

/// `epilogue_bwd`: inputs y and ∂out; output ∂y.
pub fn backward_plan(e: &Epilogue, dtype: DType) -> Result<LaunchPlan> {
    plan("epilogue_bwd", e, KernelArg::Input(1), dtype)
}

fn plan(stem: &str, e: &Epilogue, second: KernelArg, dtype: DType) -> Result<LaunchPlan> {
    let mut args = vec![KernelArg::Input(0), second, KernelArg::Output(0)];
    args.extend(shape_args(e)?);
    args.insert(6, KernelArg::I32((e.activation == Activation::Gelu) as i32));
    elementwise(stem, e, args, 1, dtype)
}

/// `gate_fwd`: inputs f, z, b and, with `residual`, r; outputs r + k ⊙ (f ⊙ s) and s = σ(z + b).
pub fn gate_forward_plan(e: &Epilogue, residual: bool, dtype: DType) -> Result<LaunchPlan> {
    let r = match residual {
        true => KernelArg::Input(3),
        false => KernelArg::Null,
    };
    let mut args = vec![
        KernelArg::Input(0),
        KernelArg::Input(1),
        KernelArg::Input(2),
        r,
        KernelArg::Output(0),
        KernelArg::Output(1),
    ];
    args.extend(shape_args(e)?);
    elementwise("gate_fwd", e, args, 2, dtype)
}

/// `gate_bwd`: inputs f, s (the forward's second output) and ∂out; outputs ∂f and ∂z.
pub fn gate_backward_plan(e: &Epilogue, dtype: DType) -> Result<LaunchPlan> {
    let mut args = (0..3).map(KernelArg::Input).collect::<Vec<_>>();
    args.extend([KernelArg::Output(0), KernelArg::Output(1)]);
    args.extend(shape_args(e)?);
    elementwise("gate_bwd", e, args, 2, dtype)
}

/// The size, sample size and feature count, then the dropout's switch, key and rate.
fn shape_args(e: &Epilogue) -> Result<Vec<KernelArg>> {
    let int = |what, v| int_arg("epilogue", what, v).map(KernelArg::I32);
    let drop = e.dropout.unwrap_or_default();
    // The site hash, or what the kernel makes it from with the step's key in the device's word.
    let (hash, key, site) = match drop.key_word {
        Some(w) => (0, KernelArg::DropoutKey, w.site),
        None => (drop.site_hash, KernelArg::Null, 0),
    };
    Ok(vec![
        int("size", e.samples * e.per_sample)?,
        int("sample size", e.per_sample)?,
        int("features", e.features)?,
        KernelArg::I32(e.dropout.is_some() as i32),
        KernelArg::U64(hash),
        key,
        KernelArg::U64(site),
        KernelArg::U64(drop.first_row),
        KernelArg::U64(drop.threshold()),
        KernelArg::U64(drop.scale().to_bits()),
    ])
}

/// One thread per element, `outputs` outputs of the elements' count.
fn elementwise(
    stem: &str,
    e: &Epilogue,
    args: Vec<KernelArg>,
    outputs: usize,
    dtype: DType,
) -> Result<LaunchPlan> {
    let n = e.samples * e.per_sample;
    Ok(LaunchPlan {
        kernel: kernel_name(stem, dtype, false)?,
        grid: [element_blocks(n), 1, 1],
        block: [ELEMENT_THREADS, 1, 1],
        shared_bytes: 0,
        args,
        outputs: vec![n; outputs],
        tables: vec![],
        workspace_bytes: 0,
    })
}
