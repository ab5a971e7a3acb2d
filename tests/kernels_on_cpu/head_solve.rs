//! The kernels of kernels/head_solve.cu through the harness — `head_pivots`, `head_sweep`,
//! `head_reduce` — run as the op launches them: forward (pivots, then the sweep) and backward
//! (the adjoint's pivots, the sweep of ∂x, the reduction), against the dense f64 solve and, bit
//! for bit, the CPU twin.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::head_solve::cuda::{
    backward_plans, forward_plans, skew_backward_plans, skew_forward_plans, sweep_lanes, LANES,
    ROWS, THREADS,
};
use myosotis::ops::plan::{DeviceLimits, KernelArg};
use myosotis::ops::{head_solve, head_solve_backward, head_solve_skew, head_solve_skew_backward};
use myosotis::tree::Tree;

use crate::assert_same;
use crate::common::heads::*;
use crate::common::*;
use crate::exec::{round_to, run, run_in_every_order};

/// The head kernels' dtypes (half precision is solved in f32 by the op), with tolerances.
const HEAD_DTYPES: [(DType, f64); 2] = [(DType::F64, 1e-12), (DType::F32, 2e-5)];

/// Devices whose multiprocessor counts make the sweep of 2 samples × 37 heads take blocks of
/// 32, 16 and 8 heads (see [`sweep_lanes`]).
const SWEEP_WIDTHS: [(u32, DeviceLimits); 3] = [
    (
        32,
        DeviceLimits {
            sms: 1,
            ..DeviceLimits::H100
        },
    ),
    (
        16,
        DeviceLimits {
            sms: 3,
            ..DeviceLimits::H100
        },
    ),
    (8, DeviceLimits::H100),
];

fn rounded(x: &HeadInputs, dtype: DType) -> HeadInputs {
    let r = |v: &[f64]| round_to(v, dtype);
    HeadInputs {
        u: r(&x.u),
        bias: r(&x.bias),
        b: r(&x.b),
        c: r(&x.c),
        ..x.clone()
    }
}

/// x of the forward's two launches; the status of the pivots.
fn forward(
    tree: &Tree,
    x: &HeadInputs,
    ts: &[Tensor; 4],
    dtype: DType,
    seed: u64,
    limits: DeviceLimits,
) -> (Vec<f64>, i32) {
    let [u, bias, b, c] = ts;
    let [pivots, sweep] = forward_plans(tree, u, bias, b, c, limits).unwrap();
    let coef = [x.b.clone(), x.c.clone()].concat();
    let piv = run_in_every_order(&pivots, dtype, &[&coef], seed);
    let inputs: Vec<&[f64]> = match tree.len() > tree.leaves() {
        true => vec![&x.u, &x.bias, &piv.outputs[0]],
        false => vec![&x.u, &piv.outputs[0]],
    };
    let run = run_in_every_order(&sweep, dtype, &inputs, seed);
    assert_eq!(run.status, 0);
    (run.outputs[0].clone(), piv.status)
}

#[test]
fn head_kernels_match_the_dense_solve_and_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("head kernels", 41);
    let trees = [
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("ragged 3-ary 50", Tree::ragged(50, 3).unwrap()),
        ("quad 6x5", Tree::quad(6, 5).unwrap()),
        ("chain 12", Tree::chain(12).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ];
    // 37 heads: a partial second block of lanes.
    for (name, tree) in &trees {
        for shape in [(2, 3, false), (2, 37, true), (3, 5, false)] {
            for coupling in [Coupling::Skew, Coupling::Dominant] {
                for ((dtype, tol), (lanes, limits)) in HEAD_DTYPES
                    .into_iter()
                    .flat_map(|d| SWEEP_WIDTHS.map(|w| (d, w)))
                {
                    let what = format!(
                        "{name}, {shape:?}, {coupling:?}, {dtype:?}, sweep of {} lanes (seed {seed})",
                        sweep_lanes(shape.0, shape.1, limits.sms)
                    );
                    if shape == (2, 37, true) {
                        assert_eq!(sweep_lanes(2, 37, limits.sms), lanes, "{what}");
                    }
                    let x = rounded(&random_head_inputs(tree, shape, coupling, &mut rng), dtype);
                    let ts = x.tensors(tree, dtype, &Device::Cpu);
                    let [u, bias, b, c] = &ts;
                    let (sol, status) = forward(tree, &x, &ts, dtype, seed, limits);
                    assert_eq!(status, 0, "{what}");
                    let e = rel_err(&sol, &dense(tree, &x));
                    assert!(e < tol, "x vs dense solve: {e:e}, {what}");
                    let twin = head_solve(tree, u, bias, b, c).unwrap();
                    assert_same(&sol, &to_vec(&twin), &format!("x, {what}"));

                    let n = tree.len();
                    let g = round_to(&uniform(&mut rng, sol.len(), -1.0, 1.0), dtype);
                    let g_t = tensor(&g, twin.dims(), dtype, &Device::Cpu);
                    let want = dense_grads(tree, &x, &g);
                    let twin = head_solve_backward(tree, u, bias, b, c, &twin, &g_t).unwrap();
                    let [pivots, sweep, reduce] =
                        backward_plans(tree, u, bias, b, c, limits).unwrap();
                    let coef = [x.b.clone(), x.c.clone()].concat();
                    let piv = run_in_every_order(&pivots, dtype, &[&coef], seed);
                    assert_eq!(piv.status, 0, "{what}");
                    let lam = run_in_every_order(&sweep, dtype, &[&g, &piv.outputs[0]], seed);
                    let lam = &lam.outputs[0];
                    let red = run_in_every_order(&reduce, dtype, &[lam, &sol], seed);
                    // ∂u: λ on the first m nodes of every sample.
                    let per = n * x.heads * 2;
                    let du: Vec<f64> = lam
                        .chunks(per)
                        .flat_map(|s| s[..x.m * x.heads * 2].to_vec())
                        .collect();
                    let e = rel_err(&du, &want[0]);
                    assert!(e < tol, "∂u vs dense adjoint: {e:e}, {what}");
                    assert_same(&du, &to_vec(&twin.u), &format!("∂u, {what}"));
                    let dcoef = &red.outputs[0];
                    let e = rel_err(dcoef, &[want[2].clone(), want[3].clone()].concat());
                    assert!(e < 4.0 * tol, "∂b, ∂c vs f64 reference: {e:e}, {what}");
                    let twin_dcoef = [to_vec(&twin.b), to_vec(&twin.c)].concat();
                    assert_same(dcoef, &twin_dcoef, &format!("∂b, ∂c, {what}"));
                    if n > tree.leaves() {
                        let dbias = &red.outputs[1];
                        let e = rel_err(dbias, &want[1]);
                        assert!(e < 4.0 * tol, "∂bias vs f64 reference: {e:e}, {what}");
                        assert_same(dbias, &to_vec(&twin.bias), &format!("∂bias, {what}"));
                    } else {
                        assert_eq!(red.outputs.len(), 1, "{what}");
                        assert_eq!(reduce.args[3], KernelArg::Null, "{what}");
                    }
                }
            }
        }
    }
}

/// The skew form (s and the bias in the Myo layer's layout, B = −s and C = conj(s) formed by the
/// kernels): x equal bit for bit to the general form's kernels on the same system and to the
/// CPU twin; ∂s and ∂bias against the f64 reference and, bit for bit, the twin.
#[test]
fn head_kernels_skew_form() {
    let (mut rng, seed) = seeded_rng("head kernels, skew form", 43);
    let trees = [
        ("ragged 3-ary 50", Tree::ragged(50, 3).unwrap()),
        ("quad 6x5", Tree::quad(6, 5).unwrap()),
        ("chain 12", Tree::chain(12).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ];
    for (name, tree) in &trees {
        for shape in [(2, 3, false), (2, 37, true)] {
            for (dtype, tol) in HEAD_DTYPES {
                let what = format!("{name}, {shape:?}, {dtype:?} (seed {seed})");
                let x = rounded(
                    &random_head_inputs(tree, shape, Coupling::Skew, &mut rng),
                    dtype,
                );
                let (n, heads, internal) = (tree.len(), x.heads, tree.len() - tree.leaves());
                let ts = x.tensors(tree, dtype, &Device::Cpu);
                let u = &ts[0];
                let (s, bias) = x.skew_form(tree);
                let s_t = tensor(&s, &[heads, n, 2], dtype, &Device::Cpu);
                let bias_t = tensor(&bias, &[heads, internal, 2], dtype, &Device::Cpu);
                // The skew form in blocks of 32 heads, the general one in the H100's choice.
                let wide = SWEEP_WIDTHS[0].1;
                let [pivots, sweep] = skew_forward_plans(tree, u, &bias_t, &s_t, wide).unwrap();
                let piv = run_in_every_order(&pivots, dtype, &[&s], seed);
                assert_eq!(piv.status, 0, "{what}");
                let inputs: Vec<&[f64]> = match internal > 0 {
                    true => vec![&x.u, &bias, &piv.outputs[0]],
                    false => vec![&x.u, &piv.outputs[0]],
                };
                let sol = run_in_every_order(&sweep, dtype, &inputs, seed).outputs[0].clone();
                let (general, _) = forward(tree, &x, &ts, dtype, seed, DeviceLimits::H100);
                assert_same(&sol, &general, &format!("x vs the general form, {what}"));
                let twin = head_solve_skew(tree, u, &bias_t, &s_t).unwrap();
                assert_same(&sol, &to_vec(&twin), &format!("x, {what}"));

                let g = round_to(&uniform(&mut rng, sol.len(), -1.0, 1.0), dtype);
                let g_t = tensor(&g, twin.dims(), dtype, &Device::Cpu);
                let twin = head_solve_skew_backward(tree, u, &bias_t, &s_t, &twin, &g_t).unwrap();
                let [pivots, sweep, reduce] =
                    skew_backward_plans(tree, u, &bias_t, &s_t, wide).unwrap();
                let piv = run_in_every_order(&pivots, dtype, &[&s], seed);
                let lam = run_in_every_order(&sweep, dtype, &[&g, &piv.outputs[0]], seed);
                let red = run_in_every_order(&reduce, dtype, &[&lam.outputs[0], &sol], seed);
                // ∂s = conj(∂C) − ∂B and ∂bias, by head, from the f64 reference.
                let [_, dbias, db, dc] = dense_grads(tree, &x, &g);
                let mut ds = vec![0.0; s.len()];
                let mut dbias_h = vec![0.0; bias.len()];
                for hi in 0..heads {
                    for v in 0..n {
                        let e = 2 * (v * heads + hi);
                        ds[2 * (hi * n + v)] = dc[e] - db[e];
                        ds[2 * (hi * n + v) + 1] = -dc[e + 1] - db[e + 1];
                        if v >= n - internal {
                            let (k, j) = (
                                2 * (hi * internal + v - (n - internal)),
                                e - 2 * heads * (n - internal),
                            );
                            dbias_h[k..k + 2].copy_from_slice(&dbias[j..j + 2]);
                        }
                    }
                }
                let e = rel_err(&red.outputs[0], &ds);
                assert!(e < 4.0 * tol, "∂s vs f64 reference: {e:e}, {what}");
                assert_same(&red.outputs[0], &to_vec(&twin.s), &format!("∂s, {what}"));
                if internal > 0 {
                    let e = rel_err(&red.outputs[1], &dbias_h);
                    assert!(e < 4.0 * tol, "∂bias vs f64 reference: {e:e}, {what}");
                    assert_same(
                        &red.outputs[1],
                        &to_vec(&twin.bias),
                        &format!("∂bias, {what}"),
                    );
                } else {
                    assert_eq!(red.outputs.len(), 1, "{what}");
                }
            }
        }
    }
}

/// zMNIST's shape: a 28 × 28 quad tree, 64 heads (two blocks of lanes), forward and backward
/// equal to the CPU twin.
#[test]
fn head_kernels_on_the_zmnist_tree() {
    let (mut rng, seed) = seeded_rng("head kernels, zMNIST tree", 42);
    let tree = Tree::quad(28, 28).unwrap();
    let dtype = DType::F32;
    let x = rounded(
        &random_head_inputs(&tree, (2, 64, false), Coupling::Skew, &mut rng),
        dtype,
    );
    let ts = x.tensors(&tree, dtype, &Device::Cpu);
    let [u, bias, b, c] = &ts;
    let [pivots, sweep] = forward_plans(&tree, u, bias, b, c, DeviceLimits::H100).unwrap();
    // 64 heads in blocks of LANES, two samples.
    let h = 64 / LANES;
    assert_eq!((pivots.grid, pivots.block), ([h, 1, 1], [LANES, ROWS, 1]));
    assert_eq!((sweep.grid, sweep.block), ([h, 2, 1], [LANES, ROWS, 1]));
    let (sol, _) = forward(&tree, &x, &ts, dtype, seed, DeviceLimits::H100);
    let twin = head_solve(&tree, u, bias, b, c).unwrap();
    assert_same(&sol, &to_vec(&twin), &format!("x (seed {seed})"));
}

/// The sweep's heads per block by shape on an H100 (132 SMs): 8 at (16 samples, 64 heads),
/// 128 blocks; 32 at (64, 256), 512 blocks; 16 where 32 would leave SMs short.
#[test]
fn head_sweep_lanes_follow_the_grid() {
    let sms = DeviceLimits::H100.sms;
    assert_eq!(sweep_lanes(16, 64, sms), 8);
    assert_eq!(sweep_lanes(64, 256, sms), 32);
    assert_eq!(sweep_lanes(32, 256, sms), 16);
    assert_eq!(sweep_lanes(1, 1, 1), 8);
    let tree = Tree::quad(28, 28).unwrap();
    let (n, dtype) = (tree.len(), DType::F32);
    let z = |s: &[usize]| Tensor::zeros(s, dtype, &Device::Cpu).unwrap();
    let (u, bias, s) = (
        z(&[64, tree.leaves(), 256, 2]),
        z(&[256, n - tree.leaves(), 2]),
        z(&[256, n, 2]),
    );
    let [_, sweep] = skew_forward_plans(&tree, &u, &bias, &s, DeviceLimits::H100).unwrap();
    assert_eq!(
        (sweep.grid, sweep.block),
        ([8, 64, 1], [32, THREADS / 32, 1])
    );
    let [_, sweep, _] = skew_backward_plans(&tree, &u, &bias, &s, DeviceLimits::V100).unwrap();
    assert_eq!(sweep.block, [32, THREADS / 32, 1]);
}

/// A singular pivot sets the status words to 1 + node and 1 + head, forward and backward.
#[test]
fn head_kernels_report_a_singular_pivot_with_its_node() {
    let tree = Tree::perfect(16, 4).unwrap();
    let x = singular_head_inputs(&tree);
    let [u, bias, b, c] = x.tensors(&tree, DType::F32, &Device::Cpu);
    let parent = tree.parent(4).unwrap() as i32;
    let coef = [x.b.clone(), x.c.clone()].concat();
    let [fwd, _] = forward_plans(&tree, &u, &bias, &b, &c, DeviceLimits::H100).unwrap();
    let [bwd, _, _] = backward_plans(&tree, &u, &bias, &b, &c, DeviceLimits::H100).unwrap();
    for (plan, what) in [(fwd, "forward"), (bwd, "backward")] {
        let r = run(
            &plan,
            DType::F32,
            &[&coef],
            kernels_on_cpu::Order::Ascending,
        )
        .unwrap();
        assert_eq!(
            (r.status, r.status_head),
            (1 + parent, 2),
            "{what}: node, head 1"
        );
    }
}
