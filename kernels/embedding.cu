// An embedding table W (vocab, h) read at token ids, and the gradient of the table:
//   y[n, :] = W[id_n, :],   ∂W[v, :] = Σ_{n : id_n = v} ∂y[n, :].
// The ids come as values of W's type (whole numbers, exact below 2^24 in f32); an id outside
// 0..vocab reads zeros and adds nowhere. The forward is one thread per element of y,
// grid-strided. The backward uses no atomics, so that its sums are deterministic: block (v, c)
// makes row v of ∂W, columns 32c .. 32c + 31 (one per lane); the ids are staged in shared
// memory EMB_THREADS at a time, warp s takes positions 32s .. 32s + 31 of each stage in order
// (all its lanes test the same id, so the branch does not diverge), and the warps' sums are
// added in warp order. The CPU twin is src/ops/embedding/mod.rs.
#include "values.cuh"

#define EMB_THREADS 256
#define EMB_LANES 32
#define EMB_SLOTS (EMB_THREADS / EMB_LANES)

// Row of W that `id` names, or -1 outside the table.
template <typename F> __device__ __forceinline__ int embedding_row(F id, int vocab) {
    return id >= F(0) && id < F(vocab) ? (int)id : -1;
}

template <typename T>
__device__ void embedding_fwd(const T *ids, const T *w, T *y, int n, int h, int vocab) {
    typedef typename AccOf<T>::F F;
    const i64 total = (i64)n * h;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const int row = embedding_row(to_acc(ids[e / h]), vocab);
        store_s(y + e, row < 0 ? F(0) : to_acc(w[(i64)row * h + e % h]));
    }
}

template <typename T>
__device__ void embedding_bwd(const T *ids, const T *g, T *dw, int n, int h, int vocab) {
    typedef typename AccOf<T>::F F;
    __shared__ int stage[EMB_THREADS];
    __shared__ F red[EMB_THREADS];
    const int v = blockIdx.x, lane = threadIdx.x % EMB_LANES, slot = threadIdx.x / EMB_LANES;
    const int col = blockIdx.y * EMB_LANES + lane;
    F acc = F(0);
    for (i64 base = 0; base < n; base += EMB_THREADS) {
        const i64 p = base + threadIdx.x;
        stage[threadIdx.x] = p < n ? embedding_row(to_acc(ids[p]), vocab) : -1;
        __syncthreads();
        if (col < h)
            for (int k = slot * EMB_LANES; k < (slot + 1) * EMB_LANES; ++k)
                if (stage[k] == v) acc += to_acc(g[(base + k) * h + col]);
        __syncthreads(); // every id read before the next stage is written
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    if (slot == 0 && col < h) {
        F s = F(0);
        for (int k = 0; k < EMB_SLOTS; ++k) s += red[k * EMB_LANES + lane];
        store_s(dw + (i64)v * h + col, s);
    }
}

#define EMBEDDING_KERNELS(SUFFIX, T)                                                            \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS)                                   \
        embedding_fwd_##SUFFIX(const T *ids, const T *w, T *y, int n, int h, int vocab) {       \
        embedding_fwd<T>(ids, w, y, n, h, vocab);                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS)                                   \
        embedding_bwd_##SUFFIX(const T *ids, const T *g, T *dw, int n, int h, int vocab) {      \
        embedding_bwd<T>(ids, g, dw, n, h, vocab);                                              \
    }

// The instantiations (tables train in f32; f64 for the tests; f16/bf16 tables use candle's
// index_select): kernel-name suffix and type. The host harness registers the same list.
#define EMBEDDING_DTYPES(X) X(f32, float) X(f64, double)

EMBEDDING_DTYPES(EMBEDDING_KERNELS)
