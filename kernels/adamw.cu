// One AdamW step of one parameter, in place, in one launch: per element
//   ĝ = s g,  m ← β₁ m + (1 − β₁) ĝ,  v ← β₂ v + (1 − β₂) ĝ²,
//   θ ← θ − η (m / c₁) / (√(v / c₂) + ε) − η λ θ,   c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ,
// θ and the moments [m; v] both updated where they are (nothing is allocated per step, so a
// captured step replays on the same buffers). The hyper-parameters are a device row
// [β₁, β₂, c₁, c₂, ε, η, λ, s] per parameter group (s: the gradient-clipping factor, or 1), so
// nothing is read back. The CPU twin is src/ops/adamw/mod.rs. One thread per element,
// grid-strided.
#include "values.cuh"

#define ADAMW_THREADS 256

// theta: n values; mv: [m; v], 2 n values.
template <typename T>
__device__ void adamw_step(T *theta, T *mv, const T *g, const T *hyper, i64 n) {
    const T b1 = hyper[0], b2 = hyper[1], c1 = hyper[2], c2 = hyper[3], eps = hyper[4],
            eta = hyper[5], wd = hyper[6], s = hyper[7];
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
        adamw_step_##SUFFIX(T *theta, T *mv, const T *g, const T *hyper, int n) {             \
        adamw_step<T>(theta, mv, g, hyper, n);                                                 \
    }

// The instantiations (parameters train in f32; f64 for the tests): kernel-name suffix and
// type. The host harness in tests/kernels_on_cpu registers the same list.
#define ADAMW_DTYPES(X) X(f32, float) X(f64, double)

ADAMW_DTYPES(ADAMW_KERNELS)
