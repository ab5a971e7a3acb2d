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
// rows; the CPU twin is src/ops/batch_norm/mod.rs. Rows (x, y, ∂y, ∂x), γ, β and the running
// averages are stored in T; the statistics (μ, σ², n, the partial sums, ∂γ and ∂β of the
// whole batch) in F = Acc<T>, f32 for f16/bf16 rows: sums over batch × length rows overflow
// f16, and n need not be exact in it. Each value is read into F and only what is stored in T
// rounded, so f16/bf16 rows give the bits of their f32 copy normalised and rounded.
#include "rows.cuh"

// part[block] = Σ over the block's rows of x, or of (x − μ)² when `mean` is given. Dynamic
// shared memory: ROWS_SLOTS × h values of F.
template <typename T>
__device__ void batch_norm_stats(const T *x, const Acc<T> *mean, Acc<T> *part, int rows,
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
                const F d = xv - mean[i];
                mine[i] += d * d;
            } else {
                mine[i] += xv;
            }
        }
    }
    rows_block_partial(acc, h, part);
}

// 1 / √(σ² + ε) of column i.
template <typename F> __device__ __forceinline__ F batch_norm_rstd(const F *var, int i, F eps) {
    return F(1) / sqrt(var[i] + eps);
}

template <typename T>
__device__ void batch_norm_apply(const T *x, const Acc<T> *mean, const Acc<T> *var, const T *w,
                                 const T *b, T *y, int n, int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    const F eps = F(f64_from_bits(eps_bits));
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % h);
        const F k = batch_norm_rstd(var, i, eps);
        store_s(y + e, (to_acc(x[e]) - mean[i]) * (to_acc(w[i]) * k) + to_acc(b[i]));
    }
}

// part[block] = [Σ ∂y ⊙ x̂ | Σ ∂y] over the block's rows. Dynamic shared memory: the slots'
// accumulators, ROWS_SLOTS × 2h values of F.
template <typename T>
__device__ void batch_norm_bwd_stats(const T *x, const Acc<T> *mean, const Acc<T> *var,
                                     const T *g, Acc<T> *part, int rows, int per_block, int h,
                                     u64 eps_bits) {
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
            const F xh = (to_acc(x[e]) - mean[i]) * batch_norm_rstd(var, i, eps);
            const F gv = to_acc(g[e]);
            mine[i] += gv * xh;
            mine[h + i] += gv;
        }
    }
    rows_block_partial(acc, 2 * h, part);
}

// dw[i], db[i] = the sums over the `blocks` partial rows [∂γ | ∂β] of columns i and h + i
// (F: statistics are never stored in half precision).
template <typename F>
__device__ void batch_norm_pair(const F *part, F *dw, F *db, int blocks, int h) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * h;
         i += (i64)gridDim.x * blockDim.x) {
        F s = F(0);
        for (int k = 0; k < blocks; ++k) s += part[(i64)k * 2 * h + i];
        *(i < h ? dw + i : db + (i - h)) = s;
    }
}

template <typename T>
__device__ void batch_norm_bwd(const T *x, const Acc<T> *mean, const Acc<T> *var, const T *w,
                               const T *g, const Acc<T> *dw, const Acc<T> *db,
                               const Acc<T> *count, T *dx, int n, int h, u64 eps_bits) {
    typedef typename AccOf<T>::F F;
    const F eps = F(f64_from_bits(eps_bits));
    const F rows = count[0];
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % h);
        const F k = batch_norm_rstd(var, i, eps);
        const F xh = (to_acc(x[e]) - mean[i]) * k;
        const F mean_part = (db[i] + xh * dw[i]) / rows;
        store_s(dx + e, to_acc(w[i]) * k * (to_acc(g[e]) - mean_part));
    }
}

// In place, one thread per column, with m the decay and n = count[0]:
// running_mean = running_mean m + μ (1 - m), running_var = running_var m + (σ² c) (1 - m) with
// c = n / (n - 1) (1 for a single value, whose σ² is 0: no unbiased estimate, and no NaN kept),
// the operations of the CPU twin in its order.
template <typename T>
__device__ void batch_norm_running(T *rmean, T *rvar, const Acc<T> *mean, const Acc<T> *var,
                                   const Acc<T> *count, int h, u64 decay_bits) {
    typedef typename AccOf<T>::F F;
    const double m = f64_from_bits(decay_bits);
    const F keep = F(m), take = F(1.0 - m);
    const F n = count[0];
    const F unbiased = n > F(1) ? n / (n - F(1)) : F(1);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < h; i += gridDim.x * blockDim.x) {
        store_s(rmean + i, to_acc(rmean[i]) * keep + mean[i] * take);
        store_s(rvar + i, to_acc(rvar[i]) * keep + var[i] * unbiased * take);
    }
}

// The kernels over rows of T: kernel-name suffix and storage type.
#define BATCH_NORM_KERNELS(SUFFIX, T)                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_stats_##SUFFIX(const T *x, const Acc<T> *mean, Acc<T> *part, int rows,       \
                                  int per_block, int h) {                                       \
        batch_norm_stats<T>(x, mean, part, rows, per_block, h);                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_apply_##SUFFIX(       \
        const T *x, const Acc<T> *mean, const Acc<T> *var, const T *w, const T *b, T *y, int n, \
        int h, u64 eps_bits) {                                                                  \
        batch_norm_apply<T>(x, mean, var, w, b, y, n, h, eps_bits);                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_bwd_stats_##SUFFIX(   \
        const T *x, const Acc<T> *mean, const Acc<T> *var, const T *g, Acc<T> *part, int rows,  \
        int per_block, int h, u64 eps_bits) {                                                   \
        batch_norm_bwd_stats<T>(x, mean, var, g, part, rows, per_block, h, eps_bits);           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_bwd_##SUFFIX(         \
        const T *x, const Acc<T> *mean, const Acc<T> *var, const T *w, const T *g,              \
        const Acc<T> *dw, const Acc<T> *db, const Acc<T> *count, T *dx, int n, int h,           \
        u64 eps_bits) {                                                                         \
        batch_norm_bwd<T>(x, mean, var, w, g, dw, db, count, dx, n, h, eps_bits);               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) batch_norm_running_##SUFFIX(     \
        T *rmean, T *rvar, const Acc<T> *mean, const Acc<T> *var, const Acc<T> *count, int h,   \
        u64 decay_bits) {                                                                       \
        batch_norm_running<T>(rmean, rvar, mean, var, count, h, decay_bits);                    \
    }

// The kernels over statistics, in F alone (f32 serves f16/bf16 rows).
#define BATCH_NORM_SUM_KERNELS(SUFFIX, F)                                                       \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_sums_##SUFFIX(const F *part, F *out, int blocks, int n) {                    \
        rows_column_sums<F>(part, out, blocks, n);                                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        batch_norm_pair_##SUFFIX(const F *part, F *dw, F *db, int blocks, int h) {              \
        batch_norm_pair<F>(part, dw, db, blocks, h);                                            \
    }

// The instantiations: kernel-name suffix and storage type. The host harness registers the
// same lists.
#define BATCH_NORM_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)
#define BATCH_NORM_SUM_DTYPES(X) X(f32, float) X(f64, double)

BATCH_NORM_DTYPES(BATCH_NORM_KERNELS)
BATCH_NORM_SUM_DTYPES(BATCH_NORM_SUM_KERNELS)
