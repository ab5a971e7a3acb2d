//! The kernel benchmarks: the linear scan, the tree solve and the Myo layer's head solve,
//! each against its plain-candle reference.

use super::*;

/// Shape and options of a scan benchmark (`myo bench scan`).
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct ScanBench {
    /// Sequences per call.
    #[arg(long, visible_alias = "batch-size", default_value_t = 8)]
    pub batch: usize,
    /// Channels per step.
    #[arg(long, default_value_t = 256)]
    pub channels: usize,
    /// Steps per sequence.
    #[arg(long, default_value_t = 4096)]
    pub len: usize,
    /// Complex values (trailing dimension 2).
    #[arg(long)]
    pub complex: bool,
    /// Gate shared over batch and length, shape (channels), as S5's Λ̄.
    #[arg(long)]
    pub shared_a: bool,
    #[command(flatten)]
    #[serde(flatten)]
    pub timing: TimingArgs,
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
        let s = self.timing.dtype.size_in_bytes() * self.width();
        let n = self.batch * self.len * self.channels * s;
        let state = self.batch * self.channels * s;
        let a = if self.shared_a { self.channels * s } else { n };
        let fwd = a + 2 * n + state;
        let da = if self.shared_a { state } else { n };
        let bwd = a + 3 * n + state + da + state;
        (if self.timing.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Random inputs: b ~ U(-1, 1); a with modulus below 1 so the recurrence stays bounded.
    fn inputs(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let b = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.timing.dtype)?;
        let (lo, hi) = if self.complex {
            (-0.7f32, 0.7)
        } else {
            (0.5, 0.99)
        };
        let a = Tensor::rand(lo, hi, self.a_shape(), device)?.to_dtype(self.timing.dtype)?;
        Ok((a, b))
    }

    /// Runs the benchmark on `device`.
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        at_least(&[
            ("--batch", self.batch, 1),
            ("--channels", self.channels, 1),
            ("--len", self.len, 1),
        ])?;
        let (a, b) = self.inputs(device)?;
        let opts = self.opts();
        let g = Tensor::rand(-1f32, 1f32, self.b_shape(), device)?.to_dtype(self.timing.dtype)?;
        let ours = time_median(device, self.timing.warmup, self.timing.repeats, || {
            let h = linear_scan(&a, &b, None, opts)?;
            if self.timing.backward {
                linear_scan_backward(&a, &h, None, &g, opts)?;
            }
            Ok(())
        })?;
        let reference_ms = if self.timing.reference {
            let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
            Some(time_reference(device, || {
                let h = linear_scan_reference(va.as_tensor(), vb.as_tensor(), None, opts)?;
                if self.timing.backward {
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
            self.timing.dtype.as_str(),
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
        BenchReport::new(
            "scan",
            device,
            shape,
            self.timing.backward,
            self,
            self.timing.repeats,
            m,
        )
    }
}

/// Shape and options of a tree-solve benchmark (`myo bench tree`).
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct TreeBench {
    /// Samples per call.
    #[arg(long, visible_alias = "batch-size", default_value_t = 16)]
    pub batch: usize,
    /// Trees per sample.
    #[arg(long, default_value_t = 64)]
    pub heads: usize,
    /// Leaves of the tree (perfect when a power of --arity, else ragged).
    #[arg(long, default_value_t = 1024)]
    pub leaves: usize,
    /// Children per internal node.
    #[arg(long, default_value_t = 4)]
    pub arity: usize,
    /// Block size d.
    #[arg(long, default_value_t = 1)]
    pub block: usize,
    /// Right-hand sides r.
    #[arg(long, default_value_t = 1)]
    pub rhs: usize,
    /// Complex values (trailing dimension 2).
    #[arg(long)]
    pub complex: bool,
    /// Coefficients per sample (batch, heads, ...) instead of shared (heads, ...).
    #[arg(long)]
    pub per_sample: bool,
    /// The CUDA kernels' layout: the one measured fastest for each pass (auto), a block per
    /// tree (tree), trees across lanes (lanes) or the sweep (sweep).
    #[arg(long, value_enum, default_value_t = TreeLayout::Auto)]
    pub layout: TreeLayout,
    #[command(flatten)]
    #[serde(flatten)]
    pub timing: TimingArgs,
}

impl TreeBench {
    /// The tree: perfect when `leaves` is a power of `arity`, else ragged.
    pub fn tree(&self) -> Result<Tree> {
        Ok(Tree::ragged(self.leaves, self.arity)?)
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
        let s = self.timing.dtype.size_in_bytes();
        let (nu, nc) = (
            u.iter().product::<usize>() * s,
            coef.iter().product::<usize>() * s,
        );
        let fwd = 2 * nu + 3 * nc;
        let bwd = 3 * nc + 3 * nu + 3 * nc;
        (if self.timing.backward { fwd + bwd } else { fwd }) as u64
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
        let t = |x: Tensor| x.to_dtype(self.timing.dtype);
        Ok([
            t(a)?,
            t(rand(-s, s, &coef_shape)?)?,
            t(rand(-s, s, &coef_shape)?)?,
            t(rand(-1.0, 1.0, &u_shape)?)?,
        ])
    }

    /// Runs the benchmark on `device`.
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        at_least(&[
            ("--batch", self.batch, 1),
            ("--heads", self.heads, 1),
            ("--leaves", self.leaves, 1),
            ("--arity", self.arity, 2),
            ("--block", self.block, 1),
            ("--rhs", self.rhs, 1),
        ])?;
        let tree = self.tree()?;
        let [a, b, c, u] = self.inputs(tree.len(), device)?;
        let opts = TreeSolveOptions {
            complex: self.complex,
            layout: self.layout,
        };
        let g = Tensor::rand(-1f32, 1f32, u.shape(), device)?.to_dtype(self.timing.dtype)?;
        let ours = time_median(device, self.timing.warmup, self.timing.repeats, || {
            let x = tree_solve(&tree, &a, &b, &c, &u, opts)?;
            if self.timing.backward {
                tree_solve_backward(&tree, &a, &b, &c, &x, &g, opts)?;
            }
            Ok(())
        })?;
        let (reference_ms, reference_note) = if !self.timing.reference {
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
                if self.timing.backward {
                    (x * &g)?.sum_all()?.backward()?;
                }
                Ok(())
            })?;
            (Some(ms), None)
        };
        let shape = format!(
            "(batch {}, heads {}, {} leaves, {}-ary, {} nodes, d {}, r {}) {} {}, coefficients {}, \
             layout {:?}{}",
            self.batch,
            self.heads,
            self.leaves,
            self.arity,
            tree.len(),
            self.block,
            self.rhs,
            self.timing.dtype.as_str(),
            if self.complex { "complex" } else { "real" },
            if self.per_sample { "per sample" } else { "shared" },
            self.layout,
            launched(&tree, [&a, &b, &c, &u], opts, device)?,
        );
        let m = Measured {
            ours,
            bytes: self.bytes(tree.len()),
            reference_ms,
            reference: "plain candle ops",
            reference_note,
            copy_elems: u.elem_count().max(1 << 20),
        };
        BenchReport::new(
            "tree",
            device,
            shape,
            self.timing.backward,
            self,
            self.timing.repeats,
            m,
        )
    }
}

/// On CUDA, the forward's kernels with their grid and block shape (what the layout resolved
/// to), else nothing.
fn launched(
    tree: &Tree,
    t: [&Tensor; 4],
    opts: TreeSolveOptions,
    device: &Device,
) -> Result<String> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        let [a, b, c, u] = t;
        let limits = crate::cuda::limits(dev)?;
        let plans = crate::ops::tree_solve::cuda::forward_plans(tree, a, b, c, u, opts, limits)?;
        let kernels: Vec<String> = plans
            .iter()
            .map(|p| format!("{} grid {} block {:?}", p.kernel, p.grid[0], &p.block[..2]))
            .collect();
        return Ok(format!(" ({})", kernels.join(" + ")));
    }
    let _ = (tree, t, opts, device);
    Ok(String::new())
}

/// Shape of a benchmark of the Myo layer's solve ([`head_solve_skew()`]): skew couplings (the
/// layer's default) over a ragged tree, inputs on the leaves.
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct HeadBench {
    /// Samples per call.
    #[arg(long, visible_alias = "batch-size", default_value_t = 16)]
    pub batch: usize,
    /// Trees per sample.
    #[arg(long, default_value_t = 64)]
    pub heads: usize,
    /// Leaves of the tree (perfect when a power of --arity, else ragged).
    #[arg(long, default_value_t = 784)]
    pub leaves: usize,
    /// Children per internal node.
    #[arg(long, default_value_t = 4)]
    pub arity: usize,
    #[command(flatten)]
    #[serde(flatten)]
    pub timing: TimingArgs,
}

impl HeadBench {
    /// Bytes the timed unit must move at the least. Forward: read u, the bias and the couplings
    /// s; write x. Backward: read ∂x, x and s; write ∂u, ∂bias and ∂s.
    pub fn bytes(&self, tree: &Tree) -> u64 {
        let cx = 2 * self.timing.dtype.size_in_bytes() * self.heads;
        let (n, internal) = (tree.len(), tree.len() - tree.leaves());
        let (u, x) = (self.batch * tree.leaves() * cx, self.batch * n * cx);
        let (bias, coef) = (internal * cx, n * cx);
        let fwd = u + bias + coef + x;
        let bwd = 2 * x + coef + u + bias + coef;
        (if self.timing.backward { fwd + bwd } else { fwd }) as u64
    }

    /// Runs the benchmark on `device`. The reference is the general [`tree_solve()`] as the layer
    /// would call it in that op's layout: u transposed to (batch, heads, nodes) with the bias
    /// concatenated, A = 1 stacked, x transposed back (autograd for the backward).
    pub fn run(&self, device: &Device) -> Result<BenchReport> {
        at_least(&[
            ("--batch", self.batch, 1),
            ("--heads", self.heads, 1),
            ("--leaves", self.leaves, 1),
            ("--arity", self.arity, 2),
        ])?;
        let tree = Tree::ragged(self.leaves, self.arity)?;
        let (b, h, n, l) = (self.batch, self.heads, tree.len(), tree.leaves());
        let rand = |shape: &[usize]| {
            Tensor::rand(-1f32, 1f32, shape, device).and_then(|t| t.to_dtype(self.timing.dtype))
        };
        let (u, bias, s) = (
            rand(&[b, l, h, 2])?,
            rand(&[h, n - l, 2])?,
            rand(&[h, n, 2])?,
        );
        let g = rand(&[b, n, h, 2])?;
        let ours = time_median(device, self.timing.warmup, self.timing.repeats, || {
            let x = head_solve_skew(&tree, &u, &bias, &s)?;
            if self.timing.backward {
                head_solve_skew_backward(&tree, &u, &bias, &s, &x, &g)?;
            }
            Ok(())
        })?;
        let reference_ms = if self.timing.reference {
            // The same system with B = −s and C = conj(s), each (nodes, heads, 2).
            let signs = Tensor::new(&[1f32, -1.], device)?.to_dtype(self.timing.dtype)?;
            let (cb, cc) = (
                s.neg()?.transpose(0, 1)?,
                s.broadcast_mul(&signs)?.transpose(0, 1)?,
            );
            let (vu, vbias, vb, vc) = (
                Var::from_tensor(&u)?,
                Var::from_tensor(&bias)?,
                Var::from_tensor(&cb)?,
                Var::from_tensor(&cc)?,
            );
            let by_head = |t: &Tensor| t.transpose(0, 1)?.reshape((h, n, 1, 1, 2));
            let ones = Tensor::ones((h, n, 1), self.timing.dtype, device)?;
            let a = Tensor::cat(&[&ones, &ones.zeros_like()?], 2)?.reshape((h, n, 1, 1, 2))?;
            Some(time_reference(device, || {
                let virt = vbias.as_tensor().unsqueeze(0)?;
                let full = Tensor::cat(
                    &[
                        vu.as_tensor().transpose(1, 2)?,
                        virt.broadcast_as((b, h, n - l, 2))?,
                    ],
                    2,
                )?
                .reshape((b, h, n, 1, 1, 2))?;
                let opts = TreeSolveOptions {
                    complex: true,
                    ..Default::default()
                };
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
                if self.timing.backward {
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
            self.timing.dtype.as_str()
        );
        let m = Measured {
            ours,
            bytes: self.bytes(&tree),
            reference_ms,
            reference: "the general tree_solve in its layout",
            reference_note: None,
            copy_elems: g.elem_count().max(1 << 20),
        };
        BenchReport::new(
            "heads",
            device,
            shape,
            self.timing.backward,
            self,
            self.timing.repeats,
            m,
        )
    }
}

/// Refuses a shape flag below its least value, naming it.
fn at_least(flags: &[(&str, usize, usize)]) -> Result<()> {
    for &(flag, value, least) in flags {
        if value < least {
            candle_core::bail!("{flag} {value}: expected at least {least}");
        }
    }
    Ok(())
}
