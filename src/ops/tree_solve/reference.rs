//! The tree solve as the paper's Listing 1 in plain candle ops: the benchmark baseline and an
//! independent check of the op and its backward (through candle's autograd).

use candle_core::{bail, Result, Tensor};

use super::{check_args, TreeSolveOptions};
use crate::complex::C;
use crate::tree::Tree;

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

/// x · y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_mul(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    C::from_pairs(x)?.mul(&C::from_pairs(y)?)?.to_pairs()
}

/// x / y for complex tensors with a trailing (re, im) dimension, broadcasting.
fn complex_div(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    C::from_pairs(x)?.div(&C::from_pairs(y)?)?.to_pairs()
}
