// GELU in its tanh form, forward and backward, one thread per element (grid-strided):
//   gelu(x) = ½ x (1 + tanh z),   z = √(2/π) (x + 0.044715 x³),
//   gelu′(x) = ½ (1 + tanh z) + ½ x (1 − tanh² z) √(2/π) (1 + 3 · 0.044715 x²),
// with tanh z = 1 − 2 / (1 + e^{2z}). The CPU twin (src/ops/gelu/mod.rs) does the same
// arithmetic in the same order.
#include "gelu.cuh"

#define GELU_THREADS 256

template <typename T> __device__ void gelu_fwd(const T *x, T *y, int n) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x)
        store_s(y + e, gelu_value(to_acc(x[e])));
}

template <typename T> __device__ void gelu_bwd(const T *x, const T *g, T *dx, int n) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x)
        store_s(dx + e, to_acc(g[e]) * gelu_slope(to_acc(x[e])));
}

#define GELU_KERNELS(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                                  \
        gelu_fwd_##SUFFIX(const T *x, T *y, int n) {                                            \
        gelu_fwd<T>(x, y, n);                                                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                                  \
        gelu_bwd_##SUFFIX(const T *x, const T *g, T *dx, int n) {                               \
        gelu_bwd<T>(x, g, dx, n);                                                               \
    }

// The instantiations: kernel-name suffix and storage type (the host harness in
// tests/kernels_on_cpu registers the same list).
#define GELU_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

GELU_DTYPES(GELU_KERNELS)
