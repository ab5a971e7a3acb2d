// The Myo tree solve x = T_G^-1 u, for trees too large for tree_lanes.cu, as a sweep: a block
// takes several samples of a head (lanes) or one tree, with the right-hand sides of the nodes
// above the leaves in shared memory and the leaves streamed (below), reading the pivots of its
// coefficient set together. Scalar blocks eliminate those pivots themselves into shared memory
// where they fit beside the right-hand sides (3n values: 16 KiB for a 1,024-leaf 4-ary tree in
// f32), one launch; else `tree_pivots` eliminates each set once into global memory first (a
// head's, shared by the batch; Path-X's 16,384-leaf trees: 384 KiB of pivots per head beside
// 64 KiB of right-hand sides per tree). d x d blocks up to SWEEP_MAX_D always take the two
// launches (`tree_block_pivots`, `tree_sweep_block_*`, below; 4 x 4 blocks on a 1,024-leaf
// tree: 22 KiB of right-hand sides, 262 KiB of pivots). The operations per node and their
// order are the CPU twins' (src/ops/tree_solve/levels.rs: `pivots`, then `sweep`; blocked.rs).
// f32 and f64, real and complex: the pivots are kept in the storage type.
//
// A singular or non-finite pivot sets *status to 1 + node (first one wins).
#include "tree_steps.cuh"
#include "values.cuh"

// Threads per block of the scalar kernels, at most (the host takes a power of two from 64, a
// thread per parent of the leaves): the backward SWEEP_THREADS; the forward, whose leaves' loads
// wait on memory (Path-X's trees: a block per SM, by its shared memory), and tree_pivots, a
// block per coefficient set (64 heads at Path-X's bench shape, fewer blocks than SMs),
// SWEEP_WIDE_THREADS. Compiled for 64 registers (1 block of 1,024): with no minimum, ptxas kept
// the sweeps to 32 registers and spilled on sm_70 and sm_90. In complex f64 they take 512 and
// 128 registers: at 64 they spilled.
#define SWEEP_THREADS 512
#define SWEEP_WIDE_THREADS 1024
template <typename O>
constexpr int sweep_wide_threads = sizeof(typename O::V) > 8 ? SWEEP_THREADS : SWEEP_WIDE_THREADS;
// The scalar backward is compiled for one (at most 128 registers): at 64, its leaves' gradient
// terms spilled in f64 and complex f64 on sm_70.
#define SWEEP_BWD_MIN_BLOCKS 1

struct SweepTree {
    const int *level_start; // levels + 1
    const int *child_start; // nodes + 1
    const int *parent;      // nodes (the root is its own parent)
    int levels, nodes;
};

// What the elimination loads for a child together: Â_c as accumulated, B'_c and C'_c.
template <typename V> struct PivotLoad {
    V a, b, c;
};

// The pivots of T_G or (adjoint) T_G^H for one coefficient set, eliminated by the block's
// threads: piv = [inv; bh; dn] with inv[v] = Â_v^-1, bh[v] = B̂_v = (0 - B'_v) Â_v^-1,
// dn[v] = C'_v, and Â_p = A'_p + Σ_c C'_c B̂_c over the children in order. coef = [A; B; C]
// with cset values per part, the set's at co; piv likewise with pset and po (global memory for
// `tree_pivots`, a block's shared memory for a sweep that stages them). The adjoint reads
// A' = conj(A), B' = conj(C), C' = conj(B). Thread 0 inverts the root after the last barrier:
// the caller reads the pivots after a barrier of its own. SHARED: piv is shared memory, which
// the coefficients as stored fill without waiting (stage_lanes).
template <typename T, typename O, bool SHARED>
__device__ void eliminate_pivots(const T *coef, i64 cset, i64 co, T *piv, i64 pset, i64 po,
                                 const SweepTree &g, int adjoint, int *status) {
    typedef typename O::V V;
    static_assert(AsStored<T, O>::value, "the pivots are kept in the storage type");
    const int n = g.nodes;
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const i64 up = adjoint ? 2 * cset : cset, down = adjoint ? cset : 2 * cset;
    auto read = [&](i64 base, int v) {
        const V x = O::load(coef, base + co + v);
        return adjoint ? O::conj(x) : x;
    };
    // inv holds Â until a node is eliminated, bh holds B' until then.
    const i64 parts[3] = {0, up, down};
    for (int k = 0; k < 3; ++k)
        stage_lanes<V>(
            SHARED && !(adjoint && O::complex), 1, n,
            [&](int) { return as_values<O>(coef, parts[k] + co); },
            [&](int) { return reinterpret_cast<V *>(piv) + k * pset + po; },
            [&](int, int v) { return read(parts[k], v); });
    async_wait();
    __syncthreads();
    // Per parent, its children's three values load together (up to 48 bytes), and with them
    // Â_p: in global memory (`tree_pivots`) each load after a store waits a round trip.
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + tid, p_end = g.level_start[k + 1]; p < p_end;
             p += threads) {
            V ap = O::load(piv, po + p);
            const int c0 = g.child_start[p];
            in_batches<batch_of<PivotLoad<V>, 48>>(
                g.child_start[p + 1] - c0,
                [&](int i) {
                    const i64 c = po + c0 + i;
                    return PivotLoad<V>{O::load(piv, c), O::load(piv, pset + c),
                                        O::load(piv, 2 * pset + c)};
                },
                [&](int i, const PivotLoad<V> &in) {
                    const int c = c0 + i;
                    if (!pivot_ok(in.a)) atomicCAS(status, 0, 1 + c);
                    const V inv = O::inv(in.a);
                    const V bh = O::mul(O::sub(O::zero(), in.b), inv);
                    O::store(piv, po + c, inv);
                    O::store(piv, pset + po + c, bh);
                    ap = O::add(ap, O::mul(in.c, bh));
                });
            O::store(piv, po + p, ap);
        }
        __syncthreads();
    }
    if (tid == 0) {
        const V ar = O::load(piv, po + n - 1);
        if (!pivot_ok(ar)) atomicCAS(status, 0, n);
        O::store(piv, po + n - 1, O::inv(ar));
    }
}

// Per coefficient set (block) the pivots into global memory, each part (sets, nodes).
template <typename T, typename O>
__device__ void tree_pivots(const T *coef, T *piv, const SweepTree &g, int sets, int adjoint,
                            int *status) {
    const i64 set = (i64)sets * g.nodes, o = (i64)blockIdx.x * g.nodes;
    eliminate_pivots<T, O, false>(coef, set, o, piv, set, o, g, adjoint, status);
}

// A block of the sweep is blockDim.x lanes (BlockLanes) x blockDim.y rows: with coefficients
// shared by the batch the lanes are samples of one head, which read that head's pivots together
// (threads of a warp the same addresses: one load for all); with per-sample coefficients a block
// holds one tree (one lane).

template <typename V> __device__ __forceinline__ V *sweep_workspace() {
    extern __shared__ __align__(16) unsigned char smem[];
    return reinterpret_cast<V *>(smem);
}

// ---- scalar blocks: the leaves streamed ----------------------------------------------------
// The batches of leaves the forward loads at once (in_batches): 32 bytes of values (16 for
// complex f64, which spilled on sm_70 at 32).
template <typename V> constexpr int sweep_leaf_bytes = sizeof(V) > 8 ? 16 : 32;

// What the backward loads for a leaf, together: ∂x and x at the leaf, x at its parent.
template <typename V> struct LeafLoad {
    V g, xv, xp;
};

// Only the nodes above the leaves live in shared memory, each lane's (n - n0) * r values at an
// odd stride (n0: the leaves, level 0; a one-node tree has none below its root). A leaf's
// right-hand side is read from global memory where its parent's upward step needs it
// (û_c = u_c Â_c^-1, ũ_p -= C'_c û_c) and again where the downward step does (x_c = û_c +
// B̂_c x_p, û_c computed the same way; the second read is served by L2), and x_c is written
// straight out. Most nodes are leaves (3/4 of a 4-ary tree's): the block's shared memory and
// barriers serve the rest, and the leaves' loads issue independently of each other.

// The first node above the leaves.
__device__ __forceinline__ int first_inner(const SweepTree &g) {
    return g.levels > 1 ? g.level_start[1] : 0;
}

// A block's trees and their pivots: ws holds, per lane at an odd stride, the r values of each
// node v >= n0 at (v - n0) * r; the pivots of the lanes' coefficient set are at piv + o, each
// part `set` values apart.
template <typename T, typename O> struct ScalarSweep {
    typedef typename O::V V;
    SweepTree g;
    BlockLanes s;
    int r, n0, su;
    Divisor rhs; // by r, for q = l r + j over the lanes l and right-hand sides j
    const T *piv;
    i64 set, o;
    V *ws;

    __device__ __forceinline__ V &at(int l, int v, int j) const {
        return ws[l * su + (v - n0) * r + j];
    }
    // The lane of q = l r + j, the index over the lanes and right-hand sides.
    __device__ __forceinline__ int lane(int q) const { return rhs.div(q); }
    // at(l, v, j) for q = l r + j.
    __device__ __forceinline__ V &at(int q, int v) const {
        const int l = lane(q);
        return at(l, v, q - l * r);
    }
    // Where q's value at node v is in a (trees, n, r) array.
    __device__ __forceinline__ i64 offset(int q, int v) const {
        const int l = lane(q);
        return ((i64)s.tree(l) * g.nodes + v) * r + (q - l * r);
    }
    __device__ __forceinline__ V inv(int v) const { return O::load(piv, o + v); }
    __device__ __forceinline__ V bh(int v) const { return O::load(piv, set + o + v); }
    __device__ __forceinline__ V dn(int v) const { return O::load(piv, 2 * set + o + v); }
};

// Runs body(sw) on the block's sweep state. src: with `stage` the coefficients [A; B; C], whose
// set the block eliminates into its shared memory behind the lanes' workspace (the pivots of
// T_G, or of T_G^H for the adjoint), saving `tree_pivots`' launch and its round trip through
// global memory; else the pivots from `tree_pivots` (sets = heads for shared coefficients, else
// trees). Two calls, so that in each the compiler knows where the pivots are: through a
// pointer that may be either, every load of them is a generic one.
template <typename T, typename O, typename Body>
__device__ __forceinline__ void with_scalar_sweep(const SweepTree &g, const BlockLanes &s, int r,
                                                  const T *src, int stage, int adjoint,
                                                  int *status, Body body) {
    typedef typename O::V V;
    const int n = g.nodes, n0 = first_inner(g), su = ((n - n0) * r) | 1;
    const i64 set = (i64)(s.shared ? s.heads : s.batch * s.heads) * n;
    const i64 o = (i64)s.coef_set(s.tree(0)) * n;
    V *ws = sweep_workspace<V>();
    if (!stage) {
        body(ScalarSweep<T, O>{g, s, r, n0, su, Divisor(r), src, set, o, ws});
        return;
    }
    T *piv = reinterpret_cast<T *>(ws + (i64)blockDim.x * su);
    eliminate_pivots<T, O, true>(src, set, o, piv, n, 0, g, adjoint, status);
    body(ScalarSweep<T, O>{g, s, r, n0, su, Divisor(r), piv, n, 0, ws});
}

// The sweep of the block's trees up to the nodes above the leaves: on return sw.ws holds their
// x (or λ). rhs: u (or ∂x), (trees, n, r). Upward, û_c = ũ_c Â_c^-1 and ũ_p -= C'_c û_c for
// each child in order; the root's x = ũ Â^-1; downward, x_c = û_c + B̂_c x_p down to level 1.
template <typename T, typename O>
__device__ void sweep_inner(const ScalarSweep<T, O> &sw, const T *rhs) {
    typedef typename O::V V;
    const SweepTree &g = sw.g;
    const int n = g.nodes, r = sw.r, n0 = sw.n0, nr = n * r, lanes = blockDim.x;
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    stage_lanes<V>(
        AsStored<T, O>::value, lanes, (n - n0) * r,
        [&](int l) {
            const int t = sw.s.tree(l);
            return t < 0 ? nullptr : as_values<O>(rhs, (i64)t * nr + (i64)n0 * r);
        },
        [&](int l) { return sw.ws + l * sw.su; },
        [&](int l, int e) {
            const int t = sw.s.tree(l);
            return t < 0 ? O::zero() : O::load(rhs, (i64)t * nr + (i64)n0 * r + e);
        });
    async_wait();
    // Also orders staged pivots (the root's) before their reads.
    __syncthreads();
    // Level 1 folds in the leaves, read from rhs: per child, every lane's loads issue together.
    if (g.levels > 1) {
        for (int p = g.level_start[1] + tid, p_end = g.level_start[2]; p < p_end; p += threads) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const V inv = sw.inv(c), dn = sw.dn(c);
                in_batches<batch_of<V, sweep_leaf_bytes<V>>>(
                    sw.s.lanes * r,
                    [&](int q) { return O::load(rhs, sw.offset(q, c)); },
                    [&](int q, V u) {
                        V &acc = sw.at(q, p);
                        acc = O::sub(acc, O::mul(dn, O::mul(u, inv)));
                    });
            }
        }
    }
    __syncthreads();
    // Above level 1: a thread per (lane, parent), the lanes across a warp's threads (a parent's
    // pivots one load for its lanes, their values an odd stride apart: in different banks).
    const int l = threadIdx.x;
    const bool live = sw.s.tree(l) >= 0;
    for (int k = 2; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const V inv = sw.inv(c), dn = sw.dn(c);
                for (int j = 0; j < r; ++j) {
                    const V uc = O::mul(sw.at(l, c, j), inv);
                    sw.at(l, c, j) = uc;
                    sw.at(l, p, j) = O::sub(sw.at(l, p, j), O::mul(dn, uc));
                }
            }
        }
        __syncthreads();
    }
    const int root = n - 1;
    for (int j = threadIdx.y; live && j < r; j += blockDim.y)
        sw.at(l, root, j) = O::mul(sw.at(l, root, j), sw.inv(root));
    __syncthreads();
    for (int k = g.levels - 1; k >= 2; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const V bh = sw.bh(c);
                for (int j = 0; j < r; ++j)
                    sw.at(l, c, j) = O::add(sw.at(l, c, j), O::mul(bh, sw.at(l, p, j)));
            }
        }
        __syncthreads();
    }
}

// x = T_G^-1 u for the block's trees; src: the coefficients or the pivots (`with_scalar_sweep`).
template <typename T, typename O>
__device__ __forceinline__ void tree_sweep_fwd(const T *u, const T *src, T *x, const SweepTree &g,
                                               const BlockLanes &s, int r, int stage, int *status) {
    typedef typename O::V V;
    with_scalar_sweep<T, O>(g, s, r, src, stage, 0, status, [&](const ScalarSweep<T, O> &sw) {
        sweep_inner<T, O>(sw, u);
        const int nr = g.nodes * r, threads = blockDim.x * blockDim.y;
        const int tid = threadIdx.y * blockDim.x + threadIdx.x;
        // The leaves: x_c = û_c + B̂_c x_p, straight to x; per child, every lane's loads
        // together.
        if (g.levels > 1) {
            for (int p = g.level_start[1] + tid, p_end = g.level_start[2]; p < p_end;
                 p += threads) {
                for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                    const V inv = sw.inv(c), bh = sw.bh(c);
                    in_batches<batch_of<V, sweep_leaf_bytes<V>>>(
                        sw.s.lanes * r, [&](int q) { return O::load(u, sw.offset(q, c)); },
                        [&](int q, V uq) {
                            const V uc = O::mul(uq, inv);
                            O::store(x, sw.offset(q, c), O::add(uc, O::mul(bh, sw.at(q, p))));
                        });
                }
            }
        }
        lanes_write<T, O>((g.nodes - sw.n0) * r, sw.ws, sw.su,
                          [&](int l) { return s.tree(l); }, nr, (i64)sw.n0 * r, x);
    });
}

// Backward, with the adjoint's pivots (src: the coefficients or those pivots): λ = T_G^-H ∂x,
// ∂u = λ, and the coefficient gradients ∂A_v = -Σ_r λ_v conj(x_v),
// ∂B_v = -Σ_r λ_v conj(x_parent), ∂C_v = -Σ_r λ_parent conj(x_v)
// (zero at the root), a row per block: per tree, (3, trees, nodes) as tree_solve.cu's tree_bwd
// writes them, or for shared coefficients summed over the block's lanes in order,
// (3, groups, heads, nodes) with groups = ceil(batch / lanes), as tree_lanes.cu's.
template <typename T, typename O>
__device__ __forceinline__ void tree_sweep_bwd(const T *gx, const T *src, const T *x, T *du,
                                               T *dcoef, const SweepTree &g, const BlockLanes &s,
                                               int r, int stage, int *status) {
    typedef typename O::V V;
    with_scalar_sweep<T, O>(g, s, r, src, stage, 1, status, [&](const ScalarSweep<T, O> &sw) {
        sweep_inner<T, O>(sw, gx);
        const int n = g.nodes, nr = n * r, root = n - 1;
        const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
        const i64 rows = s.shared ? (i64)(s.batch + blockDim.x - 1) / blockDim.x * s.heads
                                  : (i64)s.batch * s.heads;
        const i64 dset = rows * n, d0 = (i64)blockIdx.x * n;
        // The leaves: λ_c = û_c + B̂_c λ_p to ∂u, and their gradient terms, over the lanes and
        // right-hand sides in order; per child, every lane's loads issue together.
        if (g.levels > 1) {
            for (int p = g.level_start[1] + tid, p_end = g.level_start[2]; p < p_end;
                 p += threads) {
                for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                    const V inv = sw.inv(c), bh = sw.bh(c);
                    V da = O::zero(), db = O::zero(), dc = O::zero();
                    in_batches<batch_of<LeafLoad<V>, 96>>(
                        sw.s.lanes * r,
                        [&](int q) {
                            return LeafLoad<V>{O::load(gx, sw.offset(q, c)),
                                               O::load(x, sw.offset(q, c)),
                                               O::load(x, sw.offset(q, p))};
                        },
                        [&](int q, const LeafLoad<V> &in) {
                            const V lp = sw.at(q, p);
                            const V lc = O::add(O::mul(in.g, inv), O::mul(bh, lp));
                            O::store(du, sw.offset(q, c), lc);
                            add_gradient_term<O>(lc, lp, in.xv, in.xp, false, da, db, dc);
                        });
                    store_gradients<T, O>(dcoef, dset, d0 + c, da, db, dc);
                }
            }
        }
        lanes_write<T, O>((n - sw.n0) * r, sw.ws, sw.su,
                          [&](int l) { return s.tree(l); }, nr, (i64)sw.n0 * r, du);
        with_parents(g.parent, sw.n0 + tid, n, threads, [](int v) { return v; }, [&](int v, int p) {
            V da = O::zero(), db = O::zero(), dc = O::zero();
            in_batches<batch_of<GradientLoad<V>, 96>>(
                sw.s.lanes * r,
                [&](int q) {
                    return GradientLoad<V>{O::load(x, sw.offset(q, v)),
                                           O::load(x, sw.offset(q, p))};
                },
                [&](int q, const GradientLoad<V> &in) {
                    add_gradient_term<O>(sw.at(q, v), sw.at(q, p), in.xv, in.xp, v == root, da,
                                         db, dc);
                });
            store_gradients<T, O>(dcoef, dset, d0 + v, da, db, dc);
        });
    });
}

// ---- d x d blocks (d <= SWEEP_MAX_D) ------------------------------------------------------
// The pivots, piv = [a; bh; dn], each (sets, nodes, d, d) row-major: a[v] = Â_v as accumulated,
// Â_p = A'_p + Σ_c C'_c B̂_c, bh[v] = B̂_v, which solves Â_v B̂_v = -B'_v, and dn[v] = C'_v.
// Â_v is kept, not its factors: each tree's sweep factors it again in registers, a few flops
// where loading the factors and their row order would cost as much memory traffic, and the
// same LU in the same order as tree_solve.cu's and the CPU twin's (blocked.rs) block per tree,
// which factor Â_c once for [B̂_c | û_c] (the LU's operations on û_c do not depend on B̂_c).
#define SWEEP_MAX_D 4
// Threads per block of the d x d kernels, compiled for 2 resident blocks per SM (at most 128
// registers): at 512 threads (64 registers) the solves spilled in f64 and complex f32.
#define SWEEP_BLOCK_THREADS 256

template <typename T, typename O, int D>
__device__ void tree_block_pivots(const T *coef, T *piv, const SweepTree &g, int d_run, int sets,
                                  int adjoint, int *status) {
    typedef typename O::V V;
    const int d = D > 0 ? D : d_run, dd = d * d, n = g.nodes;
    const i64 set = (i64)sets * n * dd, o = (i64)blockIdx.x * n * dd;
    const i64 up = adjoint ? 2 * set : set, down = adjoint ? set : 2 * set;
    // The adjoint's blocks are the coefficients' conjugate transposes; the loads of the three
    // parts, A' then B' then C', issue in batches (batched_copy).
    const int len = n * dd;
    batched_copy<V>(
        3 * len,
        [&](int i) {
            const int k = i / len, e = i % len, blk = e - e % dd, r = e % dd / d, c = e % d;
            const i64 part = k == 0 ? 0 : k == 1 ? up : down;
            const V x = O::load(coef, part + o + (adjoint ? blk + c * d + r : e));
            return adjoint ? O::conj(x) : x;
        },
        [&](int i, V x) { O::store(piv, i / len * set + o + i % len, x); });
    __syncthreads();
    // Â_p is summed in registers over the children (the same additions in the same order):
    // summed in global memory, each (i, q)'s loads of it waited on the stores before them, a
    // round trip each, d² per child.
    V m[D > 0 ? D * D : SWEEP_MAX_D * SWEEP_MAX_D], bc[D > 0 ? D * D : SWEEP_MAX_D * SWEEP_MAX_D];
    V a[D > 0 ? D * D : SWEEP_MAX_D * SWEEP_MAX_D];
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.x, p_end = g.level_start[k + 1]; p < p_end;
             p += blockDim.x) {
            const i64 ap = o + (i64)p * dd;
#pragma unroll
            for (int e = 0; e < dd; ++e) a[e] = O::load(piv, ap + e);
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const i64 ac = o + (i64)c * dd;
#pragma unroll
                for (int e = 0; e < dd; ++e) {
                    m[e] = O::load(piv, ac + e);
                    bc[e] = O::sub(O::zero(), O::load(piv, set + ac + e));
                }
                if (!lu_solve<O, D>(m, bc, d, nullptr, 0, d)) atomicCAS(status, 0, 1 + c);
#pragma unroll
                for (int e = 0; e < dd; ++e) O::store(piv, set + ac + e, bc[e]);
#pragma unroll
                for (int i = 0; i < d; ++i) {
#pragma unroll
                    for (int q = 0; q < d; ++q) {
                        const V ciq = O::load(piv, 2 * set + ac + i * d + q);
#pragma unroll
                        for (int j = 0; j < d; ++j)
                            a[i * d + j] = O::add(O::mul(ciq, bc[q * d + j]), a[i * d + j]);
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < dd; ++e) O::store(piv, ap + e, a[e]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
#pragma unroll
        for (int e = 0; e < dd; ++e) m[e] = O::load(piv, o + (i64)(n - 1) * dd + e);
        if (!lu_solve<O, D>(m, nullptr, 0, nullptr, 0, d)) atomicCAS(status, 0, n);
    }
}

// The d at hand compiled in (see tree_lanes.cu's lanes_block_solve_d), complex f64 excepted.
template <typename T, typename O>
__device__ void tree_block_pivots_d(const T *coef, T *piv, const SweepTree &g, int d, int sets,
                                    int adjoint, int *status) {
    if constexpr (sizeof(typename O::V) > 8) {
        tree_block_pivots<T, O, 0>(coef, piv, g, d, sets, adjoint, status);
    } else {
        switch (d) {
        case 2: tree_block_pivots<T, O, 2>(coef, piv, g, d, sets, adjoint, status); break;
        case 3: tree_block_pivots<T, O, 3>(coef, piv, g, d, sets, adjoint, status); break;
        case 4: tree_block_pivots<T, O, 4>(coef, piv, g, d, sets, adjoint, status); break;
        }
    }
}

// The sweep of a lane's tree with d x d blocks, its pivots at piv + o (live: the lane has a
// tree; every thread reaches the barriers): uh (n * d * r) holds its right-hand sides on entry
// and x (or λ) on return. Upward, Â_c û_c = ũ_c and ũ_p -= C'_c û_c; the root's Â x = ũ;
// downward, x_c = û_c + B̂_c x_p. A bad pivot was reported by tree_block_pivots.
template <typename T, typename O, int D>
__device__ __forceinline__ void block_sweep(const SweepTree &g, int d_run, int r, const T *piv,
                                            i64 set, i64 o, bool live, typename O::V *uh) {
    typedef typename O::V V;
    const int d = D > 0 ? D : d_run, dd = d * d, dr = d * r;
    V m[D > 0 ? D * D : SWEEP_MAX_D * SWEEP_MAX_D];
    for (int k = 1; k < g.levels; ++k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            V *up = uh + p * dr;
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
                const i64 ac = o + (i64)c * dd;
                V *uc = uh + c * dr;
#pragma unroll
                for (int e = 0; e < dd; ++e) m[e] = O::load(piv, ac + e);
                lu_solve<O, D>(m, uc, r, nullptr, 0, d);
#pragma unroll
                for (int i = 0; i < d; ++i) {
#pragma unroll
                    for (int q = 0; q < d; ++q) {
                        const V ciq = O::load(piv, 2 * set + ac + i * d + q);
                        for (int j = 0; j < r; ++j)
                            up[i * r + j] = O::sub(up[i * r + j], O::mul(ciq, uc[q * r + j]));
                    }
                }
            }
        }
        __syncthreads();
    }
    const int root = g.nodes - 1;
    if (live && threadIdx.y == 0) {
#pragma unroll
        for (int e = 0; e < dd; ++e) m[e] = O::load(piv, o + (i64)root * dd + e);
        lu_solve<O, D>(m, uh + root * dr, r, nullptr, 0, d);
    }
    __syncthreads();
    for (int k = g.levels - 1; k >= 1; --k) {
        for (int p = g.level_start[k] + threadIdx.y, p_end = g.level_start[k + 1];
             live && p < p_end; p += blockDim.y) {
            for (int c = g.child_start[p]; c < g.child_start[p + 1]; ++c) {
#pragma unroll
                for (int e = 0; e < dd; ++e) m[e] = O::load(piv, set + o + (i64)c * dd + e);
                block_push_down<O, D>(m, uh + p * dr, uh + c * dr, d, r);
            }
        }
        __syncthreads();
    }
}

// Every lane's sweep: its right-hand sides loaded from rhs into the workspace (each lane's
// n * d * r values at an odd stride, so that a warp's lanes fall in different banks), solved
// with the pivots of its coefficient set (block_sweep for the d at hand, compiled in: see
// tree_lanes.cu's lanes_block_solve_d; complex f64 excepted). Returns the workspace.
template <typename T, typename O>
__device__ typename O::V *lanes_sweep(const SweepTree &g, const BlockLanes &s, int d, int r,
                                      const T *rhs, const T *piv) {
    typedef typename O::V V;
    V *ws = sweep_workspace<V>();
    const int n = g.nodes, dd = d * d, ndr = n * d * r, su = ndr | 1;
    stage_lanes<V>(
        AsStored<T, O>::value, blockDim.x, ndr,
        [&](int l) {
            const int t = s.tree(l);
            return t < 0 ? nullptr : as_values<O>(rhs, (i64)t * ndr);
        },
        [&](int l) { return ws + l * su; },
        [&](int l, int e) {
            const int t = s.tree(l);
            return t < 0 ? O::zero() : O::load(rhs, (i64)t * ndr + e);
        });
    async_wait();
    __syncthreads();
    const int t = s.tree(threadIdx.x);
    const i64 set = (i64)(s.shared ? s.heads : s.batch * s.heads) * n * dd;
    const i64 o = t < 0 ? 0 : (i64)s.coef_set(t) * n * dd;
    V *uh = ws + threadIdx.x * su;
    if constexpr (sizeof(V) > 8) {
        block_sweep<T, O, 0>(g, d, r, piv, set, o, t >= 0, uh);
    } else {
        switch (d) {
        case 2: block_sweep<T, O, 2>(g, d, r, piv, set, o, t >= 0, uh); break;
        case 3: block_sweep<T, O, 3>(g, d, r, piv, set, o, t >= 0, uh); break;
        case 4: block_sweep<T, O, 4>(g, d, r, piv, set, o, t >= 0, uh); break;
        }
    }
    return ws;
}

template <typename T, typename O>
__device__ void tree_sweep_block_fwd(const T *u, const T *piv, T *x, const SweepTree &g,
                                     const BlockLanes &s, int d, int r) {
    const typename O::V *ws = lanes_sweep<T, O>(g, s, d, r, u, piv);
    const int ndr = g.nodes * d * r;
    lanes_write<T, O>(ndr, ws, ndr | 1, [&](int l) { return s.tree(l); }, ndr, 0, x);
}

// Backward with the adjoint's pivots: λ = T_G^-H ∂x, ∂u = λ, and the blocks
// ∂A_v = -Σ_r λ_v x_v^H, ∂B_v = -Σ_r λ_v x_parent^H, ∂C_v = -Σ_r λ_parent x_v^H (zero at the
// root), a row of n d x d blocks per block: per tree, (3, trees, nodes, d, d) as tree_solve.cu's
// tree_block_bwd writes them, or for shared coefficients summed over the block's lanes in order,
// (3, groups, heads, nodes, d, d) with groups = ceil(batch / lanes), as tree_lanes.cu's.
template <typename T, typename O>
__device__ void tree_sweep_block_bwd(const T *gx, const T *piv, const T *x, T *du, T *dcoef,
                                     const SweepTree &g, const BlockLanes &s, int d, int r) {
    typedef typename O::V V;
    const V *lam = lanes_sweep<T, O>(g, s, d, r, gx, piv);
    const int n = g.nodes, dd = d * d, ndr = n * d * r, su = ndr | 1, root = n - 1;
    lanes_write<T, O>(ndr, lam, su, [&](int l) { return s.tree(l); }, ndr, 0, du);
    const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const i64 rows = s.shared ? (i64)(s.batch + blockDim.x - 1) / blockDim.x * s.heads
                              : (i64)s.batch * s.heads;
    const i64 dset = rows * n * dd;
    const int live = s.lanes;
    const Divisor rhs(r), by_block(dd), by_row(d);
    auto node = [&](int e) { return by_block.div(e); };
    with_parents(g.parent, tid, n * dd, threads, node, [&](int e, int p) {
        const int v = node(e), ij = e - v * dd, i = by_row.div(ij), j = ij - i * d;
        // Over the live lanes and right-hand sides, in that order, their loads in batches.
        V da = O::zero(), db = O::zero(), dc = O::zero();
        in_batches<batch_of<GradientLoad<V>, 64>>(
            live * r,
            [&](int q) {
                const int l = rhs.div(q);
                const i64 x0 = (i64)s.tree(l) * ndr + (q - l * r);
                return GradientLoad<V>{O::load(x, x0 + (v * d + j) * r),
                                       O::load(x, x0 + (p * d + j) * r)};
            },
            [&](int q, const GradientLoad<V> &in) {
                const int l = rhs.div(q);
                const V *lt = lam + l * su + (q - l * r);
                add_gradient_term<O>(lt[(v * d + i) * r], lt[(p * d + i) * r], in.xv, in.xp,
                                     v == root, da, db, dc);
            });
        const i64 d0 = (i64)blockIdx.x * n * dd + e;
        store_gradients<T, O>(dcoef, dset, d0, da, db, dc);
    });
}

// The scalar sweeps take `stage` as a constant in each of two calls: with one call for both,
// the two copies of the sweep (with_scalar_sweep) spilled complex f64 on sm_90.
#define SWEEP_KERNELS(SUFFIX, T, OPS)                                                           \
    extern "C" __global__ void __launch_bounds__(sweep_wide_threads<OPS>, 1)                   \
        tree_pivots_##SUFFIX(const T *coef, T *piv, const int *level_start,                     \
                             const int *child_start, const int *parent, int levels, int nodes,  \
                             int sets, int adjoint, int *status) {                              \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        tree_pivots<T, OPS>(coef, piv, g, sets, adjoint, status);                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(sweep_wide_threads<OPS>, 1)                   \
        tree_sweep_fwd_##SUFFIX(const T *u, const T *src, T *x, const int *level_start,         \
                                const int *child_start, const int *parent, int levels,          \
                                int nodes, int r, int batch, int heads, int shared_coef,        \
                                int stage, int *status) {                                       \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        const BlockLanes s{batch, heads, shared_coef};                                          \
        if (stage)                                                                              \
            tree_sweep_fwd<T, OPS>(u, src, x, g, s, r, 1, status);                              \
        else                                                                                    \
            tree_sweep_fwd<T, OPS>(u, src, x, g, s, r, 0, status);                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SWEEP_THREADS, SWEEP_BWD_MIN_BLOCKS)           \
        tree_sweep_bwd_##SUFFIX(const T *gx, const T *src, const T *x, T *du, T *dcoef,         \
                                const int *level_start, const int *child_start,                 \
                                const int *parent, int levels, int nodes, int r, int batch,     \
                                int heads, int shared_coef, int stage, int *status) {           \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        const BlockLanes s{batch, heads, shared_coef};                                          \
        if (stage)                                                                              \
            tree_sweep_bwd<T, OPS>(gx, src, x, du, dcoef, g, s, r, 1, status);                  \
        else                                                                                    \
            tree_sweep_bwd<T, OPS>(gx, src, x, du, dcoef, g, s, r, 0, status);                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SWEEP_BLOCK_THREADS, 2)                        \
        tree_block_pivots_##SUFFIX(const T *coef, T *piv, const int *level_start,               \
                                   const int *child_start, const int *parent, int levels,       \
                                   int nodes, int d, int sets, int adjoint, int *status) {      \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        tree_block_pivots_d<T, OPS>(coef, piv, g, d, sets, adjoint, status);                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SWEEP_BLOCK_THREADS, 2)                        \
        tree_sweep_block_fwd_##SUFFIX(const T *u, const T *piv, T *x, const int *level_start,   \
                                      const int *child_start, const int *parent, int levels,    \
                                      int nodes, int d, int r, int batch, int heads,            \
                                      int shared_coef) {                                        \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        tree_sweep_block_fwd<T, OPS>(u, piv, x, g, BlockLanes{batch, heads, shared_coef}, d, r); \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SWEEP_BLOCK_THREADS, 2)                        \
        tree_sweep_block_bwd_##SUFFIX(const T *gx, const T *piv, const T *x, T *du, T *dcoef,   \
                                      const int *level_start, const int *child_start,           \
                                      const int *parent, int levels, int nodes, int d, int r,   \
                                      int batch, int heads, int shared_coef) {                  \
        const SweepTree g{level_start, child_start, parent, levels, nodes};                     \
        const BlockLanes s{batch, heads, shared_coef};                                          \
        tree_sweep_block_bwd<T, OPS>(gx, piv, x, du, dcoef, g, s, d, r);                        \
    }

// f32 and f64, real and complex (the host harness in tests/kernels_on_cpu registers the same
// list).
#define SWEEP_DTYPES(X) \
    X(f32, float, RealOps<float>) \
    X(f32_c, float, ComplexOps<float>) \
    X(f64, double, RealOps<double>) \
    X(f64_c, double, ComplexOps<double>)

SWEEP_DTYPES(SWEEP_KERNELS)
