//! The launches of `kernels/scan.cu`: their plans (pure functions, executed by the CUDA launch
//! below and by the host harness in `tests/kernels_on_cpu`) and, with the `cuda` feature, their
//! execution on candle's stream.
//!
//! Grid (ceil(channels / [`TILE`]), batch), block ([`TILE`], [`SEGMENTS`]): a block is one
//! batch element's tile of channels, a warp one segment of every chunk. No dynamic shared
//! memory, no workspace.

use candle_core::{bail, DType, Result, Tensor};

use super::{check_args, width, Dims, GateShape, ScanOp, ScanOptions, SEGMENTS, TILE};
use crate::ops::plan::{int_arg, kernel_name, KernelArg, LaunchPlan};

impl GateShape {
    /// The code the kernels take (GATE_FULL, GATE_PER_STEP, GATE_PER_CHANNEL).
    fn code(self) -> i32 {
        match self {
            GateShape::Full => 0,
            GateShape::PerStep => 1,
            GateShape::PerChannel => 2,
        }
    }
}

impl ScanOp {
    fn plan(
        &self,
        stem: &str,
        dtype: DType,
        inputs: usize,
        outputs: Vec<usize>,
    ) -> Result<LaunchPlan> {
        let Dims { batch, len, chans } = self.dims;
        if batch > 65_535 {
            bail!("linear_scan: batch {batch} exceeds the CUDA grid limit of 65535");
        }
        let ints = [
            int_arg("linear_scan", "batch", batch)?,
            int_arg("linear_scan", "length", len)?,
            int_arg("linear_scan", "channels", chans)?,
            self.gate.code(),
            self.opts.reverse as i32,
        ];
        let args = (0..inputs)
            .map(KernelArg::Input)
            .chain((0..outputs.len()).map(KernelArg::Output))
            .chain(ints.map(KernelArg::I32))
            .collect();
        Ok(LaunchPlan {
            kernel: kernel_name(stem, dtype, self.opts.complex)?,
            grid: [chans.div_ceil(TILE) as u32, batch as u32, 1],
            block: [TILE as u32, SEGMENTS as u32, 1],
            shared_bytes: 0,
            args,
            outputs,
            tables: vec![],
            workspace_bytes: 0,
        })
    }

    /// `scan_fwd`: inputs (a, b, h0), output h.
    fn forward_plan(&self, dtype: DType) -> Result<LaunchPlan> {
        let Dims { batch, len, chans } = self.dims;
        let n = batch * len * chans * width(self.opts);
        self.plan("scan_fwd", dtype, 3, vec![n])
    }

    /// `scan_bwd`: inputs (a, h, h0, ∂h), outputs (∂b, the ∂a partials, ∂h0).
    fn backward_plan(&self, dtype: DType) -> Result<LaunchPlan> {
        let Dims { batch, len, chans } = self.dims;
        let w = width(self.opts);
        let outputs = vec![
            batch * len * chans * w,
            self.da_partial_shape().iter().product(),
            batch * chans * w,
        ];
        self.plan("scan_bwd", dtype, 4, outputs)
    }
}

/// The launch that `linear_scan(a, b, h0, opts)` makes on a GPU. Its inputs are (a, b, h0), with
/// h0 zeros when not given; its output is h.
pub fn forward_plan(
    a: &Tensor,
    b: &Tensor,
    h0: Option<&Tensor>,
    opts: ScanOptions,
) -> Result<LaunchPlan> {
    let (dims, gate) = check_args(a, b, h0, opts)?;
    ScanOp { dims, gate, opts }.forward_plan(b.dtype())
}

/// The launch of the backward of `linear_scan` on a GPU. Its inputs are (a, h, h0, ∂h); its
/// outputs ∂b, ∂a per batch element (the op sums them over the batch when a is shared) and ∂h0.
pub fn backward_plan(
    a: &Tensor,
    h: &Tensor,
    h0: Option<&Tensor>,
    opts: ScanOptions,
) -> Result<LaunchPlan> {
    let (dims, gate) = check_args(a, h, h0, opts)?;
    ScanOp { dims, gate, opts }.backward_plan(h.dtype())
}

#[cfg(feature = "cuda")]
pub(super) use launch::{backward, forward};

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaStorage, Layout, Result, Storage, Tensor};

    use super::ScanOp;
    use crate::cuda::{self, SCAN};

    pub(in crate::ops::scan) fn forward(
        op: &ScanOp,
        b: (&CudaStorage, &Layout),
        a: (&CudaStorage, &Layout),
        h0: (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let plan = op.forward_plan(b.0.dtype())?;
        let mut out = cuda::launch(b.0.device(), SCAN, &plan, b.0.dtype(), &[a, b, h0])?;
        Ok(out.remove(0))
    }

    pub(in crate::ops::scan) fn backward(
        op: &ScanOp,
        a: &Tensor,
        h: &Tensor,
        h0: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let guards = [a, h, h0, g].map(|t| t.storage_and_layout());
        let mut inputs = Vec::with_capacity(4);
        for (s, l) in &guards {
            let Storage::Cuda(s) = &**s else {
                bail!("linear_scan backward: tensors are not all on the same CUDA device")
            };
            inputs.push((s, *l));
        }
        let dev = inputs[3].0.device().clone();
        let plan = op.backward_plan(g.dtype())?;
        let outs = cuda::launch(&dev, SCAN, &plan, g.dtype(), &inputs)?;
        let shapes = [g.dims().to_vec(), op.da_partial_shape(), h0.dims().to_vec()];
        let mut wrapped = outs.into_iter().zip(shapes).map(|(s, shape)| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        });
        let mut next = || wrapped.next().expect("three outputs");
        Ok((next(), next(), next()))
    }
}
