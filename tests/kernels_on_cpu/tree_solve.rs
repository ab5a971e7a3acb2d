//! `tree_fwd_*` and `tree_bwd_*` of kernels/tree_solve.cu through the harness, with the per-node
//! state in dynamic shared memory and in the global workspace.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::plan::SharedMemory;
use myosotis::ops::tree_solve::cuda::{backward_plan, forward_plan};
use myosotis::ops::{tree_solve, tree_solve_backward, TreeSolveOptions};
use myosotis::tree::Tree;
use rand::Rng;

use crate::common::*;
use crate::exec::{round_to, run, run_in_every_order};
use crate::{assert_same, DTYPES};

/// A device that grants no shared memory: the plan puts every tree in the global workspace.
const NO_SHARED: SharedMemory = SharedMemory { per_block: 0 };

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

fn opts(case: &TreeCase) -> TreeSolveOptions {
    TreeSolveOptions {
        complex: case.complex,
    }
}

/// Complex conjugates of interleaved (re, im) values; real values as they are.
fn conj(v: &[f64], complex: bool) -> Vec<f64> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| if complex && i % 2 == 1 { -x } else { x })
        .collect()
}

/// The f64 reference of the backward: λ = T_G⁻ᴴ g by a dense solve of the adjoint matrix
/// (diagonal conj(A), conj(C_v) at (v, parent), conj(B_v) at (parent, v)), and per tree
/// ∂A_v = −Σ_r λ_v conj(x_v), ∂B_v = −Σ_r λ_v conj(x_parent), ∂C_v = −Σ_r λ_parent conj(x_v),
/// laid out as the kernel writes them: (3, batch, heads, nodes[, 2]).
fn reference_backward(tree: &Tree, case: &TreeCase, x: &TreeInputs, g: &[f64]) -> [Vec<f64>; 2] {
    let adjoint = TreeInputs {
        a: conj(&x.a, case.complex),
        b: conj(&x.c, case.complex),
        c: conj(&x.b, case.complex),
        u: g.to_vec(),
    };
    let lam = dense_tree_solve(tree, case, &adjoint);
    let sol = dense_tree_solve(tree, case, x);
    let (n, r, w) = (tree.len(), case.r, case.w());
    let trees = case.batch * case.heads;
    let mut dcoef = vec![0.0; 3 * trees * n * w];
    let get = |s: &[f64], o: usize| (s[o], if w == 2 { s[o + 1] } else { 0.0 });
    for bi in 0..case.batch {
        for hi in 0..case.heads {
            let t = bi * case.heads + hi;
            // −Σ_k row[k] conj(col[k])
            let outer = |row: usize, col: usize| {
                let mut s = (0.0, 0.0);
                for k in 0..r {
                    let l = get(&lam, case.rhs_at(n, bi, hi, row, 0, k));
                    let x = get(&sol, case.rhs_at(n, bi, hi, col, 0, k));
                    s.0 += l.0 * x.0 + l.1 * x.1;
                    s.1 += l.1 * x.0 - l.0 * x.1;
                }
                (-s.0, -s.1)
            };
            for v in 0..n {
                let grads = match tree.parent(v) {
                    Some(p) => [outer(v, v), outer(v, p), outer(p, v)],
                    None => [outer(v, v), (0.0, 0.0), (0.0, 0.0)],
                };
                for (k, gk) in grads.iter().enumerate() {
                    let o = ((k * trees + t) * n + v) * w;
                    dcoef[o] = gk.0;
                    if w == 2 {
                        dcoef[o + 1] = gk.1;
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

#[test]
fn tree_kernels_match_the_dense_solve_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("tree kernels", 12);
    for (name, tree) in trees() {
        for case in cases() {
            for (dtype, tol) in DTYPES {
                let x = rounded(&random_tree_inputs(&tree, &case, &mut rng), dtype);
                let [a, b, c, u] = tensors(&tree, &case, &x, dtype);
                let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
                let g = round_to(
                    &(0..x.u.len())
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect::<Vec<_>>(),
                    dtype,
                );
                let want_x = dense_tree_solve(&tree, &case, &x);
                let [want_lam, want_dcoef] = reference_backward(&tree, &case, &x, &g);
                let twin_x = to_vec(&tree_solve(&tree, &a, &b, &c, &u, opts(&case)).unwrap());
                for (path, shared) in [("shared", SharedMemory::H100), ("global", NO_SHARED)] {
                    let what = format!("{name}, {case:?}, {dtype:?}, {path} (seed {seed})");
                    let plan = forward_plan(&tree, &a, &b, &c, &u, opts(&case), shared).unwrap();
                    assert_eq!(plan.workspace_bytes > 0, path == "global", "{what}");
                    let run = run_in_every_order(&plan, dtype, &[&x.u, &coef], seed);
                    assert_eq!(run.status, 0, "{what}");
                    let sol = &run.outputs[0];
                    let e = rel_err(sol, &want_x);
                    assert!(e < tol, "x vs dense solve: {e:e}, {what}");
                    assert_same(sol, &twin_x, &format!("x, {what}"));

                    let x_t = tensor(sol, &case.u_shape(tree.len()), dtype, &Device::Cpu);
                    let plan = backward_plan(&tree, &a, &b, &c, &x_t, opts(&case), shared).unwrap();
                    let run = run_in_every_order(&plan, dtype, &[&g, &coef, sol], seed);
                    assert_eq!(run.status, 0, "{what}");
                    let (du, dcoef) = (&run.outputs[0], &run.outputs[1]);
                    let e = rel_err(du, &want_lam);
                    assert!(e < tol, "∂u vs dense adjoint solve: {e:e}, {what}");
                    let e = rel_err(dcoef, &want_dcoef);
                    assert!(e < 4.0 * tol, "∂coef vs f64 reference: {e:e}, {what}");

                    let g_t = tensor(&g, &case.u_shape(tree.len()), dtype, &Device::Cpu);
                    let twin =
                        tree_solve_backward(&tree, &a, &b, &c, &x_t, &g_t, opts(&case)).unwrap();
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

/// Large trees: a 4,096-leaf binary tree's state fits in shared memory only with an opt-in
/// above 48 KiB; Path-X's 16,384-leaf binary tree goes to the global workspace even on H100.
/// Both paths run and equal the CPU twin.
#[test]
fn tree_kernels_on_large_trees_in_shared_and_global_memory() {
    let (mut rng, seed) = seeded_rng("tree kernels, large trees", 13);
    for (name, tree, dtype) in [
        ("binary 4096", Tree::perfect(4096, 2).unwrap(), DType::F32),
        ("quad 28x28", Tree::quad(28, 28).unwrap(), DType::F64),
        ("binary 16384", Tree::perfect(16384, 2).unwrap(), DType::F32),
    ] {
        let case = TreeCase {
            batch: 1,
            heads: 2,
            d: 1,
            r: 1,
            shared: false,
            complex: false,
        };
        let x = rounded(&random_tree_inputs(&tree, &case, &mut rng), dtype);
        let [a, b, c, u] = tensors(&tree, &case, &x, dtype);
        let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
        let twin = to_vec(&tree_solve(&tree, &a, &b, &c, &u, opts(&case)).unwrap());
        for shared in [SharedMemory::H100, NO_SHARED] {
            let what = format!("{name}, {shared:?} (seed {seed})");
            let plan = forward_plan(&tree, &a, &b, &c, &u, opts(&case), shared).unwrap();
            let run = run_in_every_order(&plan, dtype, &[&x.u, &coef], seed);
            assert_same(&run.outputs[0], &twin, &what);
        }
    }
}

/// The workspace decisions, per device: bytes per tree n·(1 + r)·(4 or 8)·(1 or 2).
#[test]
fn tree_plans_place_the_workspace_by_the_device_limit() {
    let o = TreeSolveOptions::default();
    let oc = TreeSolveOptions { complex: true };
    let plan = |leaves: usize, complex: bool, dtype: DType, shared: SharedMemory| {
        let tree = Tree::perfect(leaves, 2).unwrap();
        let n = tree.len();
        let w = if complex { vec![2] } else { vec![] };
        let z = |s: &[usize]| Tensor::zeros([s, &w[..]].concat(), dtype, &Device::Cpu).unwrap();
        let (coef, u) = (z(&[3, n, 1, 1]), z(&[2, 3, n, 1, 1]));
        forward_plan(
            &tree,
            &coef,
            &coef,
            &coef,
            &u,
            if complex { oc } else { o },
            shared,
        )
        .unwrap()
    };
    // 4,096-leaf binary, f32 real: 8,191 · 2 · 4 = 65,528 bytes: opt-in on V100 and H100.
    let p = plan(4096, false, DType::F32, SharedMemory::V100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (65_528, 0));
    assert!(p.opts_in_to_shared());
    assert_eq!(p.args[11], myosotis::ops::plan::KernelArg::Null);
    assert_eq!((p.grid, p.block), ([6, 1, 1], [256, 1, 1]));
    // Complex: 131,056 bytes, over V100's 96 KiB, under H100's 227 KiB.
    let p = plan(4096, true, DType::F32, SharedMemory::V100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (0, 6 * 131_056));
    assert_eq!(p.args[11], myosotis::ops::plan::KernelArg::Workspace);
    let p = plan(4096, true, DType::F32, SharedMemory::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (131_056, 0));
    // Path-X, 16,384 leaves, f32 real: 262,136 bytes: global on H100.
    let p = plan(16384, false, DType::F32, SharedMemory::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (0, 6 * 262_136));
    assert!(!p.opts_in_to_shared());
    // Small trees need no opt-in.
    let p = plan(64, false, DType::F64, SharedMemory::H100);
    assert_eq!(p.shared_bytes, 127 * 2 * 8);
    assert!(!p.opts_in_to_shared());
}

/// A singular pivot: the status word names the node (1 + node), forward and backward, in the
/// shared-memory and the global path.
#[test]
fn tree_kernels_report_a_singular_pivot_with_its_node() {
    let (mut rng, seed) = seeded_rng("tree kernels, singular pivot", 14);
    for (tree, node) in [
        (Tree::perfect(16, 4).unwrap(), 5),
        (Tree::ragged(1, 2).unwrap(), 0),
    ] {
        let case = TreeCase {
            batch: 2,
            heads: 2,
            d: 1,
            r: 1,
            shared: false,
            complex: false,
        };
        let n = tree.len();
        let mut x = random_tree_inputs(&tree, &case, &mut rng);
        // A leaf's pivot is its own A_v (a single node's is the root's): zero it in one tree.
        x.a[case.coef_at(n, 1, 0, node, 0, 0)] = 0.0;
        let [a, b, c, u] = tensors(&tree, &case, &x, DType::F32);
        let coef = [x.a.clone(), x.b.clone(), x.c.clone()].concat();
        for shared in [SharedMemory::H100, NO_SHARED] {
            let what = format!("{n} nodes, node {node}, {shared:?} (seed {seed})");
            let plan = forward_plan(&tree, &a, &b, &c, &u, opts(&case), shared).unwrap();
            let fwd = run(
                &plan,
                DType::F32,
                &[&x.u, &coef],
                kernels_on_cpu::Order::Ascending,
            );
            assert_eq!(fwd.unwrap().status, 1 + node as i32, "forward, {what}");
            let plan = backward_plan(&tree, &a, &b, &c, &u, opts(&case), shared).unwrap();
            let bwd = run(
                &plan,
                DType::F32,
                &[&x.u, &coef, &x.u],
                kernels_on_cpu::Order::Ascending,
            );
            assert_eq!(bwd.unwrap().status, 1 + node as i32, "backward, {what}");
        }
    }
}
