//! A 2-D SSM layer (Roesser's model, 2-D SSM paper §2–3) over an image given as a raster-
//! ordered sequence: per channel, N horizontal and N vertical states with diagonal A₁…A₄:
//!
//!   x^v_{i,j} = A₃ ⊙ x^h_{i−1,j} + A₄ ⊙ x^v_{i−1,j} + B₂ u_{i,j}
//!   x^h_{i,j} = A₁ ⊙ x^h_{i,j−1} + A₂ ⊙ x^v_{i,j−1} + B₁ u_{i,j}
//!   y_{i,j}   = Σₙ (C₁ ⊙ x^h_{i,j} + C₂ ⊙ x^v_{i,j}) + D u_{i,j}
//!
//! (row i, column j, zero states outside the image; the input enters the state of its own
//! cell, as in S5). Computed row by row: x^v of a row is elementwise from the previous row, and
//! x^h is then one [`crate::ops::linear_scan`] along the row with gate A₁ and input
//! B₁u + A₂ ⊙ (x^v shifted by one column). Stability by construction: (A₁, A₂) = (s₁, s₂) /
//! (1 + |s₁| + |s₂|), likewise (A₃, A₄), so |A₁| + |A₂| < 1 and |A₃| + |A₄| < 1.
//!
//! `directions` (1, 2 or 4) runs the recurrence from the top-left, top-right, bottom-left and
//! bottom-right corners (the image flipped), each with its own A, B, C; outputs are summed.
//!
//! Parameters per direction k: `dirs.k.a` (4, H, N), `dirs.k.b` (2, H, N), `dirs.k.c`
//! (2, H, N); shared `d` (H).

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::{init_rng, normal_vec, param_with};
use crate::ops::{linear_scan, ScanOptions};

/// Configuration of an [`Ssm2d`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ssm2dConfig {
    /// Channels H.
    pub d_model: usize,
    /// States N per axis and channel.
    pub state: usize,
    /// Image height and width: the sequence is the raster order of height × width cells.
    pub height: usize,
    pub width: usize,
    /// 1, 2 or 4 scan directions.
    pub directions: usize,
    /// Seed of the initialisation.
    #[serde(default)]
    pub seed: u64,
}

struct Direction {
    a: Tensor,
    b: Tensor,
    c: Tensor,
    flip_rows: bool,
    flip_cols: bool,
}

/// The 2-D SSM layer: (batch, height·width, H) → (batch, height·width, H).
pub struct Ssm2d {
    cfg: Ssm2dConfig,
    dirs: Vec<Direction>,
    d: Tensor,
}

impl Ssm2d {
    /// Whether `name` is in the optimiser's SSM group: each direction's transitions A and
    /// input matrices B (`dirs.K.a`, `dirs.K.b`).
    pub fn is_ssm_param(name: &str) -> bool {
        name.starts_with("dirs.") && (name.ends_with(".a") || name.ends_with(".b"))
    }

    pub fn new(cfg: Ssm2dConfig, vb: VarBuilder) -> Result<Self> {
        if ![1, 2, 4].contains(&cfg.directions) {
            candle_core::bail!(
                "Ssm2d: directions must be 1, 2 or 4, got {}",
                cfg.directions
            );
        }
        if cfg.d_model == 0 || cfg.state == 0 || cfg.height == 0 || cfg.width == 0 {
            candle_core::bail!("Ssm2d: d_model, state, height and width must be positive");
        }
        let (h, n) = (cfg.d_model, cfg.state);
        let flips = [(false, false), (false, true), (true, false), (true, true)];
        // N(0, 1) for A, B and D; N(0, 1/N) for C: from a seeded generator per parameter path.
        let randn = |vb: &VarBuilder, name: &str, shape: &[usize], std: f64| -> Result<Tensor> {
            param_with(vb, name, shape, || {
                let mut rng = init_rng(cfg.seed, &vb.pp(name));
                normal_vec(&mut rng, shape.iter().product(), std)
            })
        };
        let dirs = (0..cfg.directions)
            .map(|k| {
                let vb = vb.pp(format!("dirs.{k}"));
                Ok(Direction {
                    a: randn(&vb, "a", &[4, h, n], 1.0)?,
                    b: randn(&vb, "b", &[2, h, n], 1.0)?,
                    c: randn(&vb, "c", &[2, h, n], (1.0 / n as f64).sqrt())?,
                    flip_rows: flips[k].0,
                    flip_cols: flips[k].1,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Ssm2d {
            d: randn(&vb, "d", &[h], 1.0)?,
            dirs,
            cfg,
        })
    }

    pub fn config(&self) -> &Ssm2dConfig {
        &self.cfg
    }

    /// (A₁, A₂, A₃, A₄) of a direction, each (H, N), with |A₁| + |A₂| < 1, |A₃| + |A₄| < 1.
    pub fn transitions(&self, direction: usize) -> Result<[Tensor; 4]> {
        let a = &self.dirs[direction].a;
        let s = |k: usize| a.get(k);
        let pair = |p: usize, q: usize| -> Result<(Tensor, Tensor)> {
            let (sp, sq) = (s(p)?, s(q)?);
            let den = ((sp.abs()? + sq.abs()?)? + 1.0)?;
            Ok(((sp / &den)?, (sq / den)?))
        };
        let ((a1, a2), (a3, a4)) = (pair(0, 1)?, pair(2, 3)?);
        Ok([a1, a2, a3, a4])
    }

    fn run_direction(&self, k: usize, u: &Tensor) -> Result<Tensor> {
        let dir = &self.dirs[k];
        let (batch, rows, cols, h) = u.dims4()?;
        let n = self.cfg.state;
        let flip = |t: &Tensor, dim: usize, len: usize| -> Result<Tensor> {
            let idx: Vec<u32> = (0..len as u32).rev().collect();
            t.index_select(&Tensor::new(idx, t.device())?, dim)
        };
        let mut u = u.clone();
        if dir.flip_rows {
            u = flip(&u, 1, rows)?;
        }
        if dir.flip_cols {
            u = flip(&u, 2, cols)?;
        }
        let [a1, a2, a3, a4] = self.transitions(k)?;
        let (b1, b2, c1, c2) = (dir.b.get(0)?, dir.b.get(1)?, dir.c.get(0)?, dir.c.get(1)?);
        let gate = a1.flatten_all()?; // (H·N), shared along the row
        let zeros = Tensor::zeros((batch, cols, h, n), u.dtype(), u.device())?;
        let (mut xh, mut xv) = (zeros.clone(), zeros.clone());
        let mut ys = Vec::with_capacity(rows);
        for i in 0..rows {
            let ui = u.narrow(1, i, 1)?.squeeze(1)?.unsqueeze(3)?; // (batch, cols, H, 1)
            xv = ((xh.broadcast_mul(&a3)? + xv.broadcast_mul(&a4)?)? + ui.broadcast_mul(&b2)?)?;
            // x^v of the previous column in this row (zero at j = 0)
            let xv_left = Tensor::cat(&[zeros.narrow(1, 0, 1)?, xv.narrow(1, 0, cols - 1)?], 1)?;
            let input = (ui.broadcast_mul(&b1)? + xv_left.broadcast_mul(&a2)?)?;
            let flat = input.reshape((batch, cols, h * n))?;
            xh = linear_scan(&gate, &flat, None, ScanOptions::default())?
                .reshape((batch, cols, h, n))?;
            let y = (xh.broadcast_mul(&c1)? + xv.broadcast_mul(&c2)?)?.sum(3)?; // (batch, cols, H)
            ys.push(y);
        }
        let mut y = Tensor::stack(&ys, 1)?;
        if dir.flip_cols {
            y = flip(&y, 2, cols)?;
        }
        if dir.flip_rows {
            y = flip(&y, 1, rows)?;
        }
        Ok(y)
    }
}

impl Module for Ssm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, len, h) = x.dims3()?;
        let (rows, cols) = (self.cfg.height, self.cfg.width);
        if len != rows * cols || h != self.cfg.d_model {
            candle_core::bail!(
                "Ssm2d: input (batch, {len}, {h}) does not match {rows} x {cols} cells and d_model {}",
                self.cfg.d_model
            );
        }
        let u = x.reshape((batch, rows, cols, h))?;
        let mut y = self.run_direction(0, &u)?;
        for k in 1..self.dirs.len() {
            y = (y + self.run_direction(k, &u)?)?;
        }
        y.reshape((batch, len, h))? + x.broadcast_mul(&self.d)?
    }
}
