// The tree solve of scalar complex heads with a unit diagonal, x = T_G^-1 u, in the model's
// (batch, node, head) layout, and its backward. The algorithm is described in
// src/ops/head_solve/mod.rs; the CPU twin is src/ops/head_solve/cpu.rs.
//
// Three kernels, each a 2-D block of HEAD_THREADS threads: blockDim.x consecutive heads ("lanes":
// a warp reads and writes whole 32-byte sectors, e.g. 8 neighbouring complex values of each of 4
// nodes) by blockDim.y rows (nodes of one level in turn, a barrier between levels). The host picks
// the lanes per launch (src/ops/head_solve/cuda.rs): few heads per block give small batches
// enough blocks, many heads per block suit large ones.
// - `head_pivots`: per head, the pivots of T_G (or its adjoint), which do not depend on the
//   batch: piv = [1/Â_v; B̂_v; C'_v] (3, nodes, heads);
// - `head_sweep`: per (sample, head), the upward elimination and downward substitution,
//   in place in the output (x doubles as the workspace);
// - `head_reduce`: per (node, head), the coupling and bias gradients summed over the batch in
//   order (no atomics: the sums are the same on every run).
//
// A singular or non-finite pivot sets status[0] to 1 + node (first one wins) and that one's
// status[1] to 1 + head; the host reads them when it next synchronises and turns them into an
// error.
#include "values.cuh"

#define HEAD_THREADS 256

struct HeadTree {
    const int *level_start; // levels + 1
    const int *child_start; // nodes + 1
    int levels, nodes, heads;
};

// piv = [1/Â; B̂; C'] of T_G (ADJ = 0) or T_G^H (ADJ = 1), from coef = [B; C], each
// (nodes, heads): B_v at (v, parent), C_v at (parent, v); or, with `skew`, from the skew form's
// s (heads, nodes) in the parameters' own layout: B = -s, C = conj(s). The solved matrix has
// B' = B, C' = C, or B' = conj(C), C' = conj(B) for the adjoint. Â_v = 1 + Σ_children C'_c B̂_c,
// B̂_v = -B'_v / Â_v (zero at the root, whose B and C are unused).
template <typename T, typename O>
__device__ void head_pivots(const T *coef, T *piv, const HeadTree &g, int adjoint, int skew,
                            int *status) {
    typedef typename O::V V;
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    const i64 set = (i64)g.nodes * g.heads;
    const int root = g.nodes - 1;
    for (int k = 0; k < g.levels; ++k) {
        if (h < g.heads) {
            for (int v = g.level_start[k] + threadIdx.y; v < g.level_start[k + 1];
                 v += blockDim.y) {
                V a = O::one();
                for (int c = g.child_start[v]; c < g.child_start[v + 1]; ++c) {
                    const i64 e = (i64)c * g.heads + h;
                    a = O::add(a, O::mul(O::load(piv, 2 * set + e), O::load(piv, set + e)));
                }
                if (!pivot_ok(a) && atomicCAS(status, 0, 1 + v) == 0) status[1] = 1 + h;
                const V inv = O::inv(a);
                const i64 e = (i64)v * g.heads + h;
                V bp = O::zero(), cp = O::zero();
                if (v != root) {
                    V b, c;
                    if (skew) {
                        const V s = O::load(coef, (i64)h * g.nodes + v);
                        b = O::sub(O::zero(), s);
                        c = O::conj(s);
                    } else {
                        b = O::load(coef, e);
                        c = O::load(coef, set + e);
                    }
                    bp = adjoint ? O::conj(c) : b;
                    cp = adjoint ? O::conj(b) : c;
                }
                O::store(piv, e, inv);
                O::store(piv, set + e, O::sub(O::zero(), O::mul(bp, inv)));
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

// x = M^-1 rhs for one sample (blockIdx.y) and blockDim.x heads, M = T_G or T_G^H as `piv`
// says. The right-hand side of node v: rhs[v] for v < m (rhs is (batch, m, heads)), plus
// bias[v - leaves] on the internal nodes when bias is given (laid out as `bias_at` says); zero
// for the nodes beyond m without a bias.
template <typename T, typename O>
__device__ void head_sweep(const T *rhs, const T *bias, const T *piv, T *x, const HeadTree &g,
                           int m, int leaves, int bias_by_head) {
    typedef typename O::V V;
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = h < g.heads;
    const i64 set = (i64)g.nodes * g.heads;
    const i64 x0 = (i64)blockIdx.y * set, r0 = (i64)blockIdx.y * m * g.heads;
    for (int v = threadIdx.y; live && v < g.nodes; v += blockDim.y) {
        V s = O::zero();
        if (v < m) s = O::load(rhs, r0 + (i64)v * g.heads + h);
        if (bias && v >= leaves) {
            const V b = O::load(bias, bias_at(v, h, g.nodes, leaves, g.heads, bias_by_head));
            s = v < m ? O::add(s, b) : b;
        }
        O::store(x, x0 + (i64)v * g.heads + h, s);
    }
    __syncthreads();
    // Upward: the parents of level k fold in their children (û_c = ũ_c / Â_c).
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y; live && p < g.level_start[k + 1];
             p += blockDim.y) {
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
        for (int p = g.level_start[k] + threadIdx.y; live && p < g.level_start[k + 1];
             p += blockDim.y) {
            const V xp = O::load(x, x0 + (i64)p * g.heads + h);
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const i64 e = (i64)c * g.heads + h;
                O::store(x, x0 + e, O::add(O::load(x, x0 + e), O::mul(O::load(piv, set + e), xp)));
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
