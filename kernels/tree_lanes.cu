// The Myo tree solve x = T_G^-1 u with trees across lanes, for scalar blocks (d = 1:
// `tree_lanes_fwd`/`tree_lanes_bwd`) and d x d blocks up to LANE_MAX_D (`tree_lanes_block_*`,
// below): the layout src/ops/tree_solve/cuda.rs picks for trees whose state fits in shared
// memory at least twice over. The algorithm is that of tree_solve.cu and of the CPU twins
// src/ops/tree_solve/{levels,blocked}.rs, with the same operations per node in the same order.
//
// A block holds blockDim.x trees ("lanes") and blockDim.y rows: thread (lane, row) works on the
// parents of one level, row by row, for its lane's tree, a barrier between levels. With shared
// coefficients the lanes are samples of one head (block g * heads + h holds samples g * lanes,
// ...), which share that head's pivots: the elimination of a child (Â_c^-1, B̂_c) is computed
// once per block instead of once per sample, and its coefficients are read once. With
// per-sample coefficients the lanes are consecutive trees, each with its own pivots.
//
// Shared memory, lane-major, each lane's array at an odd stride (lanes of a warp then fall in
// different banks): per pivot lane (one, or one per lane) A' (Â accumulates in place), B'
// (then B̂: only the lane that keeps the pivots reads B') and C' (n values each), and per lane
// its right-hand sides (n * r: ũ, then û, then x or λ).
// Global traffic is the minimum: u and each coefficient set read once, x written once; the
// backward sums the gradients of shared coefficients over the block's lanes, so it writes one
// gradient row per block, not per sample.
//
// A singular or non-finite pivot sets *status to 1 + node (first one wins).
#include "tree_steps.cuh"
#include "values.cuh"

// Threads per block (lanes * rows), and resident blocks per SM the kernels are compiled for.
#define LANE_THREADS 256
#define LANE_MIN_BLOCKS 2

// The odd stride of a lane's array of n values.
__device__ __forceinline__ int lane_stride(int n) { return n | 1; }

struct LaneTrees : BlockLanes {
    const int *level_start; // levels + 1
    const int *child_start; // nodes + 1
    const int *parent;      // nodes (the root is its own parent)
    int levels, nodes, r;

    __device__ LaneTrees(const int *level_start, const int *child_start, const int *parent,
                         int levels, int nodes, int r, int batch, int heads, int shared)
        : BlockLanes(batch, heads, shared), level_start(level_start), child_start(child_start),
          parent(parent), levels(levels), nodes(nodes), r(r) {}
    // The same trees, each of n nodes (d x d blocks as rows of scalars).
    __device__ __forceinline__ LaneTrees with_nodes(int n) const {
        LaneTrees g = *this;
        g.nodes = n;
        return g;
    }
    // Pivot lanes: one when the lanes share coefficients.
    __device__ __forceinline__ int pivot_lanes() const { return shared ? 1 : blockDim.x; }
};

// Loads the block's state into the workspace ws for d x d blocks (d = 1: scalars), then waits
// for the block: per pivot lane A', B' and C' (n d x d blocks each, at an odd stride; the
// adjoint reads A' = A^H, B' = C^H, C' = B^H; O::one() for a lane without a tree), then per
// lane its n d x r right-hand sides.
template <typename T, typename O, bool ADJ>
__device__ __forceinline__ void lanes_load(const LaneTrees &g, int d, const T *coef,
                                           const T *rhs, typename O::V *ws) {
    typedef typename O::V V;
    const int n = g.nodes, dd = d * d, dr = d * g.r, pl = g.pivot_lanes();
    const int nd = n * dd, sn = lane_stride(nd), su = lane_stride(n * dr);
    const i64 set = (i64)(g.shared ? g.heads : g.batch * g.heads) * nd;
    // Part `which` of A', B', C' is the stored A, B or C (the adjoint swaps B and C).
    auto part = [](int which) {
        return which == 0 ? 0 : which == 1 ? (ADJ ? 2 : 1) : (ADJ ? 1 : 2);
    };
    // The values as stored, where neither a conversion, a conjugate nor (d > 1) the adjoint's
    // transpose comes between, are copied without waiting (stage_lanes); a part at a time,
    // one copy per pivot lane.
    constexpr bool rhs_stored = AsStored<T, O>::value;
    constexpr bool coef_stored = rhs_stored && !(ADJ && O::complex);
    V *uh = ws + 3 * pl * sn;
    for (int which = 0; which < 3; ++which) {
        const i64 part_at = part(which) * set;
        stage_lanes<V>(
            coef_stored && (!ADJ || d == 1), pl, nd,
            [&](int p) -> const V * {
                const int t = g.tree(p);
                if (t < 0) return nullptr;
                return as_values<O>(coef, part_at + (i64)g.coef_set(t) * nd);
            },
            [&](int p) { return ws + (which * pl + p) * sn; },
            [&](int p, int e) {
                // Pivot lane p's coefficient set: that of its tree (lane 0's when shared).
                const int t = g.tree(p);
                if (t < 0) return O::one();
                const int v = d == 1 ? e : e / dd, i = d == 1 ? 0 : e % dd / d;
                const int j = d == 1 ? 0 : e % d;
                const i64 blk = part_at + ((i64)g.coef_set(t) * n + v) * dd;
                return ADJ ? O::conj(O::load(coef, blk + j * d + i))
                           : O::load(coef, blk + i * d + j);
            });
    }
    stage_lanes<V>(
        rhs_stored, blockDim.x, n * dr,
        [&](int l) -> const V * {
            const int t = g.tree(l);
            return t < 0 ? nullptr : as_values<O>(rhs, (i64)t * n * dr);
        },
        [&](int l) { return uh + l * su; },
        [&](int l, int e) {
            const int t = g.tree(l);
            return t < 0 ? O::zero() : O::load(rhs, (i64)t * n * dr + e);
        });
    async_wait();
    __syncthreads();
}

// The block's solve with T_G (ADJ = false) or its adjoint (A' = conj(A), B' = conj(C),
// C' = conj(B)); on return uh holds, per lane, x (or λ).
template <typename T, typename O, bool ADJ>
__device__ void lanes_solve(const LaneTrees &g, const T *coef, const T *rhs, typename O::V *ws,
                            int *status) {
    typedef typename O::V V;
    const int n = g.nodes, r = g.r, pl = g.pivot_lanes();
    const int sn = lane_stride(n), su = lane_stride(n * r);
    V *aa = ws, *bh = aa + pl * sn, *dn = bh + pl * sn, *uh = dn + pl * sn;
    lanes_load<T, O, ADJ>(g, 1, coef, rhs, ws);

    const int l = threadIdx.x, t = g.tree(l), p0 = g.shared ? 0 : l;
    // Every lane inverts its children's pivots; with shared pivots only lane 0 makes and keeps
    // B̂ and Â_p (the other lanes' would be the same).
    const bool live = t >= 0, keeps = live && (!g.shared || l == 0);
    V *a = aa + p0 * sn, *b = bh + p0 * sn, *c = dn + p0 * sn;
    V *u = uh + l * su;
    // Upward: the parents of level k fold in their children (levels below are final):
    // B̂_c = (0 - B'_c) Â_c^-1, Â_p += C'_c B̂_c, û_c = ũ_c Â_c^-1, ũ_p -= C'_c û_c.
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            V ap = keeps ? a[p] : O::zero();
            for (int ch = g.child_start[p]; ch < g.child_start[p + 1]; ++ch) {
                const V ac = a[ch];
                if (!pivot_ok(ac)) atomicCAS(status, 0, 1 + ch);
                const V inv = O::inv(ac);
                const V cc = c[ch];
                if (keeps) {
                    const V bhat = O::mul(O::sub(O::zero(), b[ch]), inv);
                    b[ch] = bhat;
                    ap = O::add(ap, O::mul(cc, bhat));
                }
                for (int j = 0; j < r; ++j) {
                    const V uc = O::mul(u[ch * r + j], inv);
                    u[ch * r + j] = uc;
                    u[p * r + j] = O::sub(u[p * r + j], O::mul(cc, uc));
                }
            }
            if (keeps) a[p] = ap;
        }
        __syncthreads();
    }
    const int root = n - 1;
    if (live && threadIdx.y == 0) {
        const V ar = a[root];
        if (!pivot_ok(ar)) atomicCAS(status, 0, 1 + root);
        const V inv = O::inv(ar);
        for (int j = 0; j < r; ++j) u[root * r + j] = O::mul(u[root * r + j], inv);
    }
    __syncthreads();
    // Downward: x_c = û_c + B̂_c x_p.
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            for (int ch = g.child_start[p]; ch < g.child_start[p + 1]; ++ch) {
                for (int j = 0; j < r; ++j)
                    u[ch * r + j] = O::add(u[ch * r + j], O::mul(b[ch], u[p * r + j]));
            }
        }
        __syncthreads();
    }
}

// The block's workspace: 3 pivot arrays per pivot lane, then the lanes' right-hand sides.
template <typename V> __device__ __forceinline__ V *lanes_workspace() {
    extern __shared__ __align__(16) unsigned char smem[];
    return reinterpret_cast<V *>(smem);
}

// Writes every live lane's n * r solution values, from the workspace, to out.
template <typename T, typename O>
__device__ __forceinline__ void lanes_store(const LaneTrees &g, const typename O::V *uh, T *out) {
    const int nr = g.nodes * g.r;
    lanes_write<T, O>(nr, uh, lane_stride(nr), [&](int l) { return g.tree(l); }, nr, 0, out);
}

template <typename T, typename O>
__device__ void tree_lanes_fwd(const T *u, const T *coef, T *x, const LaneTrees &g, int *status) {
    typedef typename O::V V;
    V *ws = lanes_workspace<V>();
    lanes_solve<T, O, false>(g, coef, u, ws, status);
    lanes_store<T, O>(g, ws + 3 * g.pivot_lanes() * lane_stride(g.nodes), x);
}

// Backward: λ = T_G^-H ∂x by the adjoint solve, ∂u = λ, and the coefficient gradients
// ∂A_v = -Σ_r λ_v conj(x_v), ∂B_v = -Σ_r λ_v conj(x_parent), ∂C_v = -Σ_r λ_parent conj(x_v)
// (zero at the root): per tree, (3, trees, nodes), or for shared coefficients summed over the
// block's lanes in order, (3, groups, heads, nodes) with groups = ceil(batch / lanes).
template <typename T, typename O>
__device__ void tree_lanes_bwd(const T *gx, const T *coef, const T *x, T *du, T *dcoef,
                               const LaneTrees &g, int *status) {
    typedef typename O::V V;
    V *ws = lanes_workspace<V>();
    lanes_solve<T, O, true>(g, coef, gx, ws, status);
    const V *lam = ws + 3 * g.pivot_lanes() * lane_stride(g.nodes);
    lanes_store<T, O>(g, lam, du);
    const int n = g.nodes, r = g.r, su = lane_stride(n * r), root = n - 1;
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    // Lanes summed per thread: all of them (shared coefficients), else one.
    const int per = g.shared ? blockDim.x : 1, rows = g.shared ? 1 : blockDim.x;
    const int groups = (g.batch + blockDim.x - 1) / blockDim.x;
    const i64 set = (i64)(g.shared ? groups * g.heads : g.batch * g.heads) * n;
    const Divisor by_node(n), by_rhs(r);
    auto node = [&](int e) { return e - by_node.div(e) * n; };
    with_parents(g.parent, tid, rows * n, threads, node, [&](int e, int p) {
        const int first = by_node.div(e), v = e - first * n;
        const int t = g.tree(first), live = g.live(first, per);
        if (live == 0) return;
        // Over the live lanes l and right-hand sides j, in that order.
        V da = O::zero(), db = O::zero(), dc = O::zero();
        in_batches<batch_of<GradientLoad<V>, 64>>(
            live * r,
            [&](int q) {
                const int l = by_rhs.div(q);
                const i64 x0 = (i64)g.tree(first + l) * n * r + (q - l * r);
                return GradientLoad<V>{O::load(x, x0 + v * r), O::load(x, x0 + p * r)};
            },
            [&](int q, const GradientLoad<V> &in) {
                const int l = by_rhs.div(q);
                const V *lt = lam + (first + l) * su + (q - l * r);
                add_gradient_term<O>(lt[v * r], lt[p * r], in.xv, in.xp, v == root, da, db, dc);
            });
        // The block's row: its tree, or (group, head) = blockIdx.x for shared coefficients.
        const i64 d0 = (i64)(g.shared ? (int)blockIdx.x : t) * n + v;
        store_gradients<T, O>(dcoef, set, d0, da, db, dc);
    });
}

// ---- d x d blocks (d <= LANE_MAX_D) -------------------------------------------------------
// The same layout with blocks: per pivot lane A', B' (then B̂) and C' of n d x d row-major
// blocks, per lane n d x r right-hand sides. Each child's Schur step is tree_solve.cu's LU solve of
// Â_c [B̂_c | û_c] = [-B'_c | ũ_c] in the CPU twin's order, on a copy of Â_c in the thread's
// registers: every lane factors Â_c (with shared pivots all lanes pivot alike) and solves for
// its own û_c; the lane that keeps the pivots also solves for B̂_c and sends Â_p += C'_c B̂_c.
// The solve is compiled for each d (lanes_block_solve_d): with d known, the copy of Â_c stays in
// registers (lu_solve's D). Complex f64 keeps one solve for every d, with the copy in local
// memory: compiled per d, its unrolled loops spill.

#define LANE_MAX_D 4

// D = 0: d known only when run.
template <typename T, typename O, bool ADJ, int D>
__device__ void lanes_block_solve(const LaneTrees &g, int d_run, const T *coef, const T *rhs,
                                  typename O::V *ws, int *status) {
    typedef typename O::V V;
    const int d = D > 0 ? D : d_run, dd = d * d;
    const int n = g.nodes, r = g.r, pl = g.pivot_lanes();
    const int dr = d * r, sn = lane_stride(n * dd), su = lane_stride(n * dr);
    V *aa = ws, *bh = aa + pl * sn, *dn = bh + pl * sn, *uh = dn + pl * sn;
    lanes_load<T, O, ADJ>(g, d, coef, rhs, ws);

    const int l = threadIdx.x, t = g.tree(l), p0 = g.shared ? 0 : l;
    const bool live = t >= 0, keeps = live && (!g.shared || l == 0);
    V *a = aa + p0 * sn, *b = bh + p0 * sn, *c = dn + p0 * sn;
    V *u = uh + l * su;
    V m[D > 0 ? D * D : LANE_MAX_D * LANE_MAX_D];
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            V *ap = a + p * dd, *up = u + p * dr;
            for (int ch = g.child_start[p]; ch < g.child_start[p + 1]; ++ch) {
                V *bc = b + ch * dd, *uc = u + ch * dr;
                const V *cc = c + ch * dd;
#pragma unroll
                for (int e = 0; e < dd; ++e) m[e] = a[ch * dd + e];
                if (keeps)
                    for (int e = 0; e < dd; ++e) bc[e] = O::sub(O::zero(), bc[e]);
                if (!lu_solve<O, D>(m, keeps ? bc : nullptr, keeps ? d : 0, uc, r, d))
                    atomicCAS(status, 0, 1 + ch);
                for (int i = 0; i < d; ++i) {
                    for (int q = 0; q < d; ++q) {
                        const V ciq = cc[i * d + q];
                        if (keeps)
                            for (int j = 0; j < d; ++j)
                                ap[i * d + j] = O::add(O::mul(ciq, bc[q * d + j]), ap[i * d + j]);
                        for (int j = 0; j < r; ++j)
                            up[i * r + j] = O::sub(up[i * r + j], O::mul(ciq, uc[q * r + j]));
                    }
                }
            }
        }
        __syncthreads();
    }
    const int root = n - 1;
    if (live && threadIdx.y == 0) {
#pragma unroll
        for (int e = 0; e < dd; ++e) m[e] = a[root * dd + e];
        if (!lu_solve<O, D>(m, u + root * dr, r, nullptr, 0, d)) atomicCAS(status, 0, 1 + root);
    }
    __syncthreads();
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            for (int ch = g.child_start[p]; ch < g.child_start[p + 1]; ++ch)
                block_push_down<O>(b + ch * dd, u + p * dr, u + ch * dr, d, r);
        }
        __syncthreads();
    }
}

// lanes_block_solve for the d at hand: the host launches d = 2 .. LANE_MAX_D alone.
template <typename T, typename O, bool ADJ>
__device__ void lanes_block_solve_d(const LaneTrees &g, int d, const T *coef, const T *rhs,
                                    typename O::V *ws, int *status) {
    if constexpr (sizeof(typename O::V) > 8) {
        lanes_block_solve<T, O, ADJ, 0>(g, d, coef, rhs, ws, status);
    } else {
        switch (d) {
        case 2: lanes_block_solve<T, O, ADJ, 2>(g, d, coef, rhs, ws, status); break;
        case 3: lanes_block_solve<T, O, ADJ, 3>(g, d, coef, rhs, ws, status); break;
        case 4: lanes_block_solve<T, O, ADJ, 4>(g, d, coef, rhs, ws, status); break;
        }
    }
}

template <typename T, typename O>
__device__ void tree_lanes_block_fwd(const T *u, const T *coef, T *x, const LaneTrees &g, int d,
                                     int *status) {
    typedef typename O::V V;
    V *ws = lanes_workspace<V>();
    lanes_block_solve_d<T, O, false>(g, d, coef, u, ws, status);
    const V *xh = ws + 3 * g.pivot_lanes() * lane_stride(g.nodes * d * d);
    lanes_store<T, O>(g.with_nodes(g.nodes * d), xh, x);
}

// Backward: λ = T_G^-H ∂x, ∂u = λ, and the blocks ∂A_v = -Σ_r λ_v x_v^H,
// ∂B_v = -Σ_r λ_v x_parent^H, ∂C_v = -Σ_r λ_parent x_v^H (zero at the root), laid out as
// tree_lanes_bwd's rows of n d x d blocks.
template <typename T, typename O>
__device__ void tree_lanes_block_bwd(const T *gx, const T *coef, const T *x, T *du, T *dcoef,
                                     const LaneTrees &g, int d, int *status) {
    typedef typename O::V V;
    V *ws = lanes_workspace<V>();
    lanes_block_solve_d<T, O, true>(g, d, coef, gx, ws, status);
    const int n = g.nodes, r = g.r, dd = d * d, dr = d * r, root = n - 1;
    const V *lam = ws + 3 * g.pivot_lanes() * lane_stride(n * dd);
    const int su = lane_stride(n * dr);
    lanes_store<T, O>(g.with_nodes(n * d), lam, du);
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int per = g.shared ? blockDim.x : 1, lines = g.shared ? 1 : blockDim.x;
    const int groups = (g.batch + blockDim.x - 1) / blockDim.x;
    const i64 set = (i64)(g.shared ? groups * g.heads : g.batch * g.heads) * n * dd;
    const Divisor by_tree(n * dd), by_block(dd), by_row(d), by_rhs(r);
    auto node = [&](int e) { return by_block.div(e - by_tree.div(e) * n * dd); };
    with_parents(g.parent, tid, lines * n * dd, threads, node, [&](int e, int p) {
        const int first = by_tree.div(e), k = e - first * n * dd;
        const int v = by_block.div(k), ij = k - v * dd, i = by_row.div(ij), j = ij - i * d;
        const int t = g.tree(first), live = g.live(first, per);
        if (live == 0) return;
        // Over the live lanes and right-hand sides, in that order (tree_lanes_bwd).
        V da = O::zero(), db = O::zero(), dc = O::zero();
        in_batches<batch_of<GradientLoad<V>, 64>>(
            live * r,
            [&](int q) {
                const int l = by_rhs.div(q);
                const i64 x0 = (i64)g.tree(first + l) * n * dr + (q - l * r);
                return GradientLoad<V>{O::load(x, x0 + (v * d + j) * r),
                                       O::load(x, x0 + (p * d + j) * r)};
            },
            [&](int q, const GradientLoad<V> &in) {
                const int l = by_rhs.div(q);
                const V *lt = lam + (first + l) * su + (q - l * r);
                add_gradient_term<O>(lt[(v * d + i) * r], lt[(p * d + i) * r], in.xv, in.xp,
                                     v == root, da, db, dc);
            });
        const i64 d0 = (i64)(g.shared ? (int)blockIdx.x : t) * n * dd + k;
        store_gradients<T, O>(dcoef, set, d0, da, db, dc);
    });
}

#define LANE_KERNELS(SUFFIX, T, OPS)                                                            \
    extern "C" __global__ void __launch_bounds__(LANE_THREADS, LANE_MIN_BLOCKS)                 \
        tree_lanes_fwd_##SUFFIX(const T *u, const T *coef, T *x, const int *level_start,        \
                                const int *child_start, const int *parent, int levels,          \
                                int nodes, int r, int batch, int heads, int shared_coef,        \
                                int *status) {                                                  \
        const LaneTrees g{level_start, child_start, parent, levels, nodes,                      \
                          r,           batch,       heads,  shared_coef};                       \
        tree_lanes_fwd<T, OPS>(u, coef, x, g, status);                                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(LANE_THREADS, LANE_MIN_BLOCKS)                 \
        tree_lanes_bwd_##SUFFIX(const T *gx, const T *coef, const T *x, T *du, T *dcoef,        \
                                const int *level_start, const int *child_start,                 \
                                const int *parent, int levels, int nodes, int r, int batch,     \
                                int heads, int shared_coef, int *status) {                      \
        const LaneTrees g{level_start, child_start, parent, levels, nodes,                      \
                          r,           batch,       heads,  shared_coef};                       \
        tree_lanes_bwd<T, OPS>(gx, coef, x, du, dcoef, g, status);                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(LANE_THREADS, LANE_MIN_BLOCKS)                 \
        tree_lanes_block_fwd_##SUFFIX(const T *u, const T *coef, T *x, const int *level_start,  \
                                      const int *child_start, const int *parent, int levels,    \
                                      int nodes, int d, int r, int batch, int heads,            \
                                      int shared_coef, int *status) {                           \
        const LaneTrees g{level_start, child_start, parent, levels, nodes,                      \
                          r,           batch,       heads,  shared_coef};                       \
        tree_lanes_block_fwd<T, OPS>(u, coef, x, g, d, status);                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(LANE_THREADS, LANE_MIN_BLOCKS)                 \
        tree_lanes_block_bwd_##SUFFIX(const T *gx, const T *coef, const T *x, T *du, T *dcoef,  \
                                      const int *level_start, const int *child_start,           \
                                      const int *parent, int levels, int nodes, int d, int r,   \
                                      int batch, int heads, int shared_coef, int *status) {     \
        const LaneTrees g{level_start, child_start, parent, levels, nodes,                      \
                          r,           batch,       heads,  shared_coef};                       \
        tree_lanes_block_bwd<T, OPS>(gx, coef, x, du, dcoef, g, d, status);                     \
    }

// The instantiations (the host harness in tests/kernels_on_cpu registers the same list).
#define LANE_DTYPES(X) \
    X(f32, float, RealOps<float>) \
    X(f32_c, float, ComplexOps<float>) \
    X(f64, double, RealOps<double>) \
    X(f64_c, double, ComplexOps<double>) \
    X(f16, __half, RealOps<float>) \
    X(f16_c, __half, ComplexOps<float>) \
    X(bf16, __nv_bfloat16, RealOps<float>) \
    X(bf16_c, __nv_bfloat16, ComplexOps<float>)

LANE_DTYPES(LANE_KERNELS)
