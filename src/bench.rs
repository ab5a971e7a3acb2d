//! Kernel and training-step benchmarks behind `myo bench` and `benches/`.
//!
//! Kernels here are memory-bound, so each benchmark counts the bytes that must move (every
//! input read once, every output written once), reports them over the median time as effective
//! GB/s, measures the device's copy bandwidth on a buffer of the same size for comparison, and
//! times a plain-candle reference of the same computation on the same device.

use crate::device::describe;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use serde::Serialize;

use crate::nn::{
    ClassifierConfig, DropoutKey, EncoderConfig, Mode, SeqLayerConfig, SequenceClassifier,
};

use crate::ops::{
    head_solve, head_solve_backward, linear_scan, linear_scan_backward, linear_scan_reference,
    tree_solve, tree_solve_backward, tree_solve_reference, ScanOptions, TreeSolveOptions,
};
use crate::tree::Tree;

/// Median and minimum of repeated timings, in milliseconds per call.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Timing {
    pub median_ms: f64,
    pub min_ms: f64,
    /// Timed samples.
    pub repeats: usize,
    /// Calls per sample (short calls are batched between device synchronisations).
    pub calls_per_sample: usize,
}

/// Times `f`: `warmup` untimed calls, then `repeats` samples. Each sample runs `f` enough times
/// to last about 20 ms and synchronises the device before reading the clock, so asynchronous
/// GPU work is counted and launch gaps are amortised. A call that takes over a second is timed
/// once (the slow references).
pub fn time_median(
    device: &Device,
    warmup: usize,
    repeats: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    for _ in 0..warmup {
        f()?;
    }
    device.synchronize()?;
    let probe = Instant::now();
    f()?;
    device.synchronize()?;
    let once = probe.elapsed().as_secs_f64();
    if once > 1.0 {
        return Ok(Timing {
            median_ms: once * 1e3,
            min_ms: once * 1e3,
            repeats: 1,
            calls_per_sample: 1,
        });
    }
    let calls = ((0.02 / once.max(1e-9)) as usize).clamp(1, 1000);
    let mut samples = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        device.synchronize()?;
        samples.push(start.elapsed().as_secs_f64() * 1e3 / calls as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Timing {
        median_ms: samples[samples.len() / 2],
        min_ms: samples[0],
        repeats: samples.len(),
        calls_per_sample: calls,
    })
}

/// Device copy bandwidth in GB/s (bytes read + written), measured with a copy of `elems` f32.
pub fn copy_bandwidth(device: &Device, elems: usize, repeats: usize) -> Result<f64> {
    let x = Tensor::rand(0f32, 1f32, elems, device)?;
    let t = time_median(device, 2, repeats, || x.copy().map(drop))?;
    Ok(2.0 * (elems * 4) as f64 / (t.median_ms * 1e-3) / 1e9)
}

/// Shape and options of a scan benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct ScanBench {
    pub batch: usize,
    pub channels: usize,
    pub len: usize,
    pub complex: bool,
    /// Gate shared across batch and length: shape (channels), as S5's Λ̄.
    pub shared_a: bool,
    /// Time forward + backward instead of forward alone.
    pub backward: bool,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
    /// Also time the plain-candle reference (a loop over the length; slow).
    pub reference: bool,
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.as_str())
}

/// What one benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub op: &'static str,
    pub device: String,
    /// The shape and options in one line.
    pub shape: String,
    pub backward: bool,
    pub config: serde_json::Value,
    pub median_ms: f64,
    pub min_ms: f64,
    pub repeats: usize,
    /// Bytes that must move per timed call.
    pub bytes: u64,
    /// Effective bandwidth: bytes / median time.
    pub gbps: f64,
    /// Device copy bandwidth measured on a buffer the size of b (read + write).
    pub copy_gbps: f64,
    /// gbps / copy_gbps × 100.
    pub pct_of_copy: f64,
    pub reference_median_ms: Option<f64>,
    /// What the reference is.
    pub reference: &'static str,
    pub speedup: Option<f64>,
    /// Why no reference was timed, when none was.
    pub reference_note: Option<String>,
}

/// What a benchmark hands to [`BenchReport::new`].
struct Measured {
    ours: Timing,
    bytes: u64,
    reference_ms: Option<f64>,
    /// What the reference is.
    reference: &'static str,
    reference_note: Option<String>,
    /// Elements (f32) of the copy used to measure the copy bandwidth.
    copy_elems: usize,
}

impl BenchReport {
    fn new<C: Serialize>(
        op: &'static str,
        device: &Device,
        shape: String,
        backward: bool,
        config: &C,
        repeats: usize,
        m: Measured,
    ) -> Result<BenchReport> {
        let gbps = m.bytes as f64 / (m.ours.median_ms * 1e-3) / 1e9;
        let copy_gbps = copy_bandwidth(device, m.copy_elems, repeats)?;
        Ok(BenchReport {
            op,
            device: describe(device),
            shape,
            backward,
            config: serde_json::to_value(config)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?,
            median_ms: m.ours.median_ms,
            min_ms: m.ours.min_ms,
            repeats: m.ours.repeats,
            bytes: m.bytes,
            gbps,
            copy_gbps,
            pct_of_copy: 100.0 * gbps / copy_gbps,
            reference_median_ms: m.reference_ms,
            speedup: m.reference_ms.map(|r| r / m.ours.median_ms),
            reference: m.reference,
            reference_note: m.reference_note,
        })
    }
}

/// Times the plain-candle reference `f` (already differentiable) on `device`: one warm-up on a
/// GPU (kernel loading), none on the CPU, where one call can take minutes.
fn time_reference(device: &Device, f: impl FnMut() -> Result<()>) -> Result<f64> {
    let warmup = usize::from(!device.is_cpu());
    Ok(time_median(device, warmup, 3, f)?.median_ms)
}

impl ScanBench {
    fn opts(&self) -> ScanOptions {
        ScanOptions {
            complex: self.complex,
            reverse: false,
        }
    }

    fn width(&self) -> usize {
        if self.complex {
            2
        } else {
            1
        }
    }

    fn b_shape(&self) -> Vec<usize> {
        let mut s = vec![self.batch, self.len, self.channels];
        if self.complex {
            s.push(2);
        }
        s
    }

    fn a_shape(&self) -> Vec<usize> {
        if self.shared_a {
            let mut s = vec![self.channels];
            if self.complex {
                s.push(2);
            }
            s
        } else {
            self.b_shape()
        }
    }

    /// Bytes the timed unit must move at the least.
    /// Forward: read a, b, h_0; write h. Backward: read a, h, h_0 and ∂h; write ∂b, ∂a (per-batch
    /// partials when a is shared), ∂h_0.
    pub fn bytes(&self) -> u64 {
        let s = self.dtype.size_in_bytes() * self.width();
        let n = self.batch * self.len * self.channels * s;
        let state = self.batch * self.channels * s;
        let a = if self.shared_a { self.channels * s } else { n };
        let fwd = a + 2 * n + state;
        let da = if self.shared_a { state } else { n };
        let bwd = a + 3 * n + state + da + state;
        (if self.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Random inputs: b ~ U(-1, 1); a with modulus below 1 so the recurrence stays bounded.
    fn inputs(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let b = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.dtype)?;
        let (lo, hi) = if self.complex {
            (-0.7f32, 0.7)
        } else {
            (0.5, 0.99)
        };
        let a = Tensor::rand(lo, hi, self.a_shape(), device)?.to_dtype(self.dtype)?;
        Ok((a, b))
    }

    /// Runs the benchmark on `device`.
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        let (a, b) = self.inputs(device)?;
        let opts = self.opts();
        let g = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.dtype)?;
        let ours = time_median(device, self.warmup, self.repeats, || {
            let h = linear_scan(&a, &b, None, opts)?;
            if self.backward {
                linear_scan_backward(&a, &h, None, &g, opts)?;
            }
            Ok(())
        })?;
        let reference_ms = if self.reference {
            let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
            Some(time_reference(device, || {
                let h = linear_scan_reference(va.as_tensor(), vb.as_tensor(), None, opts)?;
                if self.backward {
                    (h * &g)?.sum_all()?.backward()?;
                }
                Ok(())
            })?)
        } else {
            None
        };
        let shape = format!(
            "(batch {}, len {}, channels {}) {} {}, a: {}",
            self.batch,
            self.len,
            self.channels,
            self.dtype.as_str(),
            if self.complex { "complex" } else { "real" },
            if self.shared_a {
                "shared (channels)"
            } else {
                "full"
            },
        );
        let m = Measured {
            ours,
            bytes: self.bytes(),
            reference_ms,
            reference: "plain candle ops",
            reference_note: None,
            copy_elems: b.elem_count(),
        };
        BenchReport::new("scan", device, shape, self.backward, self, self.repeats, m)
    }
}

/// Shape and options of a tree-solve benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct TreeBench {
    pub batch: usize,
    pub heads: usize,
    pub leaves: usize,
    pub arity: usize,
    /// Block size d.
    pub block: usize,
    /// Right-hand sides r.
    pub rhs: usize,
    pub complex: bool,
    /// Coefficients per sample (batch, heads, ...) instead of shared (heads, ...).
    pub per_sample: bool,
    pub backward: bool,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
    pub reference: bool,
}

impl TreeBench {
    /// The tree: perfect when `leaves` is a power of `arity`, else ragged.
    pub fn tree(&self) -> Result<Tree> {
        Tree::ragged(self.leaves, self.arity).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    fn shapes(&self, nodes: usize) -> (Vec<usize>, Vec<usize>) {
        let (d, r) = (self.block, self.rhs);
        let mut u = vec![self.batch, self.heads, nodes, d, r];
        let mut coef = if self.per_sample {
            vec![self.batch, self.heads, nodes, d, d]
        } else {
            vec![self.heads, nodes, d, d]
        };
        if self.complex {
            u.push(2);
            coef.push(2);
        }
        (u, coef)
    }

    /// Bytes the timed unit must move at the least. Forward: read u, A, B, C; write x.
    /// Backward: read A, B, C, x and ∂x; write ∂u, ∂A, ∂B, ∂C.
    pub fn bytes(&self, nodes: usize) -> u64 {
        let (u, coef) = self.shapes(nodes);
        let s = self.dtype.size_in_bytes();
        let (nu, nc) = (
            u.iter().product::<usize>() * s,
            coef.iter().product::<usize>() * s,
        );
        let fwd = 2 * nu + 3 * nc;
        let bwd = 3 * nc + 3 * nu + 3 * nc;
        (if self.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Random inputs with T_G diagonally dominant, as the layer keeps it: off-diagonal entries
    /// of every block in ±s with s = 0.5 / (d (arity + 2)), diagonal of A in [1, 1.5].
    fn inputs(&self, nodes: usize, device: &Device) -> Result<[Tensor; 4]> {
        let (u_shape, coef_shape) = self.shapes(nodes);
        let s = 0.5 / (self.block * (self.arity + 2)) as f32;
        let rand = |lo: f32, hi: f32, shape: &[usize]| Tensor::rand(lo, hi, shape, device);
        let mut eye = Tensor::eye(self.block, DType::F32, device)?;
        if self.complex {
            eye = Tensor::stack(&[&eye, &eye.zeros_like()?], 2)?;
        }
        let diag = eye.broadcast_mul(&rand(1.0, 1.5, &coef_shape)?)?;
        let off = (eye.ones_like()? - &eye)?;
        let a = (diag + off.broadcast_mul(&rand(-s, s, &coef_shape)?)?)?;
        let t = |x: Tensor| x.to_dtype(self.dtype);
        Ok([
            t(a)?,
            t(rand(-s, s, &coef_shape)?)?,
            t(rand(-s, s, &coef_shape)?)?,
            t(rand(-1.0, 1.0, &u_shape)?)?,
        ])
    }

    /// Runs the benchmark on `device`.
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        let tree = self.tree()?;
        let [a, b, c, u] = self.inputs(tree.len(), device)?;
        let opts = TreeSolveOptions {
            complex: self.complex,
        };
        let g = Tensor::rand(-1f32, 1f32, u.shape(), device)?.to_dtype(self.dtype)?;
        let ours = time_median(device, self.warmup, self.repeats, || {
            let x = tree_solve(&tree, &a, &b, &c, &u, opts)?;
            if self.backward {
                tree_solve_backward(&tree, &a, &b, &c, &x, &g, opts)?;
            }
            Ok(())
        })?;
        let (reference_ms, reference_note) = if !self.reference {
            (None, None)
        } else if self.block != 1 {
            (
                None,
                Some("the Listing-1 reference covers scalar blocks (d = 1) only".to_string()),
            )
        } else {
            let (va, vb, vc, vu) = (
                Var::from_tensor(&a)?,
                Var::from_tensor(&b)?,
                Var::from_tensor(&c)?,
                Var::from_tensor(&u)?,
            );
            let ms = time_reference(device, || {
                let x = tree_solve_reference(
                    &tree,
                    va.as_tensor(),
                    vb.as_tensor(),
                    vc.as_tensor(),
                    vu.as_tensor(),
                    opts,
                )?;
                if self.backward {
                    (x * &g)?.sum_all()?.backward()?;
                }
                Ok(())
            })?;
            (Some(ms), None)
        };
        let shape =
            format!(
            "(batch {}, heads {}, {} leaves, {}-ary, {} nodes, d {}, r {}) {} {}, coefficients {}",
            self.batch,
            self.heads,
            self.leaves,
            self.arity,
            tree.len(),
            self.block,
            self.rhs,
            self.dtype.as_str(),
            if self.complex { "complex" } else { "real" },
            if self.per_sample { "per sample" } else { "shared" },
        );
        let m = Measured {
            ours,
            bytes: self.bytes(tree.len()),
            reference_ms,
            reference: "plain candle ops",
            reference_note,
            copy_elems: u.elem_count().max(1 << 20),
        };
        BenchReport::new("tree", device, shape, self.backward, self, self.repeats, m)
    }
}

/// Shape of a benchmark of the Myo layer's solve ([`head_solve()`]): skew couplings (the layer's
/// default) over a ragged tree, inputs on the leaves.
#[derive(Debug, Clone, Serialize)]
pub struct HeadBench {
    pub batch: usize,
    pub heads: usize,
    pub leaves: usize,
    pub arity: usize,
    pub backward: bool,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
    pub reference: bool,
}

impl HeadBench {
    /// Bytes the timed unit must move at the least. Forward: read u, the bias, B and C; write
    /// x. Backward: read ∂x, x, B and C; write ∂u, ∂bias, ∂B and ∂C.
    pub fn bytes(&self, tree: &Tree) -> u64 {
        let cx = 2 * self.dtype.size_in_bytes() * self.heads;
        let (n, internal) = (tree.len(), tree.len() - tree.leaves());
        let (u, x) = (self.batch * tree.leaves() * cx, self.batch * n * cx);
        let (bias, coef) = (internal * cx, 2 * n * cx);
        let fwd = u + bias + coef + x;
        let bwd = 2 * x + coef + u + bias + coef;
        (if self.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Runs the benchmark on `device`. The reference is the general [`tree_solve()`] as the layer
    /// would call it in that op's layout: u transposed to (batch, heads, nodes) with the bias
    /// concatenated, A = 1 stacked, x transposed back (autograd for the backward).
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        let tree = Tree::ragged(self.leaves, self.arity)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (b, h, n, l) = (self.batch, self.heads, tree.len(), tree.leaves());
        let rand = |shape: &[usize]| {
            Tensor::rand(-1f32, 1f32, shape, device).and_then(|t| t.to_dtype(self.dtype))
        };
        let (u, bias, z) = (
            rand(&[b, l, h, 2])?,
            rand(&[n - l, h, 2])?,
            rand(&[n, h, 2])?,
        );
        let signs = Tensor::new(&[1f32, -1.], device)?.to_dtype(self.dtype)?;
        let (cb, cc) = (z.neg()?, z.broadcast_mul(&signs)?);
        let g = rand(&[b, n, h, 2])?;
        let ours = time_median(device, self.warmup, self.repeats, || {
            let x = head_solve(&tree, &u, &bias, &cb, &cc)?;
            if self.backward {
                head_solve_backward(&tree, &u, &bias, &cb, &cc, &x, &g)?;
            }
            Ok(())
        })?;
        let reference_ms = if self.reference {
            let (vu, vbias, vb, vc) = (
                Var::from_tensor(&u)?,
                Var::from_tensor(&bias)?,
                Var::from_tensor(&cb)?,
                Var::from_tensor(&cc)?,
            );
            let by_head = |t: &Tensor| t.transpose(0, 1)?.reshape((h, n, 1, 1, 2));
            let ones = Tensor::ones((h, n, 1), self.dtype, device)?;
            let a = Tensor::cat(&[&ones, &ones.zeros_like()?], 2)?.reshape((h, n, 1, 1, 2))?;
            Some(time_reference(device, || {
                let virt = vbias.as_tensor().transpose(0, 1)?.unsqueeze(0)?;
                let full = Tensor::cat(
                    &[
                        vu.as_tensor().transpose(1, 2)?,
                        virt.broadcast_as((b, h, n - l, 2))?,
                    ],
                    2,
                )?
                .reshape((b, h, n, 1, 1, 2))?;
                let opts = TreeSolveOptions { complex: true };
                let x = tree_solve(
                    &tree,
                    &a,
                    &by_head(vb.as_tensor())?,
                    &by_head(vc.as_tensor())?,
                    &full,
                    opts,
                )?
                .reshape((b, h, n, 2))?
                .transpose(1, 2)?
                .contiguous()?;
                if self.backward {
                    (x * &g)?.sum_all()?.backward()?;
                }
                Ok(())
            })?)
        } else {
            None
        };
        let shape = format!(
            "(batch {b}, heads {h}, {l} leaves, {}-ary, {n} nodes) {} complex, skew couplings",
            self.arity,
            self.dtype.as_str()
        );
        let m = Measured {
            ours,
            bytes: self.bytes(&tree),
            reference_ms,
            reference: "the general tree_solve in its layout",
            reference_note: None,
            copy_elems: g.elem_count().max(1 << 20),
        };
        BenchReport::new("heads", device, shape, self.backward, self, self.repeats, m)
    }
}

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
            Mode::Train(DropoutKey {
                seed: 0,
                step,
                first_row: 0,
            })
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
