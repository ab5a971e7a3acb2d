// The per-node steps the tree-solve kernels share (tree_solve.cu, tree_lanes.cu,
// tree_sweep.cu), in the order of operations of the CPU twins (src/ops/tree_solve/levels.rs,
// blocked.rs).
//
// The loops over a level's parents read their bound from the level table once (p_end): a bound
// in a loop's condition is read again after every store or atomic the compiler cannot prove
// apart from the table, and each read waits on memory. The loops over a parent's children keep
// theirs in the condition: the register more spilled complex f64 kernels on sm_70 and sm_90.
#pragma once
#include "values.cuh"

// Division of indices 0 <= n < 2^31 by a divisor 1 <= d < 2^31 fixed for a loop, by a multiply
// and a shift (Granlund & Montgomery, 1994): n / d = n m >> (31 + s) with s = ceil(log2 d) and
// m = ceil(2^(31+s) / d) < 2^32. The product's excess over n / d, n (m - 2^(31+s) / d) / 2^(31+s),
// is below n / 2^(31+s) < 2^-s <= 1 / d, too little to reach the next integer. A division by
// a value known only when run is a sequence of ~20 instructions on the GPU; the kernels' loops
// over lanes and right-hand sides divide their flattened index at every element.
struct Divisor {
    unsigned m;
    int shift; // 31 + s

    __device__ explicit Divisor(int d) {
        int s = 0;
        while ((1ll << s) < d) ++s;
        m = (unsigned)(((1ull << (31 + s)) + (u64)d - 1) / (u64)d);
        shift = 31 + s;
    }
    __device__ __forceinline__ int div(int n) const {
        return (int)(((u64)(unsigned)n * m) >> shift);
    }
};

// Copies n values load(i) -> store(i, value) with the block's threads, each issuing up to 32
// bytes of loads (8 f32 values; complex f64 one at a time) before its first store: a strided
// loop that stores each value before loading the next waits one memory round trip per
// iteration (the compiler cannot move a load above a store it may alias), which made a
// 1,365-node tree's loads cost more than its solve. More bytes in flight spilled registers in
// the f64 and complex kernels.
template <typename V, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int n, Load load, Store store) {
    constexpr int loads = sizeof(V) >= 16 ? 1 : 32 / sizeof(V);
    for (int base = threadIdx.x; base < n; base += loads * blockDim.x) {
        V x[loads];
#pragma unroll
        for (int q = 0; q < loads; ++q) {
            const int i = base + q * blockDim.x;
            if (i < n) x[q] = load(i);
        }
#pragma unroll
        for (int q = 0; q < loads; ++q) {
            const int i = base + q * blockDim.x;
            if (i < n) store(i, x[q]);
        }
    }
}

// Global -> shared copies that do not wait. On sm_80 and later a thread's copies (cp.async) all
// issue at once, without registers, and land by its async_wait(), which it calls before the
// barrier after which any thread reads them; a batched copy waits a memory round trip per 32
// bytes a thread copies (a 1,365-node tree's five arrays with 64 threads: fifteen). The host
// harness issues them the same way and lands them only at the wait, their destinations
// poisoned until then. On sm_70 they are batched copies.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define ASYNC_COPIES 1
#else
#define ASYNC_COPIES 0
#endif
// Values copied asynchronously: up to 8 bytes (complex f64 kernels spilled with the extra code).
template <typename V> constexpr bool async_copies = ASYNC_COPIES && sizeof(V) <= 8;

// dst (shared memory) = src (global memory), sizeof(V) of 4, 8 or 16 bytes, src aligned to it.
template <typename V> __device__ __forceinline__ void copy_async(V *dst, const V *src) {
#if !defined(__CUDA_ARCH__)
    cuda_host_copy_async(dst, src, sizeof(V));
#elif __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "n"(sizeof(V))
                 : "memory");
#endif
}

// Waits for this thread's copy_async copies.
__device__ __forceinline__ void async_wait() {
#if !defined(__CUDA_ARCH__)
    cuda_host_wait_async();
#elif __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Copies, for every lane l < lanes and i < len, load(l, i) to store(l, i, value) with the whole
// block of blockDim.x lanes x blockDim.y rows, each thread issuing up to 32 bytes of loads before
// its first store (as batched_copy): consecutive threads take consecutive i of one lane, so the
// loads coalesce.
template <typename V, typename Load, typename Store>
__device__ __forceinline__ void lanes_copy(int lanes, int len, Load load, Store store) {
    constexpr int loads = sizeof(V) >= 16 ? 1 : 32 / sizeof(V);
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int n = lanes * len;
    const Divisor per_lane(len);
    for (int base = tid; base < n; base += loads * threads) {
        V x[loads];
#pragma unroll
        for (int q = 0; q < loads; ++q) {
            const int e = base + q * threads, l = per_lane.div(e);
            if (e < n) x[q] = load(l, e - l * len);
        }
#pragma unroll
        for (int q = 0; q < loads; ++q) {
            const int e = base + q * threads, l = per_lane.div(e);
            if (e < n) store(l, e - l * len, x[q]);
        }
    }
}

// For every lane l < lanes and i < len, dst(l)[i] (shared memory) = load(l, i), with the whole
// block as lanes_copy. Without waiting (landing by async_wait) where the compile copies V
// asynchronously, `stored` says that src(l), where not null, holds lane l's values as stored
// (else load fills the lane), and every source is aligned to V's size (not every complex view
// is); else lanes_copy itself.
template <typename V, typename Src, typename Dst, typename Load>
__device__ __forceinline__ void stage_lanes(bool stored, int lanes, int len, Src src, Dst dst,
                                            Load load) {
    if constexpr (async_copies<V>) {
        for (int l = 0; stored && l < lanes; ++l) stored = (u64)src(l) % sizeof(V) == 0;
        if (stored) {
            // Lane by lane: each lane's source and destination found once.
            const int threads = blockDim.x * blockDim.y;
            const int tid = threadIdx.y * blockDim.x + threadIdx.x;
            for (int l = 0; l < lanes; ++l) {
                const V *s = src(l);
                V *d = dst(l);
                for (int i = tid; i < len; i += threads) {
                    if (s)
                        copy_async(d + i, s + i);
                    else
                        d[i] = load(l, i);
                }
            }
            return;
        }
    }
    lanes_copy<V>(lanes, len, load, [&](int l, int i, V x) { dst(l)[i] = x; });
}

// dst[i] = load(i) for i < n with the blockDim.x threads, as stage_lanes: without waiting where
// the compile copies V asynchronously, dst is shared memory (`to_shared`) and src holds the
// values as stored (null where they are not) at V's alignment; else batched_copy.
template <typename V, typename Load>
__device__ __forceinline__ void stage_copy(bool to_shared, int n, V *dst, const V *src,
                                           Load load) {
    if constexpr (async_copies<V>) {
        if (to_shared && src && (u64)src % sizeof(V) == 0) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) copy_async(dst + i, src + i);
            return;
        }
    }
    batched_copy<V>(n, load, [&](int i, V x) { dst[i] = x; });
}

// out[tree(l) per + off + i] = ws[l * stride + i] for i < len and each lane l < blockDim.x with
// a tree (tree(l) >= 0; those lanes come first), with the whole block.
template <typename T, typename O, typename Tree>
__device__ __forceinline__ void lanes_write(int len, const typename O::V *ws, int stride,
                                            Tree tree, i64 per, i64 off, T *out) {
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int l = 0; l < (int)blockDim.x; ++l) {
        const int t = tree(l);
        if (t < 0) break;
        const i64 base = t * per + off;
        for (int i = tid; i < len; i += threads) O::store(out, base + i, ws[l * stride + i]);
    }
}

// Solves m X = [R1 | R2] in place for a d x d `m` (destroyed) and row-major right-hand sides R1
// (d x k1) and R2 (d x k2, k2 may be 0), by LU with partial pivoting. False, with the solve
// abandoned, for a pivot that is zero or not finite. With D > 0 the size is D, known when
// compiled: every loop over m unrolls and every index into it is a constant (the row swap is a
// select per row), so that m, a local array of the caller, stays in registers; with D = 0 it is
// `d`. The same arithmetic in the same order either way.
template <typename O, int D = 0>
__device__ __forceinline__ bool lu_solve(typename O::V *m, typename O::V *r1, int k1,
                                         typename O::V *r2, int k2, int d) {
    typedef typename O::V V;
    const int n = D > 0 ? D : d;
#pragma unroll
    for (int col = 0; col < n; ++col) {
        int piv = col;
        V p = m[col * n + col];
#pragma unroll
        for (int i = col + 1; i < n; ++i)
            if (O::norm2(m[i * n + col]) > O::norm2(p)) {
                piv = i;
                p = m[i * n + col];
            }
        if (!pivot_ok(p)) return false;
        if (piv != col) {
#pragma unroll
            for (int i = col + 1; i < n; ++i)
                if (i == piv)
#pragma unroll
                    for (int j = 0; j < n; ++j) swap_values(m[col * n + j], m[i * n + j]);
            for (int j = 0; j < k1; ++j) swap_values(r1[col * k1 + j], r1[piv * k1 + j]);
            for (int j = 0; j < k2; ++j) swap_values(r2[col * k2 + j], r2[piv * k2 + j]);
        }
        const V inv = O::inv(m[col * n + col]);
#pragma unroll
        for (int i = col + 1; i < n; ++i) {
            const V f = O::mul(m[i * n + col], inv);
#pragma unroll
            for (int j = col; j < n; ++j)
                m[i * n + j] = O::sub(m[i * n + j], O::mul(f, m[col * n + j]));
            for (int j = 0; j < k1; ++j)
                r1[i * k1 + j] = O::sub(r1[i * k1 + j], O::mul(f, r1[col * k1 + j]));
            for (int j = 0; j < k2; ++j)
                r2[i * k2 + j] = O::sub(r2[i * k2 + j], O::mul(f, r2[col * k2 + j]));
        }
    }
#pragma unroll
    for (int i = n - 1; i >= 0; --i) {
        const V inv = O::inv(m[i * n + i]);
        for (int j = 0; j < k1; ++j) {
            V s = r1[i * k1 + j];
#pragma unroll
            for (int l = i + 1; l < n; ++l) s = O::sub(s, O::mul(m[i * n + l], r1[l * k1 + j]));
            r1[i * k1 + j] = O::mul(s, inv);
        }
        for (int j = 0; j < k2; ++j) {
            V s = r2[i * k2 + j];
#pragma unroll
            for (int l = i + 1; l < n; ++l) s = O::sub(s, O::mul(m[i * n + l], r2[l * k2 + j]));
            r2[i * k2 + j] = O::mul(s, inv);
        }
    }
    return true;
}

// x_c = û_c + B̂_c x_p for d x d blocks: bc (d x d), xp and xc (d x r), row-major. With D > 0
// the size is D, known when compiled (see lu_solve): bc may then be a local array in registers.
template <typename O, int D = 0>
__device__ __forceinline__ void block_push_down(const typename O::V *bc, const typename O::V *xp,
                                                typename O::V *xc, int d, int r) {
    typedef typename O::V V;
    const int n = D > 0 ? D : d;
#pragma unroll
    for (int i = 0; i < n; ++i) {
        for (int j = 0; j < r; ++j) {
            V s = xc[i * r + j];
#pragma unroll
            for (int l = 0; l < n; ++l) s = O::add(O::mul(bc[i * n + l], xp[l * r + j]), s);
            xc[i * r + j] = s;
        }
    }
}

// Runs use(i, load(i)) for i = 0, 1, ..., n - 1 in that order, B at a time: a batch's loads
// all issue before its first use. A loop that loads, uses and stores one value at a time waits
// a whole memory round trip per value: the compiler may not move a load above a store that may
// alias it.
template <int B, typename Load, typename Use>
__device__ __forceinline__ void in_batches(int n, Load load, Use use) {
    for (int i0 = 0; i0 < n; i0 += B) {
        decltype(load(0)) v[B];
#pragma unroll
        for (int q = 0; q < B; ++q)
            if (i0 + q < n) v[q] = load(i0 + q);
#pragma unroll
        for (int q = 0; q < B; ++q)
            if (i0 + q < n) use(i0 + q, v[q]);
    }
}

// Runs body(e, parent[node(e)]) for e = begin, begin + stride, ... below end, each entry's
// parent loaded before the previous entry's body: the load then overlaps that body's loads of x
// instead of preceding this entry's, which depend on it (one round trip per entry, not two).
template <typename Node, typename Body>
__device__ __forceinline__ void with_parents(const int *parent, int begin, int end, int stride,
                                             Node node, Body body) {
    int p = begin < end ? parent[node(begin)] : 0;
    for (int e = begin; e < end; e += stride) {
        const int next = e + stride, p_next = next < end ? parent[node(next)] : 0;
        body(e, p);
        p = p_next;
    }
}

// The trees of a block's blockDim.x lanes (trees ordered sample-major, batch x heads): with
// coefficients shared by the batch, samples of one head (block g * heads + h holds samples
// g * blockDim.x, ... of head h), which share its pivots; else consecutive trees. Lane l's tree
// is first + l * step for l < lanes: those that have one come first.
struct BlockLanes {
    int batch, heads, shared;
    int first, step, lanes;
    int head; // with shared coefficients: the block's head

    __device__ BlockLanes(int batch, int heads, int shared)
        : batch(batch), heads(heads), shared(shared) {
        // With shared coefficients the block is (group, head) = (blockIdx.x / heads, the rest).
        const int group = (int)blockIdx.x / heads, h = (int)blockIdx.x - group * heads;
        const int b0 = (shared ? group : (int)blockIdx.x) * (int)blockDim.x;
        const int trees = shared ? batch : batch * heads;
        first = shared ? b0 * heads + h : b0;
        step = shared ? heads : 1;
        head = shared ? h : 0;
        lanes = trees - b0 < (int)blockDim.x ? trees - b0 : (int)blockDim.x;
    }
    // The tree of lane l in this block (b * heads + h), or -1 past the last one.
    __device__ __forceinline__ int tree(int l) const { return l < lanes ? first + l * step : -1; }
    // The coefficient set of a tree of this block (its head, or the tree itself).
    __device__ __forceinline__ int coef_set(int t) const { return shared ? head : t; }
    // How many of the `per` lanes from `l0` have a tree.
    __device__ __forceinline__ int live(int l0, int per) const {
        const int left = lanes - l0;
        return left < 0 ? 0 : left < per ? left : per;
    }
};

// How many of first, first + stride, ... are below n.
__device__ __forceinline__ int strided_count(int n, int first, int stride) {
    return n > first ? (n - 1 - first) / stride + 1 : 0;
}

// How many items of type I one batch of `in_batches` takes within `bytes` of registers.
template <typename I, int bytes>
constexpr int batch_of = bytes / (int)sizeof(I) > 1 ? bytes / (int)sizeof(I) : 1;

// One right-hand side's terms of an entry's coefficient gradients, added in order:
// da += λ_v conj(x_v) and, unless v is the root, db += λ_v conj(x_parent),
// dc += λ_parent conj(x_v).
template <typename O>
__device__ __forceinline__ void add_gradient_term(typename O::V lv, typename O::V lp,
                                                  typename O::V xv, typename O::V xp, bool root,
                                                  typename O::V &da, typename O::V &db,
                                                  typename O::V &dc) {
    const typename O::V xvj = O::conj(xv);
    da = O::add(da, O::mul(lv, xvj));
    if (!root) {
        db = O::add(db, O::mul(lv, O::conj(xp)));
        dc = O::add(dc, O::mul(lp, xvj));
    }
}

// An entry's terms over the r right-hand sides (add_gradient_term for j = 0, ..., r - 1). lv and
// lp are λ's r values of the entry's row at v and at the parent; x's r values of its column
// are at xv and xp.
template <typename T, typename O>
__device__ __forceinline__ void add_gradient_terms(const typename O::V *lv,
                                                   const typename O::V *lp, const T *x, i64 xv,
                                                   i64 xp, int r, bool root, typename O::V &da,
                                                   typename O::V &db, typename O::V &dc) {
    for (int j = 0; j < r; ++j)
        add_gradient_term<O>(lv[j], lp[j], O::load(x, xv + j),
                             root ? O::zero() : O::load(x, xp + j), root, da, db, dc);
}

// An entry's coefficient gradients from its sums of terms: ∂A = -da, ∂B = -db, ∂C = -dc at
// element e of each part, the parts `set` elements apart.
template <typename T, typename O>
__device__ __forceinline__ void store_gradients(T *dcoef, i64 set, i64 e, typename O::V da,
                                                typename O::V db, typename O::V dc) {
    O::store(dcoef, e, O::sub(O::zero(), da));
    O::store(dcoef, set + e, O::sub(O::zero(), db));
    O::store(dcoef, 2 * set + e, O::sub(O::zero(), dc));
}

// x's values of an entry's column at v and at its parent, for add_gradient_term, loaded
// together.
template <typename V> struct GradientLoad {
    V xv, xp;
};
