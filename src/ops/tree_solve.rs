//! The Myo tree solve x = T_G⁻¹ u (Myosotis paper §3.2–3.5, Appendix A).
//!
//! T_G is a block matrix with the sparsity of a rooted [`Tree`]: per node v a diagonal block A_v
//! (d × d), B_v at (row v, column parent(v)) and C_v at (row parent(v), column v); the root's B
//! and C are unused. Shapes:
//! * u, x: (batch, heads, nodes, d, r): r right-hand sides per node;
//! * A, B, C: (heads, nodes, d, d) shared across the batch, or (batch, heads, nodes, d, d);
//! * complex (d = 1 in the layer; any d here): a trailing dimension of 2 (re, im) on all four.
//!
//! # Algorithm (shared by the CPU twin and the CUDA kernel)
//! Upward over the BFS levels, leaves first, each child c of parent p eliminated by a Schur
//! step: B̂_c = −Â_c⁻¹ B_c, û_c = Â_c⁻¹ ũ_c, then Â_p = A_p + Σ_c C_c B̂_c and
//! ũ_p = u_p − Σ_c C_c û_c. The root is solved, x_R = Â_R⁻¹ ũ_R, and the downward pass
//! substitutes x_c = û_c + B̂_c x_p, root to leaves.
//!
//! # Backward
//! λ = T_G⁻ᴴ g is one more tree solve with the adjoint matrix (blocks A_vᴴ on the diagonal, C_vᴴ
//! at the child's row, B_vᴴ at the parent's: B and C swap roles); then ∂u = λ and, on the
//! sparsity pattern only, ∂A_v = −λ_v x_vᴴ, ∂B_v = −λ_v x_parentᴴ, ∂C_v = −λ_parent x_vᴴ, summed
//! over r and, for shared coefficients, over the batch. Nothing is kept from the forward but its
//! output x: the adjoint's pivots are recomputed (they are the Â_vᴴ of the forward) rather than
//! stored, which costs one solve's arithmetic and saves n·d² values per tree.
//!
//! # Singular pivots
//! A pivot block Â_v that is singular (zero pivot in partial-pivoting LU) or not finite is an
//! error naming the batch, head and node: the layer's parameterisation keeps T_G diagonally
//! dominant, so a failure means diverged parameters, and it stops training instead of feeding
//! NaN forward.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;

use super::value::{best_simd, contiguous, has_avx2, Complex, OutBuf, Re, SharedOut, Value};
use crate::tree::Tree;

/// Options of [`tree_solve`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeSolveOptions {
    /// Complex values: every tensor has a trailing dimension of 2 (re, im).
    pub complex: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    batch: usize,
    heads: usize,
    nodes: usize,
    d: usize,
    r: usize,
    /// Coefficients shared across the batch: (heads, nodes, d, d).
    shared: bool,
}

impl Dims {
    /// Element offset of tree (bi, hi)'s first coefficient block within one of A, B, C.
    fn coef_tree(&self, bi: usize, hi: usize) -> usize {
        let t = if self.shared {
            hi
        } else {
            bi * self.heads + hi
        };
        t * self.nodes * self.d * self.d
    }
    /// Elements in one of A, B, C.
    fn coef_set(&self) -> usize {
        let trees = if self.shared {
            self.heads
        } else {
            self.batch * self.heads
        };
        trees * self.nodes * self.d * self.d
    }
}

/// x = T_G⁻¹ u for the tree `tree` with blocks `a` (diagonal), `b` (child row, parent column)
/// and `c` (parent row, child column). See the module docs for shapes. CPU computes f32 and
/// f64 (f16/bf16 in f32).
pub fn tree_solve(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Tensor> {
    let dims = check_args(tree, a, b, c, u, opts)?;
    check_device(u, dims)?;
    let dtype = u.dtype();
    if u.device().is_cpu() && matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        return tree_solve(tree, &up(a)?, &up(b)?, &up(c)?, &up(u)?, opts)?.to_dtype(dtype);
    }
    let coef = Tensor::stack(&[a, b, c], 0)?;
    let op = TreeSolveOp {
        tree: Arc::new(tree.clone()),
        dims,
        opts,
    };
    u.contiguous()?.apply_op2(&coef, op)
}

fn check_args(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Dims> {
    let tail: &[usize] = if opts.complex { &[2] } else { &[] };
    let ud = u.dims();
    if ud.len() != 5 + tail.len() || ud[5..] != *tail {
        bail!(
            "tree_solve: u must be (batch, heads, nodes, d, r{}), got shape {ud:?}",
            if opts.complex { ", 2" } else { "" }
        );
    }
    let (batch, heads, nodes, d, r) = (ud[0], ud[1], ud[2], ud[3], ud[4]);
    if ud.contains(&0) {
        bail!("tree_solve: u has an empty dimension, shape {ud:?}");
    }
    if nodes != tree.len() {
        bail!(
            "tree_solve: u has {nodes} nodes (dimension 2) but the tree has {}",
            tree.len()
        );
    }
    for (name, t) in [("b", b), ("c", c)] {
        if t.dims() != a.dims() {
            bail!(
                "tree_solve: {name} has shape {:?} but a has {:?}",
                t.dims(),
                a.dims()
            );
        }
    }
    let with_tail = |s: &[usize]| [s, tail].concat();
    let shared = if a.dims() == with_tail(&[heads, nodes, d, d]) {
        true
    } else if a.dims() == with_tail(&[batch, heads, nodes, d, d]) {
        false
    } else {
        bail!(
            "tree_solve: coefficients have shape {:?}; with u of shape {ud:?} they must be {:?} \
             (shared across the batch) or {:?}",
            a.dims(),
            with_tail(&[heads, nodes, d, d]),
            with_tail(&[batch, heads, nodes, d, d])
        );
    };
    for (name, t) in [("a", a), ("b", b), ("c", c)] {
        if t.dtype() != u.dtype() {
            bail!(
                "tree_solve: {name} has dtype {:?} but u has {:?}",
                t.dtype(),
                u.dtype()
            );
        }
        if !t.device().same_device(u.device()) {
            bail!(
                "tree_solve: {name} is on {:?} but u is on {:?}",
                t.device().location(),
                u.device().location()
            );
        }
    }
    if !matches!(
        u.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) {
        bail!("tree_solve: dtype {:?} is not supported", u.dtype());
    }
    Ok(Dims {
        batch,
        heads,
        nodes,
        d,
        r,
        shared,
    })
}

/// The CPU runs every case; the CUDA kernel covers scalar blocks (d = 1).
fn check_device(u: &Tensor, dims: Dims) -> Result<()> {
    match u.device() {
        Device::Cpu => Ok(()),
        Device::Cuda(_) if cfg!(feature = "cuda") && dims.d == 1 => Ok(()),
        Device::Cuda(_) if cfg!(feature = "cuda") => bail!(
            "tree_solve: the CUDA kernel covers scalar blocks (d = 1) only, got d = {}; \
             run block sizes > 1 on the CPU",
            dims.d
        ),
        dev => bail!("tree_solve: device {:?} is not supported", dev.location()),
    }
}

struct TreeSolveOp {
    tree: Arc<Tree>,
    dims: Dims,
    opts: TreeSolveOptions,
}

/// The matrix a solve runs on: T_G itself, or its adjoint T_Gᴴ for the backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Forward,
    Adjoint,
}

/// The coefficient blocks of one tree, read as the blocks of T_G or of T_Gᴴ.
struct Blocks<'a, F> {
    a: &'a [F],
    b: &'a [F],
    c: &'a [F],
    d: usize,
    side: Side,
}

impl<F: WithDType> Blocks<'_, F> {
    #[inline(always)]
    fn get<V: Value<F>>(&self, m: &[F], v: usize, i: usize, j: usize) -> V {
        let d = self.d;
        match self.side {
            Side::Forward => V::load(m, (v * d + i) * d + j),
            Side::Adjoint => V::load(m, (v * d + j) * d + i).conj(),
        }
    }
    /// Diagonal block entry A'_v[i][j].
    #[inline(always)]
    fn diag<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        self.get(self.a, v, i, j)
    }
    /// Entry [i][j] of the block at (row v, column parent(v)): B_v, or C_vᴴ for the adjoint.
    #[inline(always)]
    fn up<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        match self.side {
            Side::Forward => self.get(self.b, v, i, j),
            Side::Adjoint => self.get(self.c, v, i, j),
        }
    }
    /// Entry [i][j] of the block at (row parent(v), column v): C_v, or B_vᴴ for the adjoint.
    #[inline(always)]
    fn down<V: Value<F>>(&self, v: usize, i: usize, j: usize) -> V {
        match self.side {
            Side::Forward => self.get(self.c, v, i, j),
            Side::Adjoint => self.get(self.b, v, i, j),
        }
    }
}

/// Per-thread scratch for one tree solve.
struct Workspace<V> {
    ahat: Vec<V>,
    bhat: Vec<V>,
    uhat: Vec<V>,
    m: Vec<V>,
    rhs: Vec<V>,
}

impl<V: Copy> Workspace<V> {
    fn new(zero: V) -> Self {
        Workspace {
            ahat: vec![zero],
            bhat: vec![zero],
            uhat: vec![zero],
            m: vec![zero],
            rhs: vec![zero],
        }
    }
    fn size(&mut self, zero: V, nodes: usize, d: usize, r: usize) {
        self.ahat.resize(nodes * d * d, zero);
        self.bhat.resize(nodes * d * d, zero);
        self.uhat.resize(nodes * d * r, zero);
        self.m.resize(d * d, zero);
        self.rhs.resize(d * (d + r), zero);
    }
}

/// A pivot that failed: the node whose block Â_v is singular or not finite.
struct BadPivot(usize);

#[inline(always)]
fn pivot_ok(p: f64) -> bool {
    p > 0.0 && p.is_finite()
}

/// Solves m X = rhs in place for a d × d `m` and a d × k `rhs` (row-major), by LU with
/// partial pivoting; m is destroyed and rhs becomes X.
fn lu_solve<F: WithDType, V: Value<F>>(m: &mut [V], rhs: &mut [V], d: usize, k: usize) -> bool {
    for col in 0..d {
        let mut piv = col;
        for i in col + 1..d {
            if m[i * d + col].abs2() > m[piv * d + col].abs2() {
                piv = i;
            }
        }
        if !pivot_ok(m[piv * d + col].abs2()) {
            return false;
        }
        if piv != col {
            for j in 0..d {
                m.swap(col * d + j, piv * d + j);
            }
            for j in 0..k {
                rhs.swap(col * k + j, piv * k + j);
            }
        }
        let inv = m[col * d + col].inv();
        for i in col + 1..d {
            let f = m[i * d + col].mul(inv);
            for j in col..d {
                m[i * d + j] = m[i * d + j].sub(f.mul(m[col * d + j]));
            }
            for j in 0..k {
                rhs[i * k + j] = rhs[i * k + j].sub(f.mul(rhs[col * k + j]));
            }
        }
    }
    for i in (0..d).rev() {
        let inv = m[i * d + i].inv();
        for j in 0..k {
            let mut s = rhs[i * k + j];
            for l in i + 1..d {
                s = s.sub(m[i * d + l].mul(rhs[l * k + j]));
            }
            rhs[i * k + j] = s.mul(inv);
        }
    }
    true
}

/// Trees solved together on the CPU, one per SIMD lane: all (batch, head) trees share the
/// topology, so the per-node arithmetic of [`LANES`] trees runs as one vector operation.
pub const LANES: usize = 8;

/// The scalar (d = 1) coefficients of a group of trees, one slice per lane, read as T_G
/// (`ADJ = false`) or T_Gᴴ (`ADJ = true`). With `SAME` all lanes have the same coefficients
/// (one head, several batch elements, shared coefficients): each is loaded once and broadcast.
struct LaneCoefs<'a, F> {
    a: [&'a [F]; LANES],
    b: [&'a [F]; LANES],
    c: [&'a [F]; LANES],
}

impl<F: WithDType> LaneCoefs<'_, F> {
    #[inline(always)]
    fn gather<V: Value<F>, const CONJ: bool, const SAME: bool>(
        s: &[&[F]; LANES],
        e: usize,
    ) -> [V; LANES] {
        if SAME {
            [V::load_c::<CONJ>(s[0], e); LANES]
        } else {
            std::array::from_fn(|l| V::load_c::<CONJ>(s[l], e))
        }
    }
    /// A'_v: A_v, or conj(A_v) for the adjoint.
    #[inline(always)]
    fn diag<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(&self.a, v)
    }
    /// The (v, parent) entry: B_v, or conj(C_v) for the adjoint.
    #[inline(always)]
    fn up<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(if ADJ { &self.c } else { &self.b }, v)
    }
    /// The (parent, v) entry: C_v, or conj(B_v) for the adjoint.
    #[inline(always)]
    fn down<V: Value<F>, const ADJ: bool, const SAME: bool>(&self, v: usize) -> [V; LANES] {
        Self::gather::<V, ADJ, SAME>(if ADJ { &self.b } else { &self.c }, v)
    }
}

/// Scratch of a lane group: per node, one value per lane.
struct LaneWorkspace<V> {
    ahat: Vec<[V; LANES]>,
    bhat: Vec<[V; LANES]>,
    uhat: Vec<[V; LANES]>,
    x: Vec<[V; LANES]>,
    /// The forward solution, lane-major, for the backward's block gradients.
    aux: Vec<[V; LANES]>,
}

impl<V: Copy> LaneWorkspace<V> {
    fn new() -> Self {
        LaneWorkspace {
            ahat: vec![],
            bhat: vec![],
            uhat: vec![],
            x: vec![],
            aux: vec![],
        }
    }

    fn sized(&mut self, zero: V, nodes: usize, r: usize) {
        self.ahat.resize(nodes, [zero; LANES]);
        self.bhat.resize(nodes, [zero; LANES]);
        self.uhat.resize(nodes * r, [zero; LANES]);
        self.x.resize(nodes * r, [zero; LANES]);
    }
}

/// How (batch, head) trees are grouped into lanes (see [`TreeSolveOp::lane_groups`]).
#[derive(Clone, Copy)]
struct LaneLayout {
    /// Lanes are batch elements of one head sharing its coefficients.
    same: bool,
    groups: usize,
    /// Groups per head when `same`.
    per_head: usize,
    batch: usize,
    heads: usize,
}

/// One group of lanes: the tree of each lane (padding lanes repeat the last tree and are not
/// written) and, when the lanes share a head, which head and which slice of the batch.
struct LaneGroup {
    trees: [usize; LANES],
    lanes: usize,
    head: usize,
    batch_group: usize,
}

impl LaneLayout {
    fn new(dims: Dims) -> Self {
        let same = dims.shared && dims.batch >= LANES;
        let per_head = dims.batch.div_ceil(LANES);
        let groups = if same {
            dims.heads * per_head
        } else {
            (dims.batch * dims.heads).div_ceil(LANES)
        };
        LaneLayout {
            same,
            groups,
            per_head,
            batch: dims.batch,
            heads: dims.heads,
        }
    }

    fn group(&self, index: usize, trees: usize) -> LaneGroup {
        if self.same {
            let (head, batch_group) = (index / self.per_head, index % self.per_head);
            let b0 = batch_group * LANES;
            let lanes = LANES.min(self.batch - b0);
            LaneGroup {
                trees: std::array::from_fn(|l| (b0 + l.min(lanes - 1)) * self.heads + head),
                lanes,
                head,
                batch_group,
            }
        } else {
            let t0 = index * LANES;
            let lanes = LANES.min(trees - t0);
            LaneGroup {
                trees: std::array::from_fn(|l| t0 + l.min(lanes - 1)),
                lanes,
                head: 0,
                batch_group: 0,
            }
        }
    }

    /// Gradient partials per head: one per batch group when lanes share a head (already
    /// summed over their lanes), else one per batch element.
    fn partials(&self) -> usize {
        if self.same {
            self.per_head
        } else {
            self.batch
        }
    }
}

/// Block gradients of one solved group (d = 1): with λ in `ws.x` and the forward's x in
/// `ws.aux`, ∂A_v = −Σ_r λ_v conj(x_v), ∂B_v = −Σ_r λ_v conj(x_parent), ∂C_v = −Σ_r λ_parent
/// conj(x_v) (zero for the root), written to the three partial sets, summed over the lanes
/// when they share a head.
#[inline(always)]
fn block_grads_lanes<F: WithDType, V: Value<F>>(
    tree: &Tree,
    r: usize,
    group: &LaneGroup,
    layout: &LaneLayout,
    heads: usize,
    sets: &[SharedOut<F>; 3],
    ws: &LaneWorkspace<V>,
) {
    let n = tree.len();
    let (lam, x) = (&ws.x, &ws.aux);
    let outer = |row: usize, col: usize| -> [V; LANES] {
        let mut s = [V::zero(); LANES];
        for j in 0..r {
            let (l_row, x_col) = (lam[row * r + j], x[col * r + j]);
            for l in 0..LANES {
                s[l] = l_row[l].fma(x_col[l].conj(), s[l]);
            }
        }
        s
    };
    let root = tree.root();
    let zero = [V::zero(); LANES];
    // Element e of set k, borrowed alone: the (batch group, head) or the tree identifies this
    // group, so no other task writes it.
    let put =
        |k: usize, e: usize, v: V| V::put(unsafe { sets[k].row(e * V::WIDTH, V::WIDTH) }, 0, v);
    for v in 0..n {
        let ga = outer(v, v);
        let (gb, gc) = if v == root {
            (zero, zero)
        } else {
            let p = tree.parents()[v];
            (outer(v, p), outer(p, v))
        };
        if layout.same {
            let e = (group.batch_group * heads + group.head) * n + v;
            for (k, g) in [ga, gb, gc].iter().enumerate() {
                let sum = g.iter().take(group.lanes).fold(V::zero(), |s, x| s.add(*x));
                put(k, e, V::zero().sub(sum));
            }
        } else {
            for (l, &t) in group.trees.iter().enumerate().take(group.lanes) {
                for (k, g) in [ga, gb, gc].iter().enumerate() {
                    put(k, t * n + v, V::zero().sub(g[l]));
                }
            }
        }
    }
}

/// Sums `count` consecutive blocks of `len` scalars into one (the per-batch or per-group
/// gradient partials of shared coefficients), in parallel over the block.
fn sum_partials<F: WithDType>(partials: &[F], count: usize, len: usize) -> Vec<F> {
    let mut out = partials[..len].to_vec();
    out.par_chunks_mut(4096).enumerate().for_each(|(i, chunk)| {
        for k in 1..count {
            let src = &partials[k * len + i * 4096..][..chunk.len()];
            for (o, s) in chunk.iter_mut().zip(src) {
                *o += *s;
            }
        }
    });
    out
}

/// The first lane (of `lanes` active ones) whose pivot is singular or not finite.
#[inline(always)]
fn bad_lane<F: WithDType, V: Value<F>>(piv: &[V; LANES], lanes: usize) -> Option<usize> {
    let ok = piv.iter().fold(true, |ok, p| ok & p.pivot_ok());
    if ok {
        None
    } else {
        (0..lanes).find(|&l| !piv[l].pivot_ok())
    }
}

/// Scalar-block (d = 1) solve of a group of trees in lock-step: the upward elimination, parent
/// by parent over the BFS levels (each parent gathers its contiguous children), the root, and
/// the downward substitution — the CUDA kernel's level order for every tree. `ws.uhat` holds
/// the right-hand sides on entry; the solution is left in `ws.x`; an error names the
/// (lane, node) of a bad pivot.
#[inline(always)]
fn solve_scalar_lanes<F: WithDType, V: Value<F>, const ADJ: bool, const SAME: bool>(
    tree: &Tree,
    r: usize,
    lanes: usize,
    io: &LaneCoefs<F>,
    ws: &mut LaneWorkspace<V>,
) -> std::result::Result<(), (usize, usize)> {
    let zero = [V::zero(); LANES];
    for k in 0..tree.levels() {
        for p in tree.level(k) {
            let mut ap = io.diag::<V, ADJ, SAME>(p);
            for c in tree.children(p) {
                let ac = ws.ahat[c];
                if let Some(l) = bad_lane(&ac, lanes) {
                    return Err((l, c));
                }
                let inv: [V; LANES] = std::array::from_fn(|l| ac[l].inv());
                let (bc, cc) = (io.up::<V, ADJ, SAME>(c), io.down::<V, ADJ, SAME>(c));
                let mut bh = zero;
                for l in 0..LANES {
                    bh[l] = V::zero().sub(bc[l]).mul(inv[l]);
                    ap[l] = cc[l].fma(bh[l], ap[l]);
                }
                ws.bhat[c] = bh;
                for j in 0..r {
                    let (uc, up) = (&mut ws.uhat[c * r + j], p * r + j);
                    let mut msg = zero;
                    for l in 0..LANES {
                        uc[l] = uc[l].mul(inv[l]);
                        msg[l] = cc[l].mul(uc[l]);
                    }
                    let upv = &mut ws.uhat[up];
                    for l in 0..LANES {
                        upv[l] = upv[l].sub(msg[l]);
                    }
                }
            }
            ws.ahat[p] = ap;
        }
    }
    let root = tree.root();
    let ar = ws.ahat[root];
    if let Some(l) = bad_lane(&ar, lanes) {
        return Err((l, root));
    }
    for j in 0..r {
        let ur = ws.uhat[root * r + j];
        ws.x[root * r + j] = std::array::from_fn(|l| ur[l].mul(ar[l].inv()));
    }
    for k in (1..tree.levels()).rev() {
        for p in tree.level(k) {
            for c in tree.children(p) {
                let bh = ws.bhat[c];
                for j in 0..r {
                    let (xp, uc) = (ws.x[p * r + j], ws.uhat[c * r + j]);
                    ws.x[c * r + j] = std::array::from_fn(|l| bh[l].fma(xp[l], uc[l]));
                }
            }
        }
    }
    Ok(())
}

/// One tree's solve with d × d blocks: the same passes as [`solve_scalar`], each Schur step a
/// small LU solve Â_c [B̂_c | û_c] = [−B_c | ũ_c].
fn solve_blocked<F: WithDType, V: Value<F>>(
    tree: &Tree,
    blk: &Blocks<F>,
    u: &[F],
    x: &mut [F],
    r: usize,
    ws: &mut Workspace<V>,
) -> std::result::Result<(), BadPivot> {
    let (n, d) = (tree.len(), blk.d);
    let (dd, dr, w) = (d * d, d * r, d + r);
    let Workspace {
        ahat,
        bhat,
        uhat,
        m,
        rhs,
    } = ws;
    for v in 0..n {
        for i in 0..d {
            for j in 0..d {
                ahat[v * dd + i * d + j] = blk.diag(v, i, j);
            }
        }
    }
    for (e, uh) in uhat[..n * dr].iter_mut().enumerate() {
        *uh = V::load(u, e);
    }
    for k in 0..tree.levels() - 1 {
        for c in tree.level(k) {
            m.copy_from_slice(&ahat[c * dd..(c + 1) * dd]);
            for i in 0..d {
                for j in 0..d {
                    rhs[i * w + j] = V::zero().sub(blk.up(c, i, j));
                }
                for j in 0..r {
                    rhs[i * w + d + j] = uhat[c * dr + i * r + j];
                }
            }
            if !lu_solve(m, rhs, d, w) {
                return Err(BadPivot(c));
            }
            for i in 0..d {
                bhat[c * dd + i * d..c * dd + (i + 1) * d].copy_from_slice(&rhs[i * w..i * w + d]);
                uhat[c * dr + i * r..c * dr + (i + 1) * r]
                    .copy_from_slice(&rhs[i * w + d..(i + 1) * w]);
            }
            // Messages to the parent: Â_p += C_c B̂_c, ũ_p −= C_c û_c.
            let p = tree.parents()[c];
            for i in 0..d {
                for l in 0..d {
                    let cil: V = blk.down(c, i, l);
                    for j in 0..d {
                        let e = p * dd + i * d + j;
                        ahat[e] = cil.fma(bhat[c * dd + l * d + j], ahat[e]);
                    }
                    for j in 0..r {
                        let e = p * dr + i * r + j;
                        uhat[e] = uhat[e].sub(cil.mul(uhat[c * dr + l * r + j]));
                    }
                }
            }
        }
    }
    let root = tree.root();
    m.copy_from_slice(&ahat[root * dd..(root + 1) * dd]);
    rhs[..dr].copy_from_slice(&uhat[root * dr..(root + 1) * dr]);
    if !lu_solve(m, &mut rhs[..dr], d, r) {
        return Err(BadPivot(root));
    }
    for (e, v) in rhs[..dr].iter().enumerate() {
        V::put(x, root * dr + e, *v);
    }
    for k in (0..tree.levels() - 1).rev() {
        for c in tree.level(k) {
            let p = tree.parents()[c];
            for i in 0..d {
                for j in 0..r {
                    let mut s = uhat[c * dr + i * r + j];
                    for l in 0..d {
                        s = bhat[c * dd + i * d + l].fma(V::load(x, p * dr + l * r + j), s);
                    }
                    V::put(x, c * dr + i * r + j, s);
                }
            }
        }
    }
    Ok(())
}

impl TreeSolveOp {
    /// Solves every (batch, head) tree in parallel: `rhs` holds u (forward) or g (adjoint) and
    /// the solutions go to `out`.
    fn solve_all<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        out: SharedOut<F>,
    ) -> Result<()> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let set = dims.coef_set() * w;
        let (ca, cb, cc) = (&coef[..set], &coef[set..2 * set], &coef[2 * set..3 * set]);
        let per_tree = dims.nodes * dims.d * dims.r * w;
        let per_coef = dims.nodes * dims.d * dims.d * w;
        let trees = dims.batch * dims.heads;
        let coef_at = |t: usize| dims.coef_tree(t / dims.heads, t % dims.heads) * w;
        if dims.d == 1 {
            let per_tree = dims.nodes * dims.r * w;
            return self.lane_groups::<F, V>(side, coef, rhs, |group, ws| {
                for (l, &t) in group.trees.iter().enumerate().take(group.lanes) {
                    // SAFETY: this task alone writes its trees' regions of the output.
                    let x = unsafe { out.row(t * per_tree, per_tree) };
                    for (e, xe) in ws.x.iter().enumerate() {
                        V::put(x, e, xe[l]);
                    }
                }
                Ok(())
            });
        }
        (0..trees).into_par_iter().try_for_each_init(
            || Workspace::<V>::new(V::zero()),
            |ws, t| {
                ws.size(V::zero(), dims.nodes, dims.d, dims.r);
                let c0 = coef_at(t);
                let blk = Blocks {
                    a: &ca[c0..c0 + per_coef],
                    b: &cb[c0..c0 + per_coef],
                    c: &cc[c0..c0 + per_coef],
                    d: dims.d,
                    side,
                };
                let u = &rhs[t * per_tree..(t + 1) * per_tree];
                // SAFETY: this task alone writes tree t's region of the output.
                let x = unsafe { out.row(t * per_tree, per_tree) };
                solve_blocked(&self.tree, &blk, u, x, dims.r, ws)
                    .map_err(|BadPivot(v)| self.pivot_error(side, Some(t), v))
            },
        )
    }

    /// The scalar-block (d = 1) solve of every tree, in groups of [`LANES`] trees solved in
    /// lock-step (see [`solve_scalar_lanes`]); `finish` receives each solved group, whose
    /// solution is in `ws.x` (lane-major).
    ///
    /// Lanes run over the batch elements of one head when those share their coefficients and
    /// the batch fills the lanes (coefficients are then loaded once per node and broadcast);
    /// otherwise over consecutive (batch, head) trees.
    fn lane_groups<F: WithDType, V: Value<F>>(
        &self,
        side: Side,
        coef: &[F],
        rhs: &[F],
        finish: impl Fn(&LaneGroup, &mut LaneWorkspace<V>) -> Result<()> + Sync + Send,
    ) -> Result<()> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let set = dims.coef_set() * w;
        let (ca, cb, cc) = (&coef[..set], &coef[set..2 * set], &coef[2 * set..3 * set]);
        let per_tree = dims.nodes * dims.r * w;
        let per_coef = dims.nodes * w;
        let trees = dims.batch * dims.heads;
        let coef_at = |t: usize| dims.coef_tree(t / dims.heads, t % dims.heads) * w;
        let layout = LaneLayout::new(dims);
        let avx2 = has_avx2();
        (0..layout.groups).into_par_iter().try_for_each_init(
            LaneWorkspace::<V>::new,
            |ws, index| {
                let group = layout.group(index, trees);
                let t = group.trees;
                let io = LaneCoefs {
                    a: std::array::from_fn(|l| &ca[coef_at(t[l])..][..per_coef]),
                    b: std::array::from_fn(|l| &cb[coef_at(t[l])..][..per_coef]),
                    c: std::array::from_fn(|l| &cc[coef_at(t[l])..][..per_coef]),
                };
                ws.sized(V::zero(), dims.nodes, dims.r);
                // Right-hand sides into lane-major order.
                let u: [&[F]; LANES] = std::array::from_fn(|l| &rhs[t[l] * per_tree..][..per_tree]);
                for (e, uh) in ws.uhat.iter_mut().enumerate() {
                    *uh = std::array::from_fn(|l| V::load(u[l], e));
                }
                let (tree, r, lanes) = (&*self.tree, dims.r, group.lanes);
                let solved = match (side, layout.same) {
                    (Side::Forward, true) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, false, true>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Forward, false) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, false, false>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Adjoint, true) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, true, true>(tree, r, lanes, &io, ws)
                        )
                    }
                    (Side::Adjoint, false) => {
                        best_simd!(
                            avx2,
                            solve_scalar_lanes::<F, V, true, false>(tree, r, lanes, &io, ws)
                        )
                    }
                };
                solved.map_err(|(l, v)| self.pivot_error(side, Some(t[l]), v))?;
                finish(&group, ws)
            },
        )
    }

    /// The error for a singular or non-finite pivot at node `v` of tree `t` (batch × heads +
    /// head), when known.
    fn pivot_error(&self, side: Side, t: Option<usize>, v: usize) -> candle_core::Error {
        let which = match t {
            Some(t) => format!(
                "batch {}, head {}",
                t / self.dims.heads,
                t % self.dims.heads
            ),
            None => "a batch element and head".to_string(),
        };
        let backward = if side == Side::Adjoint {
            ", backward"
        } else {
            ""
        };
        candle_core::Error::Msg(format!(
            "tree_solve: the pivot block of node {v} ({which}{backward}) is singular or not \
             finite; T_G must stay invertible (the Myo layer keeps it diagonally dominant)"
        ))
    }

    /// Backward for scalar blocks: λ = T_G⁻ᴴ g by the lane-group solve, then in the same group
    /// the block gradients −Σ_r λ_row conj(x_col), summed over the lanes when they are batch
    /// elements of one head. Returns ∂u and the gradient partials, shaped
    /// (3, partials, heads, nodes, 1, 1[, 2]) to be summed over dimension 1 (see [`LaneLayout`]).
    fn backward_scalar<F: WithDType, V: Value<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>, usize)> {
        let dims = self.dims;
        let (n, r, w) = (dims.nodes, dims.r, if self.opts.complex { 2 } else { 1 });
        let per_tree = n * r * w;
        let layout = LaneLayout::new(dims);
        let partials = layout.partials();
        let set = partials * dims.heads * n * w;
        let mut du = OutBuf::new(g.len());
        let mut dcoef = OutBuf::new(3 * set);
        let (du_out, dc_out) = (du.ptr(), dcoef.ptr());
        let avx2 = has_avx2();
        self.lane_groups::<F, V>(Side::Adjoint, coef, g, |group, ws| {
            let t = group.trees;
            for (l, &tl) in t.iter().enumerate().take(group.lanes) {
                // SAFETY: this task alone writes its trees' regions of ∂u.
                let du = unsafe { du_out.row(tl * per_tree, per_tree) };
                for (e, le) in ws.x.iter().enumerate() {
                    V::put(du, e, le[l]);
                }
            }
            let xs: [&[F]; LANES] = std::array::from_fn(|l| &x[t[l] * per_tree..][..per_tree]);
            ws.aux.resize(n * r, [V::zero(); LANES]);
            for (e, xe) in ws.aux.iter_mut().enumerate() {
                *xe = std::array::from_fn(|l| V::load(xs[l], e));
            }
            // SAFETY: the three sets lie back to back in the buffer.
            let sets: [SharedOut<F>; 3] =
                std::array::from_fn(|k| unsafe { dc_out.offset(k * set) });
            best_simd!(
                avx2,
                block_grads_lanes::<F, V>(&self.tree, r, group, &layout, dims.heads, &sets, ws)
            );
            Ok(())
        })?;
        // SAFETY: every tree's ∂u region and every partial were written by its group.
        Ok((
            unsafe { du.assume_filled() },
            unsafe { dcoef.assume_filled() },
            partials,
        ))
    }

    fn forward_t<F: WithDType>(&self, u: &[F], coef: &[F]) -> Result<Vec<F>> {
        let mut out = OutBuf::new(u.len());
        if self.opts.complex {
            self.solve_all::<F, Complex<F>>(Side::Forward, coef, u, out.ptr())?
        } else {
            self.solve_all::<F, Re<F>>(Side::Forward, coef, u, out.ptr())?
        }
        // SAFETY: the solve succeeded, so every tree's region is written.
        Ok(unsafe { out.assume_filled() })
    }

    /// λ = T_G⁻ᴴ g, then the block gradients from λ and x: returns (∂u, ∂coef) with ∂coef
    /// stacked like the coefficients, per sample (summed over the batch by the caller when
    /// shared).
    fn adjoint_and_grads<F: WithDType, V: Value<F>>(
        &self,
        coef: &[F],
        x: &[F],
        g: &[F],
    ) -> Result<(Vec<F>, Vec<F>)> {
        let dims = self.dims;
        let w = if self.opts.complex { 2 } else { 1 };
        let mut lam = OutBuf::new(g.len());
        self.solve_all::<F, V>(Side::Adjoint, coef, g, lam.ptr())?;
        // SAFETY: the solve succeeded, so every tree's region is written.
        let lam = unsafe { lam.assume_filled() };
        // Per-(batch, head) block gradients: (3, batch, heads, nodes, d, d).
        let (n, d, r) = (dims.nodes, dims.d, dims.r);
        let per_set = dims.batch * dims.heads * n * d * d * w;
        let tree = &self.tree;
        let lam_ref = &lam;
        let mut dcoef = OutBuf::new(3 * per_set);
        let dc = dcoef.ptr();
        (0..dims.batch * dims.heads).into_par_iter().for_each(|t| {
            let per_tree = n * d * r * w;
            let (xs, ls) = (
                &x[t * per_tree..][..per_tree],
                &lam_ref[t * per_tree..][..per_tree],
            );
            let per_coef = n * d * d * w;
            // SAFETY: tree t's blocks of each gradient set belong to this task.
            let (da, db, dcc) = unsafe {
                (
                    dc.row(t * per_coef, per_coef),
                    dc.row(per_set + t * per_coef, per_coef),
                    dc.row(2 * per_set + t * per_coef, per_coef),
                )
            };
            // −Σ_r λ_row[i][r] conj(x_col[j][r]) for the block at (row, col)
            let outer = |row: usize, col: usize, i: usize, j: usize| -> V {
                let mut s = V::zero();
                for k in 0..r {
                    s = V::load(ls, (row * d + i) * r + k)
                        .fma(V::load(xs, (col * d + j) * r + k).conj(), s);
                }
                V::zero().sub(s)
            };
            for v in 0..n {
                let p = tree.parent(v);
                for i in 0..d {
                    for j in 0..d {
                        let e = (v * d + i) * d + j;
                        V::put(da, e, outer(v, v, i, j));
                        V::put(db, e, p.map_or(V::zero(), |p| outer(v, p, i, j)));
                        V::put(dcc, e, p.map_or(V::zero(), |p| outer(p, v, i, j)));
                    }
                }
            }
        });
        // SAFETY: every tree wrote all entries of its blocks in the three sets.
        Ok((lam, unsafe { dcoef.assume_filled() }))
    }
}

impl CustomOp2 for TreeSolveOp {
    fn name(&self) -> &'static str {
        "tree-solve"
    }

    fn cpu_fwd(
        &self,
        su: &CpuStorage,
        lu: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match su.dtype() {
            DType::F32 => CpuStorage::F32(
                self.forward_t(contiguous::<f32>(su, lu)?, contiguous::<f32>(sc, lc)?)?,
            ),
            DType::F64 => CpuStorage::F64(
                self.forward_t(contiguous::<f64>(su, lu)?, contiguous::<f64>(sc, lc)?)?,
            ),
            dt => bail!("tree_solve: dtype {dt:?} is not supported on the CPU"),
        };
        Ok((out, lu.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        su: &candle_core::CudaStorage,
        lu: &Layout,
        sc: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::forward(self, (su, lu), (sc, lc))?, lu.shape().clone()))
    }

    fn bwd(
        &self,
        _u: &Tensor,
        coef: &Tensor,
        x: &Tensor,
        grad_x: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (du, dcoef) = self.backward(&coef.contiguous()?, x, grad_x)?;
        Ok((Some(du), Some(dcoef)))
    }
}

impl TreeSolveOp {
    /// ∂u and the stacked coefficient gradient, on whichever device the tensors are.
    fn backward(&self, coef: &Tensor, x: &Tensor, grad_x: &Tensor) -> Result<(Tensor, Tensor)> {
        let g = grad_x.contiguous()?;
        match (g.device(), g.dtype()) {
            (Device::Cpu, DType::F32) => self.backward_tensors::<f32>(coef, x, &g),
            (Device::Cpu, DType::F64) => self.backward_tensors::<f64>(coef, x, &g),
            #[cfg(feature = "cuda")]
            (Device::Cuda(_), _) => cuda::backward(self, coef, x, &g),
            (dev, dt) => bail!(
                "tree_solve backward: dtype {dt:?} on {:?} is not supported",
                dev.location()
            ),
        }
    }

    fn backward_tensors<F: WithDType>(
        &self,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (sc, lc) = coef.storage_and_layout();
        let (sx, lx) = x.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (Storage::Cpu(sc), Storage::Cpu(sx), Storage::Cpu(sg)) = (&*sc, &*sx, &*sg) else {
            bail!("tree_solve backward: tensors are not all on the CPU")
        };
        let (coef_s, x_s, g_s) = (
            contiguous::<F>(sc, lc)?,
            contiguous::<F>(sx, lx)?,
            contiguous::<F>(sg, lg)?,
        );
        let dims = self.dims;
        let (du, dcoef) = if dims.d == 1 {
            let (du, dcoef, partials) = if self.opts.complex {
                self.backward_scalar::<F, Complex<F>>(coef_s, x_s, g_s)?
            } else {
                self.backward_scalar::<F, Re<F>>(coef_s, x_s, g_s)?
            };
            (du, self.reduce_partials(dcoef, partials, 1)?)
        } else {
            let (du, dcoef) = if self.opts.complex {
                self.adjoint_and_grads::<F, Complex<F>>(coef_s, x_s, g_s)?
            } else {
                self.adjoint_and_grads::<F, Re<F>>(coef_s, x_s, g_s)?
            };
            (du, self.reduce_partials(dcoef, dims.batch, dims.d)?)
        };
        Ok((Tensor::from_vec(du, g.shape(), &Device::Cpu)?, dcoef))
    }

    /// The stacked coefficient gradient from per-(partial, head) blocks laid out as
    /// (3, partials, heads, nodes, d, d[, 2]): as is for per-sample coefficients (the partials
    /// are the batch), summed over the partials for shared ones.
    fn reduce_partials<F: WithDType>(
        &self,
        dcoef: Vec<F>,
        partials: usize,
        d: usize,
    ) -> Result<Tensor> {
        let dims = self.dims;
        let tail: &[usize] = if self.opts.complex { &[2] } else { &[] };
        if !dims.shared {
            let shape = [&[3, partials, dims.heads, dims.nodes, d, d][..], tail].concat();
            return Tensor::from_vec(dcoef, shape, &Device::Cpu);
        }
        let len = dims.heads * dims.nodes * d * d * tail.iter().product::<usize>();
        let summed: Vec<F> = (0..3)
            .flat_map(|k| {
                sum_partials(
                    &dcoef[k * partials * len..(k + 1) * partials * len],
                    partials,
                    len,
                )
            })
            .collect();
        let shape = [&[3, dims.heads, dims.nodes, d, d][..], tail].concat();
        Tensor::from_vec(summed, shape, &Device::Cpu)
    }
}

/// Gradients of a loss with respect to the inputs of [`tree_solve`].
#[derive(Debug, Clone)]
pub struct TreeSolveGrads {
    pub u: Tensor,
    pub a: Tensor,
    pub b: Tensor,
    pub c: Tensor,
}

/// The backward of [`tree_solve`] on its own: given the forward's inputs, its output `x` and
/// ∂L/∂x, returns ∂L/∂u, ∂L/∂A, ∂L/∂B, ∂L/∂C by one adjoint solve (the code autograd runs).
pub fn tree_solve_backward(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    x: &Tensor,
    grad_x: &Tensor,
    opts: TreeSolveOptions,
) -> Result<TreeSolveGrads> {
    let dims = check_args(tree, a, b, c, x, opts)?;
    if grad_x.dims() != x.dims() || grad_x.dtype() != x.dtype() {
        bail!(
            "tree_solve_backward: grad_x ({:?}, {:?}) must match x ({:?}, {:?})",
            grad_x.dims(),
            grad_x.dtype(),
            x.dims(),
            x.dtype()
        );
    }
    if !x.device().is_cpu() {
        bail!(
            "tree_solve_backward: device {:?} is not supported yet",
            x.device().location()
        );
    }
    let op = TreeSolveOp {
        tree: Arc::new(tree.clone()),
        dims,
        opts,
    };
    let coef = Tensor::stack(&[a, b, c], 0)?;
    let (du, dcoef) = op.backward(&coef, &x.contiguous()?, grad_x)?;
    Ok(TreeSolveGrads {
        u: du,
        a: dcoef.get(0)?,
        b: dcoef.get(1)?,
        c: dcoef.get(2)?,
    })
}

/// The same solve as the paper's Listing 1, in plain candle ops: a loop over the BFS levels,
/// each level one batch of tensor operations (children's messages reach their parents by
/// `index_add`, parents' solutions come back down by `index_select`). Scalar blocks (d = 1),
/// real or complex. Differentiable by candle's autograd: the benchmark baseline and an
/// independent check of the op and its backward.
pub fn tree_solve_reference(
    tree: &Tree,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    u: &Tensor,
    opts: TreeSolveOptions,
) -> Result<Tensor> {
    let dims = check_args(tree, a, b, c, u, opts)?;
    if dims.d != 1 {
        bail!(
            "tree_solve_reference: only scalar blocks (d = 1), got d = {}",
            dims.d
        );
    }
    let batched = |t: &Tensor| {
        if dims.shared {
            t.unsqueeze(0)
        } else {
            Ok(t.clone())
        }
    };
    let (a, b, c) = (batched(a)?, batched(b)?, batched(c)?);
    let level = |t: &Tensor, k: usize| t.narrow(2, tree.level(k).start, tree.level(k).len());
    let complex = opts.complex;
    let mul = |x: &Tensor, y: &Tensor| {
        if complex {
            complex_mul(x, y)
        } else {
            x.broadcast_mul(y)
        }
    };
    let div = |x: &Tensor, y: &Tensor| {
        if complex {
            complex_div(x, y)
        } else {
            x.broadcast_div(y)
        }
    };
    // Sum of per-child messages into their parents (a level of `parents` nodes).
    let to_parents = |msg: &Tensor, idx: &Tensor, parents: usize| {
        let mut shape = msg.dims().to_vec();
        shape[2] = parents;
        Tensor::zeros(shape, msg.dtype(), msg.device())?.index_add(idx, msg, 2)
    };
    let mut ahat = level(&a, 0)?;
    let mut uhat = level(u, 0)?;
    let mut down = Vec::with_capacity(tree.levels());
    for k in 0..tree.levels() - 1 {
        let up = tree.level(k + 1).start;
        let idx: Vec<u32> = tree
            .level(k)
            .map(|v| (tree.parents()[v] - up) as u32)
            .collect();
        let idx = Tensor::new(idx, u.device())?;
        let bhat = div(&level(&b, k)?.neg()?, &ahat)?;
        let uhat_k = div(&uhat, &ahat)?;
        let ck = level(&c, k)?;
        let parents = tree.level(k + 1).len();
        ahat = level(&a, k + 1)?.broadcast_add(&to_parents(&mul(&ck, &bhat)?, &idx, parents)?)?;
        uhat = (level(u, k + 1)? - to_parents(&mul(&ck, &uhat_k)?, &idx, parents)?)?;
        down.push((uhat_k, bhat, idx));
    }
    let mut x = div(&uhat, &ahat)?;
    let mut levels = vec![x.clone()];
    for (uhat_k, bhat, idx) in down.into_iter().rev() {
        x = (uhat_k + mul(&bhat, &x.index_select(&idx, 2)?)?)?;
        levels.push(x.clone());
    }
    levels.reverse();
    Tensor::cat(&levels, 2)
}

fn re_im(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let last = x.rank() - 1;
    Ok((x.narrow(last, 0, 1)?, x.narrow(last, 1, 1)?))
}

/// x · y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_mul(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ((xr, xi), (yr, yi)) = (re_im(x)?, re_im(y)?);
    let re = (xr.broadcast_mul(&yr)? - xi.broadcast_mul(&yi)?)?;
    let im = (xr.broadcast_mul(&yi)? + xi.broadcast_mul(&yr)?)?;
    Tensor::cat(&[re, im], x.rank() - 1)
}

/// x / y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_div(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ((xr, xi), (yr, yi)) = (re_im(x)?, re_im(y)?);
    let n = (yr.sqr()? + yi.sqr()?)?;
    let re = (xr.broadcast_mul(&yr)? + xi.broadcast_mul(&yi)?)?.broadcast_div(&n)?;
    let im = (xi.broadcast_mul(&yr)? - xr.broadcast_mul(&yi)?)?.broadcast_div(&n)?;
    Tensor::cat(&[re, im], x.rank() - 1)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launches of `kernels/tree_solve.cu` on candle's CUDA stream.
    use std::sync::Arc;

    use super::{Side, TreeSolveOp};
    use crate::cuda::{dtype_suffix, slice_at, CudaElem, TREE_MODULE, TREE_PTX};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUdevice_attribute_enum, CUfunction_attribute_enum,
    };
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::WrapErr;
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

    /// Threads per block (TREE_THREADS in the kernel).
    const THREADS: u32 = 256;
    /// Shared memory a kernel gets without opting in.
    const DEFAULT_SHARED: usize = 48 * 1024;

    /// What a launch of either tree kernel needs besides its tensors: the tree's arrays on the
    /// device, the sizes, the workspace (shared memory up to the device's opt-in limit per
    /// block — 96 KiB on V100, 227 KiB on H100 — else a global buffer) and the status word.
    struct TreeLaunch {
        stream: Arc<CudaStream>,
        func: CudaFunction,
        level_start: CudaSlice<u32>,
        child_start: CudaSlice<u32>,
        parent: CudaSlice<u32>,
        ints: [i32; 5],
        workspace: Option<CudaSlice<u8>>,
        null: usize,
        status: CudaSlice<i32>,
        cfg: LaunchConfig,
    }

    impl TreeLaunch {
        fn new(op: &TreeSolveOp, dev: &CudaDevice, stem: &str, dtype: DType) -> Result<Self> {
            let dims = op.dims;
            let trees = dims.batch * dims.heads;
            let upload = |v: &[usize]| -> Result<CudaSlice<u32>> {
                let v: Vec<u32> = v.iter().map(|&x| x as u32).collect();
                dev.clone_htod(&v)
            };
            let n = |v: usize| {
                i32::try_from(v).map_err(|_| {
                    candle_core::Error::Msg(format!(
                        "tree_solve: {v} is too large for the CUDA kernel"
                    ))
                })
            };
            let ints = [
                n(op.tree.levels())?,
                n(dims.nodes)?,
                n(dims.r)?,
                n(dims.heads)?,
                dims.shared as i32,
            ];
            let acc = if dtype == DType::F64 { 8 } else { 4 };
            let bytes = dims.nodes * (1 + dims.r) * acc * if op.opts.complex { 2 } else { 1 };
            let stream = dev.cuda_stream();
            let in_shared = bytes <= DEFAULT_SHARED
                || {
                    let limit = stream
                    .context()
                    .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .w()?;
                    bytes <= limit as usize
                };
            let name = format!(
                "{stem}_{}{}",
                dtype_suffix(dtype)?,
                if op.opts.complex { "_c" } else { "" }
            );
            let func = dev
                .get_or_load_custom_func(&name, TREE_MODULE, TREE_PTX)?
                .into_cuda_function();
            if in_shared && bytes > DEFAULT_SHARED {
                func.set_attribute(
                    CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .w()?;
            }
            Ok(TreeLaunch {
                stream,
                func,
                level_start: upload(op.tree.level_starts())?,
                child_start: upload(op.tree.child_starts())?,
                parent: upload(op.tree.parents())?,
                ints,
                workspace: if in_shared {
                    None
                } else {
                    Some(dev.alloc_zeros::<u8>(trees * bytes)?)
                },
                null: 0,
                status: dev.alloc_zeros::<i32>(1)?,
                cfg: LaunchConfig {
                    grid_dim: (trees as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: if in_shared { bytes as u32 } else { 0 },
                },
            })
        }

        fn builder(&self) -> LaunchArgs<'_> {
            self.stream.launch_builder(&self.func)
        }

        /// Pushes the arguments after the tensors, launches, and turns a bad pivot reported
        /// by the kernel into an error.
        fn launch<'a>(&'a self, mut b: LaunchArgs<'a>, op: &TreeSolveOp, side: Side) -> Result<()> {
            b.arg(&self.level_start)
                .arg(&self.child_start)
                .arg(&self.parent);
            for v in &self.ints {
                b.arg(v);
            }
            match &self.workspace {
                Some(ws) => b.arg(ws),
                None => b.arg(&self.null),
            };
            b.arg(&self.status);
            unsafe { b.launch(self.cfg) }.w()?;
            let status = self.stream.clone_dtoh(&self.status).w()?;
            if status[0] != 0 {
                // The kernel reports the first bad node, not its tree.
                return Err(op.pivot_error(side, None, (status[0] - 1) as usize));
            }
            Ok(())
        }
    }

    pub(super) fn forward(
        op: &TreeSolveOp,
        u: (&CudaStorage, &Layout),
        coef: (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        fn run<T: CudaElem>(
            op: &TreeSolveOp,
            u: (&CudaStorage, &Layout),
            coef: (&CudaStorage, &Layout),
        ) -> Result<CudaStorage> {
            let dev = u.0.device().clone();
            let launch = TreeLaunch::new(op, &dev, "tree_fwd", T::DTYPE)?;
            let (us, coefs) = (slice_at::<T>(u)?, slice_at::<T>(coef)?);
            let x = unsafe { dev.alloc::<T>(u.1.shape().elem_count()) }?;
            let mut b = launch.builder();
            b.arg(&us).arg(&coefs).arg(&x);
            launch.launch(b, op, Side::Forward)?;
            Ok(CudaStorage::wrap_cuda_slice(x, dev))
        }
        match u.0.dtype() {
            DType::F32 => run::<f32>(op, u, coef),
            DType::F64 => run::<f64>(op, u, coef),
            DType::F16 => run::<half::f16>(op, u, coef),
            DType::BF16 => run::<half::bf16>(op, u, coef),
            dt => bail!("tree_solve: dtype {dt:?} is not supported on CUDA"),
        }
    }

    pub(super) fn backward(
        op: &TreeSolveOp,
        coef: &Tensor,
        x: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        fn run<T: CudaElem>(
            op: &TreeSolveOp,
            coef: &Tensor,
            x: &Tensor,
            g: &Tensor,
        ) -> Result<(Tensor, Tensor)> {
            let dims = op.dims;
            let x = x.contiguous()?;
            let (sc, lc) = coef.storage_and_layout();
            let (sx, lx) = x.storage_and_layout();
            let (sg, lg) = g.storage_and_layout();
            let (Storage::Cuda(sc), Storage::Cuda(sx), Storage::Cuda(sg)) = (&*sc, &*sx, &*sg)
            else {
                bail!("tree_solve backward: tensors are not all on the same CUDA device")
            };
            let dev = sg.device().clone();
            let launch = TreeLaunch::new(op, &dev, "tree_bwd", T::DTYPE)?;
            let (cv, xv, gv) = (
                slice_at::<T>((sc, lc))?,
                slice_at::<T>((sx, lx))?,
                slice_at::<T>((sg, lg))?,
            );
            let w = if op.opts.complex { 2 } else { 1 };
            let du = unsafe { dev.alloc::<T>(g.elem_count()) }?;
            let dcoef = unsafe { dev.alloc::<T>(3 * dims.batch * dims.heads * dims.nodes * w) }?;
            let mut b = launch.builder();
            b.arg(&gv).arg(&cv).arg(&xv).arg(&du).arg(&dcoef);
            launch.launch(b, op, Side::Adjoint)?;
            let wrap = |s, shape: Vec<usize>| {
                Tensor::from_storage(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                    shape,
                    BackpropOp::none(),
                    false,
                )
            };
            let tail: &[usize] = if op.opts.complex { &[2] } else { &[] };
            let dcoef = wrap(
                dcoef,
                [&[3, dims.batch, dims.heads, dims.nodes, 1, 1][..], tail].concat(),
            );
            // Per-tree gradients; shared coefficients sum them over the batch.
            let dcoef = if dims.shared { dcoef.sum(1)? } else { dcoef };
            Ok((wrap(du, g.dims().to_vec()), dcoef))
        }
        match g.dtype() {
            DType::F32 => run::<f32>(op, coef, x, g),
            DType::F64 => run::<f64>(op, coef, x, g),
            DType::F16 => run::<half::f16>(op, coef, x, g),
            DType::BF16 => run::<half::bf16>(op, coef, x, g),
            dt => bail!("tree_solve backward: dtype {dt:?} is not supported on CUDA"),
        }
    }
}
