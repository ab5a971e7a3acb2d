//! Layers whose backward pass is written by hand.
//!
//! candle's autograd (candle-core 0.11, `backprop.rs`) pays, for every op of a forward pass, a
//! detached copy of the incoming gradient and, per input, a tensor of zeros and an add into it:
//! a layer of twenty small ops costs some 140 tensor ops in its backward, each a kernel on a GPU.
//! A layer can instead run its forward on detached tensors and join the graph as one node
//! ([`by_hand`]) whose backward is the layer's chain rule written out ([`Backward`]): the
//! gradient of the layer's input goes on through candle's graph, the parameters' gradients go to
//! a [`GradSink`], which the caller adds to candle's `GradStore` after the backward pass
//! ([`GradSink::add_to`]).

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

/// Parameter gradients computed by hand during a backward pass, in the order computed.
#[derive(Clone, Default)]
pub struct GradSink(Arc<Mutex<Vec<(Tensor, Tensor)>>>);

impl GradSink {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&self, grads: Vec<(Tensor, Tensor)>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(grads);
    }

    /// Moves the collected gradients into `grads`, adding each to what candle's backward
    /// already holds for the same parameter.
    pub fn add_to(&self, grads: &mut GradStore) -> Result<()> {
        let collected = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for (param, g) in collected {
            let sum = match grads.get(&param) {
                Some(old) => (old + g)?,
                None => g,
            };
            grads.insert(&param, sum);
        }
        Ok(())
    }
}

/// The chain rule of a layer, with what its forward kept.
pub trait Backward: Send + Sync {
    /// Given ∂L/∂y, the layer's output gradient: ∂L/∂x and (parameter, ∂L/∂parameter) pairs.
    fn backward(&self, dy: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)>;
}

/// The chain rule of a layer that reads data (its input needs no gradient): the parameters'
/// gradients alone.
pub trait ParamsBackward: Send + Sync {
    /// Given ∂L/∂y: (parameter, ∂L/∂parameter) pairs.
    fn backward(&self, dy: &Tensor) -> Result<Vec<(Tensor, Tensor)>>;
}

/// What a by-hand node's backward computes.
enum Chain {
    Layer(Box<dyn Backward>),
    Params(Box<dyn ParamsBackward>),
}

/// The output `y` of a layer with input `x`, computed on detached tensors, joined to candle's
/// graph as one node with the backward `back`. `anchor`, one of the layer's parameters, keeps
/// the node in the graph when `x` needs no gradient; the parameters' gradients go to `sink`.
/// Costs one copy of `y`; the node keeps the copy alone (`y` is not one of its arguments, which
/// candle's graph would keep until the backward).
pub fn by_hand(
    x: &Tensor,
    y: &Tensor,
    anchor: &Tensor,
    back: Box<dyn Backward>,
    sink: &GradSink,
) -> Result<Tensor> {
    node(x, y, anchor, Chain::Layer(back), sink)
}

/// [`by_hand`] for a layer on data `x`, which no gradient reaches (an error at the backward
/// if one would).
pub fn by_hand_on_data(
    x: &Tensor,
    y: &Tensor,
    anchor: &Tensor,
    back: Box<dyn ParamsBackward>,
    sink: &GradSink,
) -> Result<Tensor> {
    node(x, y, anchor, Chain::Params(back), sink)
}

fn node(x: &Tensor, y: &Tensor, anchor: &Tensor, back: Chain, sink: &GradSink) -> Result<Tensor> {
    let op = ByHand {
        back,
        sink: sink.clone(),
        y: Mutex::new(Some(y.detach())),
    };
    x.apply_op2(anchor, op)
}

struct ByHand {
    back: Chain,
    sink: GradSink,
    /// The output's values until the forward copies them.
    y: Mutex<Option<Tensor>>,
}

impl ByHand {
    /// `y`, taken: the op releases it once copied.
    fn take_y(&self) -> Result<Tensor> {
        let y = self.y.lock().unwrap_or_else(|e| e.into_inner()).take();
        y.ok_or_else(|| candle_core::Error::Msg("by-hand: the forward ran twice".into()))
    }
}

/// `y`'s values (any layout) as the node's output, contiguous.
fn copy_of<S: BackendStorage>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: the copy writes every element.
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok((out, l.shape().clone()))
}

impl CustomOp2 for ByHand {
    fn name(&self) -> &'static str {
        "by-hand"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.take_y()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => copy_of(s, layout),
            _ => candle_core::bail!("by-hand: the output is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = self.take_y()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => copy_of(s, layout),
            _ => candle_core::bail!("by-hand: the output is not on the CUDA device"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _out: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        match &self.back {
            Chain::Layer(back) => {
                let (dx, params) = back.backward(dy)?;
                self.sink.push(params);
                Ok((x.track_op().then_some(dx), None))
            }
            Chain::Params(_) if x.track_op() => {
                candle_core::bail!("by-hand: a layer on data was asked for its input's gradient")
            }
            Chain::Params(back) => {
                self.sink.push(back.backward(dy)?);
                Ok((None, None))
            }
        }
    }
}
