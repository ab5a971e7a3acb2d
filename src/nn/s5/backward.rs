//! The S5 layer's backward pass written out ([`super::S5::forward_by_hand`]). With
//! y = D ⊙ u + Σ_k X_k R_k, X_k = scan_k(Λ̄, U B̄) (U the input as (batch · length, H) rows,
//! each product one op, [`crate::ops::gemm`]):
//!
//!   ∂R = [X_1 … X_D]ᵀ ∂y,  ∂[X_1 … X_D] = ∂y Rᵀ,  (∂(UB̄), ∂Λ̄) = Σ_k scan_kᵀ(∂X_k),
//!   ∂u = D ⊙ ∂y + ∂(UB̄) B̄ᵀ,  ∂B̄ = Uᵀ ∂(UB̄),  ∂D = Σ_rows u ⊙ ∂y,
//!
//! then ∂C̃ from ∂R and (∂λ, ∂log Δ, ∂B̃) from (∂Λ̄, ∂B̄) by the readout's and the
//! discretisation's own backward kernels. With an interval per sample the scans' input is
//! k_k ⊙ (UB̃)_k and their gate Λ̄_k: `ops::s5_timed`'s backward takes (∂Λ̄_k, ∂(k ⊙ UB̃)) to
//! ∂(UB̃) and (∂λ, ∂log Δ), and ∂B̃ = Uᵀ ∂(UB̃).

use candle_core::{Result, Tensor};

use crate::nn::by_hand::Backward;
use crate::ops::{
    channel_mul_backward, gemm, linear_scan_backward, s5_discretize_backward, s5_readout_backward,
    s5_timed_backward, Mat, S5Discretization,
};

/// What the forward kept.
pub(super) struct S5Backward {
    /// The layer's parameters (the gradients' keys), in `S5::params`' order.
    pub vars: [Tensor; 6],
    /// The same, detached, as the parameter-side ops took them (`S5::param_side`: f32 under
    /// half precision).
    pub w: [Tensor; 6],
    pub u: Tensor,
    /// The scans' initial state (zeros).
    pub h0: Tensor,
    pub gate: Tensor,
    pub b_mat: Tensor,
    /// Each direction's states (batch, length, P, 2), kept apart: side by side, as the
    /// forward's readout takes them, they would be a second copy.
    pub states: Vec<Tensor>,
    pub r: Tensor,
    /// With an interval per sample: Λ̄ and k per step (`ops::s5_timed`), and B̄ is B̃.
    pub timed: Option<super::Timed>,
    pub how: S5Discretization,
    pub conj_sym: bool,
}

impl Backward for S5Backward {
    fn backward(&self, dy: &Tensor) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let [lr, li, ls, b, c, d] = &self.w;
        let (batch, len, h) = dy.dims3()?;
        let (p, dirs) = (lr.dim(0)?, self.states.len());
        let (du_skip, dd) = channel_mul_backward(&self.u, d, dy)?;
        let dy = Mat::rows(dy)?;
        // ∂R = [X_kᵀ ∂y]_k, the directions' rows stacked.
        let mut dr = self
            .states
            .iter()
            .map(|x| gemm(&Mat::matrix(x, 2 * p)?.t(), &dy, (2 * p, h)))
            .collect::<Result<Vec<_>>>()?;
        let dr = match dr.len() {
            1 => dr.remove(0),
            _ => Tensor::cat(&dr, 0)?,
        };
        let dc = s5_readout_backward(c, dirs, self.conj_sym, &dr.to_dtype(c.dtype())?)?;
        let (mut dbu, mut dgate) = (None::<Tensor>, None::<Tensor>);
        for (k, x) in self.states.iter().enumerate() {
            // ∂X_k = ∂y R_kᵀ, R_k the rows k · 2P.. of R.
            let rk = Mat::strided(&self.r, k * 2 * p * h, [1, h, 2 * p], [0, 1, h])?;
            let dx = gemm(&dy, &rk, x.dims())?;
            let g = linear_scan_backward(
                &self.gate,
                x,
                Some(&self.h0),
                &dx,
                super::S5::scan_options(k == 1),
            )?;
            dbu = Some(match dbu {
                Some(s) => (s + g.b)?,
                None => g.b,
            });
            dgate = Some(match dgate {
                Some(s) => (s + g.a)?,
                None => g.a,
            });
        }
        let (Some(dbu), Some(dgate)) = (dbu, dgate) else {
            candle_core::bail!("S5 backward: no direction");
        };
        // Timed, the scans' input is k ⊙ B̃u: back to B̃u first.
        let (dbu, timed_grads) = match &self.timed {
            Some(t) => {
                let (dbu, d) =
                    s5_timed_backward([lr, li, ls], &t.dt, &t.bu, self.how, &dgate, &dbu)?;
                (dbu, Some(d))
            }
            None => (dbu, None),
        };
        let dbu = Mat::matrix(&dbu, 2 * p)?;
        let du = (du_skip + gemm(&dbu, &Mat::rows(&self.b_mat)?.t(), (batch, len, h))?)?;
        let db_mat = gemm(&Mat::rows(&self.u)?.t(), &dbu, (h, 2 * p))?;
        let [dlr, dli, dls, db] = match timed_grads {
            // B̃ as the (H, 2P) matrix back to (P, H, 2).
            Some([dlr, dli, dls]) => {
                let db = db_mat
                    .reshape((h, p, 2))?
                    .permute((1, 0, 2))?
                    .contiguous()?;
                [dlr, dli, dls, db]
            }
            None => {
                let up = |t: &Tensor| t.to_dtype(lr.dtype());
                s5_discretize_backward([lr, li, ls, b], self.how, &up(&dgate)?, &up(&db_mat)?)?
            }
        };
        // Each gradient in its parameter's dtype.
        let grads = [dlr, dli, dls, db, dc, dd];
        let params = self
            .vars
            .iter()
            .zip(grads)
            .map(|(v, g)| Ok((v.clone(), g.to_dtype(v.dtype())?)));
        Ok((du, params.collect::<Result<_>>()?))
    }
}
