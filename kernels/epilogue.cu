// A block's epilogue, fused: out = r + k ⊙ act(y) over (samples, length, features), with act
// GELU (tanh form, gelu.cuh) or the identity, k the dropout factor of (sample, feature) — s =
// 1 / (1 − p) where the mask keeps the entry (dropout_hash.cuh), else 0; 1 without dropout —
// and r the residual (or none). Backward: ∂y = (∂out k) act′(y); ∂r = ∂out needs no kernel.
// The CPU twin (src/ops/epilogue/mod.rs) does the same arithmetic in the same order. One
// thread per element, grid-strided.
#include "dropout_hash.cuh"
#include "gelu.cuh"

#define EPILOGUE_THREADS 256

// The dropout of one launch: the key of its mask, and s. The launch passes the site hash, or the
// device's key word and the site (dropout_site_hash).
struct EpilogueDrop {
    int on;
    u64 site_hash, first_row, threshold;
    double scale;
};

// k at element e of a (samples, per_sample / features, features) tensor.
template <typename A>
__device__ __forceinline__ A epilogue_factor(const EpilogueDrop &d, i64 e, int per_sample,
                                             int features) {
    if (!d.on)
        return A(1);
    const u64 row = d.first_row + (u64)(e / per_sample), feature = (u64)(e % features);
    return dropout_kept(d.site_hash, row, feature, d.threshold) ? A(d.scale) : A(0);
}

template <typename T>
__device__ void epilogue_fwd(const T *y, const T *r, T *out, int n, int per_sample, int features,
                             int gelu, EpilogueDrop d) {
    using A = decltype(to_acc(y[0]));
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const A x = to_acc(y[e]);
        const A z = (gelu ? gelu_value(x) : x) * epilogue_factor<A>(d, e, per_sample, features);
        store_s(out + e, r ? to_acc(r[e]) + z : z);
    }
}

template <typename T>
__device__ void epilogue_bwd(const T *y, const T *g, T *dy, int n, int per_sample, int features,
                             int gelu, EpilogueDrop d) {
    using A = decltype(to_acc(y[0]));
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const A gk = to_acc(g[e]) * epilogue_factor<A>(d, e, per_sample, features);
        store_s(dy + e, gelu ? gk * gelu_slope(to_acc(y[e])) : gk);
    }
}

#define EPILOGUE_KERNELS(SUFFIX, T)                                                             \
    extern "C" __global__ void __launch_bounds__(EPILOGUE_THREADS)                              \
        epilogue_fwd_##SUFFIX(const T *y, const T *r, T *out, int n, int per_sample,            \
                              int features, int gelu, int drop, u64 site_hash, const u64 *key,  \
                              u64 site, u64 first_row, u64 threshold, u64 scale_bits) {         \
        const EpilogueDrop d = {drop, dropout_site_hash(site_hash, key, site), first_row,       \
                                threshold, f64_from_bits(scale_bits)};                          \
        epilogue_fwd<T>(y, r, out, n, per_sample, features, gelu, d);                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(EPILOGUE_THREADS)                              \
        epilogue_bwd_##SUFFIX(const T *y, const T *g, T *dy, int n, int per_sample,             \
                              int features, int gelu, int drop, u64 site_hash, const u64 *key,  \
                              u64 site, u64 first_row, u64 threshold, u64 scale_bits) {         \
        const EpilogueDrop d = {drop, dropout_site_hash(site_hash, key, site), first_row,       \
                                threshold, f64_from_bits(scale_bits)};                          \
        epilogue_bwd<T>(y, g, dy, n, per_sample, features, gelu, d);                            \
    }

// The instantiations: kernel-name suffix and storage type (the host harness in
// tests/kernels_on_cpu registers the same list).
#define EPILOGUE_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

EPILOGUE_DTYPES(EPILOGUE_KERNELS)

// The gated epilogue of the GLU activations: out = r + k ⊙ (f ⊙ s), s = σ(z + b), over
// (samples, length, features), b a bias per feature, k and r as above; the forward also writes
// s for the backward, which with gk = ∂out ⊙ k gives ∂f = gk ⊙ s, ∂z = (gk ⊙ f) ⊙ (s ⊙ (1 − s))
// (∂b sums ∂z; ∂r = ∂out). The CPU twin is src/ops/epilogue/gate.rs. One thread per element,
// grid-strided.
template <typename A> __device__ __forceinline__ A gate_sigmoid(A x) {
    return A(1) / (exp(-x) + A(1));
}

template <typename T>
__device__ void gate_fwd(const T *f, const T *z, const T *b, const T *r, T *out, T *gate, int n,
                         int per_sample, int features, EpilogueDrop d) {
    using A = decltype(to_acc(f[0]));
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const A s = gate_sigmoid(to_acc(z[e]) + to_acc(b[e % features]));
        const A v = (to_acc(f[e]) * s) * epilogue_factor<A>(d, e, per_sample, features);
        store_s(out + e, r ? to_acc(r[e]) + v : v);
        store_s(gate + e, s);
    }
}

// gate: s as the forward wrote it.
template <typename T>
__device__ void gate_bwd(const T *f, const T *gate, const T *g, T *df, T *dz, int n,
                         int per_sample, int features, EpilogueDrop d) {
    using A = decltype(to_acc(f[0]));
    // Not unrolled: unrolled, the f64 loop spills on sm_70.
#pragma unroll 1
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const A s = to_acc(gate[e]);
        const A gk = to_acc(g[e]) * epilogue_factor<A>(d, e, per_sample, features);
        store_s(df + e, gk * s);
        store_s(dz + e, (gk * to_acc(f[e])) * (s * (A(1) - s)));
    }
}

#define GATE_KERNELS(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(EPILOGUE_THREADS)                              \
        gate_fwd_##SUFFIX(const T *f, const T *z, const T *b, const T *r, T *out, T *gate,      \
                          int n, int per_sample, int features, int drop, u64 site_hash,         \
                          const u64 *key, u64 site, u64 first_row, u64 threshold,               \
                          u64 scale_bits) {                                                     \
        const EpilogueDrop d = {drop, dropout_site_hash(site_hash, key, site), first_row,       \
                                threshold, f64_from_bits(scale_bits)};                          \
        gate_fwd<T>(f, z, b, r, out, gate, n, per_sample, features, d);                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(EPILOGUE_THREADS)                              \
        gate_bwd_##SUFFIX(const T *f, const T *gate, const T *g, T *df, T *dz, int n,           \
                          int per_sample, int features, int drop, u64 site_hash,                \
                          const u64 *key, u64 site, u64 first_row, u64 threshold,               \
                          u64 scale_bits) {                                                     \
        const EpilogueDrop d = {drop, dropout_site_hash(site_hash, key, site), first_row,       \
                                threshold, f64_from_bits(scale_bits)};                          \
        gate_bwd<T>(f, gate, g, df, dz, n, per_sample, features, d);                            \
    }

// The instantiations (the host harness registers the same list).
#define GATE_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

GATE_DTYPES(GATE_KERNELS)
