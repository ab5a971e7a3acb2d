// Scalar types shared by the kernels: storage type T (f32, f64, f16, bf16) computed in F (f32,
// or f64 for f64 storage), real or complex (re, im) pairs. The CPU twins use src/ops/value.rs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// 64-bit element offsets. Not i64: NVRTC (the sm_70 check of scripts/kernel-resources.sh)
// has no <stdint.h>.
typedef long long i64;

typedef unsigned long long u64;

// The type a storage type T computes in: f32, or f64 for f64.
template <typename T> struct AccOf {
    typedef float F;
};
template <> struct AccOf<double> {
    typedef double F;
};
template <typename T> using Acc = typename AccOf<T>::F;

// An f64 passed to a kernel as its bits (kernel arguments are pointers, int or u64).
__device__ __forceinline__ double f64_from_bits(u64 bits) {
    return __longlong_as_double((long long)bits);
}

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_s(float *p, float v) { *p = v; }
__device__ __forceinline__ void store_s(double *p, double v) { *p = v; }
__device__ __forceinline__ void store_s(__half *p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void store_s(__nv_bfloat16 *p, float v) { *p = __float2bfloat16(v); }

template <typename F> struct RealOps {
    typedef F V;
    static constexpr bool complex = false;
    static __device__ __forceinline__ V zero() { return F(0); }
    static __device__ __forceinline__ V one() { return F(1); }
    static __device__ __forceinline__ V add(V a, V b) { return a + b; }
    static __device__ __forceinline__ V mul(V a, V b) { return a * b; }
    static __device__ __forceinline__ V conj(V a) { return a; }
    static __device__ __forceinline__ V sub(V a, V b) { return a - b; }
    static __device__ __forceinline__ V inv(V a) { return F(1) / a; }
    // |a|^2, for choosing pivots.
    static __device__ __forceinline__ F norm2(V a) { return a * a; }
    template <typename T> static __device__ __forceinline__ V load(const T *p, i64 e) {
        return to_acc(p[e]);
    }
    template <typename T> static __device__ __forceinline__ void store(T *p, i64 e, V v) {
        store_s(p + e, v);
    }
};

template <typename F> struct Cx {
    F re, im;
};

template <typename F> struct ComplexOps {
    typedef Cx<F> V;
    static constexpr bool complex = true;
    static __device__ __forceinline__ V zero() { return {F(0), F(0)}; }
    static __device__ __forceinline__ V one() { return {F(1), F(0)}; }
    static __device__ __forceinline__ V add(V a, V b) { return {a.re + b.re, a.im + b.im}; }
    static __device__ __forceinline__ V mul(V a, V b) {
        return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
    }
    static __device__ __forceinline__ V conj(V a) { return {a.re, -a.im}; }
    static __device__ __forceinline__ V sub(V a, V b) { return {a.re - b.re, a.im - b.im}; }
    static __device__ __forceinline__ V inv(V a) {
        const F n = a.re * a.re + a.im * a.im;
        return {a.re / n, -a.im / n};
    }
    static __device__ __forceinline__ F norm2(V a) { return a.re * a.re + a.im * a.im; }
    template <typename T> static __device__ __forceinline__ V load(const T *p, i64 e) {
        return {to_acc(p[2 * e]), to_acc(p[2 * e + 1])};
    }
    template <typename T> static __device__ __forceinline__ void store(T *p, i64 e, V v) {
        store_s(p + 2 * e, v.re);
        store_s(p + 2 * e + 1, v.im);
    }
};

// Whether O computes in storage type T itself (f32 or f64 storage, real or complex: a complex
// value is T's re, im pair), so that values are copied as they are stored.
template <typename T, typename O> struct AsStored {
    static constexpr bool value = false;
};
template <typename F> struct AsStored<F, RealOps<F>> {
    static constexpr bool value = true;
};
template <typename F> struct AsStored<F, ComplexOps<F>> {
    static constexpr bool value = true;
};

// T's storage from element e on, read as O's values where they are the same (AsStored: a complex
// value is the (re, im) pair of T's), else null.
template <typename O, typename T>
__device__ __forceinline__ const typename O::V *as_values(const T *p, i64 e) {
    if constexpr (AsStored<T, O>::value)
        return reinterpret_cast<const typename O::V *>(p) + e;
    else
        return nullptr;
}

// Usable as a pivot: non-zero and finite.
template <typename F> __device__ __forceinline__ bool pivot_ok(F v) { return v != F(0) && isfinite(v); }
template <typename F> __device__ __forceinline__ bool pivot_ok(Cx<F> v) {
    const F n = v.re * v.re + v.im * v.im;
    return n != F(0) && isfinite(n);
}

template <typename V> __device__ __forceinline__ void swap_values(V &a, V &b) {
    const V t = a;
    a = b;
    b = t;
}
