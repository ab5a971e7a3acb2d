//! The tree solve of a Myo layer's scalar complex heads, x = T_G⁻¹ u, in the model's layout.
//!
//! Per head h, T_G has the sparsity of a rooted [`Tree`] with a unit diagonal, B_v at (row v,
//! column parent(v)) and C_v at (row parent(v), column v); the root's B and C are unused. It is
//! the case of [`tree_solve`](crate::ops::tree_solve()) that the layer runs (d = 1, A = 1, one
//! right-hand side, coefficients shared by the batch), with tensors in the layout the layer's
//! projections produce and consume, so that no transposed copy surrounds the solve:
//! * u: (batch, m, heads, 2): the right-hand sides of the first m nodes (m = the leaves, or all
//!   nodes);
//! * bias: (nodes − leaves, heads, 2): added to the right-hand sides of the internal nodes
//!   (those beyond m have nothing else), shared by the batch;
//! * B, C: (nodes, heads, 2), shared by the batch;
//! * x: (batch, nodes, heads, 2).
//!
//! [`head_solve_skew`] takes the Myo layer's default form in its parameters' own layout instead:
//! B = −s and C = conj(s) from s (heads, nodes, 2), and the bias (heads, nodes − leaves, 2); its
//! backward gives ∂s = conj(∂C) − ∂B and ∂bias in the same layouts, so that the layer needs no op
//! to place its couplings, forward or backward.
//!
//! # Algorithm (shared by the CPU twin and the CUDA kernels)
//! Eliminating the leaves upward gives pivots that depend on the coefficients alone, so they
//! are computed once per head, not per sample: Â_v = 1 + Σ_children C_c B̂_c and
//! B̂_v = −B_v / Â_v, level by level from the leaves. Then per sample, upward,
//! û_c = ũ_c / Â_c and ũ_p = u_p − Σ_c C_c û_c; the root's x_R = ũ_R / Â_R; downward,
//! x_c = û_c + B̂_c x_p. Per sample and node: two complex multiply-adds up, one down.
//!
//! # Backward
//! λ = T_G⁻ᴴ g is the same solve with the adjoint (B' = C†, C' = B†, whose pivots are the
//! conjugates of the forward's); then ∂u = λ on the first m nodes, ∂bias = Σ_batch λ on the
//! internal nodes, ∂B_v = −Σ_batch λ_v x_parent† and ∂C_v = −Σ_batch λ_parent x_v† (zero at the
//! root), each sum over the batch taken in order, so the gradients are the same on every run.
//!
//! # Singular pivots
//! T_G = I + skew-Hermitian (the Myo layer's default) has every |Â_v| ≥ 1, and the dominant
//! forms keep them away from zero; a zero or non-finite pivot means diverged parameters and is
//! an error naming the node and head (on CUDA recorded on the device and reported by
//! [`check_pivots`](crate::ops::check_pivots), as for the general tree solve).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use crate::ops::value::contiguous;
use crate::tree::Tree;

mod cpu;
pub mod cuda;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    batch: usize,
    /// Nodes with a right-hand side in u: the leaves, or all nodes.
    m: usize,
    heads: usize,
    nodes: usize,
    leaves: usize,
    /// The skew form ([`head_solve_skew`]): coef = s (heads, nodes, 2), bias by head.
    skew: bool,
}

impl Dims {
    fn internal(&self) -> usize {
        self.nodes - self.leaves
    }

    /// The bias's shape, with a stand-in row for a tree without internal nodes.
    fn bias_shape(&self) -> Vec<usize> {
        let k = self.internal().max(1);
        match self.skew {
            true => vec![self.heads, k, 2],
            false => vec![k, self.heads, 2],
        }
    }

    /// The coefficients' shape: [B; C] or s.
    fn coef_shape(&self) -> Vec<usize> {
        match self.skew {
            true => vec![self.heads, self.nodes, 2],
            false => vec![2, self.nodes, self.heads, 2],
        }
    }
}

/// x = T_G⁻¹ u for `heads` scalar complex trees per sample, with unit diagonal, B and C, and
/// `bias` added to the internal nodes' right-hand sides. See the module docs for shapes. f32
/// and f64 (f16 and bf16 are solved in f32).
pub fn head_solve(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
) -> Result<Tensor> {
    let dims = check_args(tree, u, bias, b, c)?;
    let dtype = u.dtype();
    if matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        return head_solve(tree, &up(u)?, &up(bias)?, &up(b)?, &up(c)?)?.to_dtype(dtype);
    }
    let coef = Tensor::stack(&[b, c], 0)?;
    solve(tree, dims, u, bias, &coef)
}

/// [`head_solve`] of T_G's skew form, B = −s and C = conj(s), with s (heads, nodes, 2) and the
/// bias (heads, nodes − leaves, 2) in the Myo layer's parameter layout (module docs).
pub fn head_solve_skew(tree: &Tree, u: &Tensor, bias: &Tensor, s: &Tensor) -> Result<Tensor> {
    let dims = check_skew_args(tree, u, bias, s)?;
    let dtype = u.dtype();
    if matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        return head_solve_skew(tree, &up(u)?, &up(bias)?, &up(s)?)?.to_dtype(dtype);
    }
    solve(tree, dims, u, bias, &s.contiguous()?)
}

/// The op on checked arguments, `coef` as `dims.skew` says.
fn solve(tree: &Tree, dims: Dims, u: &Tensor, bias: &Tensor, coef: &Tensor) -> Result<Tensor> {
    // A tree without internal nodes has no bias; the kernels never read this stand-in.
    let bias = match dims.internal() {
        0 => Tensor::zeros(dims.bias_shape(), u.dtype(), u.device())?,
        _ => bias.contiguous()?,
    };
    u.contiguous()?
        .apply_op3(&bias, coef, HeadSolveOp::new(tree, dims))
}

fn check_args(tree: &Tree, u: &Tensor, bias: &Tensor, b: &Tensor, c: &Tensor) -> Result<Dims> {
    let dims = check_u(tree, u)?;
    let (heads, nodes, internal) = (dims.heads, dims.nodes, dims.internal());
    for (name, t, want) in [
        ("bias", bias, [internal, heads, 2]),
        ("b", b, [nodes, heads, 2]),
        ("c", c, [nodes, heads, 2]),
    ] {
        check_like_u(&dims, name, t, want, u)?;
    }
    Ok(dims)
}

fn check_skew_args(tree: &Tree, u: &Tensor, bias: &Tensor, s: &Tensor) -> Result<Dims> {
    let dims = check_u(tree, u)?;
    let (heads, nodes, internal) = (dims.heads, dims.nodes, dims.internal());
    check_like_u(&dims, "bias", bias, [heads, internal, 2], u)?;
    check_like_u(&dims, "s", s, [heads, nodes, 2], u)?;
    Ok(Dims { skew: true, ..dims })
}

/// `t`'s shape is `want`, its dtype and device u's.
fn check_like_u(d: &Dims, name: &str, t: &Tensor, want: [usize; 3], u: &Tensor) -> Result<()> {
    if t.dims() != want {
        bail!(
            "head_solve: {name} has shape {:?}, expected {want:?} for {} heads and a tree of {} \
             nodes ({} leaves)",
            t.dims(),
            d.heads,
            d.nodes,
            d.leaves
        );
    }
    if t.dtype() != u.dtype() {
        bail!(
            "head_solve: {name} has dtype {:?} but u has {:?}",
            t.dtype(),
            u.dtype()
        );
    }
    if !t.device().same_device(u.device()) {
        bail!(
            "head_solve: {name} is on {:?} but u is on {:?}",
            t.device().location(),
            u.device().location()
        );
    }
    Ok(())
}

/// u's shape, dtype and device; the dimensions of the general form.
fn check_u(tree: &Tree, u: &Tensor) -> Result<Dims> {
    let (nodes, leaves) = (tree.len(), tree.leaves());
    let (batch, m, heads, two) = match u.dims() {
        &[batch, m, heads, two] => (batch, m, heads, two),
        d => bail!("head_solve: u must be (batch, nodes or leaves, heads, 2), got shape {d:?}"),
    };
    if two != 2 || batch == 0 || heads == 0 || (m != nodes && m != leaves) {
        bail!(
            "head_solve: u has shape {:?}; it must be (batch, {leaves} leaves or {nodes} nodes, \
             heads, 2) with batch, heads ≥ 1",
            u.dims()
        );
    }
    if !matches!(
        u.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) {
        bail!("head_solve: dtype {:?} is not supported", u.dtype());
    }
    match u.device() {
        Device::Cpu => {}
        Device::Cuda(_) if cfg!(feature = "cuda") => {}
        dev => bail!("head_solve: device {:?} is not supported", dev.location()),
    }
    Ok(Dims {
        batch,
        m,
        heads,
        nodes,
        leaves,
        skew: false,
    })
}

/// The error for a singular or non-finite pivot at `node` of `head`.
/// The error of a singular or non-finite pivot at (`node`, `head`), met `at` (the backward,
/// say).
pub(crate) fn pivot_error(node: usize, head: usize, at: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "head_solve: the pivot of node {node}, head {head} ({at}) is singular or not finite; \
         T_G must stay invertible"
    ))
}

struct HeadSolveOp {
    tree: Tree,
    dims: Dims,
}

impl HeadSolveOp {
    fn new(tree: &Tree, dims: Dims) -> Self {
        HeadSolveOp {
            tree: tree.clone(),
            dims,
        }
    }

    /// (∂u, ∂bias, ∂coef) on whichever device the tensors are.
    fn backward(&self, coef: &Tensor, x: &Tensor, g: &Tensor) -> Result<[Tensor; 3]> {
        let (coef, x, g) = (coef.contiguous()?, x.contiguous()?, g.contiguous()?);
        let (lam, dbias, dcoef) = match (g.device(), g.dtype()) {
            (Device::Cpu, DType::F32) => self.backward_tensors::<f32>(&coef, &x, &g)?,
            (Device::Cpu, DType::F64) => self.backward_tensors::<f64>(&coef, &x, &g)?,
            #[cfg(feature = "cuda")]
            (Device::Cuda(_), _) => cuda::backward(self, &coef, &x, &g)?,
            (dev, dt) => bail!(
                "head_solve backward: dtype {dt:?} on {:?} is not supported",
                dev.location()
            ),
        };
        let Dims { m, nodes, .. } = self.dims;
        let du = if m == nodes {
            lam
        } else {
            lam.narrow(1, 0, m)?
        };
        Ok([du, dbias, dcoef])
    }
}

impl CustomOp3 for HeadSolveOp {
    fn name(&self) -> &'static str {
        "head-solve"
    }

    fn cpu_fwd(
        &self,
        su: &CpuStorage,
        lu: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match su.dtype() {
            DType::F32 => CpuStorage::F32(self.forward_t(
                contiguous::<f32>(su, lu)?,
                contiguous::<f32>(sb, lb)?,
                contiguous::<f32>(sc, lc)?,
            )?),
            DType::F64 => CpuStorage::F64(self.forward_t(
                contiguous::<f64>(su, lu)?,
                contiguous::<f64>(sb, lb)?,
                contiguous::<f64>(sc, lc)?,
            )?),
            dt => bail!("head_solve: dtype {dt:?} is not supported on the CPU"),
        };
        let Dims {
            batch,
            heads,
            nodes,
            ..
        } = self.dims;
        Ok((out, Shape::from((batch, nodes, heads, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        su: &candle_core::CudaStorage,
        lu: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
        sc: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Dims {
            batch,
            heads,
            nodes,
            ..
        } = self.dims;
        let x = cuda::forward(self, (su, lu), (sb, lb), (sc, lc))?;
        Ok((x, Shape::from((batch, nodes, heads, 2))))
    }

    fn bwd(
        &self,
        _u: &Tensor,
        _bias: &Tensor,
        coef: &Tensor,
        x: &Tensor,
        grad_x: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [du, dbias, dcoef] = self.backward(coef, x, grad_x)?;
        Ok((Some(du), Some(dbias), Some(dcoef)))
    }
}

/// Gradients of a loss with respect to the inputs of [`head_solve_skew`], in their layouts.
#[derive(Debug, Clone)]
pub struct HeadSkewGrads {
    pub u: Tensor,
    pub bias: Tensor,
    pub s: Tensor,
}

/// The backward of [`head_solve_skew`] on its own, as [`head_solve_backward`] for the general
/// form.
pub fn head_solve_skew_backward(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    s: &Tensor,
    x: &Tensor,
    grad_x: &Tensor,
) -> Result<HeadSkewGrads> {
    let dims = check_skew_args(tree, u, bias, s)?;
    check_outputs(&dims, u, x, grad_x)?;
    let dtype = u.dtype();
    if matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        let (u, bias, s, x, g) = (up(u)?, up(bias)?, up(s)?, up(x)?, up(grad_x)?);
        let g = head_solve_skew_backward(tree, &u, &bias, &s, &x, &g)?;
        let down = |t: Tensor| t.to_dtype(dtype);
        return Ok(HeadSkewGrads {
            u: down(g.u)?,
            bias: down(g.bias)?,
            s: down(g.s)?,
        });
    }
    let [du, dbias, ds] = HeadSolveOp::new(tree, dims).backward(s, x, grad_x)?;
    let dbias = match dims.internal() {
        0 => bias.zeros_like()?,
        _ => dbias,
    };
    Ok(HeadSkewGrads {
        u: du,
        bias: dbias,
        s: ds,
    })
}

/// x and ∂x are (batch, nodes, heads, 2) of u's dtype and device.
fn check_outputs(dims: &Dims, u: &Tensor, x: &Tensor, grad_x: &Tensor) -> Result<()> {
    let want = [dims.batch, dims.nodes, dims.heads, 2];
    for (name, t) in [("x", x), ("grad_x", grad_x)] {
        if t.dims() != want || t.dtype() != u.dtype() || !t.device().same_device(u.device()) {
            bail!(
                "head_solve_backward: {name} ({:?}, {:?}) must be {want:?} of u's dtype {:?} \
                 and device",
                t.dims(),
                t.dtype(),
                u.dtype()
            );
        }
    }
    Ok(())
}

/// Gradients of a loss with respect to the inputs of [`head_solve`].
#[derive(Debug, Clone)]
pub struct HeadSolveGrads {
    pub u: Tensor,
    pub bias: Tensor,
    pub b: Tensor,
    pub c: Tensor,
}

/// The backward of [`head_solve`] on its own: given the forward's inputs, its output `x` and
/// ∂L/∂x, the gradients with respect to u, bias, B and C (the code autograd runs).
pub fn head_solve_backward(
    tree: &Tree,
    u: &Tensor,
    bias: &Tensor,
    b: &Tensor,
    c: &Tensor,
    x: &Tensor,
    grad_x: &Tensor,
) -> Result<HeadSolveGrads> {
    let dims = check_args(tree, u, bias, b, c)?;
    check_outputs(&dims, u, x, grad_x)?;
    let dtype = u.dtype();
    if matches!(dtype, DType::F16 | DType::BF16) {
        let up = |t: &Tensor| t.to_dtype(DType::F32);
        let g = head_solve_backward(
            tree,
            &up(u)?,
            &up(bias)?,
            &up(b)?,
            &up(c)?,
            &up(x)?,
            &up(grad_x)?,
        )?;
        let down = |t: Tensor| t.to_dtype(dtype);
        return Ok(HeadSolveGrads {
            u: down(g.u)?,
            bias: down(g.bias)?,
            b: down(g.b)?,
            c: down(g.c)?,
        });
    }
    let op = HeadSolveOp::new(tree, dims);
    let [du, dbias, dcoef] = op.backward(&Tensor::stack(&[b, c], 0)?, x, grad_x)?;
    let dbias = match dims.internal() {
        0 => bias.zeros_like()?,
        _ => dbias,
    };
    Ok(HeadSolveGrads {
        u: du,
        bias: dbias,
        b: dcoef.get(0)?,
        c: dcoef.get(1)?,
    })
}
