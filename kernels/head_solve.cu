// The tree solve of scalar complex heads with a unit diagonal, x = T_G^-1 u, in the model's
// (batch, node, head) layout, and its backward. The algorithm is described in
// src/ops/head_solve/mod.rs; the CPU twin is src/ops/head_solve/cpu.rs.
//
// Every kernel is a 2-D block: blockDim.x consecutive heads ("lanes": a warp reads and writes
// whole 32-byte sectors of each node) by blockDim.y rows (nodes of one level in turn, a barrier
// between levels). The host picks the layout and the lanes per launch
// (src/ops/head_solve/cuda.rs).
// - `head_staged`: per (sample, lanes), the whole solve in shared memory: the pivots formed on
//   the way up from the coefficients, the right-hand sides read once and x written once;
// - where a tree does not fit in shared memory, `head_pivots` (per head, the pivots of T_G or
//   its adjoint, which do not depend on the batch: piv = [1/Â_v; B̂_v; C'_v] (3, nodes, heads))
//   then `head_sweep` (per (sample, head), the elimination and substitution in place in the
//   output);
// - `head_reduce`: per (node, head), the coupling and bias gradients summed over the batch in
//   order (no atomics: the sums are the same on every run).
//
// A singular or non-finite pivot sets status[0] to 1 + node (first one wins) and that one's
// status[1] to 1 + head; the host reads them when it next synchronises and turns them into an
// error.
#include "values.cuh"

#define HEAD_THREADS 256
// Threads per block of `head_staged`: more rows, to keep more loads in flight per block.
#define HEAD_STAGED_THREADS 512

struct HeadTree {
    const int *level_start; // levels + 1
    const int *child_start; // nodes + 1
    int levels, nodes, heads;
};

// The couplings of non-root node v and head h in the solved matrix: B'_v at (v, parent) and
// C'_v at (parent, v), from coef = [B; C], each (nodes, heads), or with `skew` from the skew
// form's s (heads, nodes) in the parameters' own layout: B = -s, C = conj(s). The solved matrix
// is T_G (B' = B, C' = C) or, with `adjoint`, T_G^H (B' = conj(C), C' = conj(B)).
template <typename T, typename O>
__device__ __forceinline__ void couplings(const T *coef, int v, int h, const HeadTree &g,
                                          int adjoint, int skew, typename O::V &bp,
                                          typename O::V &cp) {
    typedef typename O::V V;
    V b, c;
    if (skew) {
        const V s = O::load(coef, (i64)h * g.nodes + v);
        b = O::sub(O::zero(), s);
        c = O::conj(s);
    } else {
        const i64 e = (i64)v * g.heads + h;
        b = O::load(coef, e);
        c = O::load(coef, (i64)g.nodes * g.heads + e);
    }
    bp = adjoint ? O::conj(c) : b;
    cp = adjoint ? O::conj(b) : c;
}

// Records a singular or non-finite pivot of node v, head h (see the top of the file).
__device__ __forceinline__ void report_pivot(int *status, int v, int h) {
    if (atomicCAS(status, 0, 1 + v) == 0) status[1] = 1 + h;
}

// B̂_v = -B'_v / Â_v, from B'_v and 1/Â_v.
template <typename O>
__device__ __forceinline__ typename O::V b_hat(typename O::V bp, typename O::V inv) {
    return O::sub(O::zero(), O::mul(bp, inv));
}

// piv = [1/Â; B̂; C'] of the solved matrix (see `couplings`), each (nodes, heads).
// Â_v = 1 + Σ_children C'_c B̂_c, B̂_v = -B'_v / Â_v (zero at the root, whose B and C are unused).
template <typename T, typename O>
__device__ void head_pivots(const T *coef, T *piv, const HeadTree &g, int adjoint, int skew,
                            int *status) {
    typedef typename O::V V;
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    const i64 set = (i64)g.nodes * g.heads;
    const int root = g.nodes - 1;
    for (int k = 0; k < g.levels; ++k) {
        if (h < g.heads) {
            for (int v = g.level_start[k] + threadIdx.y, v_end = g.level_start[k + 1]; v < v_end;
                 v += blockDim.y) {
                V a = O::one();
                for (int c = g.child_start[v]; c < g.child_start[v + 1]; ++c) {
                    const i64 e = (i64)c * g.heads + h;
                    a = O::add(a, O::mul(O::load(piv, 2 * set + e), O::load(piv, set + e)));
                }
                if (!pivot_ok(a)) report_pivot(status, v, h);
                const V inv = O::inv(a);
                const i64 e = (i64)v * g.heads + h;
                V bp = O::zero(), cp = O::zero();
                if (v != root) couplings<T, O>(coef, v, h, g, adjoint, skew, bp, cp);
                O::store(piv, e, inv);
                O::store(piv, set + e, b_hat<O>(bp, inv));
                O::store(piv, 2 * set + e, cp);
            }
        }
        __syncthreads();
    }
}

// Where internal node v's bias or its gradient lies: (nodes - leaves, heads), or with
// `by_head` (heads, nodes - leaves), the layout of the Myo layer's parameter.
__device__ __forceinline__ i64 bias_at(int v, int h, int nodes, int leaves, int heads,
                                       int by_head) {
    return by_head ? (i64)h * (nodes - leaves) + (v - leaves) : (i64)(v - leaves) * heads + h;
}

// The right-hand side of node v, head h of one sample: rhs[v] for v < m (the sample's
// (m, heads) values start at complex value r0 of rhs), plus bias[v - leaves] on the internal
// nodes when bias is given (laid out as `bias_at` says); zero for the nodes beyond m without a
// bias.
template <typename T, typename O>
__device__ __forceinline__ typename O::V rhs_of(const T *rhs, i64 r0, const T *bias, int v, int h,
                                                const HeadTree &g, int m, int leaves,
                                                int bias_by_head) {
    typedef typename O::V V;
    V s = O::zero();
    if (v < m) s = O::load(rhs, r0 + (i64)v * g.heads + h);
    if (bias && v >= leaves) {
        const V b = O::load(bias, bias_at(v, h, g.nodes, leaves, g.heads, bias_by_head));
        s = v < m ? O::add(s, b) : b;
    }
    return s;
}

// x = M^-1 rhs for one sample (blockIdx.y) and blockDim.x heads, M = T_G or T_G^H as `piv`
// says; the right-hand sides as `rhs_of` says (rhs is (batch, m, heads)).
template <typename T, typename O>
__device__ void head_sweep(const T *rhs, const T *bias, const T *piv, T *x, const HeadTree &g,
                           int m, int leaves, int bias_by_head) {
    typedef typename O::V V;
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = h < g.heads;
    const i64 set = (i64)g.nodes * g.heads;
    const i64 x0 = (i64)blockIdx.y * set, r0 = (i64)blockIdx.y * m * g.heads;
    for (int v = threadIdx.y; live && v < g.nodes; v += blockDim.y)
        O::store(x, x0 + (i64)v * g.heads + h,
                 rhs_of<T, O>(rhs, r0, bias, v, h, g, m, leaves, bias_by_head));
    __syncthreads();
    // Upward: the parents of level k fold in their children (û_c = ũ_c / Â_c).
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            V acc = O::load(x, x0 + (i64)p * g.heads + h);
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const i64 e = (i64)c * g.heads + h;
                const V uc = O::mul(O::load(x, x0 + e), O::load(piv, e));
                O::store(x, x0 + e, uc);
                acc = O::sub(acc, O::mul(O::load(piv, 2 * set + e), uc));
            }
            O::store(x, x0 + (i64)p * g.heads + h, acc);
        }
        __syncthreads();
    }
    // The root, alone in the top level, by row 0, which also pushes it down first (no barrier).
    const i64 root = (i64)(g.nodes - 1) * g.heads + h;
    if (live && threadIdx.y == 0)
        O::store(x, x0 + root, O::mul(O::load(x, x0 + root), O::load(piv, root)));
    // Downward: x_c = û_c + B̂_c x_p, the parents of level k pushing to their children.
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            const V xp = O::load(x, x0 + (i64)p * g.heads + h);
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const i64 e = (i64)c * g.heads + h;
                O::store(x, x0 + e, O::add(O::load(x, x0 + e), O::mul(O::load(piv, set + e), xp)));
            }
        }
        __syncthreads();
    }
}

// Where node v's values lie in `head_staged`'s shared arrays, in units of a node's lanes (one
// 32-byte sector, 8 banks): v with its low two bits XORed by the next two. Rows take
// consecutive parents, so a half-warp reads children 2 or 4 nodes apart: unswizzled, a quad
// tree's (128 bytes apart) would all fall in the same 8 banks; swizzled, never
// (docs/performance.md counts the other strides). An array of n nodes takes n rounded up to a
// multiple of 4 slots.
__device__ __forceinline__ int staged_slot(int v) { return v ^ ((v >> 2) & 3); }

// x = M^-1 rhs for one sample (blockIdx.y) and blockDim.x heads, M = T_G or T_G^H as
// `adjoint` says, entirely in shared memory: `head_pivots` and `head_sweep` in one pass, per
// node the same arithmetic in the same order. The couplings are read from coef (see
// `couplings`), the right-hand sides as `rhs_of` says (bias by head with `skew`); each is read
// once and each x written once. Shared memory: the nodes' values (nodes, lanes), then a slot
// per internal node and lane holding 1/Â_v from v's elimination and B̂_v from its parent's (a
// leaf's Â is 1, and its B̂ is formed again on the way down).
template <typename T, typename O>
__device__ void head_staged(const T *__restrict__ rhs, const T *__restrict__ bias,
                            const T *__restrict__ coef, T *__restrict__ x, const HeadTree &g,
                            int m, int leaves, int adjoint, int skew, int *status) {
    typedef typename O::V V;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lanes = blockDim.x, l = threadIdx.x;
    V *xs = reinterpret_cast<V *>(smem);
    V *pv = xs + ((g.nodes + 3) & ~3) * lanes;
    // Node v's value, and internal node v's pivot slot, of this thread's lane.
    auto X = [&](int v) -> V & { return xs[staged_slot(v) * lanes + l]; };
    auto P = [&](int v) -> V & { return pv[staged_slot(v - leaves) * lanes + l]; };
    const int h = blockIdx.x * lanes + l;
    const bool live = h < g.heads;
    const i64 x0 = (i64)blockIdx.y * g.nodes * g.heads;
    const i64 r0 = (i64)blockIdx.y * m * g.heads;
    const int root = g.nodes - 1;
    const V leaf_inv = O::inv(O::one());
#pragma unroll 4
    for (int v = threadIdx.y; live && v < g.nodes; v += blockDim.y)
        X(v) = rhs_of<T, O>(rhs, r0, bias, v, h, g, m, leaves, skew);
    __syncthreads();
    // Upward: the parents of level k eliminate their children: Â_p = 1 + Σ C'_c B̂_c and
    // ũ_p = u_p - Σ C'_c û_c, with B̂_c = -B'_c / Â_c and û_c = ũ_c / Â_c.
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            V a = O::one(), acc = X(p);
#pragma unroll 4
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                V bp, cp;
                couplings<T, O>(coef, c, h, g, adjoint, skew, bp, cp);
                const V inv = c < leaves ? leaf_inv : P(c);
                const V bh = b_hat<O>(bp, inv);
                a = O::add(a, O::mul(cp, bh));
                const V uc = O::mul(X(c), inv);
                X(c) = uc;
                acc = O::sub(acc, O::mul(cp, uc));
                if (c >= leaves) P(c) = bh;
            }
            if (!pivot_ok(a)) report_pivot(status, p, h);
            P(p) = O::inv(a);
            X(p) = acc;
        }
        __syncthreads();
    }
    // The root, alone in the top level, by row 0, which also pushes it down first (no barrier).
    if (live && threadIdx.y == 0) {
        const V inv = root < leaves ? leaf_inv : P(root);
        const V xr = O::mul(X(root), inv);
        X(root) = xr;
        O::store(x, x0 + (i64)root * g.heads + h, xr);
    }
    // Downward: x_c = û_c + B̂_c x_p, written out as soon as it is known.
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            const V xp = X(p);
#pragma unroll 4
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                V bh;
                if (c < leaves) {
                    V bp, cp;
                    couplings<T, O>(coef, c, h, g, adjoint, skew, bp, cp);
                    bh = b_hat<O>(bp, leaf_inv);
                } else {
                    bh = P(c);
                }
                const V xc = O::add(X(c), O::mul(bh, xp));
                O::store(x, x0 + (i64)c * g.heads + h, xc);
                if (c >= leaves) X(c) = xc;
            }
        }
        __syncthreads();
    }
}

// Per (node v, head): dcoef = [∂B; ∂C] with ∂B_v = -Σ_b λ_v conj(x_parent),
// ∂C_v = -Σ_b λ_parent conj(x_v) (zero at the root), or with `skew` the skew form's
// ∂s = conj(∂C) - ∂B (heads, nodes); and, when dbias is given, for internal nodes
// ∂bias = Σ_b λ_v (laid out as `bias_at` says, by head with `skew`). lam and x are
// (batch, nodes, heads).
template <typename T, typename O>
__device__ void head_reduce(const T *lam, const T *x, T *dcoef, T *dbias, const int *parent,
                            int batch, int nodes, int leaves, int heads, int skew) {
    typedef typename O::V V;
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    const int v = blockIdx.y * blockDim.y + threadIdx.y;
    if (h >= heads || v >= nodes) return;
    const i64 set = (i64)nodes * heads, e = (i64)v * heads + h;
    const int p = parent[v];
    V db = O::zero(), dc = O::zero(), dl = O::zero();
    for (int b = 0; b < batch; ++b) {
        const i64 x0 = (i64)b * set;
        const V lv = O::load(lam, x0 + e);
        if (v != p) {
            const i64 ep = x0 + (i64)p * heads + h;
            db = O::add(db, O::mul(lv, O::conj(O::load(x, ep))));
            dc = O::add(dc, O::mul(O::load(lam, ep), O::conj(O::load(x, x0 + e))));
        }
        dl = O::add(dl, lv);
    }
    const V gb = O::sub(O::zero(), db), gc = O::sub(O::zero(), dc);
    if (skew) {
        O::store(dcoef, (i64)h * nodes + v, O::sub(O::conj(gc), gb));
    } else {
        O::store(dcoef, e, gb);
        O::store(dcoef, set + e, gc);
    }
    if (dbias && v >= leaves) O::store(dbias, bias_at(v, h, nodes, leaves, heads, skew), dl);
}

#define HEAD_KERNELS(SUFFIX, T, OPS)                                                             \
    extern "C" __global__ void __launch_bounds__(HEAD_THREADS)                                   \
        head_pivots_##SUFFIX(const T *coef, T *piv, const int *level_start,                     \
                             const int *child_start, int levels, int nodes, int heads,          \
                             int adjoint, int skew, int *status) {                              \
        const HeadTree g{level_start, child_start, levels, nodes, heads};                       \
        head_pivots<T, OPS>(coef, piv, g, adjoint, skew, status);                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(HEAD_THREADS)                                   \
        head_sweep_##SUFFIX(const T *rhs, const T *bias, const T *piv, T *x,                    \
                            const int *level_start, const int *child_start, int levels,         \
                            int nodes, int heads, int m, int leaves, int bias_by_head) {        \
        const HeadTree g{level_start, child_start, levels, nodes, heads};                       \
        head_sweep<T, OPS>(rhs, bias, piv, x, g, m, leaves, bias_by_head);                      \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(HEAD_STAGED_THREADS)                            \
        head_staged_##SUFFIX(const T *rhs, const T *bias, const T *coef, T *x,                  \
                             const int *level_start, const int *child_start, int levels,        \
                             int nodes, int heads, int m, int leaves, int adjoint, int skew,    \
                             int *status) {                                                     \
        const HeadTree g{level_start, child_start, levels, nodes, heads};                       \
        head_staged<T, OPS>(rhs, bias, coef, x, g, m, leaves, adjoint, skew, status);           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(HEAD_THREADS)                                   \
        head_reduce_##SUFFIX(const T *lam, const T *x, T *dcoef, T *dbias, const int *parent,   \
                             int batch, int nodes, int leaves, int heads, int skew) {           \
        head_reduce<T, OPS>(lam, x, dcoef, dbias, parent, batch, nodes, leaves, heads, skew);   \
    }

// Complex f32 and f64 (half precision runs the solve in f32: the wrapper converts); the host
// harness in tests/kernels_on_cpu registers the same list.
#define HEAD_DTYPES(X) \
    X(f32_c, float, ComplexOps<float>) \
    X(f64_c, double, ComplexOps<double>)

HEAD_DTYPES(HEAD_KERNELS)
