//! BatchNorm over (batch, length, H), with the batch statistics of a batch that is computed in
//! data-parallel shards (threads of one process, or ranks) summed over all of them.
//!
//! In training, y = (x − μ) / √(σ² + ε) · weight + bias with μ and σ² the mean and the biased
//! variance of each channel over the batch and the length: over the whole batch, however it is
//! cut. Each shard sums its own part, Σx, then Σ(x − μ)², and [`ShardSum`] adds the parts of all
//! shards in a fixed order, so every shard normalises with the same μ and σ². The backward of
//! that sum is the same sum of the shards' gradients (the loss is the sum of the shards' losses,
//! each depending on every shard's x through μ and σ²), so the gradients are those of the
//! whole batch in one pass. The running averages (running = m · running + (1 − m) · batch, the
//! variance unbiased, as candle-nn's `BatchNorm`) are updated by one shard per process; the
//! parameter names are candle-nn's, so checkpoints of either load into the other.

use std::sync::Arc;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, Var,
};
use candle_nn::{Init, VarBuilder};

use crate::ops::batch_norm;
use crate::ops::{
    batch_norm_apply, batch_norm_backward, batch_norm_backward_stats, batch_norm_running,
    channel_add, channel_mul, column_stats,
};

/// The sum over every data-parallel shard of a batch of a tensor each shard computes: the same
/// bits on every shard, whatever the shard.
pub trait ShardSum: Send + Sync {
    /// The element-wise sum of `t` over the shards (every shard calls it, in the same order).
    fn sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Whether this shard updates state shared by the shards of its process (BatchNorm's
    /// running averages): exactly one shard per process does.
    fn leads(&self) -> bool;
}

/// A batch's shards as a forward pass sees them.
pub type Shards = Arc<dyn ShardSum>;

/// BatchNorm over the batch and the length of (batch, length, H).
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    /// weight and bias detached once (aliases that the optimiser's in-place steps update too).
    detached: [Tensor; 2],
    running_mean: Var,
    running_var: Var,
    /// The running averages' decay m.
    decay: f64,
    eps: f64,
}

impl BatchNorm {
    /// `features` channels, running averages decaying by `decay` per step. The averages are
    /// kept in the statistics' dtype ([`batch_norm::stats_dtype`]: f32 in a half-precision
    /// model): stored in bf16, an update (1 − m)·(batch − running) below half a unit in the
    /// last place of the average would be lost, so the average could stop short of the
    /// batches' by up to 2⁻⁸/(1 − m) of itself (8% at m = 0.95).
    pub fn new(features: usize, decay: f64, vb: VarBuilder) -> Result<Self> {
        let stats = batch_norm::stats_dtype(vb.dtype());
        let average = |name, init| vb.get_with_hints_dtype(features, name, init, stats);
        let running_mean = average("running_mean", Init::Const(0.))?;
        let running_var = average("running_var", Init::Const(1.))?;
        let weight = vb.get_with_hints(features, "weight", Init::Const(1.))?;
        let bias = vb.get_with_hints(features, "bias", Init::Const(0.))?;
        Ok(BatchNorm {
            detached: [weight.detach(), bias.detach()],
            weight,
            bias,
            running_mean: Var::from_tensor(&running_mean)?,
            running_var: Var::from_tensor(&running_var)?,
            decay,
            eps: 1e-5,
        })
    }

    /// Inference: the running statistics (in a half-precision model, the scale and shift in
    /// f32, then rounded to the rows' dtype).
    pub fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        let stats = self.running_var.dtype();
        let scale = (self.running_var.as_tensor() + self.eps)?.sqrt()?.recip()?;
        let scale = (scale * self.weight.to_dtype(stats)?)?.to_dtype(x.dtype())?;
        let shift = self.running_mean.as_tensor().neg()?.to_dtype(x.dtype())?;
        channel_add(&channel_mul(&channel_add(x, &shift)?, &scale)?, &self.bias)
    }

    /// Training: the statistics of the whole batch, of which `x` is one shard's part (`None`:
    /// `x` is the whole batch).
    pub fn forward_train(&self, x: &Tensor, shards: Option<&Shards>) -> Result<Tensor> {
        if matches!(x.dtype(), DType::F16 | DType::BF16) {
            // Half-precision rows are normalised in f32: sums over batch × length rows would
            // overflow f16, and their count need not be exact in it.
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let params = [&f32(&self.weight)?, &f32(&self.bias)?];
            return self.train(&f32(x)?, shards, params)?.to_dtype(x.dtype());
        }
        self.train(x, shards, [&self.weight, &self.bias])
    }

    /// [`Self::forward_train`] on a detached `x` and parameters, with its backward by hand
    /// ([`BatchNormBackward`]): the fused ops of [`crate::ops::batch_norm`], the statistics
    /// summed over the shards between them.
    pub(crate) fn forward_by_hand(
        &self,
        x: &Tensor,
        shards: Option<&Shards>,
    ) -> Result<(Tensor, BatchNormBackward)> {
        if matches!(x.dtype(), DType::F16 | DType::BF16) && !batch_norm::fused(x)? {
            // Where the kernels do not take the rows (they read half precision into f32
            // themselves), they are normalised in f32 as in `forward_train`: x, γ and β cast
            // up, the output cast back (and in the backward, ∂y up, ∂x, ∂γ and ∂β back).
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let params = [f32(&self.detached[0])?, f32(&self.detached[1])?];
            let (y, back) = self.by_hand(&f32(x)?, shards, params)?;
            return Ok((y.to_dtype(x.dtype())?, back));
        }
        self.by_hand(x, shards, self.detached.clone())
    }

    /// [`Self::forward_by_hand`] on `x` with the detached parameters `[w, b]` of its dtype, the
    /// statistics in [`batch_norm::stats_dtype`] (f32 for half-precision rows).
    fn by_hand(
        &self,
        x: &Tensor,
        shards: Option<&Shards>,
        [w, b]: [Tensor; 2],
    ) -> Result<(Tensor, BatchNormBackward)> {
        let h = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        // The rows stay a tensor (reading them would make a GPU step wait for the host), summed
        // over the shards with Σx in one collective.
        let stats = batch_norm::stats_dtype(x.dtype());
        let count = Tensor::full(rows as f32, 1, x.device())?.to_dtype(stats)?;
        let sum = column_stats(x, None)?;
        let (sum, n) = match shards {
            Some(s) => {
                let both = s.sum(&Tensor::cat(&[&sum, &count], 0)?)?;
                (both.narrow(0, 0, h)?, both.narrow(0, h, 1)?)
            }
            None => (sum, count),
        };
        let across = |t: Tensor| match shards {
            Some(s) => s.sum(&t),
            None => Ok(t),
        };
        let mean = sum.broadcast_div(&n)?;
        let var = across(column_stats(x, Some(&mean))?)?.broadcast_div(&n)?;
        if shards.is_none_or(|s| s.leads()) {
            self.update_running(&mean, &var, &n)?;
        }
        let y = batch_norm_apply(x, &mean, &var, &w, &b, self.eps)?;
        let back = BatchNormBackward {
            vars: [self.weight.clone(), self.bias.clone()],
            weight: w,
            x: x.clone(),
            mean,
            var,
            n,
            eps: self.eps,
            shards: shards.cloned(),
        };
        Ok((y, back))
    }

    /// The parameter that anchors a block by hand in candle's graph.
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// running = m · running + (1 − m) · batch for the mean and the variance (candle-nn's
    /// unbiased one: n / (n − 1) times the batch's), n the batch's rows, in the statistics'
    /// dtype.
    fn update_running(&self, mean: &Tensor, var: &Tensor, n: &Tensor) -> Result<()> {
        let running = [self.running_mean.as_tensor(), self.running_var.as_tensor()];
        let fused = matches!(
            running[0].dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) && batch_norm::stats_dtype(running[0].dtype()) == mean.dtype()
            && (mean.device().is_cpu() || mean.device().is_cuda());
        if fused {
            return batch_norm_running(running, mean, var, n, self.decay);
        }
        // Elsewhere, the update in candle ops.
        let m = self.decay;
        let unbiased = (n / n.affine(1.0, -1.0)?)?;
        let update = |running: &Var, batch: Tensor| -> Result<()> {
            let old = running.as_tensor().to_dtype(batch.dtype())?;
            let next = ((old * m)? + (batch.detach() * (1.0 - m))?)?;
            running.set(&next.to_dtype(running.dtype())?)
        };
        update(&self.running_mean, mean.clone())?;
        update(&self.running_var, var.broadcast_mul(&unbiased)?)
    }

    /// The training forward with the parameters `[weight, bias]` in candle ops, for its
    /// autograd: the shards' sums are the [`Summed`] op, whose backward sums the gradients
    /// over the shards.
    fn train(
        &self,
        x: &Tensor,
        shards: Option<&Shards>,
        [weight, bias]: [&Tensor; 2],
    ) -> Result<Tensor> {
        let h = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        let xf = x.reshape((rows, h))?;
        let across = |t: Tensor| match shards {
            Some(s) => {
                let total = s.sum(&t.detach())?;
                t.apply_op2(&total, Summed(s.clone()))
            }
            None => Ok(t),
        };
        // Σx and the row count, summed over the shards in one collective; the count stays a
        // tensor (reading it would make a GPU step wait for the host).
        let count = Tensor::full(rows as f32, 1, x.device())?.to_dtype(x.dtype())?;
        // Column sums as a product with a row of ones: one pass, and so is its backward.
        let ones = Tensor::ones((1, rows), x.dtype(), x.device())?;
        let column_sums = |t: &Tensor| ones.matmul(t)?.squeeze(0);
        let first = across(Tensor::cat(&[&column_sums(&xf)?, &count], 0)?)?;
        let n = first.narrow(0, h, 1)?;
        let mean = first.narrow(0, 0, h)?.broadcast_div(&n)?;
        let centred = channel_add(&xf, &mean.neg()?)?;
        let var = across(column_sums(&centred.sqr()?)?)?.broadcast_div(&n)?;
        if shards.is_none_or(|s| s.leads()) {
            self.update_running(&mean, &var, &n)?;
        }
        let kg = ((var + self.eps)?.sqrt()?.recip()? * weight)?;
        channel_add(&channel_mul(&centred, &kg)?, bias)?.reshape(x.shape())
    }
}

/// The backward of [`BatchNorm::forward_by_hand`], with μ and σ² the whole batch's and
/// x̂ = (x − μ) / √(σ² + ε): this shard's ∂γ = Σ_rows ∂y ⊙ x̂ and ∂β = Σ_rows ∂y are the
/// parameters' gradients; summed over the shards (every shard's loss depends on every row
/// through μ and σ²) they give ∂x ([`batch_norm_backward`]).
pub(crate) struct BatchNormBackward {
    vars: [Tensor; 2],
    /// γ, detached.
    weight: Tensor,
    x: Tensor,
    mean: Tensor,
    var: Tensor,
    /// The rows over all shards, (1).
    n: Tensor,
    eps: f64,
    shards: Option<Shards>,
}

impl BatchNormBackward {
    /// ∂x from ∂y, in ∂y's dtype (the forward's input's); ∂γ and ∂β go to `params`, in their
    /// parameters' dtype. Half-precision rows computed in f32 come back cast.
    pub(crate) fn backward(
        &self,
        dy: &Tensor,
        params: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let (x, mean, var) = (&self.x, &self.mean, &self.var);
        let out = dy.dtype();
        let dy = dy.to_dtype(x.dtype())?;
        let [dw, db] = batch_norm_backward_stats(x, mean, var, &dy, self.eps)?;
        let [w, b] = &self.vars;
        params.push((w.clone(), dw.to_dtype(w.dtype())?));
        params.push((b.clone(), db.to_dtype(b.dtype())?));
        let (dw, db) = match &self.shards {
            Some(s) => (s.sum(&dw)?, s.sum(&db)?),
            None => (dw, db),
        };
        batch_norm_backward(x, mean, var, &self.weight, &dy, &dw, &db, &self.n, self.eps)?
            .to_dtype(out)
    }
}

/// `Summed(s).apply(local, total)` is `total` (the sum of `local` over the shards, computed
/// beforehand); its backward sends the shards' summed gradient to `local`.
struct Summed(Shards);

impl CustomOp2 for Summed {
    fn name(&self) -> &'static str {
        "summed-over-shards"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        total: &CpuStorage,
        layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        whole(layout)?;
        Ok((total.try_clone(layout)?, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        total: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        whole(layout)?;
        Ok((total.try_clone(layout)?, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(self.0.sum(grad)?), None))
    }
}

/// Storage is cloned whole, so the sum must be all of it.
fn whole(layout: &Layout) -> Result<()> {
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("summed-over-shards: the sum must be a whole contiguous tensor");
    }
    Ok(())
}
