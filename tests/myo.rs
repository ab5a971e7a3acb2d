//! The Myo layer against a dense f64 solve of its assembled T_G, the SSM correspondence on a
//! chain (paper §3.4), and its gradients.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use myosotis::nn::{Coupling, Myo, MyoConfig, TreeSpec};
use nalgebra::Complex;
use rand::Rng;

fn build(cfg: &MyoConfig) -> (VarMap, Myo) {
    let varmap = VarMap::new();
    let layer = Myo::new(
        cfg.clone(),
        VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
    )
    .unwrap();
    (varmap, layer)
}

fn get(varmap: &VarMap, name: &str) -> Vec<f64> {
    to_vec(varmap.data().lock().unwrap()[name].as_tensor())
}

#[test]
fn layer_equals_dense_solve_of_its_assembled_matrix() {
    let (mut rng, seed) = seeded_rng("myo dense", 109);
    let specs = [
        TreeSpec::Ragged {
            leaves: 16,
            arity: 4,
        },
        TreeSpec::Ragged {
            leaves: 11,
            arity: 2,
        },
        TreeSpec::Quad {
            height: 5,
            width: 6,
        },
    ];
    for spec in specs {
        for (per_level, coupling, all_nodes) in [
            (false, Coupling::Skew, false),
            (true, Coupling::Skew, true),
            (false, Coupling::Hermitian, false),
            (true, Coupling::Hermitian, true),
            (false, Coupling::Free, false),
        ] {
            let cfg = MyoConfig {
                per_level,
                coupling,
                all_nodes,
                seed: rng.random(),
                ..MyoConfig::new(3, 4, spec.clone())
            };
            let (mut varmap, layer) = build(&cfg);
            // Non-trivial internal inputs.
            let n_int = layer.tree().len() - layer.tree().leaves();
            varmap
                .set_one(
                    "virtual_u",
                    randn(&mut rng, &[4, n_int, 2], DType::F64, &Device::Cpu),
                )
                .unwrap();
            let (batch, h, heads, n) = (2, 3, 4, layer.tree().len());
            // The nodes with an input: the leaves, or all of them.
            let leaves = layer.tree().leaves();
            let len = if all_nodes { n } else { leaves };
            let x: Vec<f64> = (0..batch * len * h)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let xt = Tensor::from_vec(x.clone(), (batch, len, h), &Device::Cpu).unwrap();
            let got = to_vec(&layer.forward(&xt).unwrap());
            // Independent assembly: u from b_in and virtual_u, blocks from the layer.
            let (b_in, virt, c_out, d) = (
                get(&varmap, "b_in"),
                get(&varmap, "virtual_u"),
                get(&varmap, "c_out"),
                get(&varmap, "d"),
            );
            let (a, b, c) = layer.blocks().unwrap();
            let case = TreeCase {
                batch,
                heads,
                d: 1,
                r: 1,
                shared: true,
                complex: true,
            };
            let mut u = vec![0.0; batch * heads * n * 2];
            for bi in 0..batch {
                for hd in 0..heads {
                    for v in 0..n {
                        let mut z = Complex::new(0.0, 0.0);
                        if v < len {
                            z += (0..h)
                                .map(|j| {
                                    Complex::new(b_in[(hd * h + j) * 2], b_in[(hd * h + j) * 2 + 1])
                                        * x[(bi * len + v) * h + j]
                                })
                                .sum::<Complex<f64>>();
                        }
                        if v >= leaves {
                            let k = hd * (n - leaves) + v - leaves;
                            z += Complex::new(virt[k * 2], virt[k * 2 + 1]);
                        }
                        let o = case.rhs_at(n, bi, hd, v, 0, 0);
                        u[o] = z.re;
                        u[o + 1] = z.im;
                    }
                }
            }
            let (av, bv, cv) = (to_vec(&a), to_vec(&b), to_vec(&c));
            // Skew: the entries at (v, parent) and (parent, v) are −B and B†, so T_G − I is
            // skew-Hermitian. Hermitian: B and B†; it and Free are strictly diagonally dominant.
            let tree = layer.tree();
            for hd in 0..heads {
                let at = |s: &[f64], v: usize| {
                    Complex::new(s[(hd * n + v) * 2], s[(hd * n + v) * 2 + 1])
                };
                for v in 0..n {
                    assert_eq!(at(&av, v), Complex::new(1.0, 0.0));
                    match coupling {
                        Coupling::Skew => {
                            assert_eq!(at(&cv, v), -at(&bv, v).conj(), "C = −conj(B) at {v}")
                        }
                        Coupling::Hermitian => {
                            assert_eq!(at(&cv, v), at(&bv, v).conj(), "C = conj(B) at {v}")
                        }
                        Coupling::Free => {}
                    }
                    if coupling == Coupling::Skew {
                        continue;
                    }
                    let up = if tree.parent(v).is_some() {
                        at(&bv, v).norm()
                    } else {
                        0.0
                    };
                    let off = up + tree.children(v).map(|ch| at(&cv, ch).norm()).sum::<f64>();
                    assert!(off < 1.0, "row {v} not diagonally dominant: {off}");
                }
            }
            let inputs = TreeInputs {
                a: av,
                b: bv,
                c: cv,
                u,
            };
            let xs = dense_tree_solve(layer.tree(), &case, &inputs);
            let mut want = vec![0.0; batch * len * h];
            for bi in 0..batch {
                for v in 0..len {
                    for o in 0..h {
                        let y: f64 = (0..heads)
                            .map(|hd| {
                                let xo = case.rhs_at(n, bi, hd, v, 0, 0);
                                (Complex::new(
                                    c_out[(o * heads + hd) * 2],
                                    c_out[(o * heads + hd) * 2 + 1],
                                ) * Complex::new(xs[xo], xs[xo + 1]))
                                .re
                            })
                            .sum();
                        want[(bi * len + v) * h + o] = y + d[o] * x[(bi * len + v) * h + o];
                    }
                }
            }
            let e = rel_err(&got, &want);
            assert!(e < 1e-12, "error {e:e} for {cfg:?} (seed {seed})");
        }
    }
}

#[test]
fn block_layer_equals_dense_solve_and_stays_dominant() {
    let (mut rng, seed) = seeded_rng("myo blocks", 110);
    let ragged = TreeSpec::Ragged {
        leaves: 9,
        arity: 3,
    };
    let quad = TreeSpec::Quad {
        height: 3,
        width: 4,
    };
    for (spec, d, coupling, per_level) in [
        (ragged.clone(), 2, Coupling::Hermitian, false),
        (quad.clone(), 3, Coupling::Free, true),
        (ragged, 3, Coupling::Skew, false),
        (quad, 2, Coupling::Skew, true),
    ] {
        let cfg = MyoConfig {
            per_level,
            coupling,
            block: d,
            seed: rng.random(),
            ..MyoConfig::new(3, 2, spec)
        };
        let (mut varmap, layer) = build(&cfg);
        let (tree, heads, h) = (layer.tree().clone(), 2, 3);
        let (n, len, batch) = (tree.len(), tree.leaves(), 2);
        varmap
            .set_one(
                "virtual_u",
                randn(&mut rng, &[heads, n - len, d], DType::F64, &Device::Cpu),
            )
            .unwrap();
        let x: Vec<f64> = (0..batch * len * h)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let got = to_vec(
            &layer
                .forward(&Tensor::from_vec(x.clone(), (batch, len, h), &Device::Cpu).unwrap())
                .unwrap(),
        );
        let (b_in, virt, c_out, dd) = (
            get(&varmap, "b_in"),
            get(&varmap, "virtual_u"),
            get(&varmap, "c_out"),
            get(&varmap, "d"),
        );
        let (a, b, c) = layer.blocks().unwrap();
        let (av, bv, cv) = (to_vec(&a), to_vec(&b), to_vec(&c));
        let case = TreeCase {
            batch,
            heads,
            d,
            r: 1,
            shared: true,
            complex: false,
        };
        // Scalar rows of T_G: A = I; Skew: C = −Bᵀ, else strictly diagonally dominant.
        for hd in 0..heads {
            for v in 0..n {
                for i in 0..d {
                    let mut off = 0.0;
                    for j in 0..d {
                        if tree.parent(v).is_some() {
                            off += bv[case.coef_at(n, 0, hd, v, i, j)].abs();
                        }
                        for ch in tree.children(v) {
                            off += cv[case.coef_at(n, 0, hd, ch, i, j)].abs();
                        }
                        let aij = av[case.coef_at(n, 0, hd, v, i, j)];
                        assert_eq!(aij, if i == j { 1.0 } else { 0.0 });
                    }
                    let sign = match coupling {
                        Coupling::Skew => -1.0,
                        Coupling::Hermitian => 1.0,
                        Coupling::Free => continue,
                    };
                    for j in 0..d {
                        assert_eq!(
                            cv[case.coef_at(n, 0, hd, v, i, j)],
                            sign * bv[case.coef_at(n, 0, hd, v, j, i)]
                        );
                    }
                    if coupling != Coupling::Skew {
                        assert!(off < 1.0, "row ({v}, {i}) not dominant: {off}");
                    }
                }
            }
        }
        let mut u = vec![0.0; batch * heads * n * d];
        for bi in 0..batch {
            for hd in 0..heads {
                for v in 0..n {
                    for k in 0..d {
                        u[case.rhs_at(n, bi, hd, v, k, 0)] = if v < len {
                            (0..h)
                                .map(|j| b_in[(hd * d + k) * h + j] * x[(bi * len + v) * h + j])
                                .sum()
                        } else {
                            virt[(hd * (n - len) + v - len) * d + k]
                        };
                    }
                }
            }
        }
        let xs = dense_tree_solve(
            &tree,
            &case,
            &TreeInputs {
                a: av,
                b: bv,
                c: cv,
                u,
            },
        );
        let mut want = vec![0.0; batch * len * h];
        for bi in 0..batch {
            for v in 0..len {
                for o in 0..h {
                    let y: f64 = (0..heads)
                        .flat_map(|hd| (0..d).map(move |k| (hd, k)))
                        .map(|(hd, k)| {
                            c_out[(o * heads + hd) * d + k] * xs[case.rhs_at(n, bi, hd, v, k, 0)]
                        })
                        .sum();
                    want[(bi * len + v) * h + o] = y + dd[o] * x[(bi * len + v) * h + o];
                }
            }
        }
        let e = rel_err(&got, &want);
        assert!(e < 1e-12, "error {e:e} for {cfg:?} (seed {seed})");
    }
}

#[test]
fn chain_with_ssm_correspondence_is_a_linear_recurrence() {
    // Table 1: B = 0 and C_v = -a on a chain make T_G lower bidiagonal, and x_t = a x_{t-1} + u_t.
    // The sequence sits on all chain nodes: u_0 through the input projection, the rest as the
    // internal nodes' learned inputs.
    let (mut rng, seed) = seeded_rng("myo chain", 111);
    let len = 12;
    let cfg = MyoConfig {
        coupling: Coupling::Free,
        seed: 3,
        ..MyoConfig::new(2, 1, TreeSpec::Chain { len })
    };
    let (mut varmap, layer) = build(&cfg);
    let beta: f64 = 0.999 / 2.0; // one child per node
    let a = Complex::new(0.3f64, -0.25);
    // φ(raw) = -a / β  =>  raw = z atanh|z| / |z|
    let z = -a / beta;
    let raw = z * (z.norm().atanh() / z.norm());
    let mut set = |name: &str, v: Vec<f64>, shape: &[usize]| {
        varmap
            .set_one(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap())
            .unwrap()
    };
    set("coupling_b", vec![0.0; len * 2], &[1, len, 2]);
    set(
        "coupling_c",
        (0..len).flat_map(|_| [raw.re, raw.im]).collect(),
        &[1, len, 2],
    );
    let b: Vec<Complex<f64>> = (0..len)
        .map(|_| Complex::new(rng.random_range(-1.0..1.0), rng.random_range(-1.0..1.0)))
        .collect();
    // u_0 = B_in x_0 with x_0 = (1, 0) and B_in = (b_0, 0); internal nodes get b_1..
    set("b_in", vec![b[0].re, b[0].im, 0.0, 0.0], &[1, 2, 2]);
    set(
        "virtual_u",
        b[1..].iter().flat_map(|z| [z.re, z.im]).collect(),
        &[1, len - 1, 2],
    );
    // Outputs: y_0 = Re x, y_1 = Re(-i x) = Im x; no D skip on the leaf.
    set("c_out", vec![1.0, 0.0, 0.0, -1.0], &[2, 1, 2]);
    set("d", vec![0.0, 0.0], &[2]);
    let x = Tensor::from_vec(vec![1.0f64, 0.0], (1, 1, 2), &Device::Cpu).unwrap();
    let got = to_vec(&layer.forward_nodes(&x, 0).unwrap());
    let mut h = Complex::new(0.0, 0.0);
    let mut want = vec![];
    for bt in &b {
        h = a * h + bt;
        want.extend([h.re, h.im]);
    }
    let e = rel_err(&got, &want);
    assert!(e < 1e-12, "error {e:e} (seed {seed})");
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    let (mut rng, _) = common::seeded_rng("every_parameter_gets_a_finite_nonzero_gradient", 138);
    for (coupling, block, all_nodes) in [
        (Coupling::Skew, 1, false),
        (Coupling::Skew, 1, true),
        (Coupling::Hermitian, 1, false),
        (Coupling::Free, 1, false),
        (Coupling::Skew, 2, true),
        (Coupling::Hermitian, 2, false),
    ] {
        let cfg = MyoConfig {
            per_level: coupling == Coupling::Free,
            coupling,
            all_nodes,
            block,
            seed: 5,
            ..MyoConfig::new(
                3,
                2,
                TreeSpec::Ragged {
                    leaves: 9,
                    arity: 3,
                },
            )
        };
        let (varmap, layer) = build(&cfg);
        let len = if all_nodes { layer.tree().len() } else { 9 };
        let x = randn(&mut rng, &[2, len, 3], DType::F64, &Device::Cpu);
        // The root's output too, so that every internal input matters.
        let loss = (layer.forward(&x).unwrap().sqr().unwrap().sum_all().unwrap()
            + layer
                .forward_nodes(&x, 0)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        assert_all_gradients(&varmap, &grads, &[], &format!("{cfg:?}"));
        let bad = Tensor::zeros((1, 8, 3), DType::F64, &Device::Cpu).unwrap();
        let want = if all_nodes { "13 nodes" } else { "9 leaves" };
        let err = layer.forward(&bad).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

/// The outputs of the nodes from `first` on are those rows of every node's outputs, for
/// every starting node (the poolings compute only the top levels), scalar heads and blocks,
/// over the leaves and over all nodes.
#[test]
fn outputs_from_a_node_are_the_rows_of_all_outputs() {
    let (mut rng, _) = common::seeded_rng("outputs_from_a_node_are_the_rows_of_all_outputs", 139);
    for (block, all_nodes) in [(1, false), (1, true), (2, false)] {
        let cfg = MyoConfig {
            all_nodes,
            block,
            seed: 6,
            ..MyoConfig::new(
                3,
                4,
                TreeSpec::Ragged {
                    leaves: 10,
                    arity: 3,
                },
            )
        };
        let (_, layer) = build(&cfg);
        let n = layer.tree().len();
        let len = if all_nodes { n } else { 10 };
        let x = randn(&mut rng, &[2, len, 3], DType::F64, &Device::Cpu);
        let all = layer.forward_nodes(&x, 0).unwrap();
        for first in [0, 5, 10, n - 1] {
            let got = to_vec(&layer.forward_nodes(&x, first).unwrap());
            let want = to_vec(&all.narrow(1, first, n - first).unwrap());
            // The same arithmetic up to the matmul's blocking over a different number of rows.
            let e = rel_err(&got, &want);
            assert!(e < 1e-14, "from node {first}: {e:e}, {cfg:?}");
        }
        assert!(layer.forward_nodes(&x, n).is_err());
    }
}

#[test]
fn skew_heads_start_from_local_to_global() {
    // The default T_G is I + skew-Hermitian, and its heads start with |B| spread from 0.1 to
    // 10: the least coupled keep a leaf's input to itself, the most coupled hand a part of it
    // to the far half of the image. Both ends matter: with every |B| ≈ 1 (as a chain SSM
    // starts, Λ̄ ≈ 1) no head is local (the far half gets 0.07 in each), and with the
    // diagonally dominant Hermitian form (|B| < 0.2) none reaches past its neighbours (3e-4);
    // either way zMNIST learns far slower (docs/experiments.md).
    let heads = 8;
    let cfg = MyoConfig {
        ..MyoConfig::new(
            2,
            heads,
            TreeSpec::Quad {
                height: 16,
                width: 16,
            },
        )
    };
    let (_, layer) = build(&cfg);
    let tree = layer.tree().clone();
    let (n, leaves) = (tree.len(), tree.leaves());
    let (a, b, c) = layer.blocks().unwrap();
    let case = TreeCase {
        batch: 1,
        heads,
        d: 1,
        r: 1,
        shared: true,
        complex: true,
    };
    // u = e_0 (the first leaf) in every head: x is T_G⁻¹'s first column.
    let mut u = vec![0.0; heads * n * 2];
    for hd in 0..heads {
        u[case.rhs_at(n, 0, hd, 0, 0, 0)] = 1.0;
    }
    let inputs = TreeInputs {
        a: to_vec(&a),
        b: to_vec(&b),
        c: to_vec(&c),
        u,
    };
    let x = dense_tree_solve(&tree, &case, &inputs);
    let far: Vec<f64> = (0..heads)
        .map(|hd| {
            let mut norm2 = 0.0;
            let mut far = 0.0;
            for v in 0..n {
                let o = case.rhs_at(n, 0, hd, v, 0, 0);
                let m = x[o].hypot(x[o + 1]);
                norm2 += m * m;
                if (leaves / 2..leaves).contains(&v) {
                    far += m;
                }
            }
            assert!(
                norm2 <= 1.0 + 1e-12,
                "‖T_G⁻¹ e‖² = {norm2} > 1 in head {hd}"
            );
            far
        })
        .collect();
    let (least, most) = (far[0], far[heads - 1]);
    assert!(
        least < 1e-4,
        "the least coupled head reaches the far half with {least}"
    );
    assert!(
        most > 0.1,
        "the most coupled head reaches the far half with {most} only"
    );
    // What the root sends down reaches the leaves rotated by θ_h per leaf of position (a
    // perfect tree: equal moduli), as S5's Λ̄ᵗ; with a uniform phase it would reach every leaf
    // alike.
    let mut u = vec![0.0; heads * n * 2];
    for hd in 0..heads {
        u[case.rhs_at(n, 0, hd, n - 1, 0, 0)] = 1.0;
    }
    let x = dense_tree_solve(&tree, &case, &TreeInputs { u, ..inputs });
    let mut turning = 0;
    for hd in 0..heads {
        let at = |v: usize| {
            let o = case.rhs_at(n, 0, hd, v, 0, 0);
            Complex::new(x[o], x[o + 1])
        };
        let step = at(1) / at(0);
        for v in 1..leaves {
            let r = at(v) / at(v - 1);
            assert!(
                (r - step).norm() < 1e-9,
                "head {hd}: leaf {v} turns by {r}, not {step}"
            );
        }
        assert!(
            (step.norm() - 1.0).abs() < 1e-9,
            "head {hd}: unequal moduli {step}"
        );
        turning += usize::from((step - 1.0).norm() > 1e-3);
    }
    assert!(
        turning >= heads / 2,
        "only {turning} heads turn with the position"
    );
}

/// The layer as one node with its backward by hand (`forward_by_hand`: skew scalar heads over
/// all nodes, per node and per level, ragged and quad trees) gives the forward's output to the
/// bit and the gradients of candle's autograd to 1e-12 (f64) and 1e-5 (f32); the gradients
/// also equal central differences; layers it does not cover run through autograd unchanged.
#[test]
fn backward_by_hand_equals_autograd() {
    use candle_core::Var;
    use myosotis::nn::GradSink;
    let (mut rng, seed) = seeded_rng("myo by hand", 139);
    let h = 3;
    let cases = [
        (
            TreeSpec::Ragged {
                leaves: 9,
                arity: 3,
            },
            false,
            Coupling::Skew,
        ),
        (
            TreeSpec::Ragged {
                leaves: 11,
                arity: 2,
            },
            true,
            Coupling::Skew,
        ),
        (
            TreeSpec::Quad {
                height: 4,
                width: 4,
            },
            true,
            Coupling::Skew,
        ),
        // Not covered: the ordinary forward.
        (
            TreeSpec::Ragged {
                leaves: 9,
                arity: 3,
            },
            false,
            Coupling::Hermitian,
        ),
    ];
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for (tree, per_level, coupling) in cases.clone() {
            let cfg = MyoConfig {
                per_level,
                coupling,
                all_nodes: true,
                seed: rng.random(),
                ..MyoConfig::new(h, 4, tree)
            };
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
            let layer = Myo::new(cfg.clone(), vb).unwrap();
            let n = layer.tree().len();
            let x = Var::from_tensor(&randn(&mut rng, &[2, n, h], dtype, &Device::Cpu)).unwrap();
            let g = randn(&mut rng, &[2, n, h], dtype, &Device::Cpu);
            let what = format!("{cfg:?} {dtype:?} (seed {seed})");
            let y = layer.forward(x.as_tensor()).unwrap();
            let want = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let sink = GradSink::new();
            let y_hand = layer.forward_by_hand(x.as_tensor(), &sink).unwrap();
            assert_eq!(to_vec(&y_hand), to_vec(&y), "output by hand, {what}");
            let mut got = (&y_hand * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            sink.add_to(&mut got).unwrap();
            let vars = varmap.data().lock().unwrap().clone();
            let named: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
            let named = [named, vec![("x", &x)]].concat();
            assert_same_gradients(&named, &got, &want, tol, &what);
            if dtype == DType::F32 {
                continue;
            }
            // Central differences for a few entries of each parameter and the input.
            let loss = || {
                let y = layer.forward(x.as_tensor()).unwrap();
                (&y * &g)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            assert_central_differences(&named, &got, loss, &what);
        }
    }
}

/// In f16 and bf16 the layer runs by hand too (the readout matrix from C_out in f32): its
/// output and gradients follow the f32 layer's on the same rounded parameters and input, to the
/// half dtype's precision, every gradient in its parameter's dtype.
#[test]
fn backward_by_hand_in_half_precision_follows_f32() {
    let (mut rng, seed) = seeded_rng("myo by hand in half precision", 140);
    for (dtype, tol) in [(DType::BF16, 4e-2), (DType::F16, 4e-3)] {
        for per_level in [false, true] {
            let cfg = MyoConfig {
                per_level,
                all_nodes: true,
                seed: rng.random(),
                ..MyoConfig::new(
                    3,
                    4,
                    TreeSpec::Ragged {
                        leaves: 11,
                        arity: 2,
                    },
                )
            };
            let what = format!("{cfg:?} (seed {seed})");
            common::half::myo_follows_f32(&Device::Cpu, dtype, &cfg, &mut rng, tol, &what);
        }
    }
}
