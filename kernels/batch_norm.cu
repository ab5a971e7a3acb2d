// BatchNorm's training pass over (rows, h), its statistics taken over the whole batch: the
// host adds each launch's column sums over the batch's data-parallel shards before the next
// (src/nn/batch_norm.rs). With μ = Σx / n, σ² = Σ(x − μ)² / n, k = 1 / √(σ² + ε),
// x̂ = (x − μ) k and n the rows of the whole batch:
//   batch_norm_stats:     part[block] = Σ over the block's rows of x (mean null) or (x − μ)²;
//   batch_norm_apply:     y = (x − μ) (γ k) + β, one thread per element;
//   batch_norm_bwd_stats: part[block] = [Σ ∂y ⊙ x̂ | Σ ∂y] over the block's rows;
//   batch_norm_pair:      ∂γ, ∂β = the column sums of those partial rows, two outputs;
//   batch_norm_bwd:       ∂x = γ k (∂y − (Σ∂y + x̂ Σ∂y ⊙ x̂) / n), the sums the whole batch's;
//   batch_norm_running:   the running averages of μ and of the unbiased σ², in place.
// The stats launches take the row layout of rows.cuh and batch_norm_sums adds their partial
// rows; the CPU twin is src/ops/batch_norm/mod.rs.
#include "rows.cuh"

// part[block] = Σ over the block's rows of x, or of (x − μ)² when `mean` is given. Dynamic
// shared memory: ROWS_SLOTS × h values of F.
template <typename T>
__device__ void batch_norm_stats(const T *x, const T *mean, Acc<T> *part, int rows,
                                 int per_block, int h) {
    typedef typename AccOf<T>::F F;
    extern __shared__ __align__(16) unsigned char smem[];
    F *acc = reinterpret_cast<F *>(smem);
    const int lane = threadIdx.x % ROWS_LANES, slot = threadIdx.x / ROWS_LANES;
    F *mine = acc + (i64)slot * h;
    rows_zero(acc, ROWS_SLOTS * h);
    i64 first, end;
    rows_of_block(rows, per_block, first, end);
    for (i64 base = first; base < end; base += ROWS_SLOTS) {
        const i64 row = base + slot;
        if (row >= end) continue;
        for (int i = lane; i < h; i += ROWS_LANES) {
            const F xv = to_acc(x[row * h + i]);
            if (mean) {
                const F d = xv - to_acc(mean[i]);
                mine[i] += d * d;
            } else {
                mine[i] += xv;
            }
        }
    }
    rows_block_partial(acc, h, part);
}

// 1 / √(σ² + ε) of column i.
template <typename T, typename F>
__device__ __forceinline__ F batch_norm_rstd(const T *var, int i, F eps) {
    return F(1) / sqrt(to_acc(var[i]) + eps);
}

template <typename T>
__device__ void batch_norm_apply(const T *x, const T *mean, const T *var, const T *w, const T *b,
                                 T *y, int n, int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    const F eps = F(f64_from_bits(eps_bits));
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % h);
        const F k = batch_norm_rstd(var, i, eps);
        store_s(y + e, (to_acc(x[e]) - to_acc(mean[i])) * (to_acc(w[i]) * k) + to_acc(b[i]));
    }
}

// part[block] = [Σ ∂y ⊙ x̂ | Σ ∂y] over the block's rows. Dynamic shared memory: the slots'
// accumulators, ROWS_SLOTS × 2h values of F.
template <typename T>
__device__ void batch_norm_bwd_stats(const T *x, const T *mean, const T *var, const T *g,
                                     Acc<T> *part, int rows, int per_block, int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    extern __shared__ __align__(16) unsigned char smem[];
    F *acc = reinterpret_cast<F *>(smem);
    const F eps = F(f64_from_bits(eps_bits));
    const int lane = threadIdx.x % ROWS_LANES, slot = threadIdx.x / ROWS_LANES;
    F *mine = acc + (i64)slot * 2 * h;
    rows_zero(acc, ROWS_SLOTS * 2 * h);
    i64 first, end;
    rows_of_block(rows, per_block, first, end);
    for (i64 base = first; base < end; base += ROWS_SLOTS) {
        const i64 row = base + slot;
        if (row >= end) continue;
        for (int i = lane; i < h; i += ROWS_LANES) {
            const i64 e = row * h + i;
            const F xh = (to_acc(x[e]) - to_acc(mean[i])) * batch_norm_rstd(var, i, eps);
            const F gv = to_acc(g[e]);
            mine[i] += gv * xh;
            mine[h + i] += gv;
        }
    }
    rows_block_partial(acc, 2 * h, part);
}

// dw[i], db[i] = the sums over the `blocks` partial rows [∂γ | ∂β] of columns i and h + i.
template <typename T>
__device__ void batch_norm_pair(const Acc<T> *part, T *dw, T *db, int blocks, int h) {
    typedef typename AccOf<T>::F F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * h;
         i += (i64)gridDim.x * blockDim.x) {
        F s = F(0);
        for (int k = 0; k < blocks; ++k) s += to_acc(part[(i64)k * 2 * h + i]);
        store_s(i < h ? dw + i : db + (i - h), s);
    }
}

template <typename T>
__device__ void batch_norm_bwd(const T *x, const T *mean, const T *var, const T *w, const T *g,
                               const T *dw, const T *db, const T *count, T *dx, int n, int h,
                               u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    const F eps = F(f64_from_bits(eps_bits));
    const F rows = to_acc(count[0]);
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % h);
        const F k = batch_norm_rstd(var, i, eps);
        const F xh = (to_acc(x[e]) - to_acc(mean[i])) * k;
        const F mean_part = (to_acc(db[i]) + xh * to_acc(dw[i])) / rows;
        store_s(dx + e, to_acc(w[i]) * k * (to_acc(g[e]) - mean_part));
    }
}

// In place, one thread per column, with m the decay and n = count[0]:
// running_mean = running_mean m + μ (1 - m), running_var = running_var m + (σ² c) (1 - m) with
// c = n / (n - 1) (1 for a single value, whose σ² is 0: no unbiased estimate, and no NaN kept),
// the operations of the CPU twin in its order.
template <typename T>
__device__ void batch_norm_running(T *rmean, T *rvar, const T *mean, const T *var,
                                   const T *count, int h, u64 decay_bits) {
    typedef typename AccOf<T>::F F;
    const double m = f64_from_bits(decay_bits);
    const F keep = F(m), take = F(1.0 - m);
    const F n = to_acc(count[0]);
    const F unbiased = n > F(1) ? n / (n - F(1)) : F(1);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < h; i += gridDim.x * blockDim.x) {
        store_s(rmean + i, to_acc(rmean[i]) * keep + to_acc(mean[i]) * take);
        store_s(rvar + i, to_acc(rvar[i]) * keep + to_acc(var[i]) * unbiased * take);
    }
}

#define BATCH_NORM_KERNELS(SUFFIX, T)                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_stats_##SUFFIX(const T *x, const T *mean, Acc<T> *part, int rows,            \
                                  int per_block, int h) {                                       \
        batch_norm_stats<T>(x, mean, part, rows, per_block, h);                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_sums_##SUFFIX(const Acc<T> *part, T *out, int blocks, int n) {               \
        rows_column_sums<T>(part, out, blocks, n);                                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_apply_##SUFFIX(       \
        const T *x, const T *mean, const T *var, const T *w, const T *b, T *y, int n, int h,    \
        u64 eps_bits) {                                                                         \
        batch_norm_apply<T>(x, mean, var, w, b, y, n, h, eps_bits);                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_bwd_stats_##SUFFIX(   \
        const T *x, const T *mean, const T *var, const T *g, Acc<T> *part, int rows,            \
        int per_block, int h, u64 eps_bits) {                                                   \
        batch_norm_bwd_stats<T>(x, mean, var, g, part, rows, per_block, h, eps_bits);           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_pair_##SUFFIX(const Acc<T> *part, T *dw, T *db, int blocks, int h) {         \
        batch_norm_pair<T>(part, dw, db, blocks, h);                                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_bwd_##SUFFIX(         \
        const T *x, const T *mean, const T *var, const T *w, const T *g, const T *dw,           \
        const T *db, const T *count, T *dx, int n, int h, u64 eps_bits) {                       \
        batch_norm_bwd<T>(x, mean, var, w, g, dw, db, count, dx, n, h, eps_bits);               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_running_##SUFFIX(     \
        T *rmean, T *rvar, const T *mean, const T *var, const T *count, int h,                  \
        u64 decay_bits) {                                                                       \
        batch_norm_running<T>(rmean, rvar, mean, var, count, h, decay_bits);                    \
    }

// The instantiations (f32, and f64 for the tests; f16/bf16 batches are normalised in f32):
// kernel-name suffix and storage type. The host harness registers the same list.
#define BATCH_NORM_DTYPES(X) X(f32, float) X(f64, double)

BATCH_NORM_DTYPES(BATCH_NORM_KERNELS)
