//! HiPPO-N initialisation of S5's state matrix (S5 paper; docs/reference.md).
//!
//! HiPPO-LegS: p_n = √(1+2n), A_nk = −p_n p_k (n > k), −(n+1) (n = k), 0 (n < k). With the
//! normal-plus-low-rank term P_n = √(n+½), S = A + P Pᵀ = −½ I + K where K is skew-symmetric.
//! So S is normal and diagonalised by the eigenvectors of the Hermitian matrix −iK:
//! Λ = −½ + i ω with (ω, V) = eigh(−iK), V unitary (V⁻¹ = Vᴴ).

use nalgebra::{Complex, DMatrix};

/// The diagonalised HiPPO-N matrix of size n: eigenvalues Λ (real parts all −½) and the
/// unitary eigenvectors V (columns), eigenvalues in ascending order of Im Λ (as numpy's eigh).
pub struct HippoN {
    pub lambda: Vec<Complex<f64>>,
    /// n × n, column j the eigenvector of `lambda[j]`.
    pub v: DMatrix<Complex<f64>>,
}

/// The normal part S = A + P Pᵀ of HiPPO-LegS, n × n.
pub fn hippo_normal(n: usize) -> DMatrix<f64> {
    DMatrix::from_fn(n, n, |i, k| {
        let pp = ((i as f64 + 0.5) * (k as f64 + 0.5)).sqrt();
        match i.cmp(&k) {
            std::cmp::Ordering::Greater => {
                -(2.0 * i as f64 + 1.0).sqrt() * (2.0 * k as f64 + 1.0).sqrt() + pp
            }
            std::cmp::Ordering::Equal => -(i as f64 + 1.0) + pp,
            std::cmp::Ordering::Less => pp,
        }
    })
}

/// Diagonalises HiPPO-N of size n.
pub fn hippo_n(n: usize) -> HippoN {
    let s = hippo_normal(n);
    let re = s.diagonal().mean();
    // −iK with K = S − diag(S): Hermitian.
    let h = DMatrix::from_fn(n, n, |i, k| {
        let kk = if i == k { 0.0 } else { s[(i, k)] };
        Complex::new(0.0, -kk)
    });
    let eig = h.symmetric_eigen();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| eig.eigenvalues[a].total_cmp(&eig.eigenvalues[b]));
    let lambda = order
        .iter()
        .map(|&j| Complex::new(re, eig.eigenvalues[j]))
        .collect();
    let v = DMatrix::from_fn(n, n, |i, j| eig.eigenvectors[(i, order[j])]);
    HippoN { lambda, v }
}

/// S5's block-diagonal initialisation (see [`block_init`]).
pub struct BlockInit {
    /// Λ, length P.
    pub lambda: Vec<Complex<f64>>,
    /// V, P_full × P.
    pub v: DMatrix<Complex<f64>>,
    /// V⁻¹ = Vᴴ, P × P_full.
    pub vinv: DMatrix<Complex<f64>>,
}

/// P, the number of states [`block_init`] keeps for `state` states in `blocks` blocks, after
/// checking that the block size divides the state and, with `conj_sym`, is even.
pub fn block_states(state: usize, blocks: usize, conj_sym: bool) -> candle_core::Result<usize> {
    if blocks == 0 || state == 0 || !state.is_multiple_of(blocks) {
        candle_core::bail!(
            "HiPPO-N: state size {state} must be a positive multiple of the block count {blocks}"
        );
    }
    let size = state / blocks;
    if conj_sym && !size.is_multiple_of(2) {
        candle_core::bail!(
            "HiPPO-N: conj_sym needs an even block size, got {size} (state {state} / {blocks} blocks)"
        );
    }
    Ok(if conj_sym { state / 2 } else { state })
}

/// S5's block initialisation: one HiPPO-N block of size `state / blocks`, tiled `blocks`
/// times on the diagonal. With `conj_sym` only the first half of each block's eigenvalues (one
/// of each conjugate pair) and eigenvectors are kept, so P = `state / 2`; else P = `state`.
pub fn block_init(state: usize, blocks: usize, conj_sym: bool) -> candle_core::Result<BlockInit> {
    let p = block_states(state, blocks, conj_sym)?;
    let size = state / blocks;
    let keep = p / blocks;
    let h = hippo_n(size);
    let mut lambda = Vec::with_capacity(p);
    let mut v = DMatrix::zeros(state, p);
    for j in 0..blocks {
        lambda.extend_from_slice(&h.lambda[..keep]);
        for r in 0..size {
            for c in 0..keep {
                v[(j * size + r, j * keep + c)] = h.v[(r, c)];
            }
        }
    }
    let vinv = v.adjoint();
    Ok(BlockInit { lambda, v, vinv })
}
