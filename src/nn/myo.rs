//! The Myo layer (Myosotis paper §3.2–3.5): the S5 layer with the scan replaced by the tree
//! solve x = T_G⁻¹ u over a tree whose leaves are the sequence.
//!
//! Per head h (scalar blocks, d = 1, complex):
//! * u: every node with an input (the leaves, or all nodes with `all_nodes`, §3.2) gets the
//!   input projection B_in x (B_in complex, heads × H); the internal ("virtual") nodes also get
//!   a learned input (a parameter per head and node);
//! * T_G (§3.5): gauge A_v = 1 and a coupling B_v per node (or per level, `per_level`), placed
//!   by [`Coupling`]. The default, `Skew`, is the matrix the paper's algorithm solves:
//!   −B_v at (v, parent), B_v† at (parent, v), so T_G = I + skew-Hermitian, invertible for
//!   every B: B_v is the parameter, unbounded. The other forms keep T_G strictly diagonally
//!   dominant: B_v = β φ(b_v) with φ(z) = z tanh|z| / |z| onto the open unit disk and
//!   β = (1 − 10⁻³)/(1 + k_max), k_max the largest child count;
//! * initialisation (§3.5, from S5): head h's coupling has the phase of Λ̄_h = exp(λ_h Δ_h),
//!   λ_h the HiPPO-N eigenvalues (one of each conjugate pair) and Δ_h log-uniform in
//!   [dt_min, dt_max]. Skew: its modulus is spread log-uniformly over the heads across
//!   `coupling_init` (0.1 to 10), from heads that keep a node almost to itself to heads
//!   that reach across the tree (with |B| ≈ |Λ̄| ≈ 1 in every head, as a chain SSM starts,
//!   all heads see the same scale and zMNIST learns far slower; docs/experiments.md). The
//!   dominant forms start at −β Λ̄_h;
//! * output y_v = Re(C_out x_v) for every node, plus D ⊙ input where the node has one.
//!
//! Pooling only the top levels of a last layer (not its leaves) leaves that layer's D unused.
//!
//! `forward` returns the nodes that have inputs (the leaves, or all nodes) for the next layer;
//! `forward_nodes` returns the nodes from a given one on (all nodes, or the top levels for the Myo
//! poolings), (batch, nodes, H).
//!
//! Parameters: `b_in` (heads, H, 2), `virtual_u` (heads, internal nodes, 2), `coupling_b`
//! (heads, levels or nodes, 2), `coupling_c` (same, only for [`Coupling::Free`]), `c_out`
//! (H, heads, 2), `d` (H).

mod backward;

use candle_core::{Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::hippo::block_init;
use super::{init_param, layer_rng, normal_vec, params};
use crate::ops::{
    channel_mul, head_solve, head_solve_skew, s5_readout, swap_dims12, tree_solve, TreeSolveOptions,
};
use crate::tree::Tree;

/// The tree of a Myo layer, as a config can name it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TreeSpec {
    /// k-ary over any number of leaves (perfect when a power of k): token sequences.
    Ragged { leaves: usize, arity: usize },
    /// Level k grouped by `arities[k]`, the last repeated ([`Tree::by_levels`]).
    Levels { leaves: usize, arities: Vec<usize> },
    /// The quad tree of a height × width image in Morton order.
    Quad { height: usize, width: usize },
    /// A chain (the SSM case, paper §3.4).
    Chain { len: usize },
}

impl std::fmt::Display for TreeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TreeSpec::Ragged { leaves, arity } => write!(f, "{arity}-ary tree of {leaves} leaves"),
            TreeSpec::Levels { leaves, arities } => {
                let a: Vec<String> = arities.iter().map(|a| a.to_string()).collect();
                write!(
                    f,
                    "tree of {leaves} leaves grouped {} by level",
                    a.join(",")
                )
            }
            TreeSpec::Quad { height, width } => write!(f, "quad tree of {height}×{width} pixels"),
            TreeSpec::Chain { len } => write!(f, "chain of {len} nodes"),
        }
    }
}

impl TreeSpec {
    pub fn build(&self) -> Result<Tree> {
        let t = match *self {
            TreeSpec::Ragged { leaves, arity } => Tree::ragged(leaves, arity),
            TreeSpec::Levels {
                leaves,
                ref arities,
            } => Tree::by_levels(leaves, arities),
            TreeSpec::Quad { height, width } => Tree::quad(height, width),
            TreeSpec::Chain { len } => Tree::chain(len),
        };
        Ok(t?)
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
    /// How B_v and C_v enter T_G. A config written before this field existed meant
    /// [`Coupling::Hermitian`].
    #[serde(default = "hermitian")]
    pub coupling: Coupling,
    /// [`Coupling::Skew`] with scalar heads: the initial |B_v| of the heads, spread
    /// log-uniformly over this range (the phases come from HiPPO-N).
    #[serde(default = "coupling_init")]
    pub coupling_init: [f64; 2],
    /// [`Coupling::Skew`] with scalar heads and per-node couplings: B_v starts with the phase
    /// θ_h · (first leaf of v − first leaf of its parent), θ_h the angle of Λ̄_h, so that what
    /// reaches a leaf through the tree arrives rotated by θ_h × its position, as S5's Λ̄ᵗ.
    /// Otherwise every coupling starts with the phase θ_h, and T_G is unchanged by permuting
    /// the children of any node: siblings start interchangeable.
    #[serde(default)]
    pub position_phase: bool,
    /// The layer's input and output are all nodes of the tree in BFS order (leaves first, the
    /// root last), as in the paper's §3.2, so the virtual nodes carry features from layer to
    /// layer; otherwise only the leaves, and the virtual nodes' inputs are learned constants.
    /// [`MyoConfig::new`] leaves it off (a layer over a sequence); `myo train` turns it on,
    /// where it learned 1.7–1.9 points more on MNIST (`docs/experiments.md`).
    #[serde(default)]
    pub all_nodes: bool,
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

impl MyoConfig {
    /// The defaults of `myo train`: skew couplings per node, |B| spread over 0.1 … 10 with the
    /// position phase, scalar heads over the leaves, Δ in [0.001, 0.1], seed 0.
    pub fn new(d_model: usize, heads: usize, tree: TreeSpec) -> Self {
        MyoConfig {
            d_model,
            heads,
            tree,
            per_level: false,
            coupling: Coupling::Skew,
            coupling_init: coupling_init(),
            position_phase: true,
            all_nodes: false,
            block: 1,
            dt_min: dt_min(),
            dt_max: dt_max(),
            seed: 0,
        }
    }
}

/// How the couplings B_v, C_v of node v and its parent enter T_G (scalar heads: C_v = B_v† is
/// the complex conjugate; d × d blocks: the transpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Coupling {
    /// The paper's solve (Appendix A, Algorithm 1 and eq. 18: Â_p = I + Σ_c C_c B_c): it
    /// eliminates with a plus sign, i.e. solves the matrix with −B_v at (v, parent) and
    /// C_v = B_v† at (parent, v). Its off-diagonal part is skew-Hermitian, so T_G = I + K with
    /// K† = −K: eigenvalues 1 + iμ, invertible for every B, pivots Â_v ≥ 1 and
    /// ‖T_G⁻¹‖ ≤ 1. So B needs no bound: it is the parameter itself.
    Skew,
    /// B_v at (v, parent) and C_v = B_v† at (parent, v): Hermitian, kept positive definite by
    /// strict diagonal dominance, |B_v| < β = (1 − 10⁻³)/(1 + k_max), k_max the largest child
    /// count (0.2 in a quad tree).
    Hermitian,
    /// B_v at (v, parent) and C_v at (parent, v), each its own parameter bounded as in
    /// `Hermitian`.
    Free,
}

fn hermitian() -> Coupling {
    Coupling::Hermitian
}
fn coupling_init() -> [f64; 2] {
    [0.1, 10.0]
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
    /// Shared with the backward by hand of each forward pass.
    tree: Tree,
    beta: f64,
    /// Level of each node, for per-level couplings.
    node_level: Tensor,
    /// [1, −1] in the parameters' dtype: the conjugate of a complex scalar is a product by it
    /// (made once, not uploaded every forward).
    conj: Tensor,
    b_in: Tensor,
    virtual_u: Tensor,
    coupling_b: Tensor,
    coupling_c: Option<Tensor>,
    c_out: Tensor,
    d: Tensor,
    /// b_in, virtual_u, coupling_b, c_out and d detached once: aliases of the same storage,
    /// which the optimiser's in-place steps update too.
    detached: [Tensor; 5],
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
    /// The parameters in the optimiser's SSM group, as S5's Λ and B: the couplings, the input
    /// projection and the virtual nodes' inputs.
    pub const SSM_PARAMS: [&'static str; 4] = ["coupling_b", "coupling_c", "b_in", "virtual_u"];

    pub fn new(cfg: MyoConfig, vb: VarBuilder) -> Result<Self> {
        let tree = cfg.tree.build()?;
        let (h, heads, n, d) = (cfg.d_model, cfg.heads, tree.len(), cfg.block);
        if h == 0 || heads == 0 || d == 0 {
            candle_core::bail!("Myo: d_model, heads and block must be positive");
        }
        let [lo, hi] = cfg.coupling_init;
        if !(lo > 0.0 && lo <= hi && hi.is_finite()) {
            candle_core::bail!("Myo: coupling_init [{lo}, {hi}] must satisfy 0 < low ≤ high < ∞");
        }
        if !(cfg.dt_min > 0.0 && cfg.dt_min < cfg.dt_max && cfg.dt_max.is_finite()) {
            candle_core::bail!(
                "Myo: the step range [{}, {}] must satisfy 0 < dt_min < dt_max < ∞",
                cfg.dt_min,
                cfg.dt_max
            );
        }
        let levels = tree.levels();
        let k_max = (0..n).map(|v| tree.children(v).len()).max().unwrap_or(0);
        // The dominance bound of the Hermitian and Free forms (Skew is unbounded).
        let beta = (1.0 - 1e-3) / (1 + k_max) as f64;
        let per = if cfg.per_level { levels } else { n };
        let internal = n - tree.leaves();
        let level_of: Vec<u32> = (0..levels)
            .flat_map(|k| tree.level(k).map(move |_| k as u32))
            .collect();
        // Scalar complex heads ((…, 2) = re, im) or real d × d blocks.
        let w = if d == 1 { 2 } else { d };
        let (coupling_shape, b_in_shape, c_out_shape) = if d == 1 {
            (vec![heads, per, 2], vec![heads, h, 2], vec![h, heads, 2])
        } else {
            (vec![heads, per, d, d], vec![heads, d, h], vec![h, heads, d])
        };
        let (stored, fresh) = params(
            &vb,
            [
                ("b_in", &b_in_shape),
                ("virtual_u", &[heads, internal, w]),
                ("coupling_b", &coupling_shape),
                ("c_out", &c_out_shape),
                ("d", &[h]),
            ],
        )?;
        let coupling_c = match cfg.coupling {
            Coupling::Free => {
                let ([c], _) = params(&vb, [("coupling_c", &coupling_shape)])?;
                Some(c)
            }
            _ => None,
        };
        if fresh {
            let init = Self::initial_values(&cfg, &tree, per)?;
            let [b_in, coupling, c_out, skip, free_c] = init;
            for (param, values) in
                stored
                    .iter()
                    .zip([b_in, vec![0.0; heads * internal * w], coupling, c_out, skip])
            {
                init_param(param, values)?;
            }
            if let Some(c) = &coupling_c {
                init_param(c, free_c)?;
            }
        }
        let detached = stored.each_ref().map(Tensor::detach);
        let [b_in, virtual_u, coupling_b, c_out, d] = stored;
        Ok(Myo {
            detached,
            node_level: Tensor::new(level_of, vb.device())?,
            conj: Tensor::new(&[1.0, -1.0], vb.device())?.to_dtype(vb.dtype())?,
            b_in,
            virtual_u,
            coupling_b,
            coupling_c,
            c_out,
            d,
            beta,
            tree,
            cfg,
        })
    }

    /// The initial values of B_in, the couplings, C_out, D and (the Free form's) second
    /// couplings, drawn in this order from the layer's seed.
    fn initial_values(cfg: &MyoConfig, tree: &Tree, per: usize) -> Result<[Vec<f64>; 5]> {
        let (h, heads, n, d) = (cfg.d_model, cfg.heads, tree.len(), cfg.block);
        let w = if d == 1 { 2 } else { d };
        let mut rng = layer_rng(cfg.seed, 0);
        let mut randn = |count: usize, std: f64| normal_vec(&mut rng, count, std);
        let coupling = if d == 1 {
            // HiPPO-N eigenvalues, one of each conjugate pair per head, discretised with ZOH:
            // the entry of T_G at (v, parent) starts at −β Λ̄_h in the bounded forms.
            let init = block_init(2 * heads, 1, true)?;
            let (lo, hi) = (cfg.dt_min.ln(), cfg.dt_max.ln());
            let steps: Vec<f64> = {
                let mut r = layer_rng(cfg.seed, 0x5eed);
                (0..heads).map(|_| r.random_range(lo..hi).exp()).collect()
            };
            // The first leaf of every node's subtree (leaves first in the numbering, children
            // before their parents).
            let mut first = (0..n).collect::<Vec<usize>>();
            for p in tree.leaves()..n {
                first[p] = tree.children(p).map(|ch| first[ch]).min().unwrap_or(p);
            }
            let mut c = Vec::with_capacity(heads * per * 2);
            for (hd, (lam, step)) in init.lambda.iter().zip(&steps).enumerate() {
                let lbar = (lam * step).exp();
                let (re, im) = match cfg.coupling {
                    // Λ̄_h's phase, and a modulus spread log-uniformly over the heads
                    // (stratified) from local to global.
                    Coupling::Skew => {
                        let [lo, hi] = cfg.coupling_init;
                        let t = (hd as f64 + 0.5) / heads as f64;
                        let m = (lo.ln() + t * (hi.ln() - lo.ln())).exp();
                        let angle = lbar.im.atan2(lbar.re);
                        for v in 0..per {
                            // Per node with `position_phase`: Λ̄_h's angle per leaf of offset
                            // between the node's first leaf and its parent's.
                            let phase = match tree.parent(v) {
                                Some(p) if cfg.position_phase && !cfg.per_level => {
                                    angle * (first[v] as f64 - first[p] as f64)
                                }
                                _ => angle,
                            };
                            c.extend([m * phase.cos(), m * phase.sin()]);
                        }
                        continue;
                    }
                    Coupling::Hermitian | Coupling::Free => {
                        unsquash(-(1.0 - 1e-3) * lbar.re, -(1.0 - 1e-3) * lbar.im)
                    }
                };
                for _ in 0..per {
                    c.extend([re, im]);
                }
            }
            c
        } else {
            // HiPPO-N initialises scalar heads; blocks start from random couplings.
            randn(heads * per * d * d, 0.5)
        };
        // For scalar heads the complex parts each get half the variance.
        let part = if d == 1 { 0.5f64.sqrt() } else { 1.0 };
        let b_in = randn(heads * w * h, part * (1.0 / h as f64).sqrt());
        let c_out = randn(
            h * heads * w,
            part * (1.0 / (heads * if d == 1 { 1 } else { d }) as f64).sqrt(),
        );
        let skip = randn(h, 1.0);
        let free_c = match (cfg.coupling, d) {
            (Coupling::Free, 1) => coupling.clone(),
            (Coupling::Free, _) => randn(heads * per * d * d, 0.5),
            _ => Vec::new(),
        };
        Ok([b_in, coupling, c_out, skip, free_c])
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
        if self.cfg.coupling == Coupling::Skew {
            return Ok(raw);
        }
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
        let (b, c) = self.couplings()?;
        if self.cfg.block > 1 {
            let eye = Tensor::eye(self.cfg.block, b.dtype(), b.device())?;
            return Ok((eye.broadcast_as(b.shape())?.contiguous()?, b, c));
        }
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

    /// The entries of T_G at (v, parent) and (parent, v) as the coupling form places them:
    /// (heads, nodes, 2) each for scalar heads, (heads, nodes, d, d) for blocks.
    fn couplings(&self) -> Result<(Tensor, Tensor)> {
        let b = self.coupling(&self.coupling_b)?;
        // B† of the couplings: the transpose of real blocks, the conjugate of complex scalars.
        let adjoint = |b: &Tensor| -> Result<Tensor> {
            if self.cfg.block > 1 {
                return b.transpose(2, 3)?.contiguous();
            }
            b.broadcast_mul(&self.conj.to_dtype(b.dtype())?)
        };
        Ok(match (&self.coupling_c, self.cfg.coupling) {
            (Some(raw), _) => (b, self.coupling(raw)?),
            (None, Coupling::Skew) => (b.neg()?, adjoint(&b)?),
            (None, _) => {
                let c = adjoint(&b)?;
                (b, c)
            }
        })
    }

    /// Outputs of the nodes `from..` (batch, nodes − from, H), with the D skip on those that
    /// have an input (the leaves, or all nodes with `all_nodes`): every node from 0, the top
    /// levels from the first node of the lowest of them (the Myo poolings).
    pub fn forward_nodes(&self, x: &Tensor, from: usize) -> Result<Tensor> {
        let len = self.check_input(x)?;
        let n = self.tree.len();
        if from >= n {
            candle_core::bail!("Myo: node {from} is beyond the tree's {n} nodes");
        }
        let y = self.outputs(x, from, n - from)?;
        if from >= len {
            return Ok(y);
        }
        let skip = channel_mul(&x.narrow(1, from, len - from)?, &self.d)?;
        if n == len {
            return y + skip;
        }
        let skipped = (y.narrow(1, 0, len - from)? + skip)?;
        Tensor::cat(&[skipped, y.narrow(1, len - from, n - len)?], 1)
    }

    /// The input's length (the leaves, or all nodes with `all_nodes`), checked against the
    /// tree and d_model.
    fn check_input(&self, x: &Tensor) -> Result<usize> {
        let (_, len, h) = x.dims3()?;
        let (want, what) = if self.cfg.all_nodes {
            (self.tree.len(), "nodes")
        } else {
            (self.tree.leaves(), "leaves")
        };
        if len != want || h != self.cfg.d_model {
            candle_core::bail!(
                "Myo: input (batch, {len}, {h}) does not match the tree's {want} {what} and d_model {}",
                self.cfg.d_model
            );
        }
        Ok(len)
    }

    /// Re(C_out x_v) (scalar heads) or C_out x_v (blocks) for the `count` nodes from `start`
    /// (the leaves come first in the numbering): (batch, count, H).
    fn outputs(&self, x: &Tensor, start: usize, count: usize) -> Result<Tensor> {
        if self.cfg.block > 1 {
            return self.block_outputs(x, start, count);
        }
        let (batch, len, h) = x.dims3()?;
        let (heads, n) = (self.cfg.heads, self.tree.len());
        // B_in viewed as (H, heads·2): one matmul for every head, straight into the solve's
        // (batch, node, head) layout.
        let b_mat = self.b_in.transpose(0, 1)?.reshape((h, 2 * heads))?;
        let u = x
            .reshape((batch * len, h))?
            .matmul(&b_mat)?
            .reshape((batch, len, heads, 2))?;
        let xs = match self.cfg.coupling {
            // The solve forms B = −s and C = conj(s) itself, in the parameters' layout.
            Coupling::Skew => {
                let s = self.coupling(&self.coupling_b)?;
                head_solve_skew(&self.tree, &u, &self.virtual_u, &s)?
            }
            _ => {
                let (b, c) = self.scalar_couplings()?;
                let bias = self.virtual_u.transpose(0, 1)?;
                head_solve(&self.tree, &u, &bias, &b, &c)?
            }
        };
        let xs = xs.reshape((batch, n, 2 * heads))?;
        // Re(C_out x) = Σ_h C_re x_re − C_im x_im: one matmul against the (heads·2, H) matrix
        // of S5's readout (one direction, no doubling), made in one op.
        let r = s5_readout(&self.c_out, 1, false)?;
        if count == n {
            return xs
                .reshape((batch * n, 2 * heads))?
                .matmul(&r)?
                .reshape((batch, n, h));
        }
        xs.narrow(1, start, count)?.broadcast_matmul(&r)
    }

    /// B and C of scalar heads as the solve takes them, (nodes, heads, 2) each: the entries of
    /// T_G at (v, parent) and (parent, v).
    fn scalar_couplings(&self) -> Result<(Tensor, Tensor)> {
        let (b, c) = self.couplings()?;
        Ok((b.transpose(0, 1)?, c.transpose(0, 1)?))
    }

    /// [`Myo::outputs`] for d × d blocks, by the general tree solve: u and x in its
    /// (batch, heads, nodes, d) layout.
    fn block_outputs(&self, x: &Tensor, start: usize, count: usize) -> Result<Tensor> {
        let (batch, len, h) = x.dims3()?;
        let (heads, n, d) = (self.cfg.heads, self.tree.len(), self.cfg.block);
        let projected = x
            .reshape((batch * len, h))?
            .matmul(&self.b_in.reshape((heads * d, h))?.t()?)?
            .reshape((batch, len, heads, d))?;
        let projected = swap_dims12(&projected)?;
        let internal = n - self.tree.leaves();
        let u = if internal == 0 {
            projected
        } else {
            let virt = self.virtual_u.unsqueeze(0)?;
            if len == n {
                let zeros = Tensor::zeros((1, heads, len - internal, d), x.dtype(), x.device())?;
                projected.broadcast_add(&Tensor::cat(&[zeros, virt], 2)?)?
            } else {
                let virt = virt
                    .broadcast_as((batch, heads, internal, d))?
                    .contiguous()?;
                Tensor::cat(&[projected, virt], 2)?
            }
        };
        let (a, b, c) = self.blocks()?;
        let xs = tree_solve(
            &self.tree,
            &a,
            &b,
            &c,
            &u.unsqueeze(4)?,
            TreeSolveOptions::default(),
        )?;
        let xs = xs
            .squeeze(4)?
            .narrow(2, start, count)?
            .permute((0, 2, 1, 3))?
            .reshape((batch, count, heads * d))?;
        xs.broadcast_matmul(&self.c_out.reshape((h, heads * d))?.t()?)
    }
}

impl Module for Myo {
    /// The outputs (batch, L, H) of the nodes that have inputs (the leaves, or all nodes with
    /// `all_nodes`), with the D skip.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let len = self.check_input(x)?;
        self.outputs(x, 0, len)? + channel_mul(x, &self.d)?
    }
}
