// The global gradient norm ‖g‖₂ = √(Σ_p Σ_e g_p[e]²) over up to NORM_SEGMENTS gradients per
// launch, in two kernels instead of a square, a sum, a cast and an add per parameter:
// grad_norm_parts gives block (b, p) the elements b·256 + t + k·(B·256) of gradient p (B
// blocks per gradient, t its thread), each thread adding the squares of its elements in order;
// the block's 256 sums are added in a fixed tree and written to part[p·B + b].
// grad_norm_sum adds the partials in one block the same way (thread t takes t, t + 256, ...)
// and writes the square root. The gradients' addresses and sizes come by value, as in
// adamw.cu. The CPU twin is src/ops/grad_norm/mod.rs.
#include "values.cuh"

#define NORM_THREADS 256
#define NORM_SEGMENTS 32

// The gradients of one launch; entries past the launch's grid.y are unused.
template <typename T> struct NormSegments {
    const T *g[NORM_SEGMENTS];
    long long n[NORM_SEGMENTS];
};

// The sum of every thread's `v` over the block: pairs (t, t + s) for s = 128, 64, ..., 1.
// All threads call it; `red` holds NORM_THREADS values.
template <typename F> __device__ __forceinline__ F norm_block_sum(F v, F *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    return red[0];
}

template <typename T> __device__ void grad_norm_parts(const NormSegments<T> &seg, Acc<T> *part) {
    typedef Acc<T> F;
    __shared__ F red[NORM_THREADS];
    const int p = blockIdx.y;
    const T *g = seg.g[p];
    F acc = F(0);
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < seg.n[p];
         e += (i64)gridDim.x * blockDim.x) {
        const F x = to_acc(g[e]);
        acc += x * x;
    }
    const F s = norm_block_sum(acc, red);
    if (threadIdx.x == 0) part[(i64)p * gridDim.x + blockIdx.x] = s;
}

template <typename T> __device__ void grad_norm_sum(const T *part, T *out, int count) {
    typedef typename AccOf<T>::F F;
    __shared__ F red[NORM_THREADS];
    F acc = F(0);
    for (int i = threadIdx.x; i < count; i += NORM_THREADS) acc += to_acc(part[i]);
    const F s = norm_block_sum(acc, red);
    if (threadIdx.x == 0) store_s(out, sqrt(s));
}

#define GRAD_NORM_PARTS(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        grad_norm_parts_##SUFFIX(NormSegments<T> seg, Acc<T> *part) {                           \
        grad_norm_parts<T>(seg, part);                                                          \
    }
#define GRAD_NORM_SUM(SUFFIX, T)                                                                \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        grad_norm_sum_##SUFFIX(const T *part, T *out, int count) {                              \
        grad_norm_sum<T>(part, out, count);                                                     \
    }

// The instantiations: kernel-name suffix and type (the host harness in tests/kernels_on_cpu
// registers the same lists). The partial sums are f32 for f32, f16 and bf16 gradients (the
// compute copy's under mixed precision), f64 for f64 (the tests), and summed by the sum of
// their type.
#define GRAD_NORM_PARTS_DTYPES(X)                                                               \
    X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)
#define GRAD_NORM_SUM_DTYPES(X) X(f32, float) X(f64, double)

GRAD_NORM_PARTS_DTYPES(GRAD_NORM_PARTS)
GRAD_NORM_SUM_DTYPES(GRAD_NORM_SUM)
