// S5's discretisation per sample (S5 §6.3: samples at irregular times), forward and backward:
// sample n (of N = batch × length) takes the step Δ_n = dt_n · e^{log Δ} (s5_step.cuh), so that
//   gate[n, p] = Λ̄(λ_p, Δ_np),   v[n, p] = k(λ_p, Δ_np) · bu[n, p],
// where bu = B̃u is the input projection (N, P, 2) and v the scan's input. Inputs λ_re, λ_im,
// log Δ (P each), dt (N) and bu (N, P, 2). The forward writes [gate (N, P, 2) | v (N, P, 2)],
// one thread per (n, p). The backward takes the gradients of gate and v and writes
//   ∂bu = conj(k) ∂v,   with g_k = conj(bu) ∂v into s5d_param_grads,
// in the row layout of rows.cuh (a row is a sample's P states, lane p ≡ thread mod ROWS_LANES):
// each block adds its rows' (∂λ_re, ∂λ_im, ∂log Δ) per slot and then over the slots into one
// partial row of 3P values, and s5_timed_sums adds the partials in block order. The CPU twin is
// src/ops/s5_timed/mod.rs.
#include "rows.cuh"
#include "s5_step.cuh"

template <typename F>
__device__ __forceinline__ S5Step<F> s5t_step(const F re, const F im, const F log_dt, const F dt,
                                              int bilinear, int clip) {
    return s5d_step_at(re, im, dt * exp(log_dt), bilinear, clip);
}

template <typename T>
__device__ void s5_timed_fwd(const T *re, const T *im, const T *log_dt, const T *dt, const T *bu,
                             T *out, int n, int p_count, int bilinear, int clip) {
    typedef typename AccOf<T>::F F;
    typedef ComplexOps<F> CO;
    const i64 total = (i64)n * p_count;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const int p = (int)(e % p_count);
        const S5Step<F> s = s5t_step(to_acc(re[p]), to_acc(im[p]), to_acc(log_dt[p]),
                                     to_acc(dt[e / p_count]), bilinear, clip);
        const Cx<F> v = CO::mul(s.k, Cx<F>{to_acc(bu[2 * e]), to_acc(bu[2 * e + 1])});
        store_s(out + 2 * e, s.lbar.re);
        store_s(out + 2 * e + 1, s.lbar.im);
        store_s(out + 2 * (total + e), v.re);
        store_s(out + 2 * (total + e) + 1, v.im);
    }
}

// ∂bu into dbu and part[block] = the block's rows' (∂λ_re | ∂λ_im | ∂log Δ). Dynamic shared
// memory: ROWS_SLOTS × 3P values of F.
template <typename T>
__device__ void s5_timed_bwd(const T *re, const T *im, const T *log_dt, const T *dt, const T *bu,
                             const T *g_gate, const T *g_v, T *dbu, Acc<T> *part, int n,
                             int per_block, int p_count, int bilinear, int clip) {
    typedef typename AccOf<T>::F F;
    typedef ComplexOps<F> CO;
    extern __shared__ __align__(16) unsigned char smem[];
    F *acc = reinterpret_cast<F *>(smem);
    const int lane = threadIdx.x % ROWS_LANES, slot = threadIdx.x / ROWS_LANES;
    F *mine = acc + (i64)slot * 3 * p_count;
    rows_zero(acc, ROWS_SLOTS * 3 * p_count);
    i64 first, end;
    rows_of_block(n, per_block, first, end);
    for (i64 base = first; base < end; base += ROWS_SLOTS) {
        const i64 row = base + slot;
        if (row >= end) continue;
        const F dt_row = to_acc(dt[row]);
        for (int p = lane; p < p_count; p += ROWS_LANES) {
            const i64 e = 2 * (row * p_count + p);
            const S5Step<F> s = s5t_step(to_acc(re[p]), to_acc(im[p]), to_acc(log_dt[p]),
                                         dt_row, bilinear, clip);
            const Cx<F> gv = {to_acc(g_v[e]), to_acc(g_v[e + 1])};
            const Cx<F> gl = {to_acc(g_gate[e]), to_acc(g_gate[e + 1])};
            const Cx<F> gk = CO::mul(CO::conj(Cx<F>{to_acc(bu[e]), to_acc(bu[e + 1])}), gv);
            const Cx<F> d = CO::mul(CO::conj(s.k), gv);
            store_s(dbu + e, d.re);
            store_s(dbu + e + 1, d.im);
            F d_re, d_im, d_log;
            s5d_param_grads(s, gl, gk, bilinear, d_re, d_im, d_log);
            mine[p] += d_re;
            mine[p_count + p] += d_im;
            mine[2 * p_count + p] += d_log;
        }
    }
    rows_block_partial(acc, 3 * p_count, part);
}

#define S5T_KERNELS(SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        s5_timed_fwd_##SUFFIX(const T *re, const T *im, const T *log_dt, const T *dt,           \
                              const T *bu, T *out, int n, int p_count, int bilinear,            \
                              int clip) {                                                       \
        s5_timed_fwd<T>(re, im, log_dt, dt, bu, out, n, p_count, bilinear, clip);               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) s5_timed_bwd_##SUFFIX(           \
        const T *re, const T *im, const T *log_dt, const T *dt, const T *bu, const T *g_gate,   \
        const T *g_v, T *dbu, Acc<T> *part, int n, int per_block, int p_count, int bilinear,    \
        int clip) {                                                                             \
        s5_timed_bwd<T>(re, im, log_dt, dt, bu, g_gate, g_v, dbu, part, n, per_block, p_count,  \
                        bilinear, clip);                                                        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        s5_timed_sums_##SUFFIX(const Acc<T> *part, T *out, int blocks, int n) {                 \
        rows_column_sums<T>(part, out, blocks, n);                                              \
    }

// The instantiations (the layer trains in f32; f64 for the tests; f16/bf16 take candle's ops):
// kernel-name suffix and type. The host harness registers the same list.
#define S5T_DTYPES(X) X(f32, float) X(f64, double)

S5T_DTYPES(S5T_KERNELS)
