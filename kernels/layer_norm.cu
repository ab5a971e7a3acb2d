// LayerNorm over the last dimension of (rows, h), forward and backward, in the row layout of
// rows.cuh:
//   x̂ = (x − μ) / √(σ² + ε),   y = x̂ ⊙ w + b,
//   ∂x = (ĝ − mean(ĝ) − x̂ ⊙ mean(ĝ ⊙ x̂)) / √(σ² + ε),   ĝ = ∂y ⊙ w,
//   ∂w = Σ_rows ∂y ⊙ x̂,   ∂b = Σ_rows ∂y.
// μ and σ² are two passes over the row (no cancellation), recomputed in the backward. The
// backward writes ∂x and one partial row [∂w | ∂b] per block; layer_norm_sums adds the
// partials. The CPU twin is src/ops/layer_norm.rs.
#include "rows.cuh"

// Mean and 1/√(σ² + ε) of row `xr` (h values; a row past the end reads nothing). Every
// thread of the block calls it.
template <typename T, typename F>
__device__ __forceinline__ void layer_norm_moments(const T *xr, int h, bool live, F eps, F *red,
                                                   F &mean, F &rstd) {
    const int lane = threadIdx.x % ROWS_LANES;
    F s = F(0);
    if (live)
        for (int i = lane; i < h; i += ROWS_LANES) s += to_acc(xr[i]);
    mean = rows_lane_sum(s, red) / F(h);
    F q = F(0);
    if (live)
        for (int i = lane; i < h; i += ROWS_LANES) {
            const F d = to_acc(xr[i]) - mean;
            q += d * d;
        }
    const F var = rows_lane_sum(q, red) / F(h);
    rstd = F(1) / sqrt(var + eps);
}

template <typename T>
__device__ void layer_norm_fwd(const T *x, const T *w, const T *b, T *y, int rows, int per_block,
                               int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    __shared__ F red[ROWS_THREADS];
    const F eps = F(f64_from_bits(eps_bits));
    const int lane = threadIdx.x % ROWS_LANES;
    i64 first, end;
    rows_of_block(rows, per_block, first, end);
    for (i64 base = first; base < end; base += ROWS_SLOTS) {
        const i64 row = base + threadIdx.x / ROWS_LANES;
        const bool live = row < end;
        const T *xr = x + row * h;
        F mean, rstd;
        layer_norm_moments(xr, h, live, eps, red, mean, rstd);
        if (live)
            for (int i = lane; i < h; i += ROWS_LANES)
                store_s(y + row * h + i,
                        (to_acc(xr[i]) - mean) * rstd * to_acc(w[i]) + to_acc(b[i]));
    }
}

// ∂x, and part[block] = [Σ ∂y ⊙ x̂ | Σ ∂y] over the block's rows. Dynamic shared memory: the
// slots' accumulators, ROWS_SLOTS × 2h values of F.
template <typename T>
__device__ void layer_norm_bwd(const T *x, const T *w, const T *g, T *dx, Acc<T> *part,
                               int rows, int per_block, int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    __shared__ F red[ROWS_THREADS];
    extern __shared__ __align__(16) unsigned char smem[];
    F *acc = reinterpret_cast<F *>(smem);
    const F eps = F(f64_from_bits(eps_bits));
    const int lane = threadIdx.x % ROWS_LANES, slot = threadIdx.x / ROWS_LANES;
    F *dw = acc + (i64)slot * 2 * h, *db = dw + h;
    rows_zero(acc, ROWS_SLOTS * 2 * h);
    i64 first, end;
    rows_of_block(rows, per_block, first, end);
    for (i64 base = first; base < end; base += ROWS_SLOTS) {
        const i64 row = base + slot;
        const bool live = row < end;
        const T *xr = x + row * h, *gr = g + row * h;
        F mean, rstd;
        layer_norm_moments(xr, h, live, eps, red, mean, rstd);
        F sg = F(0), sgx = F(0);
        if (live)
            for (int i = lane; i < h; i += ROWS_LANES) {
                const F xh = (to_acc(xr[i]) - mean) * rstd, gi = to_acc(gr[i]);
                const F gh = gi * to_acc(w[i]);
                sg += gh;
                sgx += gh * xh;
                dw[i] += gi * xh;
                db[i] += gi;
            }
        const F mg = rows_lane_sum(sg, red) / F(h), mgx = rows_lane_sum(sgx, red) / F(h);
        if (live)
            for (int i = lane; i < h; i += ROWS_LANES) {
                const F xh = (to_acc(xr[i]) - mean) * rstd;
                store_s(dx + row * h + i, (to_acc(gr[i]) * to_acc(w[i]) - mg - xh * mgx) * rstd);
            }
    }
    rows_block_partial(acc, 2 * h, part);
}

#define LAYER_NORM_KERNELS(SUFFIX, T)                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        layer_norm_fwd_##SUFFIX(const T *x, const T *w, const T *b, T *y, int rows,             \
                                int per_block, int h, u64 eps_bits) {                           \
        layer_norm_fwd<T>(x, w, b, y, rows, per_block, h, eps_bits);                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        layer_norm_bwd_##SUFFIX(const T *x, const T *w, const T *g, T *dx, Acc<T> *part,        \
                                int rows, int per_block, int h, u64 eps_bits) {                 \
        layer_norm_bwd<T>(x, w, g, dx, part, rows, per_block, h, eps_bits);                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        layer_norm_sums_##SUFFIX(const Acc<T> *part, T *out, int blocks, int n) {               \
        rows_column_sums<T>(part, out, blocks, n);                                              \
    }

// The instantiations: kernel-name suffix and storage type (f16/bf16 computed in f32). The host
// harness registers the same list.
#define LAYER_NORM_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

LAYER_NORM_DTYPES(LAYER_NORM_KERNELS)
