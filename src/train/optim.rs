//! The optimiser of the S5 reference (`train_helpers.py`; docs/reference.md): AdamW in two parameter
//! groups — the SSM parameters (Λ, B, log Δ, tree coefficients, norms) at `ssm_lr` without
//! weight decay, everything else at `lr` with `weight_decay` — under a linear warm-up followed
//! by a per-step cosine decay to `lr_min`, with optional gradient clipping by global norm.
//!
//! AdamW, per parameter θ with gradient g at step t (1-based):
//!   m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,
//!   θ ← θ − η_t (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε) − η_t λ θ.
//! Written here (rather than candle-nn's `AdamW`) so that its moments can be saved with a
//! checkpoint and a resumed run continues exactly.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::dist::World;
use super::precision::LossScaler;
use crate::nn::ParamGroup;
use crate::ops::adamw::StepDtypes;
use crate::ops::{adamw_step, AdamwHyper, AdamwParam};

mod mirror;

/// Hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// Learning rate of the regular group.
    pub lr: f64,
    /// Learning rate of the SSM group.
    pub ssm_lr: f64,
    pub lr_min: f64,
    pub weight_decay: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the global gradient norm to this value (none when `None`).
    pub clip: Option<f64>,
}

impl OptimConfig {
    /// Refuses hyper-parameters that would train into divergence or nowhere, naming the flag:
    /// the rates must be positive, the decay and the final rate non-negative, the clipping norm
    /// positive, the moments' decays in [0, 1) and ε positive (all finite). A warm-up of 0
    /// steps is none.
    pub fn check(&self) -> Result<()> {
        let finite = |flag: &str, v: f64, ok: bool, want: &str| -> Result<()> {
            if v.is_finite() && ok {
                Ok(())
            } else {
                candle_core::bail!("{flag} {v}: expected {want}")
            }
        };
        // --ssm-lr first: --lr defaults to a multiple of it.
        finite(
            "--ssm-lr",
            self.ssm_lr,
            self.ssm_lr > 0.0,
            "a positive learning rate",
        )?;
        finite("--lr", self.lr, self.lr > 0.0, "a positive learning rate")?;
        finite(
            "--weight-decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "a decay ≥ 0",
        )?;
        finite(
            "the final learning rate",
            self.lr_min,
            self.lr_min >= 0.0,
            "a rate ≥ 0",
        )?;
        if let Some(c) = self.clip {
            finite("--clip", c, c > 0.0, "a positive gradient norm")?;
        }
        for (name, b) in [("β₁", self.beta1), ("β₂", self.beta2)] {
            finite(
                &format!("AdamW's {name}"),
                b,
                (0.0..1.0).contains(&b),
                "a decay in [0, 1)",
            )?;
        }
        finite("AdamW's ε", self.eps, self.eps > 0.0, "a positive value")
    }

    /// The learning rate of a group with base rate `base` at step `step` (0-based): linear from
    /// 0 to `base` over the warm-up, then cosine from `base` to `lr_min` over the rest.
    pub fn rate(&self, base: f64, step: usize) -> f64 {
        if step < self.warmup_steps {
            return base * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let t = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.lr_min + 0.5 * (base - self.lr_min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

struct Slot {
    name: String,
    var: Var,
    /// The moments [m; v], (2, θ's shape), updated in place (zeros before the first step).
    moments: Tensor,
    /// Its group's row in [`Optimizer::apply`]: 0 regular, 1 SSM, 2 SSM with weight decay.
    group: usize,
    /// Under mixed precision, the copy the model computes with ([`Optimizer::mirror`]).
    compute: Option<Var>,
}

/// Gradient values per collective in data-parallel training (16 MiB of f32).
pub const BUCKET: usize = 1 << 22;

/// AdamW over named variables in their groups.
pub struct Optimizer {
    cfg: OptimConfig,
    slots: Vec<Slot>,
    step: usize,
    /// Keep the gradient norm of every step whose number (1-based) is a multiple of this.
    log_every: usize,
    /// The last step, if kept: its learning rate and gradient norm (on the device).
    logged: Option<(f64, Tensor)>,
    /// Compute the gradient norm at every step when steps are kept at all, not only at the
    /// kept ones: a step captured as a CUDA graph does the same work each time it is replayed.
    norm_every_step: bool,
    /// Under `norm_every_step`, the last step's gradient norm, where it was computed.
    last_norm: Option<Tensor>,
    /// The regular learning rate of the step [`Optimizer::prepare`] began.
    step_lr: f64,
    /// The hyper-parameter rows of the step, a (groups, 7) table per parameter dtype, written
    /// in place every step.
    tables: Vec<(DType, Tensor)>,
    /// f16's loss scaling.
    scaler: Option<LossScaler>,
    /// 1 / the loss scale of the step being taken.
    unscale: Option<f64>,
}

impl Optimizer {
    /// Trains `vars` (name → variable) in the groups `group` assigns (the model's
    /// [`crate::nn::SequenceClassifier::param_group`]), skipping [`ParamGroup::Frozen`] ones
    /// (BatchNorm's running statistics, which are updated, not trained).
    pub fn new(
        cfg: OptimConfig,
        vars: &HashMap<String, Var>,
        group: impl Fn(&str) -> ParamGroup,
    ) -> Result<Self> {
        cfg.check()?;
        let mut names: Vec<&String> = vars
            .keys()
            .filter(|n| group(n) != ParamGroup::Frozen)
            .collect();
        names.sort();
        let slots = names
            .into_iter()
            .map(|n| {
                let var = vars[n].clone();
                let mut two = vec![2];
                two.extend_from_slice(var.dims());
                Ok(Slot {
                    name: n.clone(),
                    moments: Tensor::zeros(two, var.dtype(), var.device())?,
                    group: match group(n) {
                        ParamGroup::Ssm => 1,
                        ParamGroup::SsmDecayed => 2,
                        _ => 0,
                    },
                    var,
                    compute: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Optimizer {
            cfg,
            slots,
            step: 0,
            log_every: 0,
            logged: None,
            norm_every_step: false,
            last_norm: None,
            step_lr: 0.0,
            tables: Vec::new(),
            scaler: None,
            unscale: None,
        })
    }

    /// What the training objective is multiplied by before the backward pass: f16's loss
    /// scale, else 1.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.map_or(1.0, |s| s.scale)
    }

    /// The loss scaler's state: its scale, and the steps it skipped so far.
    pub fn scaler(&self) -> Option<LossScaler> {
        self.scaler
    }

    /// Keeps the learning rate and the global gradient norm (before clipping) of every
    /// `every`-th step, for [`Optimizer::take_logged`] (0: none).
    pub fn log_every(&mut self, every: usize) {
        self.log_every = every;
    }

    /// The regular learning rate and gradient norm (an f64 scalar on the device) of the last
    /// step, if it was one to keep.
    pub fn take_logged(&mut self) -> Option<(f64, Tensor)> {
        self.logged.take()
    }

    /// Computes the gradient norm at every step, when some steps are kept
    /// ([`Optimizer::log_every`]), so that every step does the same work (a captured CUDA
    /// graph); [`Optimizer::take_last_norm`] gives it.
    pub fn norm_every_step(&mut self, on: bool) {
        self.norm_every_step = on;
    }

    /// Under [`Optimizer::norm_every_step`], the gradient norm of the last step (before
    /// clipping), where it was computed.
    pub fn take_last_norm(&mut self) -> Option<Tensor> {
        self.last_norm.take()
    }

    /// The regular learning rate of the step [`Optimizer::prepare`] began, if it is one to
    /// keep ([`Optimizer::log_every`]).
    pub fn kept_rate(&self) -> Option<f64> {
        let kept = self.log_every > 0 && self.step.is_multiple_of(self.log_every);
        kept.then_some(self.step_lr)
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// The two groups' learning rates at the current step: (regular, ssm).
    pub fn rates(&self) -> (f64, f64) {
        (
            self.cfg.rate(self.cfg.lr, self.step),
            self.cfg.rate(self.cfg.ssm_lr, self.step),
        )
    }

    /// The global gradient norm ‖g‖₂ over the optimised parameters, as an f64 scalar on their
    /// device (missing gradients count as zero); reading it waits for the device.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<Tensor> {
        self.norm_of(&self.gather(grads)?)
    }

    /// Each slot's gradient in `grads`: under mixed precision its compute copy's, as it is
    /// (f16/bf16, or f32 where parts were summed): AdamW's kernel reads either.
    fn gather(&self, grads: &GradStore) -> Result<Vec<Option<Tensor>>> {
        Ok(self
            .slots
            .iter()
            .map(|s| grads.get(s.compute.as_ref().unwrap_or(&s.var)).cloned())
            .collect())
    }

    fn norm_of(&self, grads: &[Option<Tensor>]) -> Result<Tensor> {
        let present: Vec<&Tensor> = grads.iter().flatten().collect();
        if let Some(first) = present.first() {
            let dtype = first.dtype();
            let fused = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
                && matches!(first.device(), Device::Cpu | Device::Cuda(_))
                && present.iter().all(|g| g.dtype() == dtype);
            if fused {
                return crate::ops::grad_norm(&present)?.to_dtype(DType::F64);
            }
        }
        let mut sq: Option<Tensor> = None;
        for g in grads.iter().flatten() {
            let t = g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?;
            sq = Some(match sq {
                Some(acc) => (acc + t)?,
                None => t,
            });
        }
        match sq {
            Some(sq) => sq.sqrt(),
            None => {
                let dev = self.slots.first().map(|s| s.var.device().clone());
                Tensor::zeros((), candle_core::DType::F64, &dev.unwrap_or(Device::Cpu))
            }
        }
    }

    /// One AdamW step with the gradients in `grads` (missing gradients count as zero), clipped
    /// to the global norm `clip` when set: one fused in-place launch for all parameters
    /// ([`crate::ops::adamw_step`]). Nothing is read back from the device: the clipping factor
    /// c / max(‖g‖, c) is a tensor, the step's hyper-parameters a table of the groups' rows
    /// written in place once per step ([`Optimizer::prepare`]).
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let grads = self.gather(grads)?;
        self.apply(&grads)
    }

    /// [`Optimizer::step`] with the gradients of the ranks `0..ranks` of `world` summed in rank
    /// order ([`World::sum_in_rank_order`]), the same step on every rank. `grads`: this rank's,
    /// `None` when its part of the batch is empty. The gradients travel as f32 in buckets of
    /// [`BUCKET`] values, one collective each.
    pub fn step_across(
        &mut self,
        grads: Option<&GradStore>,
        world: &World,
        ranks: usize,
    ) -> Result<()> {
        let local = match grads {
            Some(g) => self.gather(g)?,
            None => vec![None; self.slots.len()],
        };
        if world.size() == 1 {
            return self.apply(&local);
        }
        // A parameter no rank has a gradient for (one the loss does not reach) is not stepped,
        // as in one process.
        let has: Vec<f32> = local
            .iter()
            .map(|g| f32::from(u8::from(g.is_some())))
            .collect();
        let has = world
            .sum_in_rank_order(&has, ranks)
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        if let Some(summed) = self.sum_on_device(&local, world)? {
            let summed: Vec<Option<Tensor>> = summed
                .into_iter()
                .zip(&has)
                .map(|(g, has)| (*has > 0.0).then_some(g))
                .collect();
            return self.apply(&summed);
        }
        let mut flat: Vec<f32> = Vec::new();
        for (s, g) in self.slots.iter().zip(&local) {
            if s.var.dtype() != DType::F32 {
                candle_core::bail!(
                    "data-parallel training sums f32 gradients; '{}' is {:?}",
                    s.name,
                    s.var.dtype()
                );
            }
            match g {
                Some(g) => flat.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
                None => flat.resize(flat.len() + s.var.elem_count(), 0.0),
            }
        }
        let mut sum = Vec::with_capacity(flat.len());
        for bucket in flat.chunks(BUCKET) {
            sum.extend(
                world
                    .sum_in_rank_order(bucket, ranks)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?,
            );
        }
        let mut at = 0;
        let mut summed = Vec::with_capacity(self.slots.len());
        for (s, has) in self.slots.iter().zip(&has) {
            let n = s.var.elem_count();
            let g = &sum[at..at + n];
            summed.push(if *has > 0.0 {
                Some(Tensor::from_slice(g, s.var.shape(), s.var.device())?)
            } else {
                None
            });
            at += n;
        }
        self.apply(&summed)
    }

    /// The gradients summed over the ranks on their GPUs ([`World::device_sum`]), in buckets
    /// of [`BUCKET`] values; `None` when the ranks have no device collective.
    fn sum_on_device(
        &self,
        local: &[Option<Tensor>],
        world: &World,
    ) -> Result<Option<Vec<Tensor>>> {
        let err = |e: anyhow::Error| candle_core::Error::Msg(format!("{e:#}"));
        let Some(first) = self.slots.first() else {
            return Ok(None);
        };
        if !world.sums_on_device() || first.var.device().is_cpu() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.slots.len());
        let mut bucket: Vec<(usize, Tensor)> = Vec::new();
        let flush = |bucket: &mut Vec<(usize, Tensor)>, out: &mut Vec<Tensor>| -> Result<()> {
            if bucket.is_empty() {
                return Ok(());
            }
            let flat: Vec<Tensor> = bucket.iter().map(|(_, g)| g.clone()).collect();
            let sum = world
                .device_sum(&Tensor::cat(&flat, 0)?)
                .map_err(err)?
                .expect("a device collective");
            let mut at = 0;
            for (slot, g) in bucket.drain(..) {
                let n = g.elem_count();
                out.push(
                    sum.narrow(0, at, n)?
                        .reshape(self.slots[slot].var.shape())?,
                );
                at += n;
            }
            Ok(())
        };
        let mut filled = 0;
        for (k, (s, g)) in self.slots.iter().zip(local).enumerate() {
            let g = match g {
                Some(g) => g.flatten_all()?.to_dtype(DType::F32)?,
                None => Tensor::zeros(s.var.elem_count(), DType::F32, s.var.device())?,
            };
            if filled + g.elem_count() > BUCKET {
                flush(&mut bucket, &mut out)?;
                filled = 0;
            }
            filled += g.elem_count();
            bucket.push((k, g));
        }
        flush(&mut bucket, &mut out)?;
        Ok(Some(out))
    }

    /// The step itself, with each slot's gradient (`None`: zero): [`Optimizer::prepare`],
    /// then [`Optimizer::launch`]. Under f16, a step whose gradients are not all finite is
    /// skipped (the step count stays) and the loss scale halved.
    fn apply(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        let mut norm = None;
        if let Some(scale) = self.scaler.map(|s| s.scale) {
            // The (scaled) gradients are all finite if and only if their norm is: its f32 sum
            // of squares of f16 values, or of f32 sums of a batch's parts of them, cannot
            // overflow.
            let n = self.norm_of(grads)?;
            let finite = n.to_dtype(DType::F64)?.to_scalar::<f64>()?.is_finite();
            self.unscale = Some(1.0 / scale);
            if let Some(scaler) = &mut self.scaler {
                scaler.update(finite);
            }
            if !finite {
                return Ok(());
            }
            norm = Some(n);
        }
        self.prepare()?;
        self.launch(grads, norm)
    }

    /// The host's part of a step: advances the step count and writes the step's
    /// hyper-parameter rows (learning rates, bias corrections) into device tables that stay
    /// where they are, so that the device's part ([`Optimizer::launch_with`]) is the same work
    /// on the same buffers every step (a captured CUDA graph replays it).
    pub fn prepare(&mut self) -> Result<()> {
        let (lr, ssm_lr) = self.rates();
        self.step += 1;
        self.step_lr = lr;
        let t = self.step as i32;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let hyper = |lr: f64, weight_decay: f64| AdamwHyper {
            beta1: b1,
            beta2: b2,
            c1: 1.0 - b1.powi(t),
            c2: 1.0 - b2.powi(t),
            eps: self.cfg.eps,
            lr,
            weight_decay,
        };
        let groups = [
            hyper(lr, self.cfg.weight_decay),
            hyper(ssm_lr, 0.0),
            hyper(ssm_lr, self.cfg.weight_decay),
        ];
        if self.tables.is_empty() {
            for s in &self.slots {
                let dtype = s.var.dtype();
                if !self.tables.iter().any(|(d, _)| *d == dtype) {
                    let table = AdamwHyper::table(&groups, dtype, s.var.device())?;
                    self.tables.push((dtype, table));
                }
            }
            return Ok(());
        }
        for (_, table) in &self.tables {
            AdamwHyper::fill(table, &groups)?;
        }
        Ok(())
    }

    /// The device's part of the step [`Optimizer::prepare`] began (call it after that), with
    /// the gradients in `grads`: clipping, then AdamW (one launch per 32 parameters of a
    /// dtype).
    pub fn launch_with(&mut self, grads: &GradStore) -> Result<()> {
        let grads = self.gather(grads)?;
        self.launch(&grads, None)
    }

    /// [`Optimizer::launch_with`] on gathered gradients; `norm`: their norm where it was
    /// computed already (the loss scaler's check).
    fn launch(&mut self, grads: &[Option<Tensor>], norm: Option<Tensor>) -> Result<()> {
        let kept = self.kept_rate().is_some();
        let every = self.norm_every_step && self.log_every > 0;
        let unscale = self.unscale.take();
        let norm = match (self.cfg.clip, kept || every, norm) {
            (_, _, Some(norm)) => Some(norm),
            (None, false, None) => None,
            _ => Some(self.norm_of(grads)?),
        }
        .map(|n| match unscale {
            Some(k) => n.affine(k, 0.0),
            None => Ok(n),
        })
        .transpose()?;
        // c / max(‖g‖, c), with c made on the device (no upload); times 1 / the loss scale.
        let scale = match (self.cfg.clip, &norm) {
            (Some(c), Some(norm)) => {
                Some(norm.ones_like()?.affine(c, 0.0)?.div(&norm.maximum(c)?)?)
            }
            _ => None,
        };
        let scale = match (scale, unscale) {
            (Some(s), Some(k)) => Some(s.affine(k, 0.0)?),
            (None, Some(k)) => match self.slots.first() {
                Some(s) => Some(Tensor::new(k, s.var.device())?),
                None => None,
            },
            (s, None) => s,
        };
        if self.norm_every_step {
            self.last_norm = norm.clone();
        }
        self.logged = match (kept, norm) {
            (true, Some(norm)) => Some((self.step_lr, norm)),
            _ => None,
        };
        // One adamw_step per kind of parameter (its dtypes and its compute copy's): the
        // kernel writes the compute copies, so nothing is cast after the step.
        let params: Vec<(StepDtypes, AdamwParam)> = self
            .slots
            .iter()
            .zip(grads)
            .filter_map(|(s, g)| {
                let grad = g.as_ref()?;
                let copy = s.compute.as_ref().map(|c| c.as_tensor());
                let dtypes = StepDtypes {
                    param: s.var.dtype(),
                    grad: grad.dtype(),
                    copy: copy.map(|c| c.dtype()),
                };
                let param = AdamwParam {
                    theta: s.var.as_tensor(),
                    moments: &s.moments,
                    grad,
                    group: s.group,
                    copy,
                };
                Some((dtypes, param))
            })
            .collect();
        let mut kinds: Vec<StepDtypes> = Vec::new();
        for (k, _) in &params {
            if !kinds.contains(k) {
                kinds.push(*k);
            }
        }
        for kind in kinds {
            let Some((_, table)) = self.tables.iter().find(|(d, _)| *d == kind.param) else {
                candle_core::bail!("adamw: no hyper-parameter table of {:?}", kind.param)
            };
            let of_kind: Vec<AdamwParam> = params
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, p)| *p)
                .collect();
            let k = scale.as_ref().map(|k| k.to_dtype(kind.param)).transpose()?;
            adamw_step(&of_kind, table, k.as_ref())?;
        }
        Ok(())
    }

    /// The optimiser state as named tensors (`adam.m.<param>`, `adam.v.<param>`, `adam.step`),
    /// to save beside the model.
    pub fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![(
            "adam.step".to_string(),
            Tensor::new(
                &[self.step as u32],
                self.slots
                    .first()
                    .map_or(&candle_core::Device::Cpu, |s| s.var.device()),
            )?,
        )];
        for s in &self.slots {
            out.push((format!("adam.m.{}", s.name), s.moments.get(0)?));
            out.push((format!("adam.v.{}", s.name), s.moments.get(1)?));
        }
        if let Some(scaler) = &self.scaler {
            out.push((SCALER.into(), scaler.to_tensor(&Device::Cpu)?));
        }
        Ok(out)
    }

    /// Restores a state saved by [`Optimizer::state`]; every moment must be present with its
    /// shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let step = state.get("adam.step").ok_or_else(|| {
            candle_core::Error::Msg("optimizer state: 'adam.step' is missing".into())
        })?;
        for s in &mut self.slots {
            let mut both = Vec::with_capacity(2);
            for kind in ["m", "v"] {
                let key = format!("adam.{kind}.{}", s.name);
                let t = state.get(&key).ok_or_else(|| {
                    candle_core::Error::Msg(format!("optimizer state: '{key}' is missing"))
                })?;
                if t.dims() != s.var.dims() {
                    candle_core::bail!(
                        "optimizer state: '{key}' has shape {:?}, expected {:?}",
                        t.dims(),
                        s.var.dims()
                    );
                }
                both.push(t.to_dtype(s.var.dtype())?.to_device(s.var.device())?);
            }
            s.moments = Tensor::stack(&both, 0)?;
        }
        self.step = step.flatten_all()?.to_vec1::<u32>()?[0] as usize;
        if let Some(t) = state.get(SCALER) {
            self.scaler = Some(
                LossScaler::from_tensor(t)
                    .map_err(|e| candle_core::Error::Msg(format!("optimizer state: {e}")))?,
            );
        }
        Ok(())
    }
}

/// The checkpoint key of f16's loss scaler.
const SCALER: &str = "amp.scaler";
