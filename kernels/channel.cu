// Per-channel bias and scale over the last dimension of (rows, h):
//   add: y = x + p,   ∂x = g,       ∂p = Σ_rows g;
//   mul: y = x ⊙ p,   ∂x = g ⊙ p,   ∂p = Σ_rows g ⊙ x.
// The forward is one thread per element; the backward takes the row layout of rows.cuh,
// writes ∂x (mul only) and one partial row of ∂p per block, and channel_sums adds the
// partials. The CPU twin is src/ops/channel.rs.
#include "rows.cuh"

template <typename T>
__device__ void channel_fwd(const T *x, const T *p, T *y, int n, int h, int mul) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const auto xv = to_acc(x[e]), pv = to_acc(p[e % h]);
        store_s(y + e, mul ? xv * pv : xv + pv);
    }
}

// ∂x into dx (mul; null for add) and part[block] = Σ over the block's rows of g (add) or
// g ⊙ x (mul). Dynamic shared memory: ROWS_SLOTS × h values of F.
template <typename T>
__device__ void channel_bwd(const T *x, const T *p, const T *g, T *dx, Acc<T> *part, int rows,
                            int per_block, int h, int mul) {
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
            const i64 e = row * h + i;
            const F gv = to_acc(g[e]);
            if (mul) {
                mine[i] += gv * to_acc(x[e]);
                store_s(dx + e, gv * to_acc(p[i]));
            } else {
                mine[i] += gv;
            }
        }
    }
    rows_block_partial(acc, h, part);
}

#define CHANNEL_KERNELS(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        channel_fwd_##SUFFIX(const T *x, const T *p, T *y, int n, int h, int mul) {             \
        channel_fwd<T>(x, p, y, n, h, mul);                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        channel_bwd_##SUFFIX(const T *x, const T *p, const T *g, T *dx, Acc<T> *part, int rows, \
                             int per_block, int h, int mul) {                                   \
        channel_bwd<T>(x, p, g, dx, part, rows, per_block, h, mul);                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        channel_sums_##SUFFIX(const Acc<T> *part, T *out, int blocks, int n) {                  \
        rows_column_sums<T>(part, out, blocks, n);                                              \
    }

// The instantiations: kernel-name suffix and storage type (f16/bf16 computed in f32). The host
// harness registers the same list.
#define CHANNEL_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

CHANNEL_DTYPES(CHANNEL_KERNELS)
