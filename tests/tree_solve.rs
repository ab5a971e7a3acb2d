//! The tree solve on the CPU against a dense f64 solve of the assembled T_G, central finite
//! differences, the linear scan on a chain (paper §3.4), and the Listing-1 candle reference.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::trees::permute_block_rows;
use common::*;
use myosotis::ops::{
    linear_scan, tree_solve, tree_solve_backward, tree_solve_reference, ScanOptions,
    TreeSolveOptions,
};
use myosotis::tree::Tree;
use rand::rngs::StdRng;
use rand::Rng;

struct Vars {
    a: Var,
    b: Var,
    c: Var,
    u: Var,
}

fn vars(tree: &Tree, case: &TreeCase, x: &TreeInputs, dtype: DType) -> Vars {
    let n = tree.len();
    let v = |s: &[f64], shape: Vec<usize>| {
        Var::from_tensor(&tensor(s, &shape, dtype, &Device::Cpu)).unwrap()
    };
    Vars {
        a: v(&x.a, case.coef_shape(n)),
        b: v(&x.b, case.coef_shape(n)),
        c: v(&x.c, case.coef_shape(n)),
        u: v(&x.u, case.u_shape(n)),
    }
}

fn opts(case: &TreeCase) -> TreeSolveOptions {
    TreeSolveOptions {
        complex: case.complex,
        ..Default::default()
    }
}

type Solve =
    fn(&Tree, &Tensor, &Tensor, &Tensor, &Tensor, TreeSolveOptions) -> candle_core::Result<Tensor>;

/// `f` applied to the variables' tensors.
fn apply(f: Solve, tree: &Tree, case: &TreeCase, v: &Vars) -> Tensor {
    f(
        tree,
        v.a.as_tensor(),
        v.b.as_tensor(),
        v.c.as_tensor(),
        v.u.as_tensor(),
        opts(case),
    )
    .unwrap()
}

fn solve_with(f: Solve, tree: &Tree, case: &TreeCase, x: &TreeInputs, dtype: DType) -> Vec<f64> {
    let v = vars(tree, case, x, dtype);
    let out = apply(f, tree, case, &v);
    assert_eq!(out.dims(), case.u_shape(tree.len()).as_slice());
    to_vec(&out)
}

/// x and the gradients of Σ w ⊙ x with respect to (u, a, b, c), through `f`, in f64.
fn grads_with(f: Solve, tree: &Tree, case: &TreeCase, x: &TreeInputs, w: &[f64]) -> [Vec<f64>; 5] {
    let v = vars(tree, case, x, DType::F64);
    let out = apply(f, tree, case, &v);
    let w = tensor(w, out.dims(), DType::F64, &Device::Cpu);
    let grads = (&out * w).unwrap().sum_all().unwrap().backward().unwrap();
    // A variable outside the graph (B, C of a single-node tree) has a zero gradient.
    let g = |var: &Var| {
        grads
            .get(var)
            .map_or_else(|| vec![0.0; var.elem_count()], to_vec)
    };
    [to_vec(&out), g(&v.u), g(&v.a), g(&v.b), g(&v.c)]
}

fn trees() -> Vec<(&'static str, Tree)> {
    vec![
        ("perfect 2-ary 16", Tree::perfect(16, 2).unwrap()),
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("perfect 3-ary 27", Tree::perfect(27, 3).unwrap()),
        ("ragged 5-ary 23", Tree::ragged(23, 5).unwrap()),
        ("ragged 3-ary 11", Tree::ragged(11, 3).unwrap()),
        ("ragged 2-ary 10", Tree::ragged(10, 2).unwrap()),
        ("quad 5x3", Tree::quad(5, 3).unwrap()),
        ("chain 9", Tree::chain(9).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ]
}

fn case_for(i: usize, rng: &mut StdRng) -> TreeCase {
    let complex = i % 4 == 3;
    TreeCase {
        batch: rng.random_range(1..4),
        heads: rng.random_range(1..3),
        d: if complex { 1 } else { 1 + i % 4 },
        r: rng.random_range(1..4),
        shared: i.is_multiple_of(2),
        complex,
    }
}

#[test]
fn forward_matches_dense_solve_of_assembled_matrix() {
    let (mut rng, seed) = seeded_rng("tree forward", 122);
    for (name, tree) in trees() {
        for i in 0..8 {
            let case = case_for(i, &mut rng);
            let x = random_tree_inputs(&tree, &case, &mut rng);
            let want = dense_tree_solve(&tree, &case, &x);
            let e64 = rel_err(&solve_with(tree_solve, &tree, &case, &x, DType::F64), &want);
            let e32 = rel_err(&solve_with(tree_solve, &tree, &case, &x, DType::F32), &want);
            assert!(
                e64 < 1e-12,
                "f64 error {e64:e}, {name}, {case:?} (seed {seed})"
            );
            assert!(
                e32 < 1e-5,
                "f32 error {e32:e}, {name}, {case:?} (seed {seed})"
            );
        }
    }
    // Shared coefficients with a batch that fills the CPU's SIMD lanes (batch elements of one
    // head solved together), including a partly filled group.
    for (name, tree) in trees() {
        for complex in [false, true] {
            let case = TreeCase {
                batch: 11,
                heads: 2,
                d: 1,
                r: 2,
                shared: true,
                complex,
            };
            let x = random_tree_inputs(&tree, &case, &mut rng);
            let e = rel_err(
                &solve_with(tree_solve, &tree, &case, &x, DType::F64),
                &dense_tree_solve(&tree, &case, &x),
            );
            assert!(
                e < 1e-12,
                "batch-lane layout: error {e:e}, {name}, {case:?} (seed {seed})"
            );
        }
    }
    // Blocks eliminated once per head for several samples sharing its coefficients: more
    // samples than one task takes (the last task's share partial), every size with its own code
    // and one without; and samples with coefficients of their own.
    for (name, tree) in trees() {
        for (d, batch, shared) in [
            (2, 37, true),
            (3, 20, true),
            (4, 17, true),
            (5, 18, true),
            (2, 5, false),
        ] {
            let case = TreeCase {
                batch,
                heads: 2,
                d,
                r: 2,
                shared,
                complex: false,
            };
            let x = random_tree_inputs(&tree, &case, &mut rng);
            let e = rel_err(
                &solve_with(tree_solve, &tree, &case, &x, DType::F64),
                &dense_tree_solve(&tree, &case, &x),
            );
            assert!(
                e < 1e-12,
                "blocks shared by samples: error {e:e}, {name}, {case:?} (seed {seed})"
            );
        }
    }
    // One large block size.
    let tree = Tree::ragged(6, 3).unwrap();
    let case = TreeCase {
        batch: 2,
        heads: 1,
        d: 16,
        r: 3,
        shared: false,
        complex: false,
    };
    let x = random_tree_inputs(&tree, &case, &mut rng);
    let e = rel_err(
        &solve_with(tree_solve, &tree, &case, &x, DType::F64),
        &dense_tree_solve(&tree, &case, &x),
    );
    assert!(e < 1e-12, "d = 16: error {e:e} (seed {seed})");
}

#[test]
fn gradients_match_central_finite_differences() {
    let (mut rng, seed) = seeded_rng("tree finite differences", 123);
    let small = [
        Tree::perfect(4, 2).unwrap(),
        Tree::ragged(5, 3).unwrap(),
        Tree::chain(3).unwrap(),
    ];
    for (t, tree) in small.iter().enumerate() {
        for i in 0..4 {
            let case = TreeCase {
                batch: 2,
                heads: 1,
                d: if i >= 3 { 1 } else { 1 + (i + t) % 3 },
                r: 1 + i % 2,
                shared: i % 2 == 1 || i >= 4,
                complex: i == 3 || i == 5,
            };
            let x = random_tree_inputs(tree, &case, &mut rng);
            let w: Vec<f64> = (0..x.u.len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let [_, gu, ga, gb, gc] = grads_with(tree_solve, tree, &case, &x, &w);
            let loss = |x: &TreeInputs| -> f64 {
                dense_tree_solve(tree, &case, x)
                    .iter()
                    .zip(&w)
                    .map(|(a, b)| a * b)
                    .sum()
            };
            let eps = 1e-6;
            for (name, which, got) in [("u", 0, &gu), ("a", 1, &ga), ("b", 2, &gb), ("c", 3, &gc)] {
                let want: Vec<f64> = (0..got.len())
                    .map(|k| {
                        let at = |delta: f64| {
                            let mut xp = x.clone();
                            let slot = match which {
                                0 => &mut xp.u,
                                1 => &mut xp.a,
                                2 => &mut xp.b,
                                _ => &mut xp.c,
                            };
                            slot[k] += delta;
                            loss(&xp)
                        };
                        (at(eps) - at(-eps)) / (2.0 * eps)
                    })
                    .collect();
                let e = rel_err(got, &want);
                assert!(
                    e < 1e-6,
                    "d{name}: error {e:e}, tree {t}, {case:?} (seed {seed})"
                );
            }
        }
    }
}

#[test]
fn chain_solve_equals_the_linear_scan() {
    // Paper §3.4: on a chain with A = 1, B = 0 and C_v = -a_{v+1}, the solve is the forward scan
    // h_t = a_t h_{t-1} + b_t; with C = 0 and B_v = -a_v it is the reverse scan.
    let (mut rng, seed) = seeded_rng("chain vs scan", 124);
    let (batch, len, chans) = (2, 37, 3);
    let dev = Device::Cpu;
    let a = rand_uniform(
        &mut rng,
        (-0.95, 0.95),
        &[batch, len, chans],
        DType::F64,
        &dev,
    );
    let b = rand_uniform(
        &mut rng,
        (-1.0, 1.0),
        &[batch, len, chans],
        DType::F64,
        &dev,
    );
    let tree = Tree::chain(len).unwrap();
    // (batch, len, chans) -> (batch, heads = chans, nodes = len, 1, 1)
    let to_tree = |t: &Tensor| {
        t.permute((0, 2, 1))
            .unwrap()
            .unsqueeze(3)
            .unwrap()
            .unsqueeze(4)
            .unwrap()
    };
    let from_tree = |t: &Tensor| {
        t.squeeze(4)
            .unwrap()
            .squeeze(3)
            .unwrap()
            .permute((0, 2, 1))
            .unwrap()
    };
    let ones = Tensor::ones((batch, chans, len, 1, 1), DType::F64, &dev).unwrap();
    let zeros = ones.zeros_like().unwrap();
    let a_t = to_tree(&a);
    for reverse in [false, true] {
        let (bb, cc) = if reverse {
            (a_t.neg().unwrap(), zeros.clone())
        } else {
            // C_v = -a_{v+1}: shift a one step towards the leaves; the root's C is unused.
            let shifted = Tensor::cat(
                &[
                    a_t.narrow(2, 1, len - 1).unwrap(),
                    a_t.narrow(2, 0, 1).unwrap(),
                ],
                2,
            )
            .unwrap();
            (zeros.clone(), shifted.neg().unwrap())
        };
        let x = tree_solve(
            &tree,
            &ones,
            &bb,
            &cc,
            &to_tree(&b),
            TreeSolveOptions::default(),
        )
        .unwrap();
        let h = linear_scan(
            &a,
            &b,
            None,
            ScanOptions {
                complex: false,
                reverse,
            },
        )
        .unwrap();
        let e = rel_err(&to_vec(&from_tree(&x)), &to_vec(&h));
        assert!(e < 1e-13, "reverse = {reverse}: error {e:e} (seed {seed})");
    }
}

#[test]
fn op_and_gradients_equal_the_listing_1_reference() {
    let (mut rng, seed) = seeded_rng("tree vs listing 1", 125);
    for (name, tree) in trees() {
        for i in 0..6 {
            let case = TreeCase {
                d: 1,
                complex: i % 3 == 2,
                // i = 4, 5: shared over a batch of 10 (batch elements as SIMD lanes)
                batch: if i >= 4 { 10 } else { rng.random_range(1..4) },
                shared: i >= 4 || i % 2 == 0,
                ..case_for(i, &mut rng)
            };
            let x = random_tree_inputs(&tree, &case, &mut rng);
            let w: Vec<f64> = (0..x.u.len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let ours = grads_with(tree_solve, &tree, &case, &x, &w);
            let reference = grads_with(tree_solve_reference, &tree, &case, &x, &w);
            for (k, what) in ["x", "du", "da", "db", "dc"].iter().enumerate() {
                let e = rel_err(&ours[k], &reference[k]);
                assert!(
                    e < 1e-11,
                    "{what}: error {e:e}, {name}, {case:?} (seed {seed})"
                );
            }
        }
    }
}

#[test]
fn singular_pivots_and_bad_shapes_are_errors() {
    let dev = Device::Cpu;
    let tree = Tree::perfect(4, 2).unwrap();
    let n = tree.len();
    let case = TreeCase {
        batch: 1,
        heads: 2,
        d: 1,
        r: 1,
        shared: true,
        complex: false,
    };
    let ones = Tensor::ones(case.coef_shape(n), DType::F32, &dev).unwrap();
    let u = Tensor::ones(case.u_shape(n), DType::F32, &dev).unwrap();
    let o = TreeSolveOptions::default();
    // A leaf's pivot zero: singular.
    let mut a = vec![1f32; 2 * n];
    a[n + 2] = 0.0;
    let a0 = Tensor::from_vec(a, case.coef_shape(n), &dev).unwrap();
    let err = tree_solve(&tree, &a0, &ones, &ones, &u, o)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("node 2") && err.contains("head 1") && err.contains("singular"),
        "{err}"
    );
    // A non-finite coefficient reaching a pivot.
    let nan = (ones.clone() * f64::NAN).unwrap();
    assert!(tree_solve(&tree, &nan, &ones, &ones, &u, o).is_err());
    // Shapes.
    let bad: Vec<(&str, candle_core::Result<Tensor>)> = vec![
        (
            "u rank",
            tree_solve(&tree, &ones, &ones, &ones, &u.squeeze(4).unwrap(), o),
        ),
        (
            "nodes",
            tree_solve(&Tree::perfect(8, 2).unwrap(), &ones, &ones, &ones, &u, o),
        ),
        ("b shape", tree_solve(&tree, &ones, &u, &ones, &u, o)),
        (
            "coef shape",
            tree_solve(
                &tree,
                &u.squeeze(0).unwrap().squeeze(3).unwrap(),
                &ones,
                &ones,
                &u,
                o,
            ),
        ),
        (
            "complex",
            tree_solve(
                &tree,
                &ones,
                &ones,
                &ones,
                &u,
                TreeSolveOptions {
                    complex: true,
                    ..Default::default()
                },
            ),
        ),
    ];
    for (what, r) in bad {
        let msg = r.expect_err(what).to_string();
        assert!(msg.contains("tree_solve"), "{what}: {msg}");
    }
}

/// Samples with d × d blocks of their own go through the CPU solve eight at a time, one per SIMD
/// lane, each lane choosing its own pivot rows (the rows are permuted, so the lanes pivot
/// differently): the solution and every gradient equal those of each sample solved alone, to
/// the bit; and a singular pivot in one lane names that sample.
#[test]
fn samples_with_their_own_blocks_in_lanes_equal_each_solved_alone() {
    let (mut rng, seed) = seeded_rng("tree solve, own blocks in lanes", 41);
    let tree = Tree::ragged(23, 5).unwrap();
    let n = tree.len();
    for (d, r, complex, dtype) in [
        (2, 1, false, DType::F32),
        (2, 2, true, DType::F32),
        (3, 1, true, DType::F64),
        (4, 2, false, DType::F64),
        (5, 1, false, DType::F32),
    ] {
        let case = TreeCase {
            batch: 19,
            heads: 2,
            d,
            r,
            shared: false,
            complex,
        };
        let what = format!("d = {d}, r = {r}, complex {complex}, {dtype:?} (seed {seed})");
        let mut x = random_tree_inputs(&tree, &case, &mut rng);
        permute_block_rows(&tree, &case, &mut x, &mut rng);
        let v = vars(&tree, &case, &x, dtype);
        let [a, b, c, u] = [&v.a, &v.b, &v.c, &v.u].map(|t| t.as_tensor().clone());
        let g = tensor(
            &uniform(&mut rng, x.u.len(), -1.0, 1.0),
            &case.u_shape(n),
            dtype,
            &Device::Cpu,
        );
        let o = opts(&case);
        let whole = tree_solve(&tree, &a, &b, &c, &u, o).unwrap();
        let grads = tree_solve_backward(&tree, &a, &b, &c, &whole, &g, o).unwrap();
        for bi in 0..case.batch {
            let one = |t: &Tensor| t.narrow(0, bi, 1).unwrap();
            let x1 = tree_solve(&tree, &one(&a), &one(&b), &one(&c), &one(&u), o).unwrap();
            assert_eq!(to_vec(&x1), to_vec(&one(&whole)), "x, sample {bi}, {what}");
            let g1 =
                tree_solve_backward(&tree, &one(&a), &one(&b), &one(&c), &x1, &one(&g), o).unwrap();
            for (name, alone, all) in [
                ("u", &g1.u, &grads.u),
                ("a", &g1.a, &grads.a),
                ("b", &g1.b, &grads.b),
                ("c", &g1.c, &grads.c),
            ] {
                assert_eq!(
                    to_vec(alone),
                    to_vec(&one(all)),
                    "∂{name}, sample {bi}, {what}"
                );
            }
        }
        let dense = dense_tree_solve(&tree, &case, &x);
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-3 };
        let err = rel_err(&to_vec(&whole), &dense);
        assert!(err < tol, "against the dense solve: {err:e}, {what}");
        // Sample 13 (lane 5 of the second group), head 1: a leaf's block zero, so singular.
        let mut a0 = x.a.clone();
        for i in 0..d {
            for j in 0..d {
                let o = case.coef_at(n, 13, 1, 0, i, j);
                a0[o..o + case.w()].fill(0.0);
            }
        }
        let a0 = tensor(&a0, &case.coef_shape(n), dtype, &Device::Cpu);
        let err = tree_solve(&tree, &a0, &b, &c, &u, o)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node 0 (batch 13, head 1)") && err.contains("singular"),
            "{what}: {err}"
        );
    }
}

/// Samples that share their head's coefficients go through the CPU solve eight at a time, one
/// per SIMD lane (for scalar blocks a task's remainder, r > 1 and f64 one tree at a time): the
/// solution and ∂u equal those of each sample solved alone, to the bit, on trees with and
/// without a uniform number of children per level (and a lone root), real and complex, scalar
/// and d × d blocks; the coefficient gradients equal the sum of the samples' alone.
#[test]
fn samples_sharing_coefficients_in_lanes_equal_each_solved_alone() {
    let (mut rng, seed) = seeded_rng("tree solve, shared scalar blocks in lanes", 43);
    let trees = [
        Tree::ragged(23, 5).unwrap(),
        Tree::perfect(64, 4).unwrap(),
        Tree::chain(1).unwrap(),
        Tree::chain(6).unwrap(),
    ];
    for (tree, d, r, complex, dtype) in [
        (&trees[0], 1, 1, false, DType::F32),
        (&trees[1], 1, 1, false, DType::F32),
        (&trees[1], 1, 1, true, DType::F32),
        (&trees[0], 1, 1, true, DType::F32),
        (&trees[0], 1, 1, false, DType::F64),
        (&trees[2], 1, 1, false, DType::F32),
        (&trees[3], 1, 1, true, DType::F32),
        (&trees[1], 1, 2, false, DType::F64),
        (&trees[0], 2, 1, false, DType::F32),
        (&trees[1], 3, 2, true, DType::F32),
        (&trees[1], 2, 1, false, DType::F64),
        (&trees[0], 4, 1, true, DType::F64),
    ] {
        let n = tree.len();
        let case = TreeCase {
            batch: 19,
            heads: 2,
            d,
            r,
            shared: true,
            complex,
        };
        let what = format!("n = {n}, d = {d}, r = {r}, complex {complex}, {dtype:?} (seed {seed})");
        let x = random_tree_inputs(tree, &case, &mut rng);
        let v = vars(tree, &case, &x, dtype);
        let [a, b, c, u] = [&v.a, &v.b, &v.c, &v.u].map(|t| t.as_tensor().clone());
        let g = tensor(
            &uniform(&mut rng, x.u.len(), -1.0, 1.0),
            &case.u_shape(n),
            dtype,
            &Device::Cpu,
        );
        let o = opts(&case);
        let whole = tree_solve(tree, &a, &b, &c, &u, o).unwrap();
        let grads = tree_solve_backward(tree, &a, &b, &c, &whole, &g, o).unwrap();
        let mut summed = [&grads.a, &grads.b, &grads.c].map(|t| vec![0.0; t.elem_count()]);
        for bi in 0..case.batch {
            let one = |t: &Tensor| t.narrow(0, bi, 1).unwrap();
            let x1 = tree_solve(tree, &a, &b, &c, &one(&u), o).unwrap();
            assert_eq!(to_vec(&x1), to_vec(&one(&whole)), "x, sample {bi}, {what}");
            let g1 = tree_solve_backward(tree, &a, &b, &c, &x1, &one(&g), o).unwrap();
            let du = to_vec(&one(&grads.u));
            assert_eq!(to_vec(&g1.u), du, "∂u, sample {bi}, {what}");
            for (sum, alone) in summed.iter_mut().zip([&g1.a, &g1.b, &g1.c]) {
                for (s, a) in sum.iter_mut().zip(to_vec(alone)) {
                    *s += a;
                }
            }
        }
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (name, sum, all) in [("a", 0, &grads.a), ("b", 1, &grads.b), ("c", 2, &grads.c)] {
            let err = rel_err(&to_vec(all), &summed[sum]);
            assert!(
                err < tol,
                "∂{name} against the samples' sum: {err:e}, {what}"
            );
        }
        let err = rel_err(&to_vec(&whole), &dense_tree_solve(tree, &case, &x));
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-3 };
        assert!(err < tol, "against the dense solve: {err:e}, {what}");
    }
}

/// The public backward equals autograd through the op (f64), and takes f16/bf16 on the CPU as
/// the forward does (computed in f32, rounded once).
#[test]
fn public_backward_equals_autograd_and_takes_half_precision() {
    let (mut rng, seed) = seeded_rng("tree_solve_backward", 31);
    let tree = Tree::ragged(50, 3).unwrap();
    let n = tree.len();
    let case = TreeCase {
        batch: 2,
        heads: 3,
        d: 1,
        r: 2,
        shared: true,
        complex: true,
    };
    let x = random_tree_inputs(&tree, &case, &mut rng);
    let w: Vec<f64> = (0..x.u.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let [sol, gu, ga, gb, gc] = grads_with(tree_solve, &tree, &case, &x, &w);
    let opts = TreeSolveOptions {
        complex: true,
        ..Default::default()
    };
    let public = |dtype: DType| {
        let t = |v: &[f64], s: Vec<usize>| tensor(v, &s, dtype, &Device::Cpu);
        let (a, b, c) = (
            t(&x.a, case.coef_shape(n)),
            t(&x.b, case.coef_shape(n)),
            t(&x.c, case.coef_shape(n)),
        );
        let (sol, w) = (t(&sol, case.u_shape(n)), t(&w, case.u_shape(n)));
        let g = myosotis::ops::tree_solve_backward(&tree, &a, &b, &c, &sol, &w, opts).unwrap();
        assert_eq!(g.u.dtype(), dtype);
        [g.u, g.a, g.b, g.c].map(|t| to_vec(&t))
    };
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F16, 4e-3), (DType::BF16, 3e-2)] {
        let got = public(dtype);
        for (k, (what, want)) in [("u", &gu), ("a", &ga), ("b", &gb), ("c", &gc)]
            .into_iter()
            .enumerate()
        {
            let e = rel_err(&got[k], want);
            assert!(e < tol, "∂{what} {dtype:?}: {e:e} (seed {seed})");
        }
    }
}
