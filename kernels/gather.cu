// A fixed gather of rows and its gradient, for x (rows, n) and an index of `len` rows known
// when the model is built (the frame encoder's im2col):
//   y[i, :] = x[index[i], :],   ∂x[v, :] = Σ_{i : index[i] = v} ∂y[i, :].
// The backward reads the index inverted (CSR: the positions i of row v are
// positions[starts[v] .. starts[v + 1]], ascending), so each element of ∂x is one thread that
// adds its few rows of ∂y in position order: no atomics, no serial walk over the index, and
// the sums of a sequential scatter-add. Both are grid-strided over the output's elements,
// consecutive threads on consecutive columns. The CPU twin is src/ops/gather/mod.rs.
#include "values.cuh"

#define GATHER_THREADS 256

template <typename T>
__device__ void gather_fwd(const T *x, const int *index, T *y, int len, int n) {
    const i64 total = (i64)len * n;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x)
        y[e] = x[(i64)index[e / n] * n + e % n];
}

template <typename T>
__device__ void gather_bwd(const T *g, const int *starts, const int *positions, T *dx, int rows,
                           int n) {
    typedef typename AccOf<T>::F F;
    const i64 total = (i64)rows * n;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 v = e / n, c = e % n;
        F s = F(0);
        for (int k = starts[v]; k < starts[v + 1]; ++k) s += to_acc(g[(i64)positions[k] * n + c]);
        store_s(dx + e, s);
    }
}

#define GATHER_KERNELS(SUFFIX, T)                                                               \
    extern "C" __global__ void __launch_bounds__(GATHER_THREADS)                                \
        gather_fwd_##SUFFIX(const T *x, const int *index, T *y, int len, int n) {               \
        gather_fwd<T>(x, index, y, len, n);                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GATHER_THREADS) gather_bwd_##SUFFIX(          \
        const T *g, const int *starts, const int *positions, T *dx, int rows, int n) {          \
        gather_bwd<T>(g, starts, positions, dx, rows, n);                                       \
    }

// The instantiations (the encoder trains in f32; f64 for the tests; f16/bf16 use candle's
// index_select): kernel-name suffix and type. The host harness registers the same list.
#define GATHER_DTYPES(X) X(f32, float) X(f64, double)

GATHER_DTYPES(GATHER_KERNELS)
