// One AdamW step of one parameter, fused: from θ, the moments m and v and the gradient g, write
// out = [m'; v'; θ'] (3 n values) with
//   ĝ = s g (s: the clipping factor, a device scalar, or 1),
//   m' = β₁ m + (1 − β₁) ĝ,   v' = β₂ v + (1 − β₂) ĝ²,
//   θ' = θ − η (m' / c₁) / (√(v' / c₂) + ε) − η λ θ,   c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ.
// The hyper-parameters are a device row [β₁, β₂, c₁, c₂, ε, η, λ] (one per parameter group,
// uploaded once per step), so that a step enqueues one launch per parameter and reads nothing
// back. The CPU twin is src/ops/adamw/mod.rs. One thread per element, grid-strided.
#include "values.cuh"

#define ADAMW_THREADS 256

template <typename T>
__device__ void adamw_step(const T *theta, const T *m, const T *v, const T *g, const T *scale,
                           const T *hyper, T *out, i64 n) {
    const T b1 = hyper[0], b2 = hyper[1], c1 = hyper[2], c2 = hyper[3], eps = hyper[4],
            eta = hyper[5], wd = hyper[6];
    const T s = scale ? scale[0] : T(1);
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const T gs = g[e] * s;
        const T mn = b1 * m[e] + (T(1) - b1) * gs;
        const T vn = b2 * v[e] + (T(1) - b2) * (gs * gs);
        const T update = (mn / c1) / (sqrt(vn / c2) + eps);
        const T th = theta[e];
        out[e] = mn;
        out[n + e] = vn;
        out[2 * n + e] = (th - eta * update) - eta * wd * th;
    }
}

#define ADAMW_KERNELS(SUFFIX, T)                                                                \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)                                 \
        adamw_step_##SUFFIX(const T *theta, const T *m, const T *v, const T *g, const T *scale, \
                            const T *hyper, T *out, int n) {                                    \
        adamw_step<T>(theta, m, v, g, scale, hyper, out, n);                                    \
    }

// The instantiations (parameters train in f32; f64 for the tests): kernel-name suffix and
// type. The host harness in tests/kernels_on_cpu registers the same list.
#define ADAMW_DTYPES(X) X(f32, float) X(f64, double)

ADAMW_DTYPES(ADAMW_KERNELS)
