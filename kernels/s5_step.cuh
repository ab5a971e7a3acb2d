// One state's discretisation in S5 (S5, §2 and Appendix: ZOH and bilinear) and the chain rule
// back to its parameters, shared by s5_discretize.cu (one step Δ per state) and s5_timed.cu
// (a step Δ·dt_n per sample n). The CPU twins are in src/ops/s5_discretize/mod.rs.
//   λ = (re, im), re clipped to ≤ −10⁻⁴ with clip_eigs;
//   ZOH:       Λ̄ = e^{λΔ},                   k = (Λ̄ − 1) / λ;
//   bilinear:  Λ̄ = (1 + λΔ/2) / (1 − λΔ/2),  k = Δ / (1 − λΔ/2).
#pragma once
#include "values.cuh"

template <typename F> struct S5Step {
    Cx<F> lam, lbar, k, bl; // bl: 1 / (1 − λΔ/2) (bilinear only)
    F dt, mask;             // dt: Δ; mask: ∂re_clipped / ∂re
};

// The discretisation with the step Δ = `dt`.
template <typename F>
__device__ __forceinline__ S5Step<F> s5d_step_at(F re, F im, F dt, int bilinear, int clip) {
    typedef ComplexOps<F> CO;
    S5Step<F> s;
    const F bound = F(-1e-4);
    s.mask = F(1);
    if (clip) {
        s.mask = re < bound ? F(1) : re == bound ? F(0.5) : F(0);
        re = re < bound ? re : bound;
    }
    s.lam = {re, im};
    s.dt = dt;
    if (bilinear) {
        const F hs = s.dt * F(0.5);
        const Cx<F> half = {re * hs, im * hs};
        s.bl = CO::inv(Cx<F>{F(1) - half.re, F(0) - half.im});
        s.lbar = CO::mul(s.bl, Cx<F>{half.re + F(1), half.im});
        s.k = {s.bl.re * s.dt, s.bl.im * s.dt};
    } else {
        const F ar = re * s.dt, ai = im * s.dt;
        const F m = exp(ar);
        s.lbar = {m * cos(ai), m * sin(ai)};
        s.k = CO::mul(Cx<F>{s.lbar.re + F(-1), s.lbar.im}, CO::inv(s.lam));
        s.bl = {F(0), F(0)};
    }
    return s;
}

// (∂re, ∂im, ∂log Δ) of one step from the gradients of Λ̄ (`gl`) and k (`gk`):
//   g_λ = conj(∂Λ̄/∂λ) g_Λ̄ + conj(∂k/∂λ) g_k,   g_Δ = Re(conj(∂Λ̄/∂Δ) g_Λ̄ + conj(∂k/∂Δ) g_k),
// ∂re = Re g_λ where the clip passes it, ∂log Δ = g_Δ Δ (Δ = e^{log Δ}, times dt_n if timed).
template <typename F>
__device__ __forceinline__ void s5d_param_grads(const S5Step<F> &s, Cx<F> gl, Cx<F> gk,
                                                int bilinear, F &d_re, F &d_im, F &d_log) {
    typedef ComplexOps<F> CO;
    // ∂Λ̄/∂λ, ∂k/∂λ (holomorphic) and ∂Λ̄/∂Δ, ∂k/∂Δ.
    Cx<F> dl_dlam, dk_dlam, dl_ddt, dk_ddt;
    if (bilinear) {
        const Cx<F> bl2 = CO::mul(s.bl, s.bl);
        dl_dlam = {bl2.re * s.dt, bl2.im * s.dt};
        dk_dlam = {bl2.re * (s.dt * s.dt * F(0.5)), bl2.im * (s.dt * s.dt * F(0.5))};
        dl_ddt = CO::mul(bl2, s.lam);
        dk_ddt = bl2;
    } else {
        dl_dlam = {s.lbar.re * s.dt, s.lbar.im * s.dt};
        dk_dlam = CO::mul(CO::sub(dl_dlam, s.k), CO::inv(s.lam));
        dl_ddt = CO::mul(s.lam, s.lbar);
        dk_ddt = s.lbar;
    }
    const Cx<F> a = CO::mul(CO::conj(dl_dlam), gl);
    const Cx<F> c = CO::mul(CO::conj(dk_dlam), gk);
    const F g_dt =
        (dl_ddt.re * gl.re + dl_ddt.im * gl.im) + (dk_ddt.re * gk.re + dk_ddt.im * gk.im);
    d_re = (a.re + c.re) * s.mask;
    d_im = a.im + c.im;
    d_log = g_dt * s.dt;
}
