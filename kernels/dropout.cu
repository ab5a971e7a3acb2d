// Dropout keep-masks from a counter-based hash: entry (row, feature) is 1 when
// absorb(absorb(site_hash, first_row + row), feature) >> 11 >= threshold, else 0. The same
// function as the CPU's (src/ops/dropout/mod.rs), so masks do not depend on the device, the
// sharding of a batch or a resumption; the host derives site_hash from (seed, step, site) and
// threshold = ceil(p 2^53) from the dropout rate p. One thread per entry, grid-strided.
#include "dropout_hash.cuh"

#define DROPOUT_THREADS 256

template <typename T>
__device__ void dropout_keep(T *keep, int rows, int features, u64 site_hash, u64 first_row,
                             u64 threshold) {
    const i64 n = (i64)rows * features;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (i64)gridDim.x * blockDim.x) {
        const u64 row = (u64)(e / features), feature = (u64)(e % features);
        store_s(keep + e, dropout_kept(site_hash, first_row + row, feature, threshold) ? 1.0f : 0.0f);
    }
}

#define DROPOUT_KERNELS(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(DROPOUT_THREADS)                               \
        dropout_keep_##SUFFIX(T *keep, int rows, int features, u64 site_hash, u64 first_row,    \
                              u64 threshold) {                                                  \
        dropout_keep<T>(keep, rows, features, site_hash, first_row, threshold);                 \
    }

// The instantiations: kernel-name suffix and storage type (the host harness in
// tests/kernels_on_cpu registers the same list).
#define DROPOUT_DTYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)

DROPOUT_DTYPES(DROPOUT_KERNELS)
