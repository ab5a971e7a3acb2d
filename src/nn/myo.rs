//! The Myo layer (Myosotis paper §3.2–3.5): the S5 layer with the scan replaced by the tree
//! solve x = T_G⁻¹ u over a tree whose leaves are the sequence.
//!
//! Per head h (scalar blocks, d = 1, complex):
//! * u: the leaves get the input projection u_leaf = B_in x (B_in complex, heads × H); every
//!   internal ("virtual") node v gets a learned input u_v (a parameter per head and node);
//! * T_G (§3.5): gauge A_v = 1; couplings B_v = β φ(b_v) with φ(z) = z tanh|z| / |z| (onto the
//!   open unit disk) and β = (1 − 10⁻³)/(1 + k_max), k_max the largest child count; C_v =
//!   conj(B_v) (`symmetric`, the default) or β φ(c_v). Every row of T_G then has off-diagonal
//!   moduli summing to less than |A_v| = 1: T_G is strictly diagonally dominant by construction,
//!   so every pivot of the solve stays away from zero;
//! * couplings per level (shared by the nodes of a level) or per node (`per_level`);
//! * initialisation (§3.5, from S5): head h's couplings start at −Λ̄_h (scaled by β), with
//!   Λ̄_h = exp(λ_h Δ_h), λ_h the HiPPO-N eigenvalues (one of each conjugate pair) and Δ_h
//!   log-uniform in [dt_min, dt_max];
//! * output y_v = Re(C_out x_v) for every node, plus D ⊙ input on the leaves.
//!
//! Pooling only the top levels of a last layer (not its leaves) leaves that layer's D unused.
//!
//! `forward` returns the leaves (batch, L, H) for the next layer; `forward_nodes` returns all
//! nodes (batch, nodes, H) for the Myo poolings (root, top levels).
//!
//! Parameters: `b_in` (heads, H, 2), `virtual_u` (heads, internal nodes, 2), `coupling_b`
//! (heads, levels or nodes, 2), `coupling_c` (same, only when not symmetric), `c_out`
//! (H, heads, 2), `d` (H).

use candle_core::{Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::hippo::block_init;
use super::param_with;
use crate::ops::{channel_mul, swap_dims12, tree_solve, TreeSolveOptions};
use crate::tree::Tree;

/// The tree of a Myo layer, as a config can name it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TreeSpec {
    /// k-ary over any number of leaves (perfect when a power of k): token sequences.
    Ragged { leaves: usize, arity: usize },
    /// The quad tree of a height × width image in Morton order.
    Quad { height: usize, width: usize },
    /// A chain (the SSM case, paper §3.4).
    Chain { len: usize },
}

impl TreeSpec {
    pub fn build(&self) -> Result<Tree> {
        let t = match *self {
            TreeSpec::Ragged { leaves, arity } => Tree::ragged(leaves, arity),
            TreeSpec::Quad { height, width } => Tree::quad(height, width),
            TreeSpec::Chain { len } => Tree::chain(len),
        };
        t.map_err(|e| candle_core::Error::Msg(format!("Myo: {e}")))
    }
}

/// Configuration of a [`Myo`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MyoConfig {
    /// Model width H.
    pub d_model: usize,
    /// Heads (scalar trees per sample); the paper matches them to S5's state size.
    pub heads: usize,
    pub tree: TreeSpec,
    /// Couplings shared by the nodes of a level instead of one per node.
    #[serde(default)]
    pub per_level: bool,
    /// C_v = conj(B_v) (paper §3.5; Bᵀ for real blocks); otherwise C is a separate parameter.
    #[serde(default = "yes")]
    pub symmetric: bool,
    /// Block size d: 1 (scalar complex heads, the default and the paper's setting) or d > 1
    /// (real d × d blocks).
    #[serde(default = "one")]
    pub block: usize,
    #[serde(default = "dt_min")]
    pub dt_min: f64,
    #[serde(default = "dt_max")]
    pub dt_max: f64,
    #[serde(default)]
    pub seed: u64,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn dt_min() -> f64 {
    0.001
}
fn dt_max() -> f64 {
    0.1
}

/// The Myo layer: (batch, leaves, H) → (batch, leaves, H).
#[derive(Clone, Debug)]
pub struct Myo {
    cfg: MyoConfig,
    tree: Tree,
    beta: f64,
    /// Level of each node, for per-level couplings.
    node_level: Tensor,
    b_in: Tensor,
    virtual_u: Tensor,
    coupling_b: Tensor,
    coupling_c: Option<Tensor>,
    c_out: Tensor,
    d: Tensor,
}

/// φ⁻¹ on the open unit disk: z · atanh|z| / |z|.
fn unsquash(re: f64, im: f64) -> (f64, f64) {
    let m = re.hypot(im);
    if m == 0.0 {
        return (0.0, 0.0);
    }
    let s = m.min(1.0 - 1e-9).atanh() / m;
    (re * s, im * s)
}

impl Myo {
    pub fn new(cfg: MyoConfig, vb: VarBuilder) -> Result<Self> {
        let tree = cfg.tree.build()?;
        let (h, heads, n, d) = (cfg.d_model, cfg.heads, tree.len(), cfg.block);
        if h == 0 || heads == 0 || d == 0 {
            candle_core::bail!("Myo: d_model, heads and block must be positive");
        }
        let levels = tree.levels();
        let k_max = (0..n).map(|v| tree.children(v).len()).max().unwrap_or(0);
        let beta = (1.0 - 1e-3) / (1 + k_max) as f64;
        let per = if cfg.per_level { levels } else { n };
        let internal = n - tree.leaves();
        let level_of: Vec<u32> = (0..levels)
            .flat_map(|k| tree.level(k).map(move |_| k as u32))
            .collect();
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let mut randn = |count: usize, std: f64| -> Vec<f64> {
            (0..count)
                .map(|_| {
                    let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
                    std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
                })
                .collect()
        };
        // Initial values: scalar complex heads ((…, 2) = re, im) or real d × d blocks.
        let (w, coupling, coupling_shape) = if d == 1 {
            // HiPPO-N eigenvalues, one of each conjugate pair per head, discretised with ZOH;
            // the couplings start at −β Λ̄_h.
            let init = block_init(2 * heads, 1, true)
                .map_err(|e| candle_core::Error::Msg(format!("Myo: {e}")))?;
            let (lo, hi) = (cfg.dt_min.ln(), cfg.dt_max.ln());
            let steps: Vec<f64> = {
                let mut r = StdRng::seed_from_u64(cfg.seed ^ 0x5eed);
                (0..heads).map(|_| r.random_range(lo..hi).exp()).collect()
            };
            let mut c = Vec::with_capacity(heads * per * 2);
            for (lam, step) in init.lambda.iter().zip(&steps) {
                let lbar = (lam * step).exp();
                let (re, im) = unsquash(-lbar.re * (1.0 - 1e-3), -lbar.im * (1.0 - 1e-3));
                for _ in 0..per {
                    c.extend([re, im]);
                }
            }
            (2, c, vec![heads, per, 2])
        } else {
            // HiPPO-N initialises scalar heads; blocks start from random couplings.
            (d, randn(heads * per * d * d, 0.5), vec![heads, per, d, d])
        };
        // For scalar heads the complex parts each get half the variance.
        let part = if d == 1 { 0.5f64.sqrt() } else { 1.0 };
        let b_in = randn(heads * w * h, part * (1.0 / h as f64).sqrt());
        let c_out = randn(
            h * heads * w,
            part * (1.0 / (heads * if d == 1 { 1 } else { d }) as f64).sqrt(),
        );
        let skip = randn(h, 1.0);
        let (b_in_shape, c_out_shape) = if d == 1 {
            (vec![heads, h, 2], vec![h, heads, 2])
        } else {
            (vec![heads, d, h], vec![h, heads, d])
        };
        let t = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu);
        let coupling_c = if cfg.symmetric {
            None
        } else {
            let init = if d == 1 {
                coupling.clone()
            } else {
                randn(heads * per * d * d, 0.5)
            };
            Some(param_with(&vb, "coupling_c", t(init, &coupling_shape)?)?)
        };
        Ok(Myo {
            node_level: Tensor::new(level_of, vb.device())?,
            b_in: param_with(&vb, "b_in", t(b_in, &b_in_shape)?)?,
            virtual_u: param_with(
                &vb,
                "virtual_u",
                t(vec![0.0; heads * internal * w], &[heads, internal, w])?,
            )?,
            coupling_b: param_with(&vb, "coupling_b", t(coupling, &coupling_shape)?)?,
            coupling_c,
            c_out: param_with(&vb, "c_out", t(c_out, &c_out_shape)?)?,
            d: param_with(&vb, "d", t(skip, &[h])?)?,
            beta,
            tree,
            cfg,
        })
    }

    pub fn config(&self) -> &MyoConfig {
        &self.cfg
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// Per node: β φ(raw), (heads, nodes, 2); for d × d blocks β M / (1 + max(‖M‖∞, ‖M‖₁)),
    /// (heads, nodes, d, d), whose rows and columns both sum to less than β in modulus.
    fn coupling(&self, raw: &Tensor) -> Result<Tensor> {
        let raw = if self.cfg.per_level {
            raw.index_select(&self.node_level, 1)?
        } else {
            raw.clone()
        };
        if self.cfg.block > 1 {
            let abs = raw.abs()?;
            let rows = abs.sum(D::Minus1)?.max_keepdim(D::Minus1)?;
            let cols = abs.sum(D::Minus2)?.max_keepdim(D::Minus1)?;
            let scale = (rows.maximum(&cols)? + 1.0)?
                .recip()?
                .unsqueeze(D::Minus1)?;
            return raw.broadcast_mul(&scale)? * self.beta;
        }
        let m = (raw.sqr()?.sum_keepdim(D::Minus1)? + 1e-12)?.sqrt()?;
        raw.broadcast_mul(&(m.tanh()? / m)?)? * self.beta
    }

    /// The blocks of T_G: A = 1, B, C, each (heads, nodes, 1, 1, 2); for d × d blocks
    /// A = I, B, C (heads, nodes, d, d).
    pub fn blocks(&self) -> Result<(Tensor, Tensor, Tensor)> {
        let b = self.coupling(&self.coupling_b)?;
        if self.cfg.block > 1 {
            let c = match &self.coupling_c {
                Some(raw) => self.coupling(raw)?,
                None => b.transpose(2, 3)?.contiguous()?,
            };
            let eye = Tensor::eye(self.cfg.block, b.dtype(), b.device())?;
            return Ok((eye.broadcast_as(b.shape())?.contiguous()?, b, c));
        }
        let c = match &self.coupling_c {
            Some(raw) => self.coupling(raw)?,
            None => Tensor::cat(&[b.narrow(2, 0, 1)?, b.narrow(2, 1, 1)?.neg()?], 2)?,
        };
        let (heads, n) = (self.cfg.heads, self.tree.len());
        let a = Tensor::cat(
            &[
                Tensor::ones((heads, n, 1), b.dtype(), b.device())?,
                Tensor::zeros((heads, n, 1), b.dtype(), b.device())?,
            ],
            2,
        )?;
        let shape = (heads, n, 1, 1, 2);
        Ok((a.reshape(shape)?, b.reshape(shape)?, c.reshape(shape)?))
    }

    /// Outputs of every node: (batch, nodes, H); the leaves include the D skip (internal nodes
    /// have no input to skip).
    pub fn forward_nodes(&self, x: &Tensor) -> Result<Tensor> {
        let len = self.check_input(x)?;
        let n = self.tree.len();
        let y = self.outputs(x, n)?;
        let leaves = (y.narrow(1, 0, len)? + channel_mul(x, &self.d)?)?;
        if n == len {
            return Ok(leaves);
        }
        Tensor::cat(&[leaves, y.narrow(1, len, n - len)?], 1)
    }

    /// The input's length, checked against the tree and d_model.
    fn check_input(&self, x: &Tensor) -> Result<usize> {
        let (_, len, h) = x.dims3()?;
        if len != self.tree.leaves() || h != self.cfg.d_model {
            candle_core::bail!(
                "Myo: input (batch, {len}, {h}) does not match the tree's {} leaves and d_model {}",
                self.tree.leaves(),
                self.cfg.d_model
            );
        }
        Ok(len)
    }

    /// Re(C_out x_v) (scalar heads) or C_out x_v (blocks) for the first `count` nodes (the
    /// leaves come first in the numbering): (batch, count, H).
    fn outputs(&self, x: &Tensor, count: usize) -> Result<Tensor> {
        if self.cfg.block > 1 {
            self.block_outputs(x)?.narrow(1, 0, count)
        } else {
            self.scalar_outputs(x, count)
        }
    }

    /// Re(C_out x_v) for the first `count` nodes with scalar complex heads: (batch, count, H).
    fn scalar_outputs(&self, x: &Tensor, count: usize) -> Result<Tensor> {
        let (batch, len, h) = x.dims3()?;
        let (heads, n) = (self.cfg.heads, self.tree.len());
        // Leaves: B_in x in one matmul against B_in viewed as (H, heads·2), so the result is
        // (batch, L, heads, 2), then per head; internal nodes: the learned inputs.
        let b_mat = self.b_in.transpose(0, 1)?.reshape((h, 2 * heads))?;
        let leaf = x
            .reshape((batch * len, h))?
            .matmul(&b_mat)?
            .reshape((batch, len, heads, 2))?;
        let mut u = swap_dims12(&leaf)?;
        if n > len {
            let virt = self
                .virtual_u
                .unsqueeze(0)?
                .broadcast_as((batch, heads, n - len, 2))?;
            u = Tensor::cat(&[u, virt.contiguous()?], 2)?;
        }
        let u = u.reshape((batch, heads, n, 1, 1, 2))?;
        let (a, b, c) = self.blocks()?;
        let xs = tree_solve(
            &self.tree,
            &a,
            &b,
            &c,
            &u,
            TreeSolveOptions { complex: true },
        )?
        .reshape((batch, heads, n, 2))?;
        // Re(C_out x) = Σ_h C_re x_re − C_im x_im: one matmul against C_out viewed as
        // (H, heads·2) with its imaginary columns negated.
        let signs = Tensor::new(&[1.0, -1.0], x.device())?.to_dtype(x.dtype())?;
        let c_mat = self.c_out.broadcast_mul(&signs)?.reshape((h, 2 * heads))?;
        swap_dims12(&xs.narrow(2, 0, count)?)?
            .reshape((batch * count, 2 * heads))?
            .matmul(&c_mat.t()?)?
            .reshape((batch, count, h))
    }

    /// C_out x_v for every node with real d × d blocks: (batch, nodes, H).
    fn block_outputs(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, len, h) = x.dims3()?;
        let (heads, n, d) = (self.cfg.heads, self.tree.len(), self.cfg.block);
        // Leaves: B_in x per head, (batch, heads, L, d); internal nodes: the learned inputs.
        let leaf = x
            .broadcast_matmul(&self.b_in.reshape((heads * d, h))?.t()?)?
            .reshape((batch, len, heads, d))?
            .permute((0, 2, 1, 3))?;
        let virt = self
            .virtual_u
            .unsqueeze(0)?
            .broadcast_as((batch, heads, n - len, d))?;
        let u = Tensor::cat(&[leaf.contiguous()?, virt.contiguous()?], 2)?.unsqueeze(4)?;
        let (a, b, c) = self.blocks()?;
        let xs = tree_solve(&self.tree, &a, &b, &c, &u, TreeSolveOptions::default())?;
        let xs = xs
            .squeeze(4)?
            .permute((0, 2, 1, 3))?
            .reshape((batch, n, heads * d))?;
        xs.broadcast_matmul(&self.c_out.reshape((h, heads * d))?.t()?)
    }
}

impl Module for Myo {
    /// The leaves' outputs (batch, L, H), with the D skip.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let len = self.check_input(x)?;
        self.outputs(x, len)? + channel_mul(x, &self.d)?
    }
}
