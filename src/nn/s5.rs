//! The S5 layer (Smith et al., "Simplified State Space Layers"; facts in docs/reference.md):
//!
//!   x_k = Λ̄ ⊙ x_{k−1} + B̄ u_k,   y_k = Re(C̃ x_k) (× 2 with conj_sym) + D ⊙ u_k,
//!
//! with Λ, B̃ = V⁻¹B, C̃ = CV from the HiPPO-N block initialisation ([`super::hippo`]) and a
//! learnable step Δ = exp(log Δ):
//! * ZOH: Λ̄ = exp(ΛΔ), B̄ = (Λ̄ − 1)/Λ ⊙ B̃;
//! * bilinear: Λ̄ = (1 + ΔΛ/2)/(1 − ΔΛ/2), B̄ = Δ/(1 − ΔΛ/2) ⊙ B̃.
//!
//! The scan is [`crate::ops::linear_scan`] with the shared (P) form of Λ̄, so Λ̄ is never
//! materialised over (batch, length). Samples taken at irregular times ([`S5::forward_timed`],
//! S5 §6.3) discretise each step k with Δ·dt_k instead, and then Λ̄ and B̄ vary along the
//! sequence. Bidirectional runs a second, reverse scan over the same
//! B̄u, and C̃ = [C̃₁ C̃₂] reads both state sequences. Complex values are (re, im) pairs of real
//! tensors.
//!
//! Parameters (names as in checkpoints): `lambda_re`, `lambda_im` (P), `b` (P, H, 2) = B̃,
//! `c` (H, P or 2P, 2) = C̃, `d` (H), `log_step` (P).

mod backward;

use candle_core::{bail, DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::by_hand::{by_hand, Backward, GradSink};
use super::hippo::{block_init, block_states};
use super::init::{init_param, layer_rng, normal, params, trunc_normal};
use super::ParamGroup;
use crate::complex::C;
use crate::ops::{
    channel_mul, gemm, linear_scan, s5_discretize, s5_discretize_untracked, s5_readout, s5_timed,
    Mat, S5Discretization, ScanOptions,
};

/// How the continuous system is discretised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Discretization {
    Zoh,
    Bilinear,
}

/// How C is initialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum CInit {
    /// Truncated normal (±2σ) with σ² = 1/P per entry, then C̃ = C V.
    TruncStandardNormal,
    /// LeCun normal over the whole (H, P, 2) array, as the reference applies it: fan-in H·P,
    /// so a truncated normal with σ² = 1/(H·P) per part (√H smaller than the default), then
    /// C̃ = C V.
    LecunNormal,
    /// C̃ complex normal with variance ½ per part, without V.
    ComplexNormal,
}

/// Configuration of an [`S5`] layer. Defaults are the reference's (`run_train.py`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct S5Config {
    /// Model width H (input and output features).
    pub d_model: usize,
    /// State size P before conjugate symmetry (the reference's `ssm_size`).
    pub state: usize,
    /// Number of HiPPO-N blocks J on the diagonal of the initial state matrix.
    pub blocks: usize,
    /// Keep one of each conjugate pair of eigenvalues (half the states, output × 2).
    pub conj_sym: bool,
    /// Clamp Re(Λ) to at most −1e-4.
    pub clip_eigs: bool,
    pub discretization: Discretization,
    pub dt_min: f64,
    pub dt_max: f64,
    pub c_init: CInit,
    pub bidirectional: bool,
    /// Which optimiser group B̃ and C̃ learn in (the reference's `opt_config`).
    #[serde(default)]
    pub groups: S5Groups,
    /// Δ (`log_step`) learns with the regular group, at the global learning rate and with weight
    /// decay, rather than with the SSM parameters (the reference's `dt_global`, its choice for
    /// LRA Text and Retrieval).
    #[serde(default)]
    pub dt_global: bool,
    /// Seed of the initialisation.
    pub seed: u64,
}

impl Default for S5Config {
    fn default() -> Self {
        S5Config {
            d_model: 128,
            state: 256,
            blocks: 8,
            conj_sym: true,
            clip_eigs: false,
            discretization: Discretization::Zoh,
            dt_min: 0.001,
            dt_max: 0.1,
            c_init: CInit::TruncStandardNormal,
            bidirectional: false,
            groups: S5Groups::Standard,
            dt_global: false,
            seed: 0,
        }
    }
}

/// The optimiser groups of S5's input and output matrices, as the reference's `opt_config`
/// names them (Λ always learns in the SSM group, D and C̃ together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum S5Groups {
    /// B̃ in the SSM group (SSM learning rate, no weight decay), C̃ in the regular one.
    #[default]
    #[serde(rename = "standard")]
    #[value(name = "standard")]
    Standard,
    /// B̃ at the SSM learning rate with weight decay (Path-X).
    #[serde(rename = "b_and_c_decay")]
    #[value(name = "b_and_c_decay")]
    BAndCDecay,
    /// B̃ in the regular group (ListOps, the image tasks).
    #[serde(rename = "b_fast_and_c_decay")]
    #[value(name = "b_fast_and_c_decay")]
    BFastAndCDecay,
    /// B̃, C̃ and D in the SSM group (Speech Commands).
    #[serde(rename = "no_bc_decay")]
    #[value(name = "no_bc_decay")]
    NoBcDecay,
}

/// The S5 layer: (batch, length, H) → (batch, length, H).
#[derive(Clone, Debug)]
pub struct S5 {
    cfg: S5Config,
    lambda_re: Tensor,
    lambda_im: Tensor,
    b: Tensor,
    c: Tensor,
    d: Tensor,
    log_step: Tensor,
    /// The parameters in [`S5::params`]' order, detached once: aliases of the same storage,
    /// which the optimiser's in-place steps update too.
    detached: [Tensor; 6],
}

impl S5 {
    /// The optimiser group of the parameter `name` (relative to the layer), by the config's
    /// [`S5Groups`] and `dt_global`.
    pub fn param_group(&self, name: &str) -> ParamGroup {
        use ParamGroup::*;
        match (name, self.cfg.groups) {
            ("lambda_re" | "lambda_im", _) => Ssm,
            ("log_step", _) if self.cfg.dt_global => Regular,
            ("log_step", _) => Ssm,
            ("b", S5Groups::Standard | S5Groups::NoBcDecay) => Ssm,
            ("b", S5Groups::BAndCDecay) => SsmDecayed,
            ("c" | "d", S5Groups::NoBcDecay) => Ssm,
            _ => Regular,
        }
    }

    pub fn new(cfg: S5Config, vb: VarBuilder) -> Result<Self> {
        let (h, p_full) = (cfg.d_model, cfg.state);
        if h == 0 {
            candle_core::bail!("S5: d_model must be positive");
        }
        if !(cfg.dt_min > 0.0 && cfg.dt_min < cfg.dt_max && cfg.dt_max.is_finite()) {
            candle_core::bail!(
                "S5: the step range [{}, {}] must satisfy 0 < dt_min < dt_max < ∞",
                cfg.dt_min,
                cfg.dt_max
            );
        }
        let p = block_states(p_full, cfg.blocks, cfg.conj_sym)?;
        let dirs = if cfg.bidirectional { 2 } else { 1 };
        let (params, fresh) = params(
            &vb,
            [
                ("lambda_re", &[p]),
                ("lambda_im", &[p]),
                ("b", &[p, h, 2]),
                ("c", &[h, dirs * p, 2]),
                ("d", &[h]),
                ("log_step", &[p]),
            ],
        )?;
        if fresh {
            for (param, values) in params.iter().zip(Self::initial_values(&cfg, p)?) {
                init_param(param, values)?;
            }
        }
        let [lambda_re, lambda_im, b, c, d, log_step] = params;
        let detached = [&lambda_re, &lambda_im, &log_step, &b, &c, &d].map(Tensor::detach);
        Ok(S5 {
            detached,
            lambda_re,
            lambda_im,
            b,
            c,
            d,
            log_step,
            cfg,
        })
    }

    /// The initial values of the parameters, in [`S5::new`]'s order, drawn from the layer's seed.
    fn initial_values(cfg: &S5Config, p: usize) -> Result<[Vec<f64>; 6]> {
        let (h, p_full) = (cfg.d_model, cfg.state);
        let init = block_init(p_full, cfg.blocks, cfg.conj_sym)?;
        let (lambda, v, vinv) = (init.lambda, init.v, init.vinv);
        let mut rng = layer_rng(cfg.seed, 0);
        // B̃ = V⁻¹ B with B (P_full, H) LeCun normal.
        let b_real = nalgebra::DMatrix::from_fn(p_full, h, |_, _| {
            nalgebra::Complex::new(trunc_normal(&mut rng, p_full), 0.0)
        });
        let bt = &vinv * b_real;
        let mut b_init = Vec::with_capacity(p * h * 2);
        for i in 0..p {
            for j in 0..h {
                b_init.extend([bt[(i, j)].re, bt[(i, j)].im]);
            }
        }
        // C̃ per direction: C V with C (H, P_full) complex, or complex normal (H, P).
        let dirs = if cfg.bidirectional { 2 } else { 1 };
        let mut c_dirs = Vec::with_capacity(dirs);
        for _ in 0..dirs {
            let ct = match cfg.c_init {
                CInit::ComplexNormal => {
                    let s = 0.5f64.sqrt();
                    nalgebra::DMatrix::from_fn(h, p, |_, _| {
                        nalgebra::Complex::new(s * normal(&mut rng), s * normal(&mut rng))
                    })
                }
                CInit::TruncStandardNormal | CInit::LecunNormal => {
                    let fan_in = match cfg.c_init {
                        CInit::LecunNormal => h * p_full,
                        _ => p_full,
                    };
                    let c = nalgebra::DMatrix::from_fn(h, p_full, |_, _| {
                        nalgebra::Complex::new(
                            trunc_normal(&mut rng, fan_in),
                            trunc_normal(&mut rng, fan_in),
                        )
                    });
                    c * &v
                }
            };
            c_dirs.push(ct);
        }
        let mut c_init = Vec::with_capacity(h * dirs * p * 2);
        for i in 0..h {
            for ct in &c_dirs {
                for j in 0..p {
                    c_init.extend([ct[(i, j)].re, ct[(i, j)].im]);
                }
            }
        }
        let d_init: Vec<f64> = (0..h).map(|_| normal(&mut rng)).collect();
        let (lo, hi) = (cfg.dt_min.ln(), cfg.dt_max.ln());
        let step_init: Vec<f64> = (0..p).map(|_| rng.random_range(lo..hi)).collect();
        Ok([
            lambda.iter().map(|l| l.re).collect(),
            lambda.iter().map(|l| l.im).collect(),
            b_init,
            c_init,
            d_init,
            step_init,
        ])
    }

    pub fn config(&self) -> &S5Config {
        &self.cfg
    }
}

impl S5 {
    /// The layer on samples taken at irregular times: `dt` (batch, length) holds each sample's
    /// interval since the previous one, and step k is discretised with Δ·dt_k (ZOH or
    /// bilinear), so that Λ̄_k and B̄_k vary along the sequence; with dt ≡ 1 this is
    /// [`Module::forward`]. Causal layers only: the reverse direction would need the intervals
    /// after each sample.
    pub fn forward_timed(&self, u: &Tensor, dt: &Tensor) -> Result<Tensor> {
        if self.cfg.bidirectional {
            bail!("S5: time intervals per sample need a causal layer, not a bidirectional one");
        }
        let (batch, len, h) = u.dims3()?;
        if dt.dims() != [batch, len] {
            bail!(
                "S5: the intervals have shape {:?}, the input (batch, length) = ({batch}, {len})",
                dt.dims()
            );
        }
        let p = self.lambda_re.dim(0)?;
        let re = match self.cfg.clip_eigs {
            true => self.lambda_re.minimum(-1e-4)?,
            false => self.lambda_re.clone(),
        };
        let lambda = C::new(re, self.lambda_im.clone());
        // Δ_k = Δ·dt_k, (batch, length, P).
        let step = dt
            .to_dtype(u.dtype())?
            .unsqueeze(2)?
            .broadcast_mul(&self.log_step.exp()?)?;
        let (gate, coef) = match self.cfg.discretization {
            Discretization::Zoh => {
                let gate = lambda.scale(&step)?.exp()?;
                let coef = gate.add_real(-1.0)?.div(&lambda)?;
                (gate, coef)
            }
            Discretization::Bilinear => {
                let half = lambda.scale(&(&step * 0.5)?)?;
                let bl = C::one_like(&step)?.sub(&half)?.recip()?;
                (bl.mul(&half.add_real(1.0)?)?, bl.scale(&step)?)
            }
        };
        // B̄_k u_k = coef_k ⊙ (B̃ u_k): one matmul with B̃ as an (H, 2P) matrix of (re, im).
        let b_mat = self
            .b
            .permute((1, 0, 2))?
            .contiguous()?
            .reshape((h, 2 * p))?;
        let bu = u
            .reshape((batch * len, h))?
            .matmul(&b_mat)?
            .reshape((batch, len, p, 2))?;
        let bu = coef.mul(&C::from_pairs(&bu)?)?.to_pairs()?;
        let causal = ScanOptions {
            complex: true,
            reverse: false,
        };
        let x = linear_scan(&gate.to_pairs()?, &bu, None, causal)?;
        let r = s5_readout(&self.c, 1, self.cfg.conj_sym)?;
        let y = x.reshape((batch * len, 2 * p))?.matmul(&r)?;
        channel_mul(u, &self.d)? + y.reshape((batch, len, h))?
    }
}

impl Module for S5 {
    fn forward(&self, u: &Tensor) -> Result<Tensor> {
        Ok(self.run(u, self.params(), None)?.y)
    }
}

/// What a forward pass computed, kept for the backward by hand ([`S5::forward_by_hand`]).
struct Pass {
    y: Tensor,
    /// The scans' initial state (zeros).
    h0: Tensor,
    gate: Tensor,
    b_mat: Tensor,
    /// Each direction's states (batch, length, P, 2).
    states: Vec<Tensor>,
    /// The readout matrices of all directions, (directions · 2P, H).
    r: Tensor,
    /// With an interval per sample: what the discretisation's backward needs.
    timed: Option<Timed>,
}

/// The intervals (batch, length) and the input projection B̃u (batch, length, P, 2) of a
/// layer run on samples at irregular times.
struct Timed {
    dt: Tensor,
    bu: Tensor,
}

impl S5 {
    /// The parameters in the order λ_re, λ_im, log Δ, B̃, C̃, D.
    fn params(&self) -> [&Tensor; 6] {
        [
            &self.lambda_re,
            &self.lambda_im,
            &self.log_step,
            &self.b,
            &self.c,
            &self.d,
        ]
    }

    fn how(&self) -> S5Discretization {
        S5Discretization {
            bilinear: self.cfg.discretization == Discretization::Bilinear,
            clip_eigs: self.cfg.clip_eigs,
        }
    }

    /// The discretised Λ̄ as the scan's (P, 2) gate and B̄ as the (H, 2P) matrix whose columns
    /// interleave (re, im), so that one matmul writes B̄u in the scan's (…, P, 2) layout
    /// ([`s5_discretize()`]: one op forward and one backward).
    pub fn discretize(&self) -> Result<(Tensor, Tensor)> {
        let [lr, li, ls, b, ..] = self.params();
        s5_discretize(lr, li, ls, b, self.how())
    }

    fn scan_options(reverse: bool) -> ScanOptions {
        ScanOptions {
            complex: true,
            reverse,
        }
    }

    /// The layer on `u` with the parameters `w` ([`S5::params`]' order); with intervals `dt`
    /// (by hand only: [`S5::run_by_hand`]) each step discretised with its own.
    fn run(&self, u: &Tensor, w: [&Tensor; 6], dt: Option<&Tensor>) -> Result<Pass> {
        let (batch, len, h) = u.dims3()?;
        let p = w[0].dim(0)?;
        // Outside candle's graph (the backward by hand), the fused ops on the parameters (in
        // f16 and bf16 too: they compute in f32 and round what they store); their results in
        // u's dtype.
        let tracked = w[..4].iter().any(|t| t.track_op());
        let by_hand = !tracked && Self::has_backward_by_hand(u);
        let [lr, li, ls, b, c, d] = w;
        let down = |t: Tensor| t.to_dtype(u.dtype());
        let mut timed = None;
        let (gate, b_mat, bu) = match dt {
            // B̃u, then Λ̄_k and B̄_k u_k = k_k ⊙ (B̃u)_k per step (`ops::s5_timed`).
            Some(dt) if by_hand => {
                let b_mat = b.permute((1, 0, 2))?.contiguous()?.reshape((h, 2 * p))?;
                let bu = gemm(&Mat::rows(u)?, &Mat::rows(&b_mat)?, (batch, len, p, 2))?;
                let (gate, v) = s5_timed([lr, li, ls], dt, &bu, self.how())?;
                timed = Some(Timed { dt: dt.clone(), bu });
                (gate, b_mat, v)
            }
            Some(_) => bail!("S5: time intervals per sample are applied by hand only"),
            None => {
                let (gate, b_mat) = match by_hand {
                    true => {
                        let (gate, b_mat) = s5_discretize_untracked(lr, li, ls, b, self.how())?;
                        (down(gate)?, down(b_mat)?)
                    }
                    false => s5_discretize(lr, li, ls, b, self.how())?,
                };
                // The products: by hand as single ops, else candle's (differentiable) ones.
                let bu = match by_hand {
                    true => gemm(&Mat::rows(u)?, &Mat::rows(&b_mat)?, (batch, len, p, 2))?,
                    false => u
                        .reshape((batch * len, h))?
                        .matmul(&b_mat)?
                        .reshape((batch, len, p, 2))?,
                };
                (gate, b_mat, bu)
            }
        };
        // One zero initial state for both directions, forward and backward.
        let h0 = Tensor::zeros((batch, p, 2), bu.dtype(), bu.device())?;
        let mut states = vec![linear_scan(
            &gate,
            &bu,
            Some(&h0),
            Self::scan_options(false),
        )?];
        if self.cfg.bidirectional {
            states.push(linear_scan(
                &gate,
                &bu,
                Some(&h0),
                Self::scan_options(true),
            )?);
        }
        // Re(C̃ x) (× 2 with conj_sym): one matmul of the directions' states side by side with
        // their readout matrices stacked.
        let r = down(s5_readout(c, states.len(), self.cfg.conj_sym)?)?;
        // (batch, len, directions · P, 2): each step's states side by side.
        let xs = match &states[..] {
            [x] => x.clone(),
            states => Tensor::cat(states, 2)?,
        };
        let width = 2 * p * states.len();
        let read = match by_hand {
            true => gemm(&Mat::matrix(&xs, width)?, &Mat::rows(&r)?, (batch, len, h))?,
            false => xs
                .reshape((batch * len, width))?
                .matmul(&r)?
                .reshape((batch, len, h))?,
        };
        let y = (channel_mul(u, d)? + read)?;
        Ok(Pass {
            y,
            h0,
            gate,
            b_mat,
            states,
            r,
            timed,
        })
    }

    /// [`Module::forward`] as one node of candle's graph whose backward is written by hand
    /// ([`super::by_hand`]): the parameters' gradients go to `sink`. Where the fused ops do
    /// not cover the dtype or device, the ordinary forward.
    pub fn forward_by_hand(&self, u: &Tensor, sink: &GradSink) -> Result<Tensor> {
        match self.run_by_hand(u, None)? {
            Some((y, back)) => by_hand(u, &y, &self.d, back, sink),
            None => self.forward(u),
        }
    }

    /// [`S5::forward_timed`] as one node of candle's graph whose backward is written by hand,
    /// as [`S5::forward_by_hand`].
    pub fn forward_timed_by_hand(
        &self,
        u: &Tensor,
        dt: &Tensor,
        sink: &GradSink,
    ) -> Result<Tensor> {
        match self.run_by_hand(u, Some(dt))? {
            Some((y, back)) => by_hand(u, &y, &self.d, back, sink),
            None => self.forward_timed(u, dt),
        }
    }

    /// Whether [`S5::run_by_hand`] covers `u`: the fused ops' dtypes and devices.
    pub(crate) fn has_backward_by_hand(u: &Tensor) -> bool {
        matches!(
            u.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) && (u.device().is_cpu() || u.device().is_cuda())
    }

    /// Whether [`S5::run_by_hand`] takes the intervals `dt` for `u`: a causal layer, intervals
    /// of shape (batch, length), the state size within `ops::s5_timed`'s.
    pub(crate) fn covers_timed(&self, u: &Tensor, dt: &Tensor) -> Result<bool> {
        let (batch, len, _) = u.dims3()?;
        let p = self.lambda_re.dim(0)?;
        Ok(!self.cfg.bidirectional
            && dt.dims() == [batch, len]
            && crate::ops::s5_timed::cuda::supports(p, u.dtype()))
    }

    /// The forward on detached tensors and its backward by hand, each step discretised with
    /// its interval in `dt` (batch, length) when given; `None` where the fused ops do not cover
    /// u's dtype or device (or, timed, the state size).
    pub(crate) fn run_by_hand(
        &self,
        u: &Tensor,
        dt: Option<&Tensor>,
    ) -> Result<Option<(Tensor, Box<dyn Backward>)>> {
        if !Self::has_backward_by_hand(u) {
            return Ok(None);
        }
        let w = self.detached.clone();
        let x = u.detach();
        let dt = match dt {
            // What is not covered, or not valid, goes to `forward_timed`.
            Some(dt) if !self.covers_timed(u, dt)? => return Ok(None),
            Some(dt) => Some(dt.detach().to_dtype(u.dtype())?),
            None => None,
        };
        let pass = self.run(&x, w.each_ref(), dt.as_ref())?;
        let back = backward::S5Backward {
            vars: self.params().map(Tensor::clone),
            w,
            u: x,
            h0: pass.h0,
            gate: pass.gate,
            b_mat: pass.b_mat,
            states: pass.states,
            r: pass.r,
            timed: pass.timed,
            how: self.how(),
            conj_sym: self.cfg.conj_sym,
        };
        Ok(Some((pass.y, Box::new(back))))
    }
}
