//! The benchmark of a whole training step.

use super::*;

/// A training step of a whole [`SequenceClassifier`] (forward, loss, backward; no optimiser
/// update) on random inputs of a task's shape, with the part spent in its sequence layers.
#[derive(Debug, Clone)]
pub struct StepBench {
    pub model: ClassifierConfig,
    pub batch: usize,
    /// Sequence length (the tree's leaves for Myo).
    pub len: usize,
    pub warmup: usize,
    pub repeats: usize,
}

/// What a [`StepBench`] measured, in milliseconds per step.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    pub device: String,
    /// The layer and shape in one line.
    pub shape: String,
    pub config: serde_json::Value,
    /// Forward + loss + backward of the whole model.
    pub step: Timing,
    /// Forward + backward of one sequence layer alone (on its input shape), times the layers.
    pub layers: Timing,
    /// Forward alone of the whole model.
    pub forward: Timing,
}

impl StepBench {
    pub fn run(&self, device: &Device) -> Result<StepReport> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
        let model = SequenceClassifier::new(self.model.clone(), vb)?;
        let (b, l, h) = (self.batch, self.len, self.model.d_model);
        let x = match self.model.encoder {
            EncoderConfig::Linear { features } => {
                Tensor::randn(0f32, 1., (b, l, features), device)?
            }
            EncoderConfig::Embedding { vocab } => {
                Tensor::rand(0f32, vocab as f32, (b, l), device)?.to_dtype(DType::U32)?
            }
        };
        let y = Tensor::rand(0f32, self.model.classes as f32, b, device)?.to_dtype(DType::U32)?;
        let mode = |step: u64| {
            Mode::Train(
                DropoutKey {
                    seed: 0,
                    step,
                    first_row: 0,
                },
                None,
            )
        };
        let mut step = 0;
        let whole = time_median(device, self.warmup, self.repeats, || {
            step += 1;
            let logp = model.forward(&x, None, mode(step))?;
            candle_nn::loss::nll(&logp, &y)?.backward().map(drop)
        })?;
        let forward = time_median(device, self.warmup, self.repeats, || {
            model.forward(&x, None, Mode::Eval).map(drop)
        })?;
        // One sequence layer on its own input: all tree nodes for Myo over all nodes.
        let width = model.positions(l);
        let z = Var::from_tensor(&Tensor::randn(0f32, 1., (b, width, h), device)?)?;
        let one = time_median(device, self.warmup, self.repeats, || {
            let out = model.layer_forward(0, z.as_tensor())?;
            out.sqr()?.sum_all()?.backward().map(drop)
        })?;
        let times = self.model.layers as f64;
        let layers = Timing {
            median_ms: one.median_ms * times,
            min_ms: one.min_ms * times,
            ..one
        };
        let kind = match &self.model.layer {
            SeqLayerConfig::S5(c) => format!(
                "S5 P {}{}",
                c.state,
                if c.bidirectional {
                    " bidirectional"
                } else {
                    ""
                }
            ),
            SeqLayerConfig::Myo(c) => format!(
                "Myo heads {} d {} {:?} over {}",
                c.heads,
                c.block,
                c.coupling,
                if c.all_nodes {
                    "all nodes"
                } else {
                    "the leaves"
                }
            ),
            SeqLayerConfig::Ssm2d(_) => "2-D SSM".into(),
            SeqLayerConfig::MinGru(_) => "minGRU".into(),
        };
        Ok(StepReport {
            device: describe(device),
            shape: format!(
                "{kind}, {} layers, H {h}, batch {b}, length {l} ({width} positions)",
                self.model.layers
            ),
            config: serde_json::to_value(&self.model).unwrap_or_default(),
            step: whole,
            layers,
            forward,
        })
    }
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "step  device={}  {}", self.device, self.shape)?;
        for (what, t) in [
            ("forward + backward", self.step),
            ("  in the layers   ", self.layers),
            ("forward           ", self.forward),
        ] {
            writeln!(
                f,
                "  {what}  median {:>9.2} ms  (min {:.2}, {} samples)",
                t.median_ms, t.min_ms, t.repeats
            )?;
        }
        Ok(())
    }
}
