// S5's readout matrices from C̃ (H, D·P, 2), D directions: for direction d the (2P, H) matrix
//   R_d[2p, j] = s C̃[j, dP + p].re,   R_d[2p + 1, j] = −s C̃[j, dP + p].im
// (s = 2 with conj_sym, else 1), stacked as (D·2P, H), so that Re(s C̃ x) for the scan's states
// x (…, P, 2) is one matmul x · R_d per direction. The backward is the same map transposed:
// ∂C̃[j, dP + p] = (s ∂R_d[2p, j], −s ∂R_d[2p + 1, j]). One thread per output element,
// grid-strided. The CPU twin is src/ops/s5_readout/mod.rs.
#include "values.cuh"

#define S5R_THREADS 256

template <typename T>
__device__ void s5_readout_fwd(const T *c, T *r, int dirs, int p, int h, int scale) {
    typedef typename AccOf<T>::F F;
    const i64 n = (i64)dirs * 2 * p * h;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 row = e / h, j = e % h;
        const i64 d = row / (2 * p), q = row % (2 * p);
        const i64 src = ((j * dirs + d) * p + q / 2) * 2 + q % 2;
        store_s(r + e, to_acc(c[src]) * F(q % 2 ? -scale : scale));
    }
}

template <typename T>
__device__ void s5_readout_bwd(const T *g, T *dc, int dirs, int p, int h, int scale) {
    typedef typename AccOf<T>::F F;
    const i64 n = (i64)h * dirs * p * 2;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 j = e / ((i64)dirs * p * 2), k = e % ((i64)dirs * p * 2);
        const i64 dp = k / 2, comp = k % 2;
        const i64 row = (dp / p) * 2 * p + (dp % p) * 2 + comp;
        store_s(dc + e, to_acc(g[row * h + j]) * F(comp ? -scale : scale));
    }
}

#define S5R_KERNELS(SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(S5R_THREADS)                                   \
        s5_readout_fwd_##SUFFIX(const T *c, T *r, int dirs, int p, int h, int scale) {          \
        s5_readout_fwd<T>(c, r, dirs, p, h, scale);                                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(S5R_THREADS)                                   \
        s5_readout_bwd_##SUFFIX(const T *g, T *dc, int dirs, int p, int h, int scale) {         \
        s5_readout_bwd<T>(g, dc, dirs, p, h, scale);                                            \
    }

// The instantiations: kernel-name suffix and type (f64 for the tests; f16 and bf16 for a
// mixed-precision step's compute copy, computed in f32 and rounded once on store). The host
// harness in tests/kernels_on_cpu registers the same list.
#define S5R_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

S5R_DTYPES(S5R_KERNELS)
