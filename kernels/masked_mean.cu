// The mean of each sample's first len_b steps, out[b, j] = (Σ_{t < len_b} h[b, t, j]) / len_b,
// for h (batch, L, H) and the lengths as values of F = Acc<T> (f32 for f16/bf16 h: exact up to
// 2²⁴); backward dh[b, t, j] = t < len_b ? g[b, j] / len_b : 0. The forward sums in step order
// in F, one thread per (sample, feature); the backward is one thread per element. Values are
// read into F and what is stored rounded. Grid-strided. The CPU twin is
// src/ops/masked_mean/mod.rs.
#include "values.cuh"

#define MASKED_MEAN_THREADS 256

template <typename T>
__device__ void masked_mean_fwd(const T *h, const Acc<T> *len, T *out, int batch, int steps,
                                int features) {
    typedef Acc<T> F;
    const i64 n = (i64)batch * features;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 b = e / features, j = e % features;
        const int count = (int)len[b];
        F s = F(0);
        // Unrolled so that 16 loads are in flight ahead of the adds, which stay in order.
#pragma unroll 16
        for (int t = 0; t < count; ++t) s += to_acc(h[(b * steps + t) * features + j]);
        store_s(out + e, s / len[b]);
    }
}

template <typename T>
__device__ void masked_mean_bwd(const T *g, const Acc<T> *len, T *dh, int batch, int steps,
                                int features) {
    typedef Acc<T> F;
    const i64 n = (i64)batch * steps * features;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 b = e / ((i64)steps * features), t = (e / features) % steps, j = e % features;
        store_s(dh + e, t < (i64)len[b] ? to_acc(g[b * features + j]) / len[b] : F(0));
    }
}

#define MASKED_MEAN_KERNELS(SUFFIX, T)                                                          \
    extern "C" __global__ void __launch_bounds__(MASKED_MEAN_THREADS) masked_mean_fwd_##SUFFIX( \
        const T *h, const Acc<T> *len, T *out, int batch, int steps, int features) {            \
        masked_mean_fwd<T>(h, len, out, batch, steps, features);                                \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MASKED_MEAN_THREADS) masked_mean_bwd_##SUFFIX( \
        const T *g, const Acc<T> *len, T *dh, int batch, int steps, int features) {             \
        masked_mean_bwd<T>(g, len, dh, batch, steps, features);                                 \
    }

// The instantiations; the host harness in tests/kernels_on_cpu registers the same list.
#define MASKED_MEAN_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

MASKED_MEAN_DTYPES(MASKED_MEAN_KERNELS)
