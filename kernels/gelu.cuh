// GELU in its tanh form, value and slope (kernels/gelu.cu, kernels/epilogue.cu; the CPU's is
// src/ops/gelu/mod.rs):
//   gelu(x) = ½ x (1 + tanh z),   z = √(2/π) (x + 0.044715 x³),
//   gelu′(x) = ½ (1 + tanh z) + ½ x (1 − tanh² z) √(2/π) (1 + 3 · 0.044715 x²),
// with tanh z = 1 − 2 / (1 + e^{2z}).
#pragma once
#include "values.cuh"

template <typename F> __device__ __forceinline__ F gelu_tanh_z(F x) {
    const F c = F(0.7978845608028654), k = F(0.044715);
    const F z = c * (x + k * x * x * x);
    // e^{2z} overflows to ∞ for large z, giving exactly 1; underflows to 0 giving −1.
    return F(1) - F(2) / (F(1) + exp(z + z));
}

template <typename F> __device__ __forceinline__ F gelu_value(F x) {
    return F(0.5) * x * (F(1) + gelu_tanh_z(x));
}

template <typename F> __device__ __forceinline__ F gelu_slope(F x) {
    const F c = F(0.7978845608028654), k3 = F(3.0 * 0.044715);
    const F t = gelu_tanh_z(x);
    return F(0.5) * (F(1) + t) + F(0.5) * x * (F(1) - t * t) * c * (F(1) + k3 * x * x);
}
