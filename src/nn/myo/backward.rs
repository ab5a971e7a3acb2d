//! The Myo layer's backward written out, for scalar complex heads with skew couplings over all
//! tree nodes (the default layer). With U = X B_in (X the input as rows), per head
//! x = T_G⁻¹ u + bias (the heads' solve), y = Re(C_out x) + D ⊙ X and T_G's entries
//! B = −s, C = conj(s) from the couplings s (per level: s = S[level(v)]):
//!
//!   ∂C_out from [x]ᵀ ∂y (the readout's backward kernel), ∂x = ∂y Rᵀ,
//!   (∂u, ∂bias, ∂s = conj(∂C) − ∂B) = the skew solve's backward (∂s summed per level),
//!   ∂B_in = Xᵀ ∂U,  ∂X = ∂U B_inᵀ + D ⊙ ∂y,  ∂D = Σ_rows X ⊙ ∂y.

use candle_core::{DType, Result, Tensor};

use super::{Coupling, Myo};
use crate::nn::by_hand::{by_hand, Backward, GradSink};
use crate::ops::{
    channel_mul, channel_mul_backward, embedding_backward, gemm, gemm_relaid, head_solve_skew,
    head_solve_skew_backward, s5_readout, s5_readout_backward, Mat,
};
use crate::tree::Tree;

/// What the forward kept (all detached).
pub(super) struct MyoBackward {
    /// The parameters b_in, virtual_u, coupling_b, c_out, d (the gradients' keys).
    vars: [Tensor; 5],
    /// C_out as the readout's fused op took it (f32 under half precision).
    c_out: Tensor,
    d: Tensor,
    x: Tensor,
    b_mat: Tensor,
    /// The virtual nodes' inputs (heads, internal, 2) and the couplings per node.
    bias: Tensor,
    s: Tensor,
    xs: Tensor,
    r: Tensor,
    /// The first node with an output: the outputs are nodes `from..`, read from `x` and `xs`
    /// narrowed to them (`x_out`, `xs_out`).
    from: usize,
    x_out: Tensor,
    xs_out: Tensor,
    /// Per-level couplings: each node's level, and the levels.
    levels: Option<(Tensor, usize)>,
    tree: Tree,
}

impl Myo {
    /// [`candle_core::Module::forward`] as one node of candle's graph whose backward is
    /// written by hand ([`crate::nn::by_hand`]): the parameters' gradients go to `sink`. Where
    /// [`Myo::has_backward_by_hand`] is false, the ordinary forward.
    pub fn forward_by_hand(&self, x: &Tensor, sink: &GradSink) -> Result<Tensor> {
        match self.run_by_hand(x)? {
            Some((y, back)) => by_hand(x, &y, &self.d, back, sink),
            None => candle_core::Module::forward(self, x),
        }
    }

    /// Whether the backward by hand ([`Myo::forward_by_hand`]) covers this layer on `x`.
    pub fn has_backward_by_hand(&self, x: &Tensor) -> bool {
        matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) && (x.device().is_cpu() || x.device().is_cuda())
            && self.cfg.block == 1
            && self.cfg.coupling == Coupling::Skew
            && self.cfg.all_nodes
    }

    /// [`candle_core::Module::forward`] on detached tensors, the same ops, and its backward by
    /// hand; `None` where [`Myo::has_backward_by_hand`] is false.
    pub(crate) fn run_by_hand(&self, x: &Tensor) -> Result<Option<(Tensor, Box<dyn Backward>)>> {
        self.run_nodes_by_hand(x, 0)
    }

    /// [`Myo::run_by_hand`] with outputs for the nodes `from..` alone, as
    /// [`Myo::forward_nodes`] gives them: the solve covers every node, the readout and the D
    /// skip only those.
    pub(crate) fn run_nodes_by_hand(
        &self,
        x: &Tensor,
        from: usize,
    ) -> Result<Option<(Tensor, Box<dyn Backward>)>> {
        if !self.has_backward_by_hand(x) {
            return Ok(None);
        }
        let x = x.detach();
        let len = self.check_input(&x)?;
        let (batch, _, h) = x.dims3()?;
        let (heads, n) = (self.cfg.heads, self.tree.len());
        let vars = [
            self.b_in.clone(),
            self.virtual_u.clone(),
            self.coupling_b.clone(),
            self.c_out.clone(),
            self.d.clone(),
        ];
        let [b_in, virtual_u, raw, c_out, d] = self.detached.clone();
        let b_mat = b_in.transpose(0, 1)?.reshape((h, 2 * heads))?;
        let u = gemm(&Mat::rows(&x)?, &Mat::rows(&b_mat)?, (batch, len, heads, 2))?;
        let s = match self.cfg.per_level {
            true => raw.index_select(&self.node_level, 1)?,
            false => raw,
        };
        let xs = head_solve_skew(&self.tree, &u, &virtual_u, &s)?;
        // The readout matrix by its fused op, in x's dtype.
        let r = s5_readout(&c_out, 1, false)?.to_dtype(x.dtype())?;
        if from >= n {
            candle_core::bail!("Myo: node {from} is beyond the tree's {n} nodes");
        }
        let rows = n - from;
        let (x_out, xs_out) = match from {
            0 => (x.clone(), xs.clone()),
            _ => (
                x.narrow(1, from, rows)?.contiguous()?,
                xs.narrow(1, from, rows)?.contiguous()?,
            ),
        };
        let y = gemm(
            &Mat::matrix(&xs_out, 2 * heads)?,
            &Mat::rows(&r)?,
            (batch, rows, h),
        )?;
        let y = (y + channel_mul(&x_out, &d)?)?;
        let back = MyoBackward {
            vars,
            c_out,
            d,
            x,
            b_mat,
            bias: virtual_u,
            s,
            xs,
            r,
            from,
            x_out,
            xs_out,
            levels: self
                .cfg
                .per_level
                .then(|| (self.node_level.clone(), self.tree.levels())),
            tree: self.tree.clone(),
        };
        Ok(Some((y, Box::new(back))))
    }
}

impl Backward for MyoBackward {
    fn backward(&self, dy: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let (batch, rows, h) = dy.dims3()?;
        let (n, heads) = (self.xs.dim(1)?, self.xs.dim(2)?);
        // The nodes before `from` have no output: their rows of ∂xs and of the skip's ∂x are 0.
        let pad = |t: Tensor| match self.from {
            0 => Ok(t),
            f => t.pad_with_zeros(1, f, 0),
        };
        let (dx_skip, dd) = channel_mul_backward(&self.x_out, &self.d, dy)?;
        let dx_skip = pad(dx_skip)?;
        let dy = Mat::rows(dy)?;
        let xs = Mat::matrix(&self.xs_out, 2 * heads)?;
        let dr = gemm(&xs.t(), &dy, (2 * heads, h))?.to_dtype(self.c_out.dtype())?;
        let dc_out = s5_readout_backward(&self.c_out, 1, false, &dr)?;
        let dxs = pad(gemm(
            &dy,
            &Mat::rows(&self.r)?.t(),
            (batch, rows, heads, 2),
        )?)?;
        // The solve's backward reads only u's shape, which over all nodes is x's: u itself is not
        // kept (at Path-X's size it is a quarter of what a block keeps).
        let xs = &self.xs;
        let g = head_solve_skew_backward(&self.tree, xs, &self.bias, &self.s, xs, &dxs)?;
        let (dv, ds) = (g.bias, g.s);
        let ds = match &self.levels {
            // Σ over each level's nodes: the nodes' (heads, 2) rows summed by level.
            Some((level, levels)) => {
                let by_node = ds.transpose(0, 1)?.reshape((ds.dim(1)?, 2 * heads))?;
                embedding_backward(level, &by_node, *levels)?
                    .reshape((*levels, heads, 2))?
                    .transpose(0, 1)?
                    .contiguous()?
            }
            None => ds,
        };
        // ∂B_in = Xᵀ ∂U, (h, heads · 2), written in the parameter's (heads, h, 2) order.
        let du = Mat::matrix(&g.u, 2 * heads)?;
        let db_in = gemm_relaid(
            &Mat::rows(&self.x)?.t(),
            &du,
            [heads, h, 2],
            [2, 2 * heads, 1],
            (heads, h, 2),
        )?;
        let dx = (dx_skip + gemm(&du, &Mat::rows(&self.b_mat)?.t(), (batch, n, h))?)?;
        // Each gradient in its parameter's dtype.
        let grads = [db_in, dv, ds, dc_out, dd];
        let params = self.vars.iter().zip(grads);
        let params = params.map(|(v, g)| Ok((v.clone(), g.to_dtype(v.dtype())?)));
        Ok((dx, params.collect::<Result<_>>()?))
    }
}
