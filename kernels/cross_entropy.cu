// The classification loss of logits x (rows, C) and labels y (rows, whole numbers as T):
//   logp[r, c] = (x[r, c] − m_r) − log Σ_c' exp(x[r, c'] − m_r),   m_r = max_c x[r, c],
//   loss = −(1/rows) Σ_r logp[r, y_r],   correct = #{r : the first c of maximal x[r, c] is y_r},
// written as one row [logp (rows · C) | loss | correct]; a label outside 0..C makes the loss NaN.
// Backward: ∂x[r, c] = (exp(logp[r, c]) − [c = y_r]) · ∂loss / rows.
// The forward is one block: thread t takes the rows t, t + CE_THREADS, …, and the block adds
// its threads' partial sums in a fixed tree order. The backward is one thread per element,
// grid-strided. The CPU twin is src/ops/cross_entropy/mod.rs.
#include "values.cuh"

#define CE_THREADS 256

template <typename T>
__device__ void cross_entropy_fwd(const T *x, const T *y, T *out, int rows, int classes) {
    __shared__ T loss_part[CE_THREADS], hit_part[CE_THREADS];
    const int t = threadIdx.x;
    T loss = T(0), hit = T(0);
    for (int r = t; r < rows; r += CE_THREADS) {
        const T *xr = x + (i64)r * classes;
        T *lr = out + (i64)r * classes;
        T m = xr[0];
        int arg = 0;
        for (int c = 1; c < classes; ++c)
            if (xr[c] > m) {
                m = xr[c];
                arg = c;
            }
        T s = T(0);
        for (int c = 0; c < classes; ++c) s += exp(xr[c] - m);
        const T lse = log(s);
        for (int c = 0; c < classes; ++c) lr[c] = (xr[c] - m) - lse;
        const T label = y[r];
        const bool valid = label >= T(0) && label < T(classes) && label == floor(label);
        loss -= valid ? lr[(int)label] : T(0) / T(0);
        hit += (valid && arg == (int)label) ? T(1) : T(0);
    }
    loss_part[t] = loss;
    hit_part[t] = hit;
    __syncthreads();
    for (int half = CE_THREADS / 2; half > 0; half /= 2) {
        if (t < half) {
            loss_part[t] += loss_part[t + half];
            hit_part[t] += hit_part[t + half];
        }
        __syncthreads();
    }
    if (t == 0) {
        out[(i64)rows * classes] = loss_part[0] / T(rows);
        out[(i64)rows * classes + 1] = hit_part[0];
    }
}

// logp: the forward's row (its first rows · C values); g: ∂loss (one value).
template <typename T>
__device__ void cross_entropy_bwd(const T *logp, const T *y, const T *g, T *dx, int rows,
                                  int classes) {
    const i64 n = (i64)rows * classes;
    const T scale = g[0] / T(rows);
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / classes, c = e % classes;
        const T hot = (T)c == y[r] ? T(1) : T(0);
        dx[e] = (exp(logp[e]) - hot) * scale;
    }
}

#define CE_KERNELS(SUFFIX, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(CE_THREADS)                                    \
        cross_entropy_fwd_##SUFFIX(const T *x, const T *y, T *out, int rows, int classes) {     \
        cross_entropy_fwd<T>(x, y, out, rows, classes);                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_bwd_##SUFFIX(        \
        const T *logp, const T *y, const T *g, T *dx, int rows, int classes) {                  \
        cross_entropy_bwd<T>(logp, y, g, dx, rows, classes);                                    \
    }

// The instantiations (f32 and f64: the labels must be exact in T); the host harness in
// tests/kernels_on_cpu registers the same list.
#define CE_DTYPES(X) X(f32, float) X(f64, double)

CE_DTYPES(CE_KERNELS)
