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
//! error naming the node: the layer's parameterisation keeps T_G diagonally dominant, so a
//! failure means diverged parameters, and it stops training instead of feeding NaN forward. On
//! the CPU the solve returns it (with the batch element and head); on CUDA the kernels record
//! the first bad node on the device and [`check_pivots`] returns it, so that no solve waits for
//! the GPU.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use crate::ops::value::contiguous;
use crate::tree::Tree;

mod blocked;
mod cpu;
pub mod cuda;
mod levels;
mod pivoting;
mod reference;
mod transpose;

pub use reference::tree_solve_reference;

/// Options of [`tree_solve`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeSolveOptions {
    /// Complex values: every tensor has a trailing dimension of 2 (re, im).
    pub complex: bool,
    /// How the CUDA kernels lay the trees out (the CPU ignores it).
    pub layout: TreeLayout,
}

/// The work layout of the CUDA tree solve: the layouts and Auto's choice are described in the
/// [`cuda`] module's docs; a variant's doc is its line in `myo bench tree --help`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TreeLayout {
    /// The layout measured fastest for the pass, among those that take the solve.
    #[default]
    Auto,
    /// A block of threads per tree (`tree_fwd`, `tree_block_fwd`).
    Tree,
    /// Trees across lanes (`tree_lanes_fwd`, `tree_lanes_block_fwd`); an error where it does
    /// not fit.
    Lanes,
    /// A sweep per tree (or per samples of a head) through shared memory; an error where it
    /// does not fit.
    Sweep,
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
    check_device(u)?;
    let dtype = u.dtype();
    if u.device().is_cpu() && matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        return tree_solve(tree, &up(a)?, &up(b)?, &up(c)?, &up(u)?, opts)?.to_dtype(dtype);
    }
    let coef = Tensor::stack(&[a, b, c], 0)?;
    u.contiguous()?
        .apply_op2(&coef, TreeSolveOp::new(tree, dims, opts))
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

/// The CPU, and CUDA when built with the `cuda` feature.
fn check_device(u: &Tensor) -> Result<()> {
    match u.device() {
        Device::Cpu => Ok(()),
        Device::Cuda(_) if cfg!(feature = "cuda") => Ok(()),
        dev => bail!("tree_solve: device {:?} is not supported", dev.location()),
    }
}

/// The error for a singular or non-finite pivot block at `node`, found `where`.
fn pivot_error(node: usize, at: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "tree_solve: the pivot block of node {node} ({at}) is singular or not finite; T_G must \
         stay invertible (the Myo layer keeps it diagonally dominant)"
    ))
}

/// Reports a singular or non-finite pivot that a tree solve on `device` met since the last
/// check. On the CPU each solve returns its own error; on CUDA the kernels leave the first bad
/// node in a status word on the device instead, so that no solve waits for the device: call
/// this where the host reads a result back anyway (the trainer does at every loss it reads).
pub fn check_pivots(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let at = "a CUDA solve since the last check, forward or backward";
            match crate::cuda::take_status(dev)? {
                (0, _) => Ok(()),
                (node, 0) => Err(pivot_error((node - 1) as usize, at)),
                (node, head) => Err(crate::ops::head_solve::pivot_error(
                    (node - 1) as usize,
                    (head - 1) as usize,
                    at,
                )),
            }
        }
        _ => Ok(()),
    }
}

struct TreeSolveOp {
    tree: Tree,
    dims: Dims,
    opts: TreeSolveOptions,
}

/// The matrix a solve runs on: T_G itself, or its adjoint T_Gᴴ for the backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Forward,
    Adjoint,
}

impl TreeSolveOp {
    fn new(tree: &Tree, dims: Dims, opts: TreeSolveOptions) -> Self {
        TreeSolveOp {
            tree: tree.clone(),
            dims,
            opts,
        }
    }

    /// The error for a singular or non-finite pivot at node `v` of tree `t` (batch × heads +
    /// head).
    fn pivot_error(&self, side: Side, t: usize, v: usize) -> candle_core::Error {
        let (batch, head) = (t / self.dims.heads, t % self.dims.heads);
        let backward = if side == Side::Adjoint {
            ", backward"
        } else {
            ""
        };
        pivot_error(v, &format!("batch {batch}, head {head}{backward}"))
    }

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
    if !grad_x.device().same_device(x.device()) {
        bail!(
            "tree_solve_backward: grad_x is on {:?} but x is on {:?}",
            grad_x.device().location(),
            x.device().location()
        );
    }
    check_device(x)?;
    if x.device().is_cpu() && matches!(x.dtype(), DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        let g = tree_solve_backward(tree, &up(a)?, &up(b)?, &up(c)?, &up(x)?, &up(grad_x)?, opts)?;
        let down = |t: Tensor| t.to_dtype(x.dtype());
        return Ok(TreeSolveGrads {
            u: down(g.u)?,
            a: down(g.a)?,
            b: down(g.b)?,
            c: down(g.c)?,
        });
    }
    let op = TreeSolveOp::new(tree, dims, opts);
    let coef = Tensor::stack(&[a, b, c], 0)?;
    let (du, dcoef) = op.backward(&coef, &x.contiguous()?, grad_x)?;
    Ok(TreeSolveGrads {
        u: du,
        a: dcoef.get(0)?,
        b: dcoef.get(1)?,
        c: dcoef.get(2)?,
    })
}
