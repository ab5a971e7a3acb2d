//! The CUDA head-solve kernels through autograd against the CPU twin and the dense f64 solve.
//! Compiled with `--features cuda` (CI compiles them); each test prints why it is skipped when
//! no CUDA device can be opened.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Var};
use common::heads::*;
use common::*;
use myosotis::ops::head_solve::cuda::{staged_bytes, sweep_lanes};
use myosotis::ops::plan::DeviceLimits;
use myosotis::ops::{check_pivots, head_solve, head_solve_skew};
use myosotis::tree::Tree;

/// x and the gradients of Σ w ⊙ x with respect to (u, bias, b, c), on `dev` in `dtype`.
fn forward_backward(
    tree: &Tree,
    x: &HeadInputs,
    w: &[f64],
    dev: &Device,
    dtype: DType,
) -> [Vec<f64>; 5] {
    let vars = x
        .tensors(tree, dtype, dev)
        .map(|t| Var::from_tensor(&t).unwrap());
    let [u, bias, b, c] = vars.each_ref().map(|v| v.as_tensor().clone());
    let out = head_solve(tree, &u, &bias, &b, &c).unwrap();
    let w = tensor(w, out.dims(), dtype, dev);
    let grads = (&out * w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |v: &Var| {
        grads
            .get(v)
            .map_or_else(|| vec![0.0; v.elem_count()], to_vec)
    };
    [
        to_vec(&out),
        g(&vars[0]),
        g(&vars[1]),
        g(&vars[2]),
        g(&vars[3]),
    ]
}

#[test]
fn cuda_head_solve_matches_cpu_twin_and_dense_solve() {
    let Some(gpu) = gpu("cuda_head_solve_matches_cpu_twin_and_dense_solve") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda head solve", 43);
    let trees = [
        ("perfect 4-ary 64", Tree::perfect(64, 4).unwrap()),
        ("ragged 3-ary 100", Tree::ragged(100, 3).unwrap()),
        ("quad 28x28", Tree::quad(28, 28).unwrap()),
        ("chain 300", Tree::chain(300).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ];
    for (name, tree) in &trees {
        for shape in [(2, 3, false), (5, 64, false), (3, 37, true)] {
            for coupling in [Coupling::Skew, Coupling::Dominant] {
                let x = random_head_inputs(tree, shape, coupling, &mut rng);
                let w = uniform(&mut rng, shape.0 * tree.len() * shape.1 * 2, -1.0, 1.0);
                let want = dense(tree, &x);
                for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
                    let what = format!("{dtype:?}, {name}, {shape:?}, {coupling:?} (seed {seed})");
                    let cuda = forward_backward(tree, &x, &w, &gpu, dtype);
                    check_pivots(&gpu).unwrap();
                    let cpu = forward_backward(tree, &x, &w, &Device::Cpu, dtype);
                    let e = rel_err(&cuda[0], &want);
                    assert!(e < tol, "x vs dense: {e:e}, {what}");
                    for (k, g) in ["x", "du", "dbias", "db", "dc"].iter().enumerate() {
                        if cpu[k].is_empty() {
                            continue;
                        }
                        let e = rel_err(&cuda[k], &cpu[k]);
                        assert!(e < 20.0 * tol, "{g} CUDA vs CPU {e:e}, {what}");
                    }
                }
            }
        }
    }
}

/// The skew form (s and the bias by head, the Myo layer's layout): x and the gradients of
/// Σ w ⊙ x with respect to (u, bias, s) on CUDA against the CPU twin.
#[test]
fn cuda_head_solve_skew_matches_cpu_twin() {
    let Some(gpu) = gpu("cuda_head_solve_skew_matches_cpu_twin") else {
        return;
    };
    let (mut rng, seed) = seeded_rng("cuda head solve, skew form", 44);
    for (name, tree) in [
        ("ragged 3-ary 100", Tree::ragged(100, 3).unwrap()),
        ("quad 28x28", Tree::quad(28, 28).unwrap()),
        ("single node", Tree::ragged(1, 2).unwrap()),
    ] {
        for shape in [(2, 3, false), (3, 37, true)] {
            let x = random_head_inputs(&tree, shape, Coupling::Skew, &mut rng);
            let (n, internal) = (tree.len(), tree.len() - tree.leaves());
            let (s, bias) = x.skew_form(&tree);
            let w = uniform(&mut rng, shape.0 * n * shape.1 * 2, -1.0, 1.0);
            let parts = [
                (&x.u, vec![shape.0, x.m, shape.1, 2]),
                (&bias, vec![shape.1, internal, 2]),
                (&s, vec![shape.1, n, 2]),
            ];
            for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
                let what = format!("{dtype:?}, {name}, {shape:?} (seed {seed})");
                let run = |dev: &Device| -> Vec<Vec<f64>> {
                    let vars: Vec<Var> = parts
                        .iter()
                        .map(|(v, sh)| Var::from_tensor(&tensor(v, sh, dtype, dev)).unwrap())
                        .collect();
                    let t: Vec<_> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                    let out = head_solve_skew(&tree, &t[0], &t[1], &t[2]).unwrap();
                    let w = tensor(&w, out.dims(), dtype, dev);
                    let grads = (&out * w).unwrap().sum_all().unwrap().backward().unwrap();
                    let mut all = vec![to_vec(&out)];
                    all.extend(vars.iter().map(|v| {
                        grads
                            .get(v)
                            .map_or_else(|| vec![0.0; v.elem_count()], to_vec)
                    }));
                    all
                };
                let cuda = run(&gpu);
                check_pivots(&gpu).unwrap();
                let cpu = run(&Device::Cpu);
                for (k, g) in ["x", "du", "dbias", "ds"].iter().enumerate() {
                    if cpu[k].is_empty() {
                        continue;
                    }
                    let e = rel_err(&cuda[k], &cpu[k]);
                    assert!(e < 20.0 * tol, "{g} CUDA vs CPU {e:e}, {what}");
                }
            }
        }
    }
}

/// A singular pivot on the GPU is reported by `check_pivots` with its node and head.
#[test]
fn cuda_head_solve_reports_a_singular_pivot() {
    let Some(gpu) = gpu("cuda_head_solve_reports_a_singular_pivot") else {
        return;
    };
    let tree = Tree::perfect(16, 4).unwrap();
    let x = singular_head_inputs(&tree);
    check_pivots(&gpu).unwrap();
    let [u, bias, b, c] = x.tensors(&tree, DType::F32, &gpu);
    let _ = head_solve(&tree, &u, &bias, &b, &c).unwrap();
    let err = check_pivots(&gpu).unwrap_err().to_string();
    let parent = tree.parent(4).unwrap();
    assert!(err.contains(&format!("node {parent}, head 1")), "{err}");
    check_pivots(&gpu).unwrap();
}

/// x and the gradients of Σ w ⊙ x on this GPU against the CPU twin, in f32, for `cases` of
/// (what, tree, batch, heads).
fn matches_cpu_twin(gpu: &Device, cases: &[(&str, &Tree, usize, usize)], seed_name: &str) {
    let (mut rng, seed) = seeded_rng(seed_name, 45);
    for &(what, tree, batch, heads) in cases {
        let x = random_head_inputs(tree, (batch, heads, false), Coupling::Skew, &mut rng);
        let w = uniform(&mut rng, batch * tree.len() * heads * 2, -1.0, 1.0);
        let what = format!("{what}, batch {batch} (seed {seed})");
        let cuda = forward_backward(tree, &x, &w, gpu, DType::F32);
        check_pivots(gpu).unwrap();
        let cpu = forward_backward(tree, &x, &w, &Device::Cpu, DType::F32);
        for (k, g) in ["x", "du", "dbias", "db", "dc"].iter().enumerate() {
            let e = rel_err(&cuda[k], &cpu[k]);
            assert!(e < 4e-4, "{g} CUDA vs CPU {e:e}, {what}");
        }
    }
}

/// The device's limits.
fn limits_of(gpu: &Device) -> DeviceLimits {
    let Device::Cuda(dev) = gpu else {
        unreachable!("a CUDA device")
    };
    myosotis::cuda::limits(dev).unwrap()
}

/// The staged solve with more shared memory than a kernel gets without opting in: ListOps'
/// 4,095-node tree.
#[test]
fn cuda_head_solve_staged_in_opted_in_shared_memory() {
    let Some(gpu) = gpu("cuda_head_solve_staged_in_opted_in_shared_memory") else {
        return;
    };
    let limits = limits_of(&gpu);
    let listops = Tree::perfect(2048, 2).unwrap();
    let bytes = staged_bytes(&listops, DType::F32);
    assert!(
        bytes > DeviceLimits::DEFAULT_SHARED && bytes <= limits.shared_per_block,
        "{bytes} bytes staged, {limits:?}"
    );
    let cases = [("staged, ListOps' tree", &listops, 3, 37)];
    matches_cpu_twin(&gpu, &cases, "cuda head solve, staged");
}

/// A tree too large to be staged: pivots and sweep, with grids large enough that the sweep
/// takes 32 and 16 heads per block (as `sweep_lanes` picks from the multiprocessor count).
/// (Named apart from the `cuda_head_solve` tests, which the bundle also runs under
/// compute-sanitizer: these grids are large.)
#[test]
fn cuda_head_sweep_in_wide_blocks_matches_cpu_twin() {
    let Some(gpu) = gpu("cuda_head_sweep_in_wide_blocks_matches_cpu_twin") else {
        return;
    };
    let limits = limits_of(&gpu);
    let large = Tree::ragged(4000, 3).unwrap();
    let bytes = staged_bytes(&large, DType::F32);
    assert!(bytes > limits.shared_per_block, "{bytes} bytes, {limits:?}");
    // 128 heads make 4 blocks of 32 per sample, 8 of 16: the fewest samples for each.
    let (sms, heads) = (limits.sms, 128);
    let (b32, b16) = ((2 * sms).div_ceil(4), (2 * sms).div_ceil(8));
    assert_eq!(sweep_lanes(b32, heads, sms), 32, "{sms} SMs");
    assert_eq!(sweep_lanes(b16, heads, sms), 16, "{sms} SMs");
    let cases = [
        ("sweep of 32 lanes", &large, b32, heads),
        ("sweep of 16 lanes", &large, b16, heads),
    ];
    matches_cpu_twin(&gpu, &cases, "cuda head solve, wide blocks");
}
