//! The kernels of kernels/head_solve.cu through the harness — `head_staged`, `head_pivots`,
//! `head_sweep`, `head_reduce` — run as the op launches them: forward (a solve: staged, or pivots
//! then the sweep) and backward (the adjoint's solve, then the reduction), against the dense f64
//! solve and, bit for bit, the CPU twin.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::head_solve::cuda::{
    backward_plans, forward_plans, skew_backward_plans, skew_forward_plans, staged_bytes,
    staged_lanes, sweep_lanes, Solve, LANES, ROWS, STAGED_THREADS, THREADS,
};
use myosotis::ops::plan::{DeviceLimits, KernelArg};
use myosotis::ops::{head_solve, head_solve_backward, head_solve_skew, head_solve_skew_backward};
use myosotis::tree::Tree;

use crate::assert_same;
use crate::common::heads::*;
use crate::common::*;
use crate::exec::{round_to, run, run_in_every_order, HostRun};

/// The head kernels' dtypes (half precision is solved in f32 by the op), with tolerances.
const HEAD_DTYPES: [(DType, f64); 2] = [(DType::F64, 1e-12), (DType::F32, 2e-5)];

/// A device without shared memory to spare: every solve takes pivots and sweep.
const NO_SHARED: DeviceLimits = DeviceLimits {
    shared_per_block: 0,
    ..DeviceLimits::H100
};

/// The layouts of a solve, by the devices that choose them: staged (an H100), and pivots and
/// sweep with blocks of 32, 16 and 8 heads (see [`sweep_lanes`]: 2 samples × 37 heads on 1, 3
/// and 132 multiprocessors), with the sweep's lanes (0 for staged).
const LAYOUTS: [(u32, DeviceLimits); 4] = [
    (0, DeviceLimits::H100),
    (
        32,
        DeviceLimits {
            sms: 1,
            ..NO_SHARED
        },
    ),
    (
        16,
        DeviceLimits {
            sms: 3,
            ..NO_SHARED
        },
    ),
    (8, NO_SHARED),
];

/// Runs a solve's launches in every order of threads and blocks: rhs, the bias if the solve has
/// one, coef. The status is the first launch's (the one that forms the pivots).
fn run_solve(
    solve: &Solve,
    dtype: DType,
    rhs: &[f64],
    bias: Option<&[f64]>,
    coef: &[f64],
    seed: u64,
) -> HostRun {
    let (plan, piv) = match solve {
        Solve::Staged(plan) => (plan, None),
        Solve::Global { pivots, sweep } => (
            sweep,
            Some(run_in_every_order(pivots, dtype, &[coef], seed)),
        ),
    };
    let last = piv.as_ref().map_or(coef, |p| &p.outputs[0][..]);
    let inputs: Vec<&[f64]> = [Some(rhs), bias, Some(last)]
        .into_iter()
        .flatten()
        .collect();
    let mut out = run_in_every_order(plan, dtype, &inputs, seed);
    if let Some(p) = piv {
        assert_eq!(out.status, 0, "the sweep sets no status");
        (out.status, out.status_head) = (p.status, p.status_head);
    }
    out
}

/// The layout a solve took: the sweep's lanes, or 0 for staged.
fn layout_of(solve: &Solve) -> u32 {
    match solve {
        Solve::Staged(_) => 0,
        Solve::Global { sweep, .. } => sweep.block[0],
    }
}

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

/// x of the forward's launches; the status of the pivots.
fn forward(
    tree: &Tree,
    x: &HeadInputs,
    ts: &[Tensor; 4],
    dtype: DType,
    seed: u64,
    limits: DeviceLimits,
) -> (Vec<f64>, i32) {
    let [u, bias, b, c] = ts;
    let solve = forward_plans(tree, u, bias, b, c, limits).unwrap();
    let coef = [x.b.clone(), x.c.clone()].concat();
    let bias = (tree.len() > tree.leaves()).then_some(&x.bias[..]);
    let run = run_solve(&solve, dtype, &x.u, bias, &coef, seed);
    (run.outputs[0].clone(), run.status)
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
                    .flat_map(|d| LAYOUTS.map(|w| (d, w)))
                {
                    let x = rounded(&random_head_inputs(tree, shape, coupling, &mut rng), dtype);
                    let ts = x.tensors(tree, dtype, &Device::Cpu);
                    let [u, bias, b, c] = &ts;
                    let layout = layout_of(&forward_plans(tree, u, bias, b, c, limits).unwrap());
                    let what = format!(
                        "{name}, {shape:?}, {coupling:?}, {dtype:?}, {} (seed {seed})",
                        match layout {
                            0 => "staged".to_string(),
                            l => format!("sweep of {l} lanes"),
                        }
                    );
                    if shape == (2, 37, true) || lanes == 0 {
                        assert_eq!(layout, lanes, "{what}");
                    }
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
                    let (solve, reduce) = backward_plans(tree, u, bias, b, c, limits).unwrap();
                    assert_eq!(layout_of(&solve), layout, "{what}");
                    let coef = [x.b.clone(), x.c.clone()].concat();
                    let lam = run_solve(&solve, dtype, &g, None, &coef, seed);
                    assert_eq!(lam.status, 0, "{what}");
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
            // The skew form staged and in sweeps of 32 heads, the general form in sweeps of 8.
            for ((dtype, tol), limits) in HEAD_DTYPES
                .into_iter()
                .flat_map(|d| [LAYOUTS[0].1, LAYOUTS[1].1].map(|l| (d, l)))
            {
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
                let solve = skew_forward_plans(tree, u, &bias_t, &s_t, limits).unwrap();
                let what = format!(
                    "{name}, {shape:?}, {dtype:?}, layout {} (seed {seed})",
                    layout_of(&solve)
                );
                let with_bias = (internal > 0).then_some(&bias[..]);
                let sol = run_solve(&solve, dtype, &x.u, with_bias, &s, seed);
                assert_eq!(sol.status, 0, "{what}");
                let sol = sol.outputs[0].clone();
                let (general, _) = forward(tree, &x, &ts, dtype, seed, NO_SHARED);
                assert_same(&sol, &general, &format!("x vs the general form, {what}"));
                let twin = head_solve_skew(tree, u, &bias_t, &s_t).unwrap();
                assert_same(&sol, &to_vec(&twin), &format!("x, {what}"));

                let g = round_to(&uniform(&mut rng, sol.len(), -1.0, 1.0), dtype);
                let g_t = tensor(&g, twin.dims(), dtype, &Device::Cpu);
                let twin = head_solve_skew_backward(tree, u, &bias_t, &s_t, &twin, &g_t).unwrap();
                let (solve, reduce) = skew_backward_plans(tree, u, &bias_t, &s_t, limits).unwrap();
                let lam = run_solve(&solve, dtype, &g, None, &s, seed);
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
    let twin = head_solve(&tree, u, bias, b, c).unwrap();
    // Staged: 64 heads in blocks of 4, two samples, every node's value and every internal node's
    // pivot slot per lane.
    let Solve::Staged(staged) = forward_plans(&tree, u, bias, b, c, DeviceLimits::H100).unwrap()
    else {
        panic!("a 1,047-node tree is staged on an H100")
    };
    assert_eq!(staged_lanes(dtype), 4);
    let block = [4, STAGED_THREADS / 4, 1];
    assert_eq!((staged.grid, staged.block), ([16, 2, 1], block));
    let (n, internal) = (tree.len(), tree.len() - tree.leaves());
    let slots = n.div_ceil(4) * 4 + internal.div_ceil(4) * 4;
    assert_eq!(staged.shared_bytes, slots * 4 * 8);
    assert_eq!(staged_bytes(&tree, dtype), staged.shared_bytes);
    // Pivots and sweep: 64 heads in blocks of LANES.
    let Solve::Global { pivots, sweep } = forward_plans(&tree, u, bias, b, c, NO_SHARED).unwrap()
    else {
        panic!("no shared memory, no staged solve")
    };
    let h = 64 / LANES;
    assert_eq!((pivots.grid, pivots.block), ([h, 1, 1], [LANES, ROWS, 1]));
    assert_eq!((sweep.grid, sweep.block), ([h, 2, 1], [LANES, ROWS, 1]));
    for limits in [DeviceLimits::H100, NO_SHARED] {
        let (sol, _) = forward(&tree, &x, &ts, dtype, seed, limits);
        assert_same(&sol, &to_vec(&twin), &format!("x (seed {seed})"));
    }
}

/// The staged solve takes a tree while a block's values fit in the device's shared memory:
/// ListOps' 4,095-node binary tree on an H100 (196 KB in f32, and in f64, whose blocks have half
/// the lanes), not on a V100 (96 KB); Path-X's 32,767 nodes nowhere.
#[test]
fn head_solve_is_staged_where_the_tree_fits() {
    let staged = |tree: &Tree, dtype: DType, limits: DeviceLimits| {
        let z = |s: &[usize]| Tensor::zeros(s, dtype, &Device::Cpu).unwrap();
        let (n, l) = (tree.len(), tree.leaves());
        let (u, bias, s) = (z(&[2, l, 8, 2]), z(&[8, n - l, 2]), z(&[8, n, 2]));
        let fwd = skew_forward_plans(tree, &u, &bias, &s, limits).unwrap();
        let (bwd, _) = skew_backward_plans(tree, &u, &bias, &s, limits).unwrap();
        assert_eq!(layout_of(&fwd), layout_of(&bwd));
        matches!(fwd, Solve::Staged(_))
    };
    let listops = Tree::perfect(2048, 2).unwrap();
    assert_eq!(staged_bytes(&listops, DType::F32), (4096 + 2048) * 32);
    assert!(staged(&listops, DType::F32, DeviceLimits::H100));
    assert!(!staged(&listops, DType::F32, DeviceLimits::V100));
    assert!(staged(&listops, DType::F64, DeviceLimits::H100));
    assert_eq!(staged_bytes(&listops, DType::F64), (4096 + 2048) * 32);
    let zmnist = Tree::quad(28, 28).unwrap();
    assert!(staged(&zmnist, DType::F64, DeviceLimits::V100));
    let pathx = Tree::perfect(16_384, 2).unwrap();
    assert!(!staged(&pathx, DType::F32, DeviceLimits::H100));
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
    let sweep = |solve| match solve {
        Solve::Global { sweep, .. } => sweep,
        Solve::Staged(_) => panic!("no shared memory, no staged solve"),
    };
    let fwd = sweep(skew_forward_plans(&tree, &u, &bias, &s, NO_SHARED).unwrap());
    assert_eq!((fwd.grid, fwd.block), ([8, 64, 1], [32, THREADS / 32, 1]));
    let v100 = DeviceLimits {
        shared_per_block: 0,
        ..DeviceLimits::V100
    };
    let (bwd, _) = skew_backward_plans(&tree, &u, &bias, &s, v100).unwrap();
    assert_eq!(sweep(bwd).block, [32, THREADS / 32, 1]);
}

/// A singular pivot sets the status words to 1 + node and 1 + head, forward and backward.
#[test]
fn head_kernels_report_a_singular_pivot_with_its_node() {
    let tree = Tree::perfect(16, 4).unwrap();
    let x = singular_head_inputs(&tree);
    let [u, bias, b, c] = x.tensors(&tree, DType::F32, &Device::Cpu);
    let parent = tree.parent(4).unwrap() as i32;
    let coef = [x.b.clone(), x.c.clone()].concat();
    for limits in [DeviceLimits::H100, NO_SHARED] {
        let fwd = forward_plans(&tree, &u, &bias, &b, &c, limits).unwrap();
        let (bwd, _) = backward_plans(&tree, &u, &bias, &b, &c, limits).unwrap();
        for (solve, what) in [(fwd, "forward"), (bwd, "backward")] {
            let what = format!("{what}, layout {}", layout_of(&solve));
            // The launch that forms the pivots: with the right-hand sides when staged.
            let r = match &solve {
                Solve::Staged(plan) => {
                    let g = vec![0.5; plan.outputs[0]];
                    let inputs: Vec<&[f64]> = match what.starts_with("forward") {
                        true => vec![&x.u, &x.bias, &coef],
                        false => vec![&g, &coef],
                    };
                    run(plan, DType::F32, &inputs, kernels_on_cpu::Order::Ascending)
                }
                Solve::Global { pivots, .. } => run(
                    pivots,
                    DType::F32,
                    &[&coef],
                    kernels_on_cpu::Order::Ascending,
                ),
            }
            .unwrap();
            assert_eq!(
                (r.status, r.status_head),
                (1 + parent, 2),
                "{what}: node, head 1"
            );
        }
    }
}
