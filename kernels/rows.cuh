// The row layout shared by the kernels over (rows, h) tensors with per-column parameters
// (layer_norm.cu, channel.cu): block k takes the rows [k R, (k + 1) R) (R = `per_block`, a
// multiple of ROWS_SLOTS), ROWS_SLOTS rows at a time, ROWS_LANES threads per row, each thread
// the columns lane, lane + ROWS_LANES, ... Sums over a row go through shared memory in lane
// order; sums over rows (parameter gradients) are accumulated per slot in shared memory, added
// over the slots in slot order into one partial row per block (in the compute type, f32 for
// f16/bf16), and the partials over the blocks in block order by rows_column_sums. The CPU
// twins (src/ops/rows.rs) add in the same orders.
#pragma once
#include "values.cuh"

#define ROWS_THREADS 256
#define ROWS_LANES 32
#define ROWS_SLOTS (ROWS_THREADS / ROWS_LANES)

// The sum over the lanes of one row of each thread's `v`, in lane order. Every thread of the
// block calls it (it has barriers); `red` holds ROWS_THREADS values.
template <typename F> __device__ __forceinline__ F rows_lane_sum(F v, F *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    const F *row = red + (threadIdx.x / ROWS_LANES) * ROWS_LANES;
    F s = F(0);
    for (int k = 0; k < ROWS_LANES; ++k) s += row[k];
    __syncthreads(); // every row read before `red` is written again
    return s;
}

// The rows [first, end) of this block.
__device__ __forceinline__ void rows_of_block(int rows, int per_block, i64 &first, i64 &end) {
    first = (i64)blockIdx.x * per_block;
    end = first + per_block < rows ? first + per_block : (i64)rows;
}

// Zeroes `n` shared values (all threads; a barrier follows).
template <typename F> __device__ __forceinline__ void rows_zero(F *acc, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc[i] = F(0);
    __syncthreads();
}

// Adds the slots' accumulators acc[slot][n] in slot order into this block's partial row
// part[blockIdx.x][n], kept in the compute type (all threads; a barrier first).
template <typename F>
__device__ __forceinline__ void rows_block_partial(const F *acc, int n, F *part) {
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        F s = F(0);
        for (int slot = 0; slot < ROWS_SLOTS; ++slot) s += acc[(i64)slot * n + i];
        part[(i64)blockIdx.x * n + i] = s;
    }
}

// out[i] = Σ_k part[k][i] over the `blocks` partial rows of n values, in block order.
template <typename T>
__device__ void rows_column_sums(const Acc<T> *part, T *out, int blocks, int n) {
    typedef Acc<T> F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        F s = F(0);
        // Unrolled so that 16 loads are in flight ahead of the adds, which stay in order.
#pragma unroll 16
        for (int k = 0; k < blocks; ++k) s += part[(i64)k * n + i];
        store_s(out + i, s);
    }
}
