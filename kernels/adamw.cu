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

// The compute copy's type of a step without one: the store compiles to nothing (a copy
// pointer kept live beside f32 division's slow path made ptxas spill on sm_90).
struct NoCopy {};
__device__ __forceinline__ void store_s(NoCopy *, float) {}
__device__ __forceinline__ void store_s(NoCopy *, double) {}

// The parameters of one launch, θ and its moments in T, the gradients in G and the compute
// copies (null: none) in C; entries past the launch's grid.y are unused.
template <typename T, typename G, typename C> struct AdamwSegments {
    T *theta[ADAMW_SEGMENTS];
    T *mv[ADAMW_SEGMENTS]; // [m; v]: 2 n values
    const G *g[ADAMW_SEGMENTS];
    C *copy[ADAMW_SEGMENTS];
    long long n[ADAMW_SEGMENTS];
    int group[ADAMW_SEGMENTS]; // the row of `hyper`
};

template <typename T, typename G, typename C>
__device__ void adamw_step(const AdamwSegments<T, G, C> &seg, const T *hyper, const T *scale) {
    const int p = blockIdx.y;
    const T *h = hyper + (i64)seg.group[p] * ADAMW_HYPER;
    const T b1 = h[0], b2 = h[1], c1 = h[2], c2 = h[3], eps = h[4], eta = h[5], wd = h[6];
    const T s = scale ? scale[0] : T(1);
    T *theta = seg.theta[p], *mv = seg.mv[p];
    const G *g = seg.g[p];
    C *copy = seg.copy[p];
    const i64 n = seg.n[p];
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const T gs = to_acc(g[e]) * s;
        const T m = b1 * mv[e] + (T(1) - b1) * gs;
        const T v = b2 * mv[n + e] + (T(1) - b2) * (gs * gs);
        mv[e] = m;
        mv[n + e] = v;
        const T update = (m / c1) / (sqrt(v / c2) + eps);
        const T th = theta[e];
        const T next = (th - eta * update) - eta * wd * th;
        theta[e] = next;
        if (copy) store_s(copy + e, next);
    }
}

#define ADAMW_KERNEL(NAME, T, G, C)                                                            \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)                                \
        NAME(AdamwSegments<T, G, C> seg, const T *hyper, const T *scale) {                     \
        adamw_step<T, G, C>(seg, hyper, scale);                                                \
    }

// The instantiations (parameters train in f32; f64 for the tests; the host harness in
// tests/kernels_on_cpu registers the same list). adamw_step_<dtype>: the gradients, and the
// compute copies, in <dtype> (f32 parameters for f16/bf16; no copy for f32 and f64). adamw_step_wide_<dtype>:
// f32 gradients (summed over a batch's parts in f32) and an f16/bf16 compute copy.
#define ADAMW_INSTANCES(X)                                                                     \
    X(adamw_step_f32, float, float, NoCopy)                                                    \
    X(adamw_step_f64, double, double, NoCopy)                                                  \
    X(adamw_step_f16, float, __half, __half)                                                   \
    X(adamw_step_bf16, float, __nv_bfloat16, __nv_bfloat16)                                    \
    X(adamw_step_wide_f16, float, float, __half)                                               \
    X(adamw_step_wide_bf16, float, float, __nv_bfloat16)

ADAMW_INSTANCES(ADAMW_KERNEL)
