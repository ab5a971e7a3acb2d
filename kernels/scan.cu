// Linear scan h_t = a_t * h_{t-1} + b_t over (batch, length, channels), and its adjoint.
// The algorithm and its CPU twin are described in src/ops/scan.rs; the constants below must
// equal TILE, SEGMENTS and SEG_LEN there (a test checks).
//
// Grid: (ceil(channels / TILE), batch). Block: (TILE, SEGMENTS): lane = channel within the
// tile, warp = segment of the chunk. Each thread keeps its SEG_LEN steps in registers, so every
// element is loaded once and stored once. Complex values are (re, im) pairs; f16/bf16 are
// computed in f32, f64 in f64.

#define SCAN_TILE 32
#define SCAN_SEGMENTS 8
#define SCAN_SEG_LEN 8
#define SCAN_CHUNK (SCAN_SEGMENTS * SCAN_SEG_LEN)
// Blocks per SM that the register budget is sized for: 3, i.e. at most 80 registers a thread;
// complex f64 (16-byte values) spills at 80 and gets 128 (2 blocks). ptxas -v, sm_70 and
// sm_90: no kernel spills (scripts/kernel-resources.sh).
#define SCAN_MIN_BLOCKS(V) (sizeof(V) > 8 ? 2 : 3)

// Gate shapes (GateShape::code in Rust).
#define GATE_FULL 0
#define GATE_PER_STEP 1
#define GATE_PER_CHANNEL 2

#include "values.cuh"

struct Geometry {
    int len, chans, gate_shape, reverse, bi, d;
    // Time of scan step j (scan order is reversed time for a reverse scan).
    __device__ __forceinline__ int time(int j) const { return reverse ? len - 1 - j : j; }
    // Element index of (bi, time t, d) in a (batch, len, chans) tensor.
    __device__ __forceinline__ i64 elem(int t) const {
        return ((i64)bi * len + t) * chans + d;
    }
    __device__ __forceinline__ i64 gate(int t) const {
        switch (gate_shape) {
        case GATE_FULL: return elem(t);
        case GATE_PER_STEP: return (i64)t * chans + d;
        default: return d;
        }
    }
    __device__ __forceinline__ i64 state() const { return (i64)bi * chans + d; }
};

// Pass 1 and the composition of the chunk (see src/ops/scan.rs): returns this thread's incoming
// state and advances `carry` past the whole chunk. Padded steps hold the identity (1, 0).
template <typename O>
__device__ __forceinline__ typename O::V chunk_prefix(
    const typename O::V (&g)[SCAN_SEG_LEN], const typename O::V (&x)[SCAN_SEG_LEN],
    typename O::V (*agg_a)[SCAN_TILE], typename O::V (*agg_b)[SCAN_TILE],
    typename O::V &carry) {
    typedef typename O::V V;
    const int lane = threadIdx.x, seg = threadIdx.y;
    V A = O::one(), B = O::zero();
#pragma unroll
    for (int k = 0; k < SCAN_SEG_LEN; ++k) {
        A = O::mul(g[k], A);
        B = O::add(O::mul(g[k], B), x[k]);
    }
    agg_a[seg][lane] = A;
    agg_b[seg][lane] = B;
    __syncthreads();
    V h = carry, h_in = carry;
#pragma unroll
    for (int s = 0; s < SCAN_SEGMENTS; ++s) {
        if (s == seg) h_in = h;
        h = O::add(O::mul(agg_a[s][lane], h), agg_b[s][lane]);
    }
    carry = h;
    __syncthreads(); // the next chunk reuses agg_a/agg_b
    return h_in;
}

template <typename T, typename O>
__device__ void scan_fwd(const T *__restrict__ a, const T *__restrict__ b,
                         const T *__restrict__ h0, T *__restrict__ out, int len, int chans,
                         int gate_shape, int reverse) {
    typedef typename O::V V;
    __shared__ V agg_a[SCAN_SEGMENTS][SCAN_TILE];
    __shared__ V agg_b[SCAN_SEGMENTS][SCAN_TILE];
    const Geometry geo{len, chans, gate_shape, reverse, (int)blockIdx.y,
                       (int)(blockIdx.x * SCAN_TILE + threadIdx.x)};
    const bool active = geo.d < chans;
    const int seg = threadIdx.y;
    V carry = active ? O::load(h0, geo.state()) : O::zero();
    for (int c0 = 0; c0 < len; c0 += SCAN_CHUNK) {
        V g[SCAN_SEG_LEN], x[SCAN_SEG_LEN];
#pragma unroll
        for (int k = 0; k < SCAN_SEG_LEN; ++k) {
            const int p = c0 + seg * SCAN_SEG_LEN + k;
            if (active && p < len) {
                const int t = geo.time(p);
                g[k] = O::load(a, geo.gate(t));
                x[k] = O::load(b, geo.elem(t));
            } else {
                g[k] = O::one();
                x[k] = O::zero();
            }
        }
        V h = chunk_prefix<O>(g, x, agg_a, agg_b, carry);
#pragma unroll
        for (int k = 0; k < SCAN_SEG_LEN; ++k) {
            const int p = c0 + seg * SCAN_SEG_LEN + k;
            h = O::add(O::mul(g[k], h), x[k]);
            if (active && p < len) O::store(out, geo.elem(geo.time(p)), h);
        }
    }
}

// Adjoint: traversal step p is scan step j = len-1-p; lambda_j = conj(a_{j+1}) lambda_{j+1} + g_j.
template <typename T, typename O>
__device__ void scan_bwd(const T *__restrict__ a, const T *__restrict__ h,
                         const T *__restrict__ h0, const T *__restrict__ gr,
                         T *__restrict__ db, T *__restrict__ da, T *__restrict__ dh0, int len,
                         int chans, int gate_shape, int reverse) {
    typedef typename O::V V;
    __shared__ V agg_a[SCAN_SEGMENTS][SCAN_TILE];
    __shared__ V agg_b[SCAN_SEGMENTS][SCAN_TILE];
    const Geometry geo{len, chans, gate_shape, reverse, (int)blockIdx.y,
                       (int)(blockIdx.x * SCAN_TILE + threadIdx.x)};
    const bool active = geo.d < chans;
    const int lane = threadIdx.x, seg = threadIdx.y;
    V carry = O::zero(), da_sum = O::zero();
    for (int c0 = 0; c0 < len; c0 += SCAN_CHUNK) {
        V g[SCAN_SEG_LEN], x[SCAN_SEG_LEN], h_prev[SCAN_SEG_LEN];
#pragma unroll
        for (int k = 0; k < SCAN_SEG_LEN; ++k) {
            const int p = c0 + seg * SCAN_SEG_LEN + k;
            if (active && p < len) {
                const int j = len - 1 - p;
                g[k] = j + 1 < len ? O::conj(O::load(a, geo.gate(geo.time(j + 1)))) : O::zero();
                x[k] = O::load(gr, geo.elem(geo.time(j)));
                h_prev[k] = j > 0 ? O::load(h, geo.elem(geo.time(j - 1))) : O::load(h0, geo.state());
            } else {
                g[k] = O::one();
                x[k] = O::zero();
                h_prev[k] = O::zero();
            }
        }
        V lam = chunk_prefix<O>(g, x, agg_a, agg_b, carry);
#pragma unroll
        for (int k = 0; k < SCAN_SEG_LEN; ++k) {
            const int p = c0 + seg * SCAN_SEG_LEN + k;
            lam = O::add(O::mul(g[k], lam), x[k]);
            if (active && p < len) {
                const int j = len - 1 - p, t = geo.time(j);
                O::store(db, geo.elem(t), lam);
                const V da_j = O::mul(lam, O::conj(h_prev[k]));
                if (gate_shape == GATE_PER_CHANNEL) da_sum = O::add(da_sum, da_j);
                else O::store(da, geo.elem(t), da_j);
                if (j == 0) O::store(dh0, geo.state(), O::mul(O::conj(O::load(a, geo.gate(t))), lam));
            }
        }
    }
    if (gate_shape == GATE_PER_CHANNEL) {
        // Per-(batch, channel) partial of the shared gate's gradient: sum over the segments.
        agg_a[seg][lane] = da_sum;
        __syncthreads();
        if (seg == 0 && active) {
            V s = O::zero();
#pragma unroll
            for (int i = 0; i < SCAN_SEGMENTS; ++i) s = O::add(s, agg_a[i][lane]);
            O::store(da, geo.state(), s);
        }
    }
}

#define SCAN_KERNELS(SUFFIX, T, OPS)                                                            \
    extern "C" __global__ void __launch_bounds__(SCAN_TILE *SCAN_SEGMENTS, SCAN_MIN_BLOCKS(OPS::V))                      \
        scan_fwd_##SUFFIX(const T *a, const T *b, const T *h0, T *out, int batch, int len,      \
                          int chans, int gate_shape, int reverse) {                             \
        scan_fwd<T, OPS>(a, b, h0, out, len, chans, gate_shape, reverse);                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SCAN_TILE *SCAN_SEGMENTS, SCAN_MIN_BLOCKS(OPS::V))                      \
        scan_bwd_##SUFFIX(const T *a, const T *h, const T *h0, const T *g, T *db, T *da,        \
                          T *dh0, int batch, int len, int chans, int gate_shape, int reverse) { \
        scan_bwd<T, OPS>(a, h, h0, g, db, da, dh0, len, chans, gate_shape, reverse);            \
    }

// The instantiations: kernel-name suffix, storage type, arithmetic (the host harness in
// tests/kernels_on_cpu registers the same list).
#define SCAN_DTYPES(X) \
    X(f32, float, RealOps<float>) \
    X(f32_c, float, ComplexOps<float>) \
    X(f64, double, RealOps<double>) \
    X(f64_c, double, ComplexOps<double>) \
    X(f16, __half, RealOps<float>) \
    X(f16_c, __half, ComplexOps<float>) \
    X(bf16, __nv_bfloat16, RealOps<float>) \
    X(bf16_c, __nv_bfloat16, ComplexOps<float>)

SCAN_DTYPES(SCAN_KERNELS)
