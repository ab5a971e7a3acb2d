//! The CUDA tree-solve kernels against the CPU twin and the dense f64 solve, forward and
//! backward. Compiled with `--features cuda` (CI compiles them); each test prints why it is
//! skipped when no CUDA device can be opened.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use myosotis::ops::tree_solve::cuda::LANE_MAX_D;
use myosotis::ops::{check_pivots, tree_solve, TreeLayout, TreeSolveOptions};
use myosotis::tree::Tree;
use rand::Rng;

/// x and the gradients of Σ w ⊙ x with respect to (u, a, b, c), on `dev` in `dtype`, the
/// CUDA kernels in `layout`; None where that layout, asked for by name, refuses the solve (its
/// trees do not fit in a block's shared memory).
fn forward_backward(
    tree: &Tree,
    case: &TreeCase,
    x: &TreeInputs,
    w: &[f64],
    (dev, layout): (&Device, TreeLayout),
    dtype: DType,
) -> Option<[Vec<f64>; 5]> {
    let n = tree.len();
    let var = |v: &[f64], s: Vec<usize>| Var::from_tensor(&tensor(v, &s, dtype, dev)).unwrap();
    let (a, b, c, u) = (
        var(&x.a, case.coef_shape(n)),
        var(&x.b, case.coef_shape(n)),
        var(&x.c, case.coef_shape(n)),
        var(&x.u, case.u_shape(n)),
    );
    let opts = TreeSolveOptions {
        complex: case.complex,
        layout,
    };
    let out = tree_solve(
        tree,
        a.as_tensor(),
        b.as_tensor(),
        c.as_tensor(),
        u.as_tensor(),
        opts,
    );
    let out = match out {
        Err(e) if layout != TreeLayout::Auto && e.to_string().contains("layout needs") => {
            return None;
        }
        out => out.unwrap(),
    };
    let w: Tensor = tensor(w, out.dims(), dtype, dev);
    let grads = (&out * w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |v: &Var| {
        grads
            .get(v)
            .map_or_else(|| vec![0.0; v.elem_count()], to_vec)
    };
    Some([to_vec(&out), g(&u), g(&a), g(&b), g(&c)])
}

/// Every tree × case in f32 and f64, in every layout that takes the blocks: x against the dense solve
/// (the f64 CPU twin for large systems), x and every gradient against the CPU twin.
fn check(gpu: &Device, cases: &[TreeCase], rng_of: (&str, u64)) {
    let (mut rng, seed) = seeded_rng(rng_of.0, rng_of.1);
    let trees = [
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("ragged 3-ary 100", Tree::ragged(100, 3).unwrap()),
        ("quad 28x28", Tree::quad(28, 28).unwrap()),
        ("chain 300", Tree::chain(300).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ];
    for (name, tree) in &trees {
        for case in cases {
            let x = random_tree_inputs(tree, case, &mut rng);
            let w: Vec<f64> = (0..x.u.len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            // The dense solve is O((n d)³): past a few thousand unknowns (zMNIST's tree with
            // d = 16: 16,752) it took minutes of the GPU machine's time, so there the reference
            // is the CPU twin in f64, which the CPU suite checks against the dense solve.
            let want = match tree.len() * case.d <= 4096 {
                true => dense_tree_solve(tree, case, &x),
                false => {
                    let cpu = (&Device::Cpu, TreeLayout::Auto);
                    forward_backward(tree, case, &x, &w, cpu, DType::F64).unwrap()[0].clone()
                }
            };
            let layouts: &[TreeLayout] = match case.d {
                d if d <= LANE_MAX_D => &[
                    TreeLayout::Auto,
                    TreeLayout::Tree,
                    TreeLayout::Lanes,
                    TreeLayout::Sweep,
                ],
                _ => &[TreeLayout::Auto, TreeLayout::Tree],
            };
            for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
                let cpu =
                    forward_backward(tree, case, &x, &w, (&Device::Cpu, TreeLayout::Auto), dtype)
                        .unwrap();
                for &layout in layouts {
                    let what = format!("{layout:?}, {name}, {case:?} (seed {seed})");
                    let Some(cuda) = forward_backward(tree, case, &x, &w, (gpu, layout), dtype)
                    else {
                        println!("{dtype:?} {what}: the layout refuses it (shared memory)");
                        continue;
                    };
                    let e = rel_err(&cuda[0], &want);
                    assert!(e < tol, "{dtype:?} x vs dense: {e:e}, {what}");
                    for (k, grad) in ["x", "du", "da", "db", "dc"].iter().enumerate() {
                        let e = rel_err(&cuda[k], &cpu[k]);
                        assert!(e < 20.0 * tol, "{dtype:?} {grad} CUDA vs CPU {e:e}, {what}");
                    }
                }
            }
        }
    }
}

fn case(batch: usize, d: usize, r: usize, shared: bool, complex: bool) -> TreeCase {
    TreeCase {
        batch,
        heads: 3,
        d,
        r,
        shared,
        complex,
    }
}

#[test]
fn cuda_tree_solve_matches_cpu_twin_and_dense_solve() {
    let Some(gpu) = gpu("cuda_tree_solve_matches_cpu_twin_and_dense_solve") else {
        return;
    };
    let cases = [
        case(2, 1, 1, false, false),
        case(9, 1, 2, true, false),
        case(2, 1, 3, false, true),
        case(2, 1, 1, true, true),
    ];
    check(&gpu, &cases, ("cuda tree solve", 21));
}

/// d × d blocks (`tree_block_*` kernels): the block sizes the layer offers, up to 16.
#[test]
fn cuda_block_tree_solve_matches_cpu_twin_and_dense_solve() {
    let Some(gpu) = gpu("cuda_block_tree_solve_matches_cpu_twin_and_dense_solve") else {
        return;
    };
    let cases = [
        case(2, 2, 1, false, false),
        case(5, 3, 2, true, false),
        case(2, 4, 2, false, true),
        case(2, 16, 1, true, false),
    ];
    check(&gpu, &cases, ("cuda block tree solve", 22));
}

#[test]
fn cuda_large_trees_in_shared_and_global_workspace() {
    let Some(gpu) = gpu("cuda_large_trees_in_shared_and_global_workspace") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda large trees", 103);
    // 4,096-leaf 4-ary and 16,384-leaf binary (Path-X) trees, and 4 × 4 blocks on 1,024
    // leaves, in every layout that takes them.
    for (name, tree, d) in [
        ("4-ary 4096", Tree::perfect(4096, 4).unwrap(), 1),
        ("binary 16384", Tree::perfect(16384, 2).unwrap(), 1),
        ("4-ary 1024, d = 4", Tree::perfect(1024, 4).unwrap(), 4),
    ] {
        let case = TreeCase {
            batch: 2,
            heads: 2,
            d,
            r: 1,
            shared: true,
            complex: false,
        };
        let x = random_tree_inputs(&tree, &case, &mut rng);
        let w: Vec<f64> = (0..x.u.len())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let cpu = (&Device::Cpu, TreeLayout::Auto);
        let cpu = forward_backward(&tree, &case, &x, &w, cpu, DType::F64).unwrap();
        // Auto takes trees across lanes for the first (two fit in shared memory) and the sweep
        // for the others (one tree's right-hand sides fit), which the lanes do not take.
        let layouts: &[TreeLayout] = match tree.len() < 10_000 {
            true => &[TreeLayout::Auto, TreeLayout::Tree, TreeLayout::Sweep],
            false => &[TreeLayout::Auto, TreeLayout::Tree],
        };
        for &layout in layouts {
            let cuda = forward_backward(&tree, &case, &x, &w, (&gpu, layout), DType::F32)
                .expect("the layout takes these trees");
            for (k, what) in ["x", "du", "da", "db", "dc"].iter().enumerate() {
                let e = rel_err(&cuda[k], &cpu[k]);
                assert!(
                    e < 1e-4,
                    "{what}: CUDA f32 vs CPU f64 {e:e}, {name}, {layout:?} (seed {seed})"
                );
            }
        }
    }
}

/// A singular pivot does not stop the solve (that would wait for the device); the next
/// `check_pivots` names the node, and the one after it is clear again.
#[test]
fn cuda_singular_pivot_is_reported_by_check_pivots() {
    let Some(gpu) = gpu("cuda_singular_pivot_is_reported_by_check_pivots") else {
        return;
    };
    check_pivots(&gpu).unwrap();
    for d in [1, 3] {
        let tree = Tree::perfect(4, 2).unwrap();
        let n = tree.len();
        let eye = Tensor::eye(d, DType::F32, &gpu).unwrap();
        let blocks = eye.unsqueeze(0).unwrap().repeat((n, 1, 1)).unwrap();
        let keep = Tensor::from_vec(
            (0..n).map(|v| if v == 1 { 0f32 } else { 1.0 }).collect(),
            (n, 1, 1),
            &gpu,
        )
        .unwrap();
        let a = blocks.broadcast_mul(&keep).unwrap().unsqueeze(0).unwrap();
        let small = (a.ones_like().unwrap() * 0.1).unwrap();
        let u = Tensor::ones((2, 1, n, d, 1), DType::F32, &gpu).unwrap();
        let opts = TreeSolveOptions::default();
        tree_solve(&tree, &a, &small, &small, &u, opts).unwrap();
        let err = check_pivots(&gpu).unwrap_err().to_string();
        assert!(
            err.contains("node 1") && err.contains("singular"),
            "d = {d}: {err}"
        );
        check_pivots(&gpu).unwrap();
    }
}

/// `tree_solve_backward` (what `myo bench tree --backward` times) runs on CUDA and equals the
/// CPU's.
#[test]
fn cuda_public_backward_equals_the_cpu() {
    let Some(gpu) = gpu("cuda_public_backward_equals_the_cpu") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda public backward", 21);
    let tree = Tree::perfect(64, 4).unwrap();
    let case = TreeCase {
        batch: 3,
        heads: 2,
        d: 1,
        r: 2,
        shared: true,
        complex: true,
    };
    let n = tree.len();
    let x = random_tree_inputs(&tree, &case, &mut rng);
    let g: Vec<f64> = (0..x.u.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let opts = TreeSolveOptions {
        complex: true,
        ..Default::default()
    };
    let grads = |dev: &Device| {
        let t = |v: &[f64], s: Vec<usize>| tensor(v, &s, DType::F64, dev);
        let (a, b, c) = (
            t(&x.a, case.coef_shape(n)),
            t(&x.b, case.coef_shape(n)),
            t(&x.c, case.coef_shape(n)),
        );
        let u = t(&x.u, case.u_shape(n));
        let sol = tree_solve(&tree, &a, &b, &c, &u, opts).unwrap();
        let gr = t(&g, case.u_shape(n));
        let gr = myosotis::ops::tree_solve_backward(&tree, &a, &b, &c, &sol, &gr, opts).unwrap();
        [gr.u, gr.a, gr.b, gr.c].map(|t| to_vec(&t))
    };
    let (cuda, cpu) = (grads(&gpu), grads(&Device::Cpu));
    for (k, what) in ["du", "da", "db", "dc"].iter().enumerate() {
        let e = rel_err(&cuda[k], &cpu[k]);
        assert!(e < 1e-12, "{what}: CUDA vs CPU {e:e} (seed {seed})");
    }
}
