// S5's parameters to the discretised system (S5, §2 and Appendix: ZOH and bilinear), forward
// and backward, one block per state p, the block's threads over the H input channels:
//   λ = (re, im), re clipped to ≤ −10⁻⁴ with clip_eigs;  Δ = e^{log Δ};
//   ZOH:       Λ̄ = e^{λΔ},                   k = (Λ̄ − 1) / λ;
//   bilinear:  Λ̄ = (1 + λΔ/2) / (1 − λΔ/2),  k = Δ / (1 − λΔ/2);
//   B̄[p, j] = B[p, j] · k_p.
// Inputs λ_re, λ_im, log Δ (P each) and `b` (P, H, 2). The forward writes [Λ̄ as (P, 2) | B̄ as
// the (H, 2P) matrix whose row j is (re, im) of B̄[·, j]], the layout the scan and the input
// projection's matmul take. The backward takes the gradients of Λ̄ and B̄ in that layout and
// writes [∂λ_re | ∂λ_im | ∂log Δ | ∂b (P, H, 2)], with g_k = Σ_j conj(B[p, j]) ∂B̄[p, j] added per
// thread (j ≡ thread mod S5D_THREADS) and then over the threads in order. The CPU twin is
// src/ops/s5_discretize/mod.rs; its forward is also the arithmetic of the same formulas in
// candle ops, operation for operation.
#include "s5_step.cuh"

#define S5D_THREADS 128

template <typename T>
__device__ void s5_discretize_fwd(const T *re, const T *im, const T *log_dt, const T *b, T *out,
                                  int p_count, int h, int bilinear, int clip) {
    typedef typename AccOf<T>::F F;
    typedef ComplexOps<F> CO;
    const int p = blockIdx.x;
    const S5Step<F> s =
        s5d_step_at(to_acc(re[p]), to_acc(im[p]), exp(to_acc(log_dt[p])), bilinear, clip);
    if (threadIdx.x == 0) {
        store_s(out + 2 * p, s.lbar.re);
        store_s(out + 2 * p + 1, s.lbar.im);
    }
    T *bmat = out + 2 * (i64)p_count;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const i64 e = ((i64)p * h + j) * 2;
        const Cx<F> v = CO::mul(Cx<F>{to_acc(b[e]), to_acc(b[e + 1])}, s.k);
        const i64 o = (i64)j * 2 * p_count + 2 * p;
        store_s(bmat + o, v.re);
        store_s(bmat + o + 1, v.im);
    }
}

template <typename T>
__device__ void s5_discretize_bwd(const T *re, const T *im, const T *log_dt, const T *b,
                                  const T *g_lbar, const T *gbar, T *out, int p_count, int h,
                                  int bilinear, int clip) {
    typedef typename AccOf<T>::F F;
    typedef ComplexOps<F> CO;
    __shared__ F part_re[S5D_THREADS], part_im[S5D_THREADS];
    const int p = blockIdx.x;
    const S5Step<F> s =
        s5d_step_at(to_acc(re[p]), to_acc(im[p]), exp(to_acc(log_dt[p])), bilinear, clip);
    T *db = out + 3 * (i64)p_count;
    const Cx<F> kc = CO::conj(s.k);
    Cx<F> gk = CO::zero();
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const i64 e = ((i64)p * h + j) * 2, o = (i64)j * 2 * p_count + 2 * p;
        const Cx<F> gv = {to_acc(gbar[o]), to_acc(gbar[o + 1])};
        gk = CO::add(gk, CO::mul(CO::conj(Cx<F>{to_acc(b[e]), to_acc(b[e + 1])}), gv));
        const Cx<F> d = CO::mul(kc, gv);
        store_s(db + e, d.re);
        store_s(db + e + 1, d.im);
    }
    part_re[threadIdx.x] = gk.re;
    part_im[threadIdx.x] = gk.im;
    __syncthreads();
    if (threadIdx.x != 0) return;
    gk = CO::zero();
    for (int t = 0; t < S5D_THREADS; ++t) gk = CO::add(gk, Cx<F>{part_re[t], part_im[t]});
    const Cx<F> gl = {to_acc(g_lbar[2 * p]), to_acc(g_lbar[2 * p + 1])};
    F d_re, d_im, d_log;
    s5d_param_grads(s, gl, gk, bilinear, d_re, d_im, d_log);
    store_s(out + p, d_re);
    store_s(out + p_count + p, d_im);
    store_s(out + 2 * p_count + p, d_log);
}

#define S5D_KERNELS(SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(S5D_THREADS)                                   \
        s5_discretize_fwd_##SUFFIX(const T *re, const T *im, const T *log_dt, const T *b,       \
                                   T *out, int p_count, int h, int bilinear, int clip) {        \
        s5_discretize_fwd<T>(re, im, log_dt, b, out, p_count, h, bilinear, clip);               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(S5D_THREADS) s5_discretize_bwd_##SUFFIX(       \
        const T *re, const T *im, const T *log_dt, const T *b, const T *g_lbar, const T *gbar,  \
        T *out, int p_count, int h, int bilinear, int clip) {                                   \
        s5_discretize_bwd<T>(re, im, log_dt, b, g_lbar, gbar, out, p_count, h, bilinear, clip); \
    }

// The instantiations: kernel-name suffix and type (f64 for the tests; f16 and bf16 for a
// mixed-precision step's compute copy, computed in f32 and rounded once on store). The host
// harness in tests/kernels_on_cpu registers the same list.
#define S5D_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

S5D_DTYPES(S5D_KERNELS)
