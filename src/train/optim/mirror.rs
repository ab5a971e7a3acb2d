//! Mixed precision on the optimiser's side: the model copy in the compute dtype that a step
//! runs (`docs/precision.md`), which AdamW writes as it steps the f32 masters, and which shares
//! the variables not trained with them.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Var};
use candle_nn::VarMap;

use super::Optimizer;
use crate::train::precision::{LossScaler, Precision};

impl Optimizer {
    /// Whether this optimiser trains the variable called `name`.
    fn trains(&self, name: &str) -> bool {
        self.slots.iter().any(|s| s.name == name)
    }

    /// The variable map to build a compute copy of the model in: it holds `master`'s
    /// variables that this optimiser does not train (BatchNorm's running averages, f32 in a
    /// half-precision model too), so that the copy updates the masters' own.
    pub fn compute_varmap(&self, master: &HashMap<String, Var>) -> VarMap {
        let varmap = VarMap::new();
        varmap.data().lock().expect("varmap lock").extend(
            master
                .iter()
                .filter(|(n, _)| !self.trains(n))
                .map(|(n, v)| (n.clone(), v.clone())),
        );
        varmap
    }

    /// Trains the model copy `compute` (name → variable, in `precision`'s dtype, built in
    /// [`Optimizer::compute_varmap`]) through the f32 masters this optimiser was made with,
    /// `master` holding them and the variables not trained, which the copy shares: AdamW reads
    /// the compute copy's gradients and writes each stepped master, rounded, into its compute
    /// copy. Under f16 the loss is scaled ([`Optimizer::loss_scale`]). Casts the masters into
    /// the compute copy now.
    pub fn mirror(
        &mut self,
        master: &HashMap<String, Var>,
        compute: &HashMap<String, Var>,
        precision: Precision,
    ) -> Result<()> {
        if !precision.is_mixed() {
            return Ok(());
        }
        for s in &mut self.slots {
            s.compute = Some(compute_of(compute, &s.name, &s.var)?);
        }
        for (name, var) in master {
            let shared = compute.get(name).map(|c| c.as_tensor().id());
            if !self.trains(name) && shared != Some(var.as_tensor().id()) {
                candle_core::bail!(
                    "the compute copy's '{name}' is not the master's own variable (a copy \
                     built in Optimizer::compute_varmap shares what is not trained)"
                );
            }
        }
        if precision == Precision::F16 && self.scaler.is_none() {
            self.scaler = Some(LossScaler::default());
        }
        self.to_compute()
    }

    /// Casts the masters into their compute copies.
    fn to_compute(&self) -> Result<()> {
        for s in &self.slots {
            if let Some(c) = &s.compute {
                c.set(&s.var.as_tensor().to_dtype(c.dtype())?)?;
            }
        }
        Ok(())
    }

    /// Under mixed precision, casts the compute copies' gradients in `grads` to f32, so that
    /// sums over shards and micro-batches are taken in f32 (one part's gradients need not be
    /// cast: [`Optimizer::step`] reads them as they are).
    pub fn grads_to_f32(&self, grads: &mut GradStore) -> Result<()> {
        for s in &self.slots {
            if let Some(c) = &s.compute {
                if let Some(g) = grads.remove(c) {
                    grads.insert(c, g.to_dtype(s.var.dtype())?);
                }
            }
        }
        Ok(())
    }
}

/// The compute copy of the master variable `name`, which must have its shape.
fn compute_of(compute: &HashMap<String, Var>, name: &str, master: &Var) -> Result<Var> {
    match compute.get(name) {
        Some(c) if c.dims() == master.dims() => Ok(c.clone()),
        Some(c) => candle_core::bail!(
            "the compute copy of '{name}' has shape {:?}, the master {:?}",
            c.dims(),
            master.dims()
        ),
        None => candle_core::bail!("the compute copy of the model has no '{name}'"),
    }
}
