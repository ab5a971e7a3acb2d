// One AdamW step of up to ADAMW_SEGMENTS parameters, in place, in one launch: per element
//   ĝ = s g,  m ← β₁ m + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²,
//   θ ← θ − η (m / c₁) / (√(v / c₂) + ε) − η λ θ,   c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
// θ and the moments [m; v] both updated where they are (nothing is allocated per step, so a
// captured step replays on the same buffers). The parameters' addresses, sizes and groups come
// by value (the gradients' addresses change every step: a table in device memory would be an
// upload per step); the hyper-parameters are a device row [β₁, β₂, c₁, c₂, ε, η, λ] per
// parameter group and s the gradient-clipping factor (a device scalar, or none: 1), so nothing
// is read back. The CPU twin is src/ops/adamw/mod.rs. Block row y takes parameter y; its
// threads take the elements grid-strided.
#include "values.cuh"

#define ADAMW_THREADS 256
#define ADAMW_SEGMENTS 32
#define ADAMW_HYPER 7

// The parameters of one launch; entries past the launch's grid.y are unused.
template <typename T> struct AdamwSegments {
    T *theta[ADAMW_SEGMENTS];
    T *mv[ADAMW_SEGMENTS]; // [m; v]: 2 n values
    const T *g[ADAMW_SEGMENTS];
    long long n[ADAMW_SEGMENTS];
    int group[ADAMW_SEGMENTS]; // the row of `hyper`
};

template <typename T>
__device__ void adamw_step(const AdamwSegments<T> &seg, const T *hyper, const T *scale) {
    const int p = blockIdx.y;
    const T *h = hyper + (i64)seg.group[p] * ADAMW_HYPER;
    const T b1 = h[0], b2 = h[1], c1 = h[2], c2 = h[3], eps = h[4], eta = h[5], wd = h[6];
    const T s = scale ? scale[0] : T(1);
    T *theta = seg.theta[p], *mv = seg.mv[p];
    const T *g = seg.g[p];
    const i64 n = seg.n[p];
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const T gs = g[e] * s;
        const T m = b1 * mv[e] + (T(1) - b1) * gs;
        const T v = b2 * mv[n + e] + (T(1) - b2) * (gs * gs);
        mv[e] = m;
        mv[n + e] = v;
        const T update = (m / c1) / (sqrt(v / c2) + eps);
        const T th = theta[e];
        theta[e] = (th - eta * update) - eta * wd * th;
    }
}

#define ADAMW_KERNELS(SUFFIX, T)                                                               \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)                                \
        adamw_step_##SUFFIX(AdamwSegments<T> seg, const T *hyper, const T *scale) {           \
        adamw_step<T>(seg, hyper, scale);                                                      \
    }

// The instantiations (parameters train in f32; f64 for the tests): kernel-name suffix and
// type. The host harness in tests/kernels_on_cpu registers the same list.
#define ADAMW_DTYPES(X) X(f32, float) X(f64, double)

ADAMW_DTYPES(ADAMW_KERNELS)
