// The CUDA built-ins our kernels use, for compiling kernels/*.cu unchanged as host C++ and
// running them with the launcher in launcher.cpp (one fiber per CUDA thread, serialised from
// barrier to barrier).
//
// What maps to what:
// - `__shared__` is `thread_local`: a block's fibers all run on the launching OS thread, so they
//   share it, and launches on other OS threads (parallel tests) have their own copy. `extern
//   __shared__` arrays name the launcher's dynamic shared memory (`smem`, poisoned with 0xff
//   before every block, with a canary past the launch's dynamic size).
// - threadIdx, blockIdx, blockDim, gridDim are per-OS-thread globals that the launcher sets
//   before it switches to a fiber.
// - __syncthreads() hands control back to the launcher: it is a real barrier, and it records the
//   caller's line so that threads waiting at different barriers are reported.
// - Asynchronous global -> shared copies (cp.async, in kernels/tree_steps.cuh) land when their
//   thread waits for them, the latest a GPU may land them, and poison their destination until
//   then; the destination must be dynamic shared memory, and a thread must not return with
//   copies it has not waited for.
// - Atomics are plain read-modify-writes: only one fiber runs at a time.
// - __half and __nv_bfloat16 are 16-bit storage types with round-to-nearest-even conversions,
//   as on the GPU.
// A kernel that starts using another built-in (warp shuffles, __syncwarp, ...) needs it here.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cmath>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define __shared__ thread_local

struct uint3 {
    unsigned x, y, z;
};
typedef uint3 dim3;

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local uint3 blockDim;
extern thread_local uint3 gridDim;

// The barrier of the block. Defined in launcher.cpp, never inlined here: the compiler must
// assume it reads and writes all shared and global memory, as the real one does.
void cuda_host_syncthreads(int line, const char *file);
inline void __syncthreads(int line = __builtin_LINE(), const char *file = __builtin_FILE()) {
    cuda_host_syncthreads(line, file);
}

// cp.async and cp.async.wait_all of the running thread. Defined in launcher.cpp.
void cuda_host_copy_async(void *dst, const void *src, size_t bytes);
void cuda_host_wait_async();

// ---- atomics (one fiber runs at a time, so plain operations are atomic)
inline int atomicCAS(int *p, int compare, int val) {
    const int old = *p;
    if (old == compare) *p = val;
    return old;
}
inline unsigned atomicCAS(unsigned *p, unsigned compare, unsigned val) {
    const unsigned old = *p;
    if (old == compare) *p = val;
    return old;
}
template <typename T> inline T atomicAdd(T *p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <typename T> inline T atomicExch(T *p, T v) {
    const T old = *p;
    *p = v;
    return old;
}
template <typename T> inline T atomicMin(T *p, T v) {
    const T old = *p;
    if (v < old) *p = v;
    return old;
}
template <typename T> inline T atomicMax(T *p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}

// ---- math: the C library's, under the names device code uses
using std::isfinite;
using std::isinf;
using std::isnan;
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline double __longlong_as_double(long long x) {
    double d;
    memcpy(&d, &x, sizeof d);
    return d;
}
inline float __logf(float x) { return logf(x); }

// ---- 16-bit floating-point storage types
struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};

inline uint32_t cuda_host_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline float cuda_host_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000) << 16;
    const uint32_t exp = (h.bits >> 10) & 0x1f, man = h.bits & 0x3ff;
    if (exp == 0x1f) return cuda_host_bits_f32(sign | 0x7f800000 | (man << 13)); // inf, NaN
    if (exp != 0) return cuda_host_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
    // zero or subnormal: man * 2^-24, exact in f32
    const float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
}

// f32 -> f16, rounding to nearest even (as __float2half).
inline __half __float2half(float f) {
    const uint32_t u = cuda_host_f32_bits(f);
    const uint16_t sign = (u >> 16) & 0x8000;
    const uint32_t a = u & 0x7fffffff;
    if (a >= 0x7f800000) return {(uint16_t)(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0))};
    if (a >= 0x477ff000) return {(uint16_t)(sign | 0x7c00)}; // rounds to >= 65520: inf
    if (a < 0x38800000) {
        // below the smallest normal half: a subnormal (or zero) in units of 2^-24
        const float v = cuda_host_bits_f32(a) * 16777216.0f; // exact
        return {(uint16_t)(sign | (uint16_t)nearbyintf(v))};  // ties to even
    }
    const uint32_t exp = (a >> 23) - 112, man = a & 0x7fffff;
    uint32_t h = (exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
    return {(uint16_t)(sign | h)};
}
inline __half __float2half_rn(float f) { return __float2half(f); }

inline float __bfloat162float(__nv_bfloat16 b) { return cuda_host_bits_f32((uint32_t)b.bits << 16); }

// f32 -> bf16, rounding to nearest even (as __float2bfloat16).
inline __nv_bfloat16 __float2bfloat16(float f) {
    const uint32_t u = cuda_host_f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) return {(uint16_t)((u >> 16) | 0x40)}; // quiet NaN
    const uint32_t rounded = u + 0x7fff + ((u >> 16) & 1);
    return {(uint16_t)(rounded >> 16)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
