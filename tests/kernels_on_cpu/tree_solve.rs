//! The kernels of kernels/tree_solve.cu through the harness — `tree_fwd_*`/`tree_bwd_*` for
//! scalar blocks, `tree_block_fwd_*`/`tree_block_bwd_*` for d × d blocks (the tests named
//! `block_*`) — with the per-tree state in dynamic shared memory and in the global workspace.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::plan::DeviceLimits;
use myosotis::ops::tree_solve::cuda::{
    backward_plan, backward_plans, forward_plan, forward_plans, LANE_MAX_D, SWEEP_MAX_D,
};
use myosotis::ops::{tree_solve, tree_solve_backward, TreeLayout, TreeSolveOptions};
use myosotis::tree::Tree;
use rand::Rng;

use crate::common::trees::permute_block_rows;
use crate::common::*;
use crate::exec::{round_to, run, run_in_every_order, HostRun};
use crate::{assert_same, DTYPES};
use kernels_on_cpu::Order;
use myosotis::ops::plan::{KernelArg, LaunchPlan};

/// A device that grants no shared memory: the plan puts every tree in the global workspace.
const NO_SHARED: DeviceLimits = DeviceLimits {
    shared_per_block: 0,
    ..DeviceLimits::H100
};

fn trees() -> Vec<(&'static str, Tree)> {
    vec![
        ("perfect binary 16", Tree::perfect(16, 2).unwrap()),
        ("perfect 3-ary 27", Tree::perfect(27, 3).unwrap()),
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("perfect 5-ary 125", Tree::perfect(125, 5).unwrap()),
        ("ragged 3-ary 100", Tree::ragged(100, 3).unwrap()),
        ("ragged binary 23", Tree::ragged(23, 2).unwrap()),
        ("quad 6x5", Tree::quad(6, 5).unwrap()),
        ("chain 40", Tree::chain(40).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ]
}

/// Shared and per-sample coefficients, real and complex, one and several right-hand sides.
fn cases() -> [TreeCase; 4] {
    let case = |batch, heads, r, shared, complex| TreeCase {
        batch,
        heads,
        d: 1,
        r,
        shared,
        complex,
    };
    [
        case(2, 3, 1, false, false),
        case(3, 2, 3, true, false),
        case(2, 2, 2, false, true),
        case(2, 3, 1, true, true),
    ]
}

/// The options of a case with a block of threads per tree.
fn opts(case: &TreeCase) -> TreeSolveOptions {
    opts_in(case, TreeLayout::Tree)
}

fn opts_in(case: &TreeCase, layout: TreeLayout) -> TreeSolveOptions {
    TreeSolveOptions {
        complex: case.complex,
        layout,
    }
}

/// Runs a solve's launches in every order: one, or the sweep layout's two, the first making
/// the pivots from the coefficients (the inputs' second) and the second taking them in the
/// coefficients' place. A bad pivot's status comes from the first.
fn run_launches(plans: &[LaunchPlan], dtype: DType, inputs: &[&[f64]], seed: u64) -> HostRun {
    match plans {
        [plan] => run_in_every_order(plan, dtype, inputs, seed),
        [pivots, sweep] => {
            let piv = run_in_every_order(pivots, dtype, &[inputs[1]], seed);
            if piv.status != 0 {
                return piv;
            }
            let mut ins = inputs.to_vec();
            ins[1] = &piv.outputs[0];
            run_in_every_order(sweep, dtype, &ins, seed)
        }
        _ => panic!("{} launches", plans.len()),
    }
}

/// A device one byte short of what the scalar sweep's blocks need to eliminate their pivots
/// themselves (on an H100): its sweep takes them from tree_pivots, a launch apart.
fn pivots_apart(tree: &Tree, case: &TreeCase, [a, b, c, u]: [&Tensor; 4]) -> DeviceLimits {
    let o = opts_in(case, TreeLayout::Sweep);
    let staged = forward_plan(tree, a, b, c, u, o, DeviceLimits::H100).unwrap();
    DeviceLimits {
        shared_per_block: staged.shared_bytes - 1,
        ..DeviceLimits::H100
    }
}

/// A device whose grid is never too small: the lanes layout takes its widest width that fits.
const FEW_SMS: DeviceLimits = DeviceLimits {
    sms: 0,
    ..DeviceLimits::H100
};

/// Reference gradients of shared coefficients, (3, batch, heads, n·w) per sample, summed over
/// the samples of each block of `lanes`: (3, groups, heads, n·w), as the lanes kernels write.
fn group_sums(per_sample: &[f64], case: &TreeCase, lanes: usize) -> Vec<f64> {
    let (batch, heads) = (case.batch, case.heads);
    let row = per_sample.len() / (3 * batch * heads);
    let groups = batch.div_ceil(lanes);
    let mut out = vec![0.0; 3 * groups * heads * row];
    for k in 0..3 {
        for b in 0..batch {
            for h in 0..heads {
                let src = ((k * batch + b) * heads + h) * row;
                let dst = ((k * groups + b / lanes) * heads + h) * row;
                for e in 0..row {
                    out[dst + e] += per_sample[src + e];
                }
            }
        }
    }
    out
}

/// The f64 reference of the backward: λ = T_G⁻ᴴ g by a dense solve of the adjoint matrix
/// (diagonal A_vᴴ, C_vᴴ at (v, parent), B_vᴴ at (parent, v)), and per tree
/// ∂A_v = −Σ_r λ_v x_vᴴ, ∂B_v = −Σ_r λ_v x_parentᴴ, ∂C_v = −Σ_r λ_parent x_vᴴ, laid out as the
/// kernels write them: (3, batch, heads, nodes, d, d[, 2]).
fn reference_backward(tree: &Tree, case: &TreeCase, x: &TreeInputs, g: &[f64]) -> [Vec<f64>; 2] {
    let (n, d, r, w) = (tree.len(), case.d, case.r, case.w());
    // Blocks conjugate-transposed in place.
    let adj = |m: &[f64]| {
        let mut out = vec![0.0; m.len()];
        for blk in 0..m.len() / (d * d * w) {
            for i in 0..d {
                for j in 0..d {
                    let (src, dst) = ((blk * d * d + i * d + j) * w, (blk * d * d + j * d + i) * w);
                    out[dst] = m[src];
                    if w == 2 {
                        out[dst + 1] = -m[src + 1];
                    }
                }
            }
        }
        out
    };
    let adjoint = TreeInputs {
        a: adj(&x.a),
        b: adj(&x.c),
        c: adj(&x.b),
        u: g.to_vec(),
    };
    let lam = dense_tree_solve(tree, case, &adjoint);
    let sol = dense_tree_solve(tree, case, x);
    let trees = case.batch * case.heads;
    let mut dcoef = vec![0.0; 3 * trees * n * d * d * w];
    let get = |s: &[f64], o: usize| (s[o], if w == 2 { s[o + 1] } else { 0.0 });
    for bi in 0..case.batch {
        for hi in 0..case.heads {
            let t = bi * case.heads + hi;
            // −Σ_k λ_row[i][k] conj(x_col[j][k])
            let outer = |row: usize, col: usize, i: usize, j: usize| {
                let mut s = (0.0, 0.0);
                for k in 0..r {
                    let l = get(&lam, case.rhs_at(n, bi, hi, row, i, k));
                    let x = get(&sol, case.rhs_at(n, bi, hi, col, j, k));
                    s.0 += l.0 * x.0 + l.1 * x.1;
                    s.1 += l.1 * x.0 - l.0 * x.1;
                }
                (-s.0, -s.1)
            };
            for v in 0..n {
                for i in 0..d {
                    for j in 0..d {
                        let grads = match tree.parent(v) {
                            Some(p) => [outer(v, v, i, j), outer(v, p, i, j), outer(p, v, i, j)],
                            None => [outer(v, v, i, j), (0.0, 0.0), (0.0, 0.0)],
                        };
                        for (k, gk) in grads.iter().enumerate() {
                            let o = ((((k * trees + t) * n + v) * d + i) * d + j) * w;
                            dcoef[o] = gk.0;
                            if w == 2 {
                                dcoef[o + 1] = gk.1;
                            }
                        }
                    }
                }
            }
        }
    }
    [lam, dcoef]
}

/// Tensors of a case on the CPU in `dtype`: (a, b, c, u).
fn tensors(tree: &Tree, case: &TreeCase, x: &TreeInputs, dtype: DType) -> [Tensor; 4] {
    let n = tree.len();
    let t = |v: &[f64], s: Vec<usize>| tensor(v, &s, dtype, &Device::Cpu);
    [
        t(&x.a, case.coef_shape(n)),
        t(&x.b, case.coef_shape(n)),
        t(&x.c, case.coef_shape(n)),
        t(&x.u, case.u_shape(n)),
    ]
}

fn rounded(x: &TreeInputs, dtype: DType) -> TreeInputs {
    TreeInputs {
        a: round_to(&x.a, dtype),
        b: round_to(&x.b, dtype),
        c: round_to(&x.c, dtype),
        u: round_to(&x.u, dtype),
    }
}

/// Every tree × case × dtype, forward and backward, in shared memory and in the global
/// workspace: the kernels against the dense f64 solve and, bit for bit, the CPU twin.
fn check_kernels(trees: &[(&str, Tree)], cases: &[TreeCase], permute: bool, rng_of: (&str, u64)) {
    let (mut rng, seed) = seeded_rng(rng_of.0, rng_of.1);
    for (name, tree) in trees {
        for case in cases {
            for (dtype, tol) in DTYPES {
                let mut x = random_tree_inputs(tree, case, &mut rng);
                if permute {
                    permute_block_rows(tree, case, &mut x, &mut rng);
                }
                let x = rounded(&x, dtype);
                let [a, b, c, u] = tensors(tree, case, &x, dtype);
                let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
                let g = round_to(
                    &(0..x.u.len())
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect::<Vec<_>>(),
                    dtype,
                );
                let want_x = dense_tree_solve(tree, case, &x);
                let [want_lam, want_dcoef] = reference_backward(tree, case, &x, &g);
                let twin_x = to_vec(&tree_solve(tree, &a, &b, &c, &u, opts(case)).unwrap());
                // Scalar blocks stage their couplings in shared memory when there is room;
                // one byte less than that room leaves them in global memory.
                let staged = forward_plan(tree, &a, &b, &c, &u, opts(case), DeviceLimits::H100)
                    .unwrap()
                    .shared_bytes;
                let unstaged = DeviceLimits {
                    shared_per_block: staged - 1,
                    ..DeviceLimits::H100
                };
                let tree_layout = TreeLayout::Tree;
                let mut paths = vec![
                    ("shared", DeviceLimits::H100, tree_layout),
                    ("global", NO_SHARED, tree_layout),
                ];
                if case.d == 1 {
                    paths.push(("shared, unstaged", unstaged, tree_layout));
                }
                if case.d <= LANE_MAX_D {
                    // Trees across lanes, the most blocks (two lanes here) and the widest.
                    paths.push(("lanes", DeviceLimits::H100, TreeLayout::Lanes));
                    paths.push(("lanes, wide", FEW_SMS, TreeLayout::Lanes));
                }
                if case.d <= SWEEP_MAX_D && matches!(dtype, DType::F32 | DType::F64) {
                    paths.push(("sweep", DeviceLimits::H100, TreeLayout::Sweep));
                    // Shared coefficients: samples of a head across lanes.
                    paths.push(("sweep, wide", FEW_SMS, TreeLayout::Sweep));
                    if case.d == 1 {
                        let apart = pivots_apart(tree, case, [&a, &b, &c, &u]);
                        paths.push(("sweep, pivots apart", apart, TreeLayout::Sweep));
                    }
                }
                for (path, shared, layout) in paths {
                    let what = format!("{name}, {case:?}, {dtype:?}, {path} (seed {seed})");
                    let o = opts_in(case, layout);
                    let plans = forward_plans(tree, &a, &b, &c, &u, o, shared).unwrap();
                    let plan = plans.last().unwrap();
                    let lanes = plan.kernel.starts_with("tree_lanes_");
                    assert_eq!(lanes, layout == TreeLayout::Lanes, "{what}");
                    let sweep = plan.kernel.starts_with("tree_sweep_");
                    assert_eq!(sweep, layout == TreeLayout::Sweep, "{what}");
                    let apart = sweep && (case.d > 1 || path == "sweep, pivots apart");
                    assert_eq!(plans.len(), 1 + apart as usize, "{what}");
                    assert_eq!(plan.workspace_bytes > 0, path == "global", "{what}");
                    if case.d == 1 && layout == TreeLayout::Tree {
                        let want = KernelArg::I32((path == "shared") as i32);
                        assert_eq!(plan.args[12], want, "staged, {what}");
                    }
                    assert_eq!(plan.kernel.contains("block_"), case.d > 1, "{what}");
                    let run = run_launches(&plans, dtype, &[&x.u, &coef], seed);
                    assert_eq!(run.status, 0, "{what}");
                    let sol = &run.outputs[0];
                    let e = rel_err(sol, &want_x);
                    assert!(e < tol, "x vs dense solve: {e:e}, {what}");
                    assert_same(sol, &twin_x, &format!("x, {what}"));

                    let x_t = tensor(sol, &case.u_shape(tree.len()), dtype, &Device::Cpu);
                    let plans = backward_plans(tree, &a, &b, &c, &x_t, o, shared).unwrap();
                    let width = plans.last().unwrap().block[0] as usize;
                    let run = run_launches(&plans, dtype, &[&g, &coef, sol], seed);
                    assert_eq!(run.status, 0, "{what}");
                    let (du, dcoef) = (&run.outputs[0], &run.outputs[1]);
                    let e = rel_err(du, &want_lam);
                    assert!(e < tol, "∂u vs dense adjoint solve: {e:e}, {what}");
                    // Shared coefficients in lanes: one gradient row per block of samples.
                    let grouped = case.shared && (lanes || sweep);
                    let want_dcoef = match grouped {
                        true => group_sums(&want_dcoef, case, width),
                        false => want_dcoef.clone(),
                    };
                    let e = rel_err(dcoef, &want_dcoef);
                    assert!(e < 4.0 * tol, "∂coef vs f64 reference: {e:e}, {what}");

                    let g_t = tensor(&g, &case.u_shape(tree.len()), dtype, &Device::Cpu);
                    let twin =
                        tree_solve_backward(tree, &a, &b, &c, &x_t, &g_t, opts(case)).unwrap();
                    assert_same(du, &to_vec(&twin.u), &format!("∂u, {what}"));
                    if !case.shared {
                        let twin_dcoef = [twin.a, twin.b, twin.c].map(|t| to_vec(&t)).concat();
                        assert_same(dcoef, &twin_dcoef, &format!("∂coef, {what}"));
                    }
                }
            }
        }
    }
}

#[test]
fn tree_kernels_match_the_dense_solve_and_the_cpu_twin() {
    check_kernels(&trees(), &cases(), false, ("tree kernels", 12));
}

/// d × d blocks: d = 2, 3, 4 on every tree, shared and per-sample, real and complex, r ≥ 1;
/// rows permuted so that the LU pivots.
#[test]
fn block_kernels_match_the_dense_solve_and_the_cpu_twin() {
    let case = |batch, heads, d, r, shared, complex| TreeCase {
        batch,
        heads,
        d,
        r,
        shared,
        complex,
    };
    let cases = [
        case(2, 2, 2, 1, false, false),
        case(3, 2, 3, 2, true, false),
        case(2, 1, 2, 2, false, true),
        case(2, 2, 4, 1, true, true),
    ];
    check_kernels(&trees(), &cases, true, ("block kernels", 15));
}

/// The largest blocks the layer offers (d = 16) and an odd size, on a few trees.
/// Samples with blocks of their own, nine of them: the CPU twin solves eight together in SIMD
/// lanes, each lane pivoting on its own rows, and the kernels tree by tree; they agree to the
/// bit (d = 2, 3 and 5, the last with its size read at run time).
#[test]
fn block_kernels_match_the_cpu_lanes_of_samples_with_their_own_blocks() {
    let trees: Vec<_> = trees()
        .into_iter()
        .filter(|(name, _)| ["perfect 4-ary 64", "ragged binary 23"].contains(name))
        .collect();
    let cases = [(2, 1, false), (3, 2, true), (5, 1, false)].map(|(d, r, complex)| TreeCase {
        batch: 9,
        heads: 1,
        d,
        r,
        shared: false,
        complex,
    });
    check_kernels(
        &trees,
        &cases,
        true,
        ("block kernels, own blocks in lanes", 20),
    );
}

#[test]
fn block_kernels_with_large_blocks() {
    let trees: Vec<_> = trees()
        .into_iter()
        .filter(|(name, _)| ["perfect 4-ary 64", "ragged binary 23", "single node"].contains(name))
        .collect();
    let cases = [5, 16].map(|d| TreeCase {
        batch: 2,
        heads: 1,
        d,
        r: 2,
        shared: false,
        complex: false,
    });
    check_kernels(&trees, &cases, true, ("block kernels, large blocks", 16));
}

/// Large trees: the forward of `tree` with d × d blocks (per-sample, or shared by the batch)
/// in shared memory (H100) and in the global workspace, and in the layout Auto takes, equals
/// the CPU twin.
fn check_large_tree(
    name: &str,
    tree: &Tree,
    (d, shared): (usize, bool),
    dtype: DType,
    rng_of: (&str, u64),
) {
    let (mut rng, seed) = seeded_rng(rng_of.0, rng_of.1);
    let case = TreeCase {
        batch: if shared { 3 } else { 1 },
        heads: 2,
        d,
        r: 1,
        shared,
        complex: false,
    };
    let mut x = random_tree_inputs(tree, &case, &mut rng);
    permute_block_rows(tree, &case, &mut x, &mut rng);
    let x = rounded(&x, dtype);
    let [a, b, c, u] = tensors(tree, &case, &x, dtype);
    let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
    let twin = to_vec(&tree_solve(tree, &a, &b, &c, &u, opts(&case)).unwrap());
    // Auto (forward): the sweep for shared coefficients (these trees are not small), else a
    // block per tree.
    for (shared, layout) in [
        (DeviceLimits::H100, TreeLayout::Tree),
        (NO_SHARED, TreeLayout::Tree),
        (DeviceLimits::H100, TreeLayout::Auto),
    ] {
        let what = format!("{name}, {case:?}, {shared:?}, {layout:?} (seed {seed})");
        let plans = forward_plans(tree, &a, &b, &c, &u, opts_in(&case, layout), shared).unwrap();
        let sweeps = case.shared && layout == TreeLayout::Auto;
        assert_eq!(plans.len(), 1 + sweeps as usize, "{what}");
        let run = run_launches(&plans, dtype, &[&x.u, &coef], seed);
        assert_same(&run.outputs[0], &twin, &what);
    }
}

/// A 4,096-leaf binary tree's state fits in shared memory only with an opt-in above 48 KiB;
/// Path-X's 16,384-leaf binary tree goes to the global workspace even on H100, and with shared
/// coefficients takes the sweep.
#[test]
fn tree_kernels_on_large_trees_in_shared_and_global_memory() {
    let rng_of = ("tree kernels, large trees", 13);
    for (name, leaves, arity, dtype) in [
        ("binary 4096", 4096, 2, DType::F32),
        ("binary 16384", 16384, 2, DType::F32),
    ] {
        let tree = Tree::perfect(leaves, arity).unwrap();
        check_large_tree(name, &tree, (1, false), dtype, rng_of);
    }
    // Coefficients shared by the batch: the sweep, in blocks of a thread per parent of the
    // leaves (8,192 here: SWEEP_WIDE_THREADS, several parents each), its pivots apart.
    let path_x = Tree::perfect(16384, 2).unwrap();
    check_large_tree(
        "binary 16384, shared",
        &path_x,
        (1, true),
        DType::F32,
        rng_of,
    );
    let quad = Tree::quad(28, 28).unwrap();
    check_large_tree("quad 28x28", &quad, (1, false), DType::F64, rng_of);
}

/// Levels wider than the block's 256 threads: threads own several parents in turn, reusing
/// their LU scratch (zMNIST's quad tree; a 1,024-leaf binary tree has 512 parents on level 1);
/// 4 × 4 blocks shared by the batch on 1,024 leaves, which the lanes do not hold: the sweep.
#[test]
fn block_kernels_on_large_trees_in_shared_and_global_memory() {
    let rng_of = ("block kernels, large trees", 18);
    let binary = Tree::perfect(1024, 2).unwrap();
    check_large_tree("binary 1024", &binary, (2, false), DType::F32, rng_of);
    check_large_tree("binary 1024", &binary, (2, true), DType::F64, rng_of);
    let quad = Tree::quad(32, 32).unwrap();
    check_large_tree("quad 32x32", &quad, (3, false), DType::F64, rng_of);
    let quad = Tree::perfect(1024, 4).unwrap();
    check_large_tree("4-ary 1024", &quad, (4, true), DType::F32, rng_of);
}

/// A singular pivot: the status word names the node (1 + node), forward and backward, in the
/// shared-memory and the global path.
fn check_singular_pivot(d: usize, rng_of: (&str, u64)) {
    let (mut rng, seed) = seeded_rng(rng_of.0, rng_of.1);
    for (tree, node) in [
        (Tree::perfect(16, 4).unwrap(), 5),
        (Tree::ragged(1, 2).unwrap(), 0),
    ] {
        let case = TreeCase {
            batch: 2,
            heads: 2,
            d,
            r: 1,
            shared: false,
            complex: false,
        };
        let n = tree.len();
        let mut x = random_tree_inputs(&tree, &case, &mut rng);
        // A leaf's pivot is its own A_v (a single node's is the root's): zero its first column
        // in one tree.
        for i in 0..d {
            x.a[case.coef_at(n, 1, 0, node, i, 0)] = 0.0;
        }
        let [a, b, c, u] = tensors(&tree, &case, &x, DType::F32);
        let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
        let mut paths = vec![
            (DeviceLimits::H100, TreeLayout::Tree),
            (NO_SHARED, TreeLayout::Tree),
        ];
        if d <= LANE_MAX_D {
            paths.push((DeviceLimits::H100, TreeLayout::Lanes));
        }
        if d <= SWEEP_MAX_D {
            paths.push((DeviceLimits::H100, TreeLayout::Sweep));
        }
        if d == 1 {
            paths.push((
                pivots_apart(&tree, &case, [&a, &b, &c, &u]),
                TreeLayout::Sweep,
            ));
        }
        for (shared, layout) in paths {
            let what =
                format!("{n} nodes, d = {d}, node {node}, {shared:?}, {layout:?} (seed {seed})");
            let o = opts_in(&case, layout);
            // The first launch meets the pivot (tree_pivots, where the sweep takes it apart).
            let plan = forward_plans(&tree, &a, &b, &c, &u, o, shared).unwrap();
            let inputs: &[&[f64]] = match plan.len() {
                1 => &[&x.u, &coef],
                _ => &[&coef],
            };
            let fwd = run(&plan[0], DType::F32, inputs, Order::Ascending);
            assert_eq!(fwd.unwrap().status, 1 + node as i32, "forward, {what}");
            let plan = backward_plans(&tree, &a, &b, &c, &u, o, shared).unwrap();
            let inputs: &[&[f64]] = match plan.len() {
                1 => &[&x.u, &coef, &x.u],
                _ => &[&coef],
            };
            let bwd = run(&plan[0], DType::F32, inputs, Order::Ascending);
            assert_eq!(bwd.unwrap().status, 1 + node as i32, "backward, {what}");
        }
    }
}

#[test]
fn tree_kernels_report_a_singular_pivot_with_its_node() {
    check_singular_pivot(1, ("tree kernels, singular pivot", 14));
}

#[test]
fn block_kernels_report_a_singular_pivot_with_its_node() {
    check_singular_pivot(3, ("block kernels, singular pivot", 17));
}

/// A workspace budget smaller than one slice per tree: the grid shrinks to what the budget
/// holds and each block solves several trees in turn, forward and backward, with results equal
/// to the CPU twin's.
#[test]
fn tree_and_block_kernels_take_trees_in_turn_within_a_workspace_budget() {
    let (mut rng, seed) = seeded_rng("tree kernels, workspace budget", 19);
    let tree = Tree::ragged(40, 3).unwrap();
    for (d, complex) in [(1, false), (1, true), (2, false), (3, true)] {
        let case = TreeCase {
            batch: 3,
            heads: 3,
            d,
            r: 2,
            shared: false,
            complex,
        };
        let mut x = random_tree_inputs(&tree, &case, &mut rng);
        permute_block_rows(&tree, &case, &mut x, &mut rng);
        let dtype = DType::F32;
        let x = rounded(&x, dtype);
        let [a, b, c, u] = tensors(&tree, &case, &x, dtype);
        let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
        let g = round_to(&x.u.iter().map(|v| 0.5 - v).collect::<Vec<_>>(), dtype);
        let twin = tree_solve(&tree, &a, &b, &c, &u, opts(&case)).unwrap();
        let g_t = tensor(&g, &case.u_shape(tree.len()), dtype, &Device::Cpu);
        let twin_grads = tree_solve_backward(&tree, &a, &b, &c, &twin, &g_t, opts(&case)).unwrap();
        let twin_dcoef = [twin_grads.a, twin_grads.b, twin_grads.c]
            .map(|t| to_vec(&t))
            .concat();
        let full = forward_plan(&tree, &a, &b, &c, &u, opts(&case), NO_SHARED).unwrap();
        let per_tree = full.workspace_bytes / 9;
        // Room for two slices and a half: a grid of two blocks for nine trees.
        let limits = DeviceLimits {
            workspace_bytes: 5 * per_tree / 2,
            ..NO_SHARED
        };
        let what = format!("d = {d}, complex {complex} (seed {seed})");
        let plan = forward_plan(&tree, &a, &b, &c, &u, opts(&case), limits).unwrap();
        assert_eq!(
            (plan.grid[0], plan.workspace_bytes),
            (2, 2 * per_tree),
            "{what}"
        );
        let run = run_in_every_order(&plan, dtype, &[&x.u, &coef], seed);
        assert_same(&run.outputs[0], &to_vec(&twin), &format!("x, {what}"));
        let sol = &run.outputs[0];
        let plan = backward_plan(&tree, &a, &b, &c, &twin, opts(&case), limits).unwrap();
        assert_eq!(plan.grid[0], 2, "{what}");
        let run = run_in_every_order(&plan, dtype, &[&g, &coef, sol], seed);
        assert_same(
            &run.outputs[0],
            &to_vec(&twin_grads.u),
            &format!("∂u, {what}"),
        );
        assert_same(&run.outputs[1], &twin_dcoef, &format!("∂coef, {what}"));
    }
}

/// The index division the tree kernels use in their loops over lanes and right-hand sides
/// (`Divisor`, kernels/tree_steps.cuh) equals integer division: every divisor up to 4,096 and
/// around every power of two, random ones, each with the indices around its multiples, the
/// largest index and random ones.
#[test]
fn index_division_is_exact() {
    let (mut rng, seed) = seeded_rng("index_division_is_exact", 5);
    let mut divisors: Vec<i32> = (1..=4096).collect();
    for s in 12..31 {
        let p = 1i64 << s;
        divisors.extend([p - 1, p, p + 1].map(|d| d.min(i32::MAX as i64) as i32));
    }
    divisors.extend((0..2000).map(|_| rng.random_range(1..=i32::MAX)));
    for d in divisors {
        let mut indices = vec![0, 1, i32::MAX, i32::MAX - 1];
        for k in [1i64, 2, 3, 7, (i32::MAX / d) as i64] {
            let m = k * d as i64;
            indices.extend(
                [m - 1, m, m + 1]
                    .iter()
                    .filter(|&&i| (0..=i32::MAX as i64).contains(&i))
                    .map(|&i| i as i32),
            );
        }
        indices.extend((0..16).map(|_| rng.random_range(0..=i32::MAX)));
        for n in indices {
            assert_eq!(
                kernels_on_cpu::divide(n, d),
                n / d,
                "{n} / {d} (seed {seed})"
            );
        }
    }
}
