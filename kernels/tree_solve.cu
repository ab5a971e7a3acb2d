// Myo tree solve x = T_G^-1 u and its backward: scalar blocks (d = 1, `tree_fwd`/`tree_bwd`)
// and d x d blocks (`tree_block_fwd`/`tree_block_bwd`, below). The algorithm is described in
// src/ops/tree_solve/mod.rs; the CPU twins are src/ops/tree_solve/{levels,blocked}.rs.
//
// Grid: a block per (batch, head) tree, or fewer blocks each taking several trees in turn.
// Threads work on the parents of one BFS level at a time (each parent folds in its contiguous
// children), with a barrier between levels; the downward pass walks the levels back, parents
// pushing their solution to their children.
//
// Per-node state lives in one workspace: `ab[v]` holds Â_v until the parent consumes it, then
// B̂_v; `uh[v*r + j]` holds ũ_v, then û_v, then x_v. It is in shared memory when
// nodes * (1 + r) values fit the device's opt-in limit per block (the host decides and opts
// in: 227 KiB on H100 holds a 4,096-leaf binary tree), else in a global buffer, one slice per
// block (the path for Path-X's 16,384-leaf binary tree). Global traffic is the minimum: read
// u, A, B, C once, write x once.
//
// A singular or non-finite pivot sets *status to 1 + node (first one wins); the host reads it
// when it next synchronises and turns it into an error.
#include "tree_steps.cuh"
#include "values.cuh"

// Threads per block, at most: the host launches scalar-block trees whose state fits in shared
// memory with fewer (see src/ops/tree_solve/cuda.rs), so that more trees share an SM; every
// loop strides by blockDim.x.
#define TREE_THREADS 256
// Resident blocks per SM the kernels are compiled for: 3 for the scalar ones (at most 80
// registers), 2 for the d x d ones (at most 128). With no minimum, or a higher one, ptxas
// spilled in some of them on sm_70 or sm_90 (the loop over a block's trees added to what stays
// live).
#define TREE_MIN_BLOCKS 3
#define TREE_BLOCK_MIN_BLOCKS 2

struct TreeGeometry {
    const int *level_start; // levels + 1
    const int *child_start; // nodes + 1
    const int *parent;      // nodes (the root is its own parent)
    int levels, nodes, r;
};

// Coefficients of one tree, read as T_G or (ADJ) as its adjoint: A' = conj(A), the (v, parent)
// entry B' = conj(C), the (parent, v) entry C' = conj(B). Offsets are in elements (a complex
// element is two scalars), so they work for real and complex alike.
template <typename T, typename O, bool ADJ> struct TreeCoefs {
    const T *coef;
    i64 a, b, c; // element offsets of this tree's A, B and C
    __device__ __forceinline__ typename O::V diag(int v) const {
        const typename O::V x = O::load(coef, a + v);
        return ADJ ? O::conj(x) : x;
    }
    __device__ __forceinline__ typename O::V up(int v) const {
        return ADJ ? O::conj(O::load(coef, c + v)) : O::load(coef, b + v);
    }
    __device__ __forceinline__ typename O::V down(int v) const {
        return ADJ ? O::conj(O::load(coef, b + v)) : O::load(coef, c + v);
    }
    __device__ __forceinline__ void stage(int) const {}
    // A', B' and C' as stored from node 0 on, for copies, where they are the values themselves
    // (f32 or f64 storage; an adjoint conjugates complex ones), else null.
    static constexpr bool as_stored = AsStored<T, O>::value && !(ADJ && O::complex);
    __device__ __forceinline__ const typename O::V *at(i64 e) const {
        return as_stored ? as_values<O>(coef, e) : nullptr;
    }
    __device__ __forceinline__ const typename O::V *diag_at() const { return at(a); }
    __device__ __forceinline__ const typename O::V *up_at() const { return at(ADJ ? c : b); }
    __device__ __forceinline__ const typename O::V *down_at() const { return at(ADJ ? b : c); }
};

// The same coefficients with B' and C' staged in shared memory by `stage` (called before the
// first barrier), so that the levels' loops read no global memory: each
// level's loads would otherwise wait on global latency, one level after another.
template <typename T, typename O, bool ADJ> struct StagedCoefs {
    TreeCoefs<T, O, ADJ> src;
    typename O::V *up_s, *down_s; // nodes each
    __device__ __forceinline__ typename O::V diag(int v) const { return src.diag(v); }
    __device__ __forceinline__ const typename O::V *diag_at() const { return src.diag_at(); }
    __device__ __forceinline__ void stage(int nodes) const {
        stage_copy(true, nodes, up_s, src.up_at(), [&](int v) { return src.up(v); });
        stage_copy(true, nodes, down_s, src.down_at(), [&](int v) { return src.down(v); });
    }
    __device__ __forceinline__ typename O::V up(int v) const { return up_s[v]; }
    __device__ __forceinline__ typename O::V down(int v) const { return down_s[v]; }
};

template <typename T, typename O, bool ADJ>
__device__ __forceinline__ TreeCoefs<T, O, ADJ> tree_coefs(const T *coef, int nodes, int tree,
                                                             int trees, int heads,
                                                             int shared_coef) {
    const i64 set = (i64)(shared_coef ? heads : trees) * nodes;
    const i64 off = (i64)(shared_coef ? tree % heads : tree) * nodes;
    return TreeCoefs<T, O, ADJ>{coef, off, set + off, 2 * set + off};
}

// The solve of one tree into the workspace (ab, uh; in shared memory when `in_shared`); on
// return uh holds x (or λ). `rhs0` is the element offset of this tree's right-hand sides.
template <typename T, typename O, typename CF>
__device__ void tree_solve_block(const TreeGeometry &g, const CF &cf, const T *__restrict__ rhs,
                                 i64 rhs0, typename O::V *ab, typename O::V *uh, bool in_shared,
                                 int *status) {
    typedef typename O::V V;
    const int tid = threadIdx.x, r = g.r;
    stage_copy(in_shared, g.nodes, ab, cf.diag_at(), [&](int i) { return cf.diag(i); });
    stage_copy(in_shared, g.nodes * r, uh, as_values<O>(rhs, rhs0),
            [&](int i) { return O::load(rhs, rhs0 + i); });
    cf.stage(g.nodes);
    async_wait();
    __syncthreads();
    // Upward: the parents of level k fold in their children (levels below are final).
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + tid, p_end = g.level_start[k + 1]; p < p_end;
             p += blockDim.x) {
            V ap = ab[p];
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const V ac = ab[c];
                if (!pivot_ok(ac)) atomicCAS(status, 0, 1 + c);
                const V inv = O::inv(ac);
                const V bh = O::mul(O::sub(O::zero(), cf.up(c)), inv);
                const V cc = cf.down(c);
                ab[c] = bh;
                ap = O::add(ap, O::mul(cc, bh));
                for (int j = 0; j < r; ++j) {
                    const V uc = O::mul(uh[c * r + j], inv);
                    uh[c * r + j] = uc;
                    uh[p * r + j] = O::sub(uh[p * r + j], O::mul(cc, uc));
                }
            }
            ab[p] = ap;
        }
        __syncthreads();
    }
    const int root = g.nodes - 1;
    if (tid == 0) {
        const V ar = ab[root];
        if (!pivot_ok(ar)) atomicCAS(status, 0, 1 + root);
        const V inv = O::inv(ar);
        for (int j = 0; j < r; ++j) uh[root * r + j] = O::mul(uh[root * r + j], inv);
    }
    __syncthreads();
    // Downward: x_c = û_c + B̂_c x_p, the parents of level k pushing to their children.
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + tid, p_end = g.level_start[k + 1]; p < p_end;
             p += blockDim.x) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                for (int j = 0; j < r; ++j)
                    uh[c * r + j] = O::add(uh[c * r + j], O::mul(ab[c], uh[p * r + j]));
            }
        }
        __syncthreads();
    }
}

// Solves one tree with the workspace at ab (nodes values), uh (nodes * r) and, when `staged`
// (the host found room in shared memory: in_shared too), B' and C' (nodes each) and
// child_start (nodes + 1) after them; on return uh holds x (or λ).
template <typename T, typename O, bool ADJ>
__device__ __forceinline__ void tree_solve_one(const TreeGeometry &g,
                                               const TreeCoefs<T, O, ADJ> &cf, int staged,
                                               bool in_shared, const T *rhs, i64 rhs0,
                                               typename O::V *ab, int *status) {
    typedef typename O::V V;
    V *uh = ab + g.nodes;
    if (!staged) {
        tree_solve_block<T, O>(g, cf, rhs, rhs0, ab, uh, in_shared, status);
        return;
    }
    V *up = uh + g.nodes * g.r, *down = up + g.nodes;
    int *child_start = reinterpret_cast<int *>(down + g.nodes);
    stage_copy(true, g.nodes + 1, child_start, g.child_start,
            [&](int i) { return g.child_start[i]; });
    const TreeGeometry gs{g.level_start, child_start, g.parent, g.levels, g.nodes, g.r};
    const StagedCoefs<T, O, ADJ> sc{cf, up, down};
    tree_solve_block<T, O>(gs, sc, rhs, rhs0, ab, uh, true, status);
}

template <typename T, typename O>
__device__ __forceinline__ void tree_fwd(const T *u, const T *coef, T *x, const TreeGeometry &g,
                                         int tree, int trees, int heads, int shared_coef,
                                         int staged, bool in_shared, typename O::V *ab,
                                         int *status) {
    typedef typename O::V V;
    const auto cf = tree_coefs<T, O, false>(coef, g.nodes, tree, trees, heads, shared_coef);
    const i64 x0 = (i64)tree * g.nodes * g.r;
    const V *uh = ab + g.nodes;
    tree_solve_one<T, O, false>(g, cf, staged, in_shared, u, x0, ab, status);
    for (int i = threadIdx.x; i < g.nodes * g.r; i += blockDim.x) O::store(x, x0 + i, uh[i]);
}

// Backward: λ = T_G^-H ∂x by the adjoint solve, then ∂u = λ and the block gradients
// ∂A_v = -Σ_r λ_v conj(x_v), ∂B_v = -Σ_r λ_v conj(x_parent), ∂C_v = -Σ_r λ_parent conj(x_v)
// (zero for the root), per tree: dcoef is (3, trees, nodes); the host sums over the batch for
// shared coefficients.
template <typename T, typename O>
__device__ __forceinline__ void tree_bwd(const T *gx, const T *coef, const T *x, T *du, T *dcoef,
                                         const TreeGeometry &g, int tree, int trees, int heads,
                                         int shared_coef, int staged, bool in_shared,
                                         typename O::V *ab, int *status) {
    typedef typename O::V V;
    const auto cf = tree_coefs<T, O, true>(coef, g.nodes, tree, trees, heads, shared_coef);
    const i64 x0 = (i64)tree * g.nodes * g.r;
    const int r = g.r, root = g.nodes - 1;
    const i64 set = (i64)trees * g.nodes, d0 = (i64)tree * g.nodes;
    const V *lam = ab + g.nodes;
    tree_solve_one<T, O, true>(g, cf, staged, in_shared, gx, x0, ab, status);
    for (int i = threadIdx.x; i < g.nodes * r; i += blockDim.x) O::store(du, x0 + i, lam[i]);
    with_parents(
        g.parent, threadIdx.x, g.nodes, blockDim.x, [](int v) { return v; },
        [&](int v, int p) {
            V da = O::zero(), db = O::zero(), dc = O::zero();
            add_gradient_terms<T, O>(lam + v * r, lam + p * r, x, x0 + v * r, x0 + p * r, r,
                                     v == root, da, db, dc);
            store_gradients<T, O>(dcoef, set, d0 + v, da, db, dc);
        });
}

// ---- d x d blocks ---------------------------------------------------------------------------
// The same grid (a block per tree) and passes, a thread per parent; each Schur step is the CPU
// twin's LU solve with partial pivoting (src/ops/tree_solve/blocked.rs), with its operations in
// the same order. Per tree the workspace holds ab (n d x d blocks: Â_v, then B̂_v), uh (n d x r:
// ũ_v, then û_v, then x_v) and `slots` d x d LU scratch blocks, one per thread that can own a
// parent at once (the host's min(threads, widest level)). Row-major blocks throughout.

// Node v's blocks of one tree read as T_G or (ADJ) its adjoint: A'_v = A_v^H, the (v, parent)
// block C_v^H and the (parent, v) block B_v^H.
template <typename T, typename O, bool ADJ> struct BlockCoefs {
    const T *coef;
    i64 a, b, c; // element offsets of this tree's A, B and C
    int d;
    __device__ __forceinline__ typename O::V get(i64 set, int v, int i, int j) const {
        const i64 e = set + (i64)v * d * d;
        return ADJ ? O::conj(O::load(coef, e + j * d + i)) : O::load(coef, e + i * d + j);
    }
    __device__ __forceinline__ typename O::V diag(int v, int i, int j) const {
        return get(a, v, i, j);
    }
    __device__ __forceinline__ typename O::V up(int v, int i, int j) const {
        return get(ADJ ? c : b, v, i, j);
    }
    __device__ __forceinline__ typename O::V down(int v, int i, int j) const {
        return get(ADJ ? b : c, v, i, j);
    }
};

template <typename T, typename O, bool ADJ>
__device__ __forceinline__ BlockCoefs<T, O, ADJ> block_coefs(const T *coef, int nodes, int d,
                                                               int tree, int trees, int heads,
                                                               int shared_coef) {
    const i64 per_tree = (i64)nodes * d * d;
    const i64 set = (i64)(shared_coef ? heads : trees) * per_tree;
    const i64 off = (i64)(shared_coef ? tree % heads : tree) * per_tree;
    return BlockCoefs<T, O, ADJ>{coef, off, set + off, 2 * set + off, d};
}

// The block solve of one tree into the workspace; on return uh holds x (or λ).
template <typename T, typename O, bool ADJ>
__device__ void tree_block_solve(const TreeGeometry &g, int d, const BlockCoefs<T, O, ADJ> &cf,
                                 const T *__restrict__ rhs, i64 rhs0, typename O::V *ab,
                                 typename O::V *uh, typename O::V *lu, int *status) {
    typedef typename O::V V;
    const int tid = threadIdx.x, r = g.r, dd = d * d, dr = d * r;
    for (int e = tid; e < g.nodes * dd; e += blockDim.x)
        ab[e] = cf.diag(e / dd, e % dd / d, e % d);
    for (int e = tid; e < g.nodes * dr; e += blockDim.x) uh[e] = O::load(rhs, rhs0 + e);
    __syncthreads();
    V *m = lu + tid * dd; // this thread's scratch (only threads that own a parent use it)
    // Upward: each child c of the parents of level k solves Â_c [B̂_c | û_c] = [-B_c | ũ_c],
    // with B̂_c taking Â_c's place once m holds Â_c, then sends Â_p += C_c B̂_c, ũ_p -= C_c û_c.
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + tid, p_end = g.level_start[k + 1]; p < p_end;
             p += blockDim.x) {
            V *ap = ab + (i64)p * dd, *up = uh + (i64)p * dr;
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                V *bc = ab + (i64)c * dd, *uc = uh + (i64)c * dr;
                for (int e = 0; e < dd; ++e) {
                    m[e] = bc[e];
                    bc[e] = O::sub(O::zero(), cf.up(c, e / d, e % d));
                }
                if (!lu_solve<O>(m, bc, d, uc, r, d)) atomicCAS(status, 0, 1 + c);
                for (int i = 0; i < d; ++i) {
                    for (int l = 0; l < d; ++l) {
                        const V cil = cf.down(c, i, l);
                        for (int j = 0; j < d; ++j)
                            ap[i * d + j] = O::add(O::mul(cil, bc[l * d + j]), ap[i * d + j]);
                        for (int j = 0; j < r; ++j)
                            up[i * r + j] = O::sub(up[i * r + j], O::mul(cil, uc[l * r + j]));
                    }
                }
            }
        }
        __syncthreads();
    }
    const int root = g.nodes - 1;
    if (tid == 0) {
        for (int e = 0; e < dd; ++e) m[e] = ab[(i64)root * dd + e];
        if (!lu_solve<O>(m, uh + (i64)root * dr, r, nullptr, 0, d))
            atomicCAS(status, 0, 1 + root);
    }
    __syncthreads();
    // Downward: x_c = û_c + B̂_c x_p.
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + tid, p_end = g.level_start[k + 1]; p < p_end;
             p += blockDim.x) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c)
                block_push_down<O>(ab + (i64)c * dd, uh + (i64)p * dr, uh + (i64)c * dr, d, r);
        }
        __syncthreads();
    }
}

// Values of the per-tree block workspace: ab, uh, then the LU scratch.
__device__ __forceinline__ i64 block_workspace_len(int nodes, int d, int r, int slots) {
    return (i64)nodes * d * (d + r) + (i64)slots * d * d;
}

template <typename T, typename O>
__device__ __forceinline__ void tree_block_fwd(const T *u, const T *coef, T *x,
                                               const TreeGeometry &g, int d, int tree, int trees,
                                               int heads, int shared_coef, int slots,
                                               typename O::V *ab, int *status) {
    typedef typename O::V V;
    const auto cf = block_coefs<T, O, false>(coef, g.nodes, d, tree, trees, heads, shared_coef);
    const i64 len = (i64)g.nodes * d * g.r, x0 = (i64)tree * len;
    V *uh = ab + (i64)g.nodes * d * d, *lu = uh + (i64)g.nodes * d * g.r;
    tree_block_solve<T, O, false>(g, d, cf, u, x0, ab, uh, lu, status);
    for (i64 e = threadIdx.x; e < len; e += blockDim.x) O::store(x, x0 + e, uh[e]);
}

// Backward: λ = T_G^-H ∂x, ∂u = λ, and per tree the blocks ∂A_v = -Σ_r λ_v x_v^H,
// ∂B_v = -Σ_r λ_v x_parent^H, ∂C_v = -Σ_r λ_parent x_v^H (zero for the root), written as
// (3, trees, nodes, d, d).
template <typename T, typename O>
__device__ __forceinline__ void tree_block_bwd(const T *gx, const T *coef, const T *x, T *du,
                                               T *dcoef, const TreeGeometry &g, int d, int tree,
                                               int trees, int heads, int shared_coef, int slots,
                                               typename O::V *ab, int *status) {
    typedef typename O::V V;
    const auto cf = block_coefs<T, O, true>(coef, g.nodes, d, tree, trees, heads, shared_coef);
    const int r = g.r, dd = d * d, root = g.nodes - 1;
    const i64 len = (i64)g.nodes * d * r, x0 = (i64)tree * len;
    V *lam = ab + (i64)g.nodes * d * d, *lu = lam + (i64)g.nodes * d * g.r;
    tree_block_solve<T, O, true>(g, d, cf, gx, x0, ab, lam, lu, status);
    for (i64 e = threadIdx.x; e < len; e += blockDim.x) O::store(du, x0 + e, lam[e]);
    const i64 per_tree = (i64)g.nodes * dd, set = (i64)trees * per_tree;
    const i64 d0 = (i64)tree * per_tree;
    // This thread's entries e = tid, tid + blockDim.x, ... (row i, column j of node v's
    // block), each over its r right-hand sides k.
    const int tid = threadIdx.x, mine = strided_count((int)per_tree, tid, blockDim.x);
    auto entry = [&](int q) { return tid + q / r * (int)blockDim.x; };
    V da, db, dc;
    in_batches<batch_of<GradientLoad<V>, 24>>(
        mine * r,
        [&](int q) {
            const int e = entry(q), v = e / dd, j = e % d, k = q % r, p = g.parent[v];
            return GradientLoad<V>{O::load(x, x0 + ((i64)v * d + j) * r + k),
                                   O::load(x, x0 + ((i64)p * d + j) * r + k)};
        },
        [&](int q, const GradientLoad<V> &in) {
            const int e = entry(q), v = e / dd, i = e % dd / d, k = q % r, p = g.parent[v];
            if (k == 0) da = db = dc = O::zero();
            add_gradient_term<O>(lam[((i64)v * d + i) * r + k],
                                 lam[((i64)p * d + i) * r + k], in.xv, in.xp, v == root, da,
                                 db, dc);
            if (k < r - 1) return;
            store_gradients<T, O>(dcoef, set, d0 + e, da, db, dc);
        });
}

// Each block solves trees blockIdx.x, blockIdx.x + gridDim.x, ... of the `trees` (batch x heads)
// in turn, reusing its workspace: the host sizes the grid so that the global workspace stays
// within its budget (Path-X's trees take 0.26-0.52 MB each). solve(t, ws, in_shared) with ws the
// block's slice of `global_ws`, or with a null `global_ws` dynamic shared memory. Two loops, so
// that in the second the compiler knows that ws is shared memory: through a pointer that may be
// either, every access is a generic load or store, slower than a shared one and ordered with
// the global loads it might alias (and one loop for both spilled complex f64 on sm_90).
template <typename V, typename Solve>
__device__ __forceinline__ void for_block_trees(int trees, V *global_ws, i64 per_tree,
                                                Solve solve) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (global_ws) {
        V *ws = global_ws + (i64)blockIdx.x * per_tree;
        for (int t = blockIdx.x; t < trees; t += gridDim.x) {
            solve(t, ws, false);
            __syncthreads();
        }
    } else {
        V *ws = reinterpret_cast<V *>(smem);
        for (int t = blockIdx.x; t < trees; t += gridDim.x) {
            solve(t, ws, true);
            __syncthreads();
        }
    }
}

#define TREE_KERNELS(SUFFIX, T, OPS)                                                            \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS, TREE_MIN_BLOCKS)                 \
        tree_fwd_##SUFFIX(const T *u, const T *coef, T *x, const int *level_start,              \
                          const int *child_start, const int *parent, int levels, int nodes,     \
                          int r, int heads, int trees, int shared_coef, int staged,             \
                          OPS::V *global_ws, int *status) {                                     \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        const i64 per_tree = (i64)nodes * (1 + r);                                              \
        for_block_trees<OPS::V>(trees, global_ws, per_tree, [&](int t, OPS::V *ws, bool sh) {   \
            tree_fwd<T, OPS>(u, coef, x, g, t, trees, heads, shared_coef, sh && staged, sh, ws, \
                             status);                                                           \
        });                                                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS, TREE_MIN_BLOCKS)                 \
        tree_bwd_##SUFFIX(const T *gx, const T *coef, const T *x, T *du, T *dcoef,              \
                          const int *level_start, const int *child_start, const int *parent,    \
                          int levels, int nodes, int r, int heads, int trees, int shared_coef,  \
                          int staged, OPS::V *global_ws, int *status) {                         \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        const i64 per_tree = (i64)nodes * (1 + r);                                              \
        for_block_trees<OPS::V>(trees, global_ws, per_tree, [&](int t, OPS::V *ws, bool sh) {   \
            tree_bwd<T, OPS>(gx, coef, x, du, dcoef, g, t, trees, heads, shared_coef,           \
                             sh && staged, sh, ws, status);                                     \
        });                                                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS, TREE_BLOCK_MIN_BLOCKS)           \
        tree_block_fwd_##SUFFIX(const T *u, const T *coef, T *x, const int *level_start,        \
                                const int *child_start, const int *parent, int levels,          \
                                int nodes, int d, int r, int heads, int trees, int shared_coef, \
                                int slots, OPS::V *global_ws, int *status) {                    \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        const i64 per_tree = block_workspace_len(nodes, d, r, slots);                           \
        for_block_trees<OPS::V>(trees, global_ws, per_tree, [&](int t, OPS::V *ws, bool) {      \
            tree_block_fwd<T, OPS>(u, coef, x, g, d, t, trees, heads, shared_coef, slots, ws,   \
                                   status);                                                     \
        });                                                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS, TREE_BLOCK_MIN_BLOCKS)           \
        tree_block_bwd_##SUFFIX(const T *gx, const T *coef, const T *x, T *du, T *dcoef,        \
                                const int *level_start, const int *child_start,                 \
                                const int *parent, int levels, int nodes, int d, int r,         \
                                int heads, int trees, int shared_coef, int slots,               \
                                OPS::V *global_ws, int *status) {                               \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        const i64 per_tree = block_workspace_len(nodes, d, r, slots);                           \
        for_block_trees<OPS::V>(trees, global_ws, per_tree, [&](int t, OPS::V *ws, bool) {      \
            tree_block_bwd<T, OPS>(gx, coef, x, du, dcoef, g, d, t, trees, heads, shared_coef,  \
                                   slots, ws, status);                                          \
        });                                                                                     \
    }

// The instantiations: kernel-name suffix, storage type, arithmetic (the host harness in
// tests/kernels_on_cpu registers the same list).
#define TREE_DTYPES(X) \
    X(f32, float, RealOps<float>) \
    X(f32_c, float, ComplexOps<float>) \
    X(f64, double, RealOps<double>) \
    X(f64_c, double, ComplexOps<double>) \
    X(f16, __half, RealOps<float>) \
    X(f16_c, __half, ComplexOps<float>) \
    X(bf16, __nv_bfloat16, RealOps<float>) \
    X(bf16_c, __nv_bfloat16, ComplexOps<float>)

TREE_DTYPES(TREE_KERNELS)
