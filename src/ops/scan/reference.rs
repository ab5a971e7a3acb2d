//! The linear scan as a loop of plain candle ops: the benchmark baseline and an independent
//! check of the op's backward (through candle's autograd).

use candle_core::{Result, Tensor};

use super::{check_args, state_shape, GateShape, ScanOptions};
use crate::complex::C;

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
            C::from_pairs(&a_t)?.mul(&C::from_pairs(&h)?)?.to_pairs()?
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
