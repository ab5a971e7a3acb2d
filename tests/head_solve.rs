//! `head_solve` (the Myo layer's solve in the model's layout) against the dense f64 solve of
//! the assembled T_G, its gradients against the dense adjoint solve and finite differences, and
//! its errors on bad input.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::heads::*;
use common::*;
use myosotis::ops::{head_solve, head_solve_backward, head_solve_skew, head_solve_skew_backward};
use myosotis::tree::Tree;
use rand::Rng;

fn trees() -> Vec<(&'static str, Tree)> {
    vec![
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("ragged 3-ary 50", Tree::ragged(50, 3).unwrap()),
        ("ragged binary 23", Tree::ragged(23, 2).unwrap()),
        ("quad 6x5", Tree::quad(6, 5).unwrap()),
        ("chain 12", Tree::chain(12).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ]
}

/// Every tree, over the leaves and over all nodes, both coupling kinds, f32 and f64: x against
/// the dense solve, and the gradients of the backward against the dense adjoint.
#[test]
fn head_solve_matches_the_dense_solve_forward_and_backward() {
    let (mut rng, seed) = seeded_rng("head_solve dense", 31);
    for (name, tree) in trees() {
        for (batch, heads, all_nodes) in [(2, 3, false), (3, 1, true), (1, 37, false)] {
            for coupling in [Coupling::Skew, Coupling::Dominant] {
                for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                    let what = format!(
                        "{name}, batch {batch}, heads {heads}, all nodes {all_nodes}, \
                         {coupling:?}, {dtype:?} (seed {seed})"
                    );
                    let x =
                        random_head_inputs(&tree, (batch, heads, all_nodes), coupling, &mut rng);
                    let [u, bias, b, c] = x.tensors(&tree, dtype, &Device::Cpu);
                    let sol = head_solve(&tree, &u, &bias, &b, &c).unwrap();
                    assert_eq!(sol.dims(), &[batch, tree.len(), heads, 2], "{what}");
                    let e = rel_err(&to_vec(&sol), &dense(&tree, &x));
                    assert!(e < tol, "x vs dense solve: {e:e}, {what}");

                    let g = uniform(&mut rng, batch * tree.len() * heads * 2, -1.0, 1.0);
                    let g_t = tensor(&g, sol.dims(), dtype, &Device::Cpu);
                    let got = head_solve_backward(&tree, &u, &bias, &b, &c, &sol, &g_t).unwrap();
                    let want = dense_grads(&tree, &x, &g);
                    for (gname, got, want) in [
                        ("u", &got.u, &want[0]),
                        ("bias", &got.bias, &want[1]),
                        ("b", &got.b, &want[2]),
                        ("c", &got.c, &want[3]),
                    ] {
                        if want.is_empty() {
                            continue;
                        }
                        let e = rel_err(&to_vec(got), want);
                        assert!(e < 4.0 * tol, "∂{gname} vs dense adjoint: {e:e}, {what}");
                    }
                }
            }
        }
    }
}

/// Autograd through the op (what training runs) against central differences of
/// L = Σ w ⊙ x in f64, for entries of u, bias, B and C, real and imaginary parts: checks the
/// gradient convention for complex pairs and the op's wiring (∂u cut to the first m nodes).
#[test]
fn head_solve_gradients_match_finite_differences() {
    let (mut rng, seed) = seeded_rng("head_solve finite differences", 32);
    for (name, tree) in [
        ("ragged 3-ary 20", Tree::ragged(20, 3).unwrap()),
        ("quad 4x4", Tree::quad(4, 4).unwrap()),
    ] {
        for all_nodes in [false, true] {
            let x = random_head_inputs(&tree, (2, 3, all_nodes), Coupling::Skew, &mut rng);
            let n = tree.len();
            let w = uniform(&mut rng, 2 * n * 3 * 2, -1.0, 1.0);
            let dev = &Device::Cpu;
            let w_t = tensor(&w, &[2, n, 3, 2], DType::F64, dev);
            let loss = |x: &HeadInputs| -> f64 {
                let [u, bias, b, c] = x.tensors(&tree, DType::F64, dev);
                let sol = head_solve(&tree, &u, &bias, &b, &c).unwrap();
                (sol * &w_t)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap()
            };
            let vars = x
                .tensors(&tree, DType::F64, dev)
                .map(|t| Var::from_tensor(&t).unwrap());
            let [u, bias, b, c] = vars.each_ref().map(|v| v.as_tensor().clone());
            let out = head_solve(&tree, &u, &bias, &b, &c).unwrap();
            let grads = (out * &w_t).unwrap().sum_all().unwrap().backward().unwrap();
            let names = ["u", "bias", "b", "c"];
            for (k, var) in vars.iter().enumerate() {
                let g = to_vec(grads.get(var).unwrap());
                for _ in 0..6 {
                    let i = rng.random_range(0..g.len());
                    let h = 1e-6;
                    let mut plus = x.clone();
                    let mut minus = x.clone();
                    let field = |x: &mut HeadInputs| -> *mut f64 {
                        [&mut x.u, &mut x.bias, &mut x.b, &mut x.c][k].as_mut_ptr()
                    };
                    // SAFETY: i < the field's length (the gradient has the field's shape).
                    unsafe {
                        *field(&mut plus).add(i) += h;
                        *field(&mut minus).add(i) -= h;
                    }
                    let fd = (loss(&plus) - loss(&minus)) / (2.0 * h);
                    assert!(
                        (fd - g[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                        "∂{} [{i}]: autograd {} vs finite difference {fd}, {name}, all nodes \
                         {all_nodes} (seed {seed})",
                        names[k],
                        g[i]
                    );
                }
            }
        }
    }
}

/// The skew form in the layer's layout (s and the bias by head): x equal to the general form's
/// on the same system, autograd through it against central differences of L = Σ w ⊙ x in f64
/// (u, bias, s), and its backward on its own equal to autograd's.
#[test]
fn head_solve_skew_matches_the_general_form_and_finite_differences() {
    let (mut rng, seed) = seeded_rng("head_solve skew form", 33);
    let dev = &Device::Cpu;
    for (name, tree) in [
        ("ragged 3-ary 20", Tree::ragged(20, 3).unwrap()),
        ("quad 4x4", Tree::quad(4, 4).unwrap()),
    ] {
        for all_nodes in [false, true] {
            let what = format!("{name}, all nodes {all_nodes} (seed {seed})");
            let x = random_head_inputs(&tree, (2, 3, all_nodes), Coupling::Skew, &mut rng);
            let (n, internal) = (tree.len(), tree.len() - tree.leaves());
            let (s, bias) = x.skew_form(&tree);
            let parts = [x.u.clone(), bias, s];
            let shapes = [vec![2, x.m, 3, 2], vec![3, internal, 2], vec![3, n, 2]];
            let w = uniform(&mut rng, 2 * n * 3 * 2, -1.0, 1.0);
            let w_t = tensor(&w, &[2, n, 3, 2], DType::F64, dev);
            let tensors = |p: &[Vec<f64>; 3]| -> [Tensor; 3] {
                std::array::from_fn(|k| tensor(&p[k], &shapes[k], DType::F64, dev))
            };
            let solve = |t: &[Tensor; 3]| head_solve_skew(&tree, &t[0], &t[1], &t[2]).unwrap();
            let loss = |p: &[Vec<f64>; 3]| -> f64 {
                let sol = solve(&tensors(p));
                (sol * &w_t)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap()
            };
            let [u, bias, b, c] = x.tensors(&tree, DType::F64, dev);
            let general = head_solve(&tree, &u, &bias, &b, &c).unwrap();
            assert_eq!(
                to_vec(&solve(&tensors(&parts))),
                to_vec(&general),
                "x, {what}"
            );

            let vars = tensors(&parts).map(|t| Var::from_tensor(&t).unwrap());
            let ts = vars.each_ref().map(|v| v.as_tensor().clone());
            let out = solve(&ts);
            let grads = (&out * &w_t)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let by_hand =
                head_solve_skew_backward(&tree, &ts[0], &ts[1], &ts[2], &out, &w_t.clone())
                    .unwrap();
            let names = ["u", "bias", "s"];
            for (k, var) in vars.iter().enumerate() {
                let g = to_vec(grads.get(var).unwrap());
                let mine = [&by_hand.u, &by_hand.bias, &by_hand.s][k];
                assert_eq!(to_vec(mine), g, "∂{} by hand vs autograd, {what}", names[k]);
                for _ in 0..6 {
                    let i = rng.random_range(0..g.len());
                    let h = 1e-6;
                    let (mut plus, mut minus) = (parts.clone(), parts.clone());
                    plus[k][i] += h;
                    minus[k][i] -= h;
                    let fd = (loss(&plus) - loss(&minus)) / (2.0 * h);
                    assert!(
                        (fd - g[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                        "∂{} [{i}]: autograd {} vs finite difference {fd}, {what}",
                        names[k],
                        g[i]
                    );
                }
            }
        }
    }
}

/// The layer's solve agrees with the general tree solve it specialises.
#[test]
fn head_solve_equals_the_general_tree_solve() {
    use myosotis::ops::{tree_solve, TreeSolveOptions};
    let (mut rng, seed) = seeded_rng("head_solve vs tree_solve", 33);
    let tree = Tree::quad(28, 28).unwrap();
    let x = random_head_inputs(&tree, (2, 8, false), Coupling::Skew, &mut rng);
    let g = x.general(&tree);
    let (n, h) = (tree.len(), x.heads);
    let t = |v: &[f64], s: &[usize]| tensor(v, s, DType::F64, &Device::Cpu);
    let want = tree_solve(
        &tree,
        &t(&g.a, &[h, n, 1, 1, 2]),
        &t(&g.b, &[h, n, 1, 1, 2]),
        &t(&g.c, &[h, n, 1, 1, 2]),
        &t(&g.u, &[2, h, n, 1, 1, 2]),
        TreeSolveOptions {
            complex: true,
            ..Default::default()
        },
    )
    .unwrap();
    let want = to_model_layout(&to_vec(&want), 2, h, n);
    let [u, bias, b, c] = x.tensors(&tree, DType::F64, &Device::Cpu);
    let got = to_vec(&head_solve(&tree, &u, &bias, &b, &c).unwrap());
    let e = rel_err(&got, &want);
    assert!(e < 1e-12, "quad 28x28: {e:e} (seed {seed})");
}

/// f16 and bf16 are solved in f32 and rounded once.
#[test]
fn head_solve_in_half_precision_rounds_the_f32_solve() {
    let (mut rng, seed) = seeded_rng("head_solve half", 34);
    let tree = Tree::ragged(40, 4).unwrap();
    let x = random_head_inputs(&tree, (2, 5, false), Coupling::Skew, &mut rng);
    for dtype in [DType::F16, DType::BF16] {
        let [u, bias, b, c] = x.tensors(&tree, dtype, &Device::Cpu);
        let got = head_solve(&tree, &u, &bias, &b, &c).unwrap();
        assert_eq!(got.dtype(), dtype);
        let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = head_solve(&tree, &up(&u), &up(&bias), &up(&b), &up(&c))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(to_vec(&got), to_vec(&want), "{dtype:?} (seed {seed})");
    }
}

/// A zero pivot is an error naming the node and head: with a unit diagonal, a parent of
/// leaves has Â_p = 1 − Σ_c C_c B_c, zero when one child has C B = 1 and the others 0.
#[test]
fn head_solve_reports_a_singular_pivot_with_its_node() {
    let tree = Tree::perfect(16, 4).unwrap();
    let [u, bias, b, c] = singular_head_inputs(&tree).tensors(&tree, DType::F32, &Device::Cpu);
    let parent = tree.parent(4).unwrap();
    let err = head_solve(&tree, &u, &bias, &b, &c)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("node {parent}, head 1")), "{err}");
}

/// Shapes, dtypes and devices that do not fit are one-line errors naming the argument.
#[test]
fn head_solve_rejects_bad_arguments() {
    let tree = Tree::ragged(10, 3).unwrap();
    let (n, l) = (tree.len(), tree.leaves());
    let dev = &Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, dev).unwrap();
    let ok = [
        z(&[2, l, 4, 2]),
        z(&[n - l, 4, 2]),
        z(&[n, 4, 2]),
        z(&[n, 4, 2]),
    ];
    let run = |args: [&Tensor; 4]| head_solve(&tree, args[0], args[1], args[2], args[3]);
    assert!(run([&ok[0], &ok[1], &ok[2], &ok[3]]).is_ok());
    for (args, want) in [
        (
            [&z(&[2, l + 1, 4, 2]), &ok[1], &ok[2], &ok[3]],
            "u has shape",
        ),
        ([&z(&[2, l, 4]), &ok[1], &ok[2], &ok[3]], "u must be"),
        (
            [&ok[0], &z(&[n - l, 3, 2]), &ok[2], &ok[3]],
            "bias has shape",
        ),
        ([&ok[0], &ok[1], &z(&[n, 4, 1]), &ok[3]], "b has shape"),
        ([&ok[0], &ok[1], &ok[2], &z(&[n - 1, 4, 2])], "c has shape"),
    ] {
        let err = run(args).unwrap_err().to_string();
        assert!(err.contains(want), "want '{want}', got: {err}");
    }
    let c64 = ok[3].to_dtype(DType::F64).unwrap();
    let err = run([&ok[0], &ok[1], &ok[2], &c64]).unwrap_err().to_string();
    assert!(err.contains("c has dtype F64"), "{err}");
}
