// Myo tree solve x = T_G^-1 u for scalar blocks (d = 1), and its backward. The algorithm and
// its CPU twin are described in src/ops/tree_solve.rs.
//
// Grid: one block per (batch, head) tree. Threads work on the parents of one BFS level at a
// time (each parent folds in its contiguous children), with a barrier between levels; the
// downward pass walks the levels back, parents pushing their solution to their children.
//
// Per-node state lives in one workspace: `ab[v]` holds Â_v until the parent consumes it, then
// B̂_v; `uh[v*r + j]` holds ũ_v, then û_v, then x_v. It is in shared memory when
// nodes * (1 + r) values fit the device's opt-in limit per block (the host decides and opts
// in: 227 KiB on H100 holds a 4,096-leaf binary tree), else in a global buffer, one slice per
// tree (the path for Path-X's 16,384-leaf binary tree). Global traffic is the minimum: read u,
// A, B, C once, write x once.
//
// A singular or non-finite pivot sets *status to 1 + node (first one wins); the host turns it
// into an error.
#include "values.cuh"

#define TREE_THREADS 256

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
};

template <typename T, typename O, bool ADJ>
__device__ __forceinline__ TreeCoefs<T, O, ADJ> tree_coefs(const T *coef, int nodes, int heads,
                                                             int trees, int shared_coef) {
    const int tree = blockIdx.x;
    const i64 set = (i64)(shared_coef ? heads : trees) * nodes;
    const i64 off = (i64)(shared_coef ? tree % heads : tree) * nodes;
    return TreeCoefs<T, O, ADJ>{coef, off, set + off, 2 * set + off};
}

// The solve of one tree into the workspace (ab, uh); on return uh holds x (or λ). `rhs0` is
// the element offset of this tree's right-hand sides.
template <typename T, typename O, bool ADJ>
__device__ void tree_solve_block(const TreeGeometry &g, const TreeCoefs<T, O, ADJ> &cf,
                                 const T *__restrict__ rhs, i64 rhs0, typename O::V *ab,
                                 typename O::V *uh, int *status) {
    typedef typename O::V V;
    const int tid = threadIdx.x, r = g.r;
    for (int i = tid; i < g.nodes; i += blockDim.x) ab[i] = cf.diag(i);
    for (int i = tid; i < g.nodes * r; i += blockDim.x) uh[i] = O::load(rhs, rhs0 + i);
    __syncthreads();
    // Upward: the parents of level k fold in their children (levels below are final).
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + tid; p < g.level_start[k + 1]; p += blockDim.x) {
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
        for (int p = g.level_start[k] + tid; p < g.level_start[k + 1]; p += blockDim.x) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                for (int j = 0; j < r; ++j)
                    uh[c * r + j] = O::add(uh[c * r + j], O::mul(ab[c], uh[p * r + j]));
            }
        }
        __syncthreads();
    }
}

// This block's workspace: dynamic shared memory, or its tree's slice of `global_ws`.
template <typename V> __device__ __forceinline__ V *tree_workspace(V *global_ws, int per_tree) {
    extern __shared__ __align__(16) unsigned char smem[];
    return global_ws ? global_ws + (i64)blockIdx.x * per_tree : reinterpret_cast<V *>(smem);
}

template <typename T, typename O>
__device__ void tree_fwd(const T *u, const T *coef, T *x, const TreeGeometry &g, int heads,
                         int shared_coef, typename O::V *global_ws, int *status) {
    typedef typename O::V V;
    V *ab = tree_workspace<V>(global_ws, g.nodes * (1 + g.r));
    V *uh = ab + g.nodes;
    const auto cf = tree_coefs<T, O, false>(coef, g.nodes, heads, gridDim.x, shared_coef);
    const i64 x0 = (i64)blockIdx.x * g.nodes * g.r;
    tree_solve_block<T, O, false>(g, cf, u, x0, ab, uh, status);
    for (int i = threadIdx.x; i < g.nodes * g.r; i += blockDim.x) O::store(x, x0 + i, uh[i]);
}

// Backward: λ = T_G^-H ∂x by the adjoint solve, then ∂u = λ and the block gradients
// ∂A_v = -Σ_r λ_v conj(x_v), ∂B_v = -Σ_r λ_v conj(x_parent), ∂C_v = -Σ_r λ_parent conj(x_v)
// (zero for the root), per tree: dcoef is (3, trees, nodes); the host sums over the batch for
// shared coefficients.
template <typename T, typename O>
__device__ void tree_bwd(const T *gx, const T *coef, const T *x, T *du, T *dcoef,
                         const TreeGeometry &g, int heads, int shared_coef,
                         typename O::V *global_ws, int *status) {
    typedef typename O::V V;
    V *ab = tree_workspace<V>(global_ws, g.nodes * (1 + g.r));
    V *lam = ab + g.nodes;
    const auto cf = tree_coefs<T, O, true>(coef, g.nodes, heads, gridDim.x, shared_coef);
    const i64 x0 = (i64)blockIdx.x * g.nodes * g.r;
    tree_solve_block<T, O, true>(g, cf, gx, x0, ab, lam, status);
    const int r = g.r, root = g.nodes - 1;
    const i64 set = (i64)gridDim.x * g.nodes, d0 = (i64)blockIdx.x * g.nodes;
    for (int i = threadIdx.x; i < g.nodes * r; i += blockDim.x) O::store(du, x0 + i, lam[i]);
    for (int v = threadIdx.x; v < g.nodes; v += blockDim.x) {
        const int p = g.parent[v];
        V da = O::zero(), db = O::zero(), dc = O::zero();
        for (int j = 0; j < r; ++j) {
            const V xv = O::conj(O::load(x, x0 + v * r + j));
            da = O::add(da, O::mul(lam[v * r + j], xv));
            if (v != root) {
                db = O::add(db, O::mul(lam[v * r + j], O::conj(O::load(x, x0 + p * r + j))));
                dc = O::add(dc, O::mul(lam[p * r + j], xv));
            }
        }
        O::store(dcoef, d0 + v, O::sub(O::zero(), da));
        O::store(dcoef, set + d0 + v, O::sub(O::zero(), db));
        O::store(dcoef, 2 * set + d0 + v, O::sub(O::zero(), dc));
    }
}

#define TREE_KERNELS(SUFFIX, T, OPS)                                                            \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS) tree_fwd_##SUFFIX(                \
        const T *u, const T *coef, T *x, const int *level_start, const int *child_start,        \
        const int *parent, int levels, int nodes, int r, int heads, int shared_coef,            \
        OPS::V *global_ws, int *status) {                                                       \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        tree_fwd<T, OPS>(u, coef, x, g, heads, shared_coef, global_ws, status);                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TREE_THREADS) tree_bwd_##SUFFIX(                \
        const T *gx, const T *coef, const T *x, T *du, T *dcoef, const int *level_start,        \
        const int *child_start, const int *parent, int levels, int nodes, int r, int heads,     \
        int shared_coef, OPS::V *global_ws, int *status) {                                      \
        const TreeGeometry g{level_start, child_start, parent, levels, nodes, r};               \
        tree_bwd<T, OPS>(gx, coef, x, du, dcoef, g, heads, shared_coef, global_ws, status);     \
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
