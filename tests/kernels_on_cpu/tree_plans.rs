//! The tree-solve launch plans as pure functions: where the per-tree state goes (shared memory,
//! global workspace), the layout and lane width per launch, the errors for a layout that does
//! not take a solve.

use candle_core::{DType, Device, Tensor};
use myosotis::ops::plan::{DeviceLimits, KernelArg, LaunchPlan};
use myosotis::ops::tree_solve::cuda::{
    backward_plan, backward_plans, forward_plan, forward_plans, lu_slots,
};
use myosotis::ops::{TreeLayout, TreeSolveOptions};
use myosotis::tree::Tree;

/// The workspace decisions, per device: bytes per tree n·(1 + r)·(4 or 8)·(1 or 2), and with
/// the couplings and child table staged, n·(3 + r)·(4 or 8)·(1 or 2) + (n + 1)·4.
#[test]
fn tree_plans_place_the_workspace_by_the_device_limit() {
    let o = TreeSolveOptions {
        layout: TreeLayout::Tree,
        ..TreeSolveOptions::default()
    };
    let oc = TreeSolveOptions { complex: true, ..o };
    let plan = |leaves: usize, complex: bool, dtype: DType, shared: DeviceLimits| {
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
    let staged = |p: &LaunchPlan| p.args[12] == KernelArg::I32(1);
    // 4,096-leaf binary, f32 real: 8,191 · 2 · 4 = 65,528 bytes, opt-in on V100; staged
    // 8,191 · 4 · 4 + 8,192 · 4 = 163,824 bytes, over V100's 96 KiB, under H100's 227 KiB.
    let p = plan(4096, false, DType::F32, DeviceLimits::V100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (65_528, 0));
    assert!(p.opts_in_to_shared() && !staged(&p));
    assert_eq!(p.args[13], KernelArg::Null);
    assert_eq!((p.grid, p.block), ([6, 1, 1], [256, 1, 1]));
    let p = plan(4096, false, DType::F32, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (163_824, 0));
    assert!(staged(&p));
    // Complex: 131,056 bytes, over V100's 96 KiB, under H100's 227 KiB (staged: 294,800).
    let p = plan(4096, true, DType::F32, DeviceLimits::V100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (0, 6 * 131_056));
    assert_eq!(p.args[13], KernelArg::Workspace);
    let p = plan(4096, true, DType::F32, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (131_056, 0));
    assert!(!staged(&p));
    // Path-X, 16,384 leaves, f32 real: 262,136 bytes: global on H100.
    let p = plan(16384, false, DType::F32, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (0, 6 * 262_136));
    assert!(!p.opts_in_to_shared() && !staged(&p));
    // A 1,024-leaf binary tree, staged in 2,047 · 4 · 4 + 2,048 · 4 = 40,944 bytes: a small
    // tree, 64 threads; the same in f64, 73,696 bytes: 256.
    let p = plan(1024, false, DType::F32, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.block), (40_944, [64, 1, 1]));
    let p = plan(1024, false, DType::F64, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.block), (73_696, [256, 1, 1]));
    // Small trees need no opt-in: 127 · 4 · 8 + 128 · 4 bytes, staged.
    let p = plan(64, false, DType::F64, DeviceLimits::H100);
    assert_eq!(p.shared_bytes, 127 * 4 * 8 + 128 * 4);
    assert!(!p.opts_in_to_shared() && staged(&p));
}

/// The layout per launch: trees across lanes at the widest width that fits in shared memory and
/// gives every multiprocessor two blocks, else the narrowest that fits; the sweep in f32 and f64
/// (blocks up to 4 × 4) where a tree's right-hand sides fit; Auto's choice per pass among
/// them; errors for a layout asked for that does not take the solve.
#[test]
fn tree_plans_choose_the_layout_and_lane_width_per_launch() {
    let plan = |batch, heads, tree: &Tree, shared: bool, dtype, layout, limits| {
        let n = tree.len();
        let z = |s: &[usize]| Tensor::zeros(s, dtype, &Device::Cpu).unwrap();
        let coef = match shared {
            true => z(&[heads, n, 1, 1]),
            false => z(&[batch, heads, n, 1, 1]),
        };
        let u = z(&[batch, heads, n, 1, 1]);
        let o = TreeSolveOptions {
            layout,
            ..TreeSolveOptions::default()
        };
        forward_plans(tree, &coef, &coef, &coef, &u, o, limits).map(|mut p| match p.len() {
            1 => p.remove(0),
            // The sweep with its pivots apart: its second launch.
            _ => p.remove(1),
        })
    };
    let (auto, lanes) = (TreeLayout::Auto, TreeLayout::Lanes);
    let h100 = DeviceLimits::H100;
    // 1,024 leaves, 4-ary: 1,365 nodes; a block of L samples sharing a head holds
    // (3 · 1,365 + L · 1,365) f32 values.
    let quad = Tree::perfect(1024, 4).unwrap();
    let p = plan(16, 256, &quad, true, DType::F32, lanes, h100).unwrap();
    // 16 lanes would give 256 blocks for 132 SMs: 8 lanes, 512 blocks.
    assert_eq!(p.kernel, "tree_lanes_fwd_f32");
    assert_eq!((p.grid, p.block), ([512, 1, 1], [8, 32, 1]));
    assert_eq!(p.shared_bytes, (3 * 1365 + 8 * 1365) * 4);
    // At (16, 64) no width gives 264 blocks: the narrowest, two lanes, 512 blocks.
    let p = plan(16, 64, &quad, true, DType::F32, lanes, h100).unwrap();
    assert_eq!((p.grid, p.block), ([512, 1, 1], [2, 128, 1]));
    // Per-sample coefficients, f64: a pivot set per lane, 4 · 1,365 values per lane; four
    // lanes (174,720 bytes) fit in 227 KiB but give 256 blocks: two lanes, 512 blocks.
    let p = plan(16, 64, &quad, false, DType::F64, lanes, h100).unwrap();
    assert_eq!((p.grid, p.block), ([512, 1, 1], [2, 128, 1]));
    assert_eq!(p.shared_bytes, (3 * 2 * 1365 + 2 * 1365) * 8);
    // The lanes never outnumber the batch's power of two (shared coefficients).
    let few_sms = DeviceLimits { sms: 0, ..h100 };
    let p = plan(3, 64, &quad, true, DType::F32, lanes, few_sms).unwrap();
    assert_eq!(p.block, [4, 64, 1]);
    assert_eq!(p.grid, [64, 1, 1]);
    // Auto's forward of real scalar trees staged within 48 KiB: a block per tree.
    let p = plan(16, 256, &quad, true, DType::F32, auto, h100).unwrap();
    assert_eq!((p.kernel.as_str(), p.block), ("tree_fwd_f32", [64, 1, 1]));
    // Where the tree is not small (Path-X's 32,767 nodes), shared coefficients take the sweep:
    // f32 and f64, the right-hand sides of the 16,383 nodes above the leaves in shared memory.
    // Two lanes would fit (131 KB) but give 64 blocks: one, 128 blocks of a thread per parent
    // of the leaves, at most 1,024 (the forward; complex f64 and the backward 512).
    let path_x = Tree::perfect(16384, 2).unwrap();
    let p = plan(16, 8, &path_x, true, DType::F32, auto, h100).unwrap();
    assert_eq!(
        (p.kernel.as_str(), p.shared_bytes),
        ("tree_sweep_fwd_f32", 16383 * 4)
    );
    assert_eq!((p.grid, p.block), ([128, 1, 1], [1, 1024, 1]));
    // Its pivots (3 · 32,767 values, 393 KB) do not fit beside them: tree_pivots apart (below).
    assert_eq!(p.args[12], KernelArg::I32(0), "staged");
    // f64 likewise.
    let p = plan(16, 8, &path_x, true, DType::F64, auto, h100).unwrap();
    assert_eq!(
        (p.kernel.as_str(), p.block),
        ("tree_sweep_fwd_f64", [1, 1024, 1])
    );
    // The backward, and the forward in complex f64 (here on 4,096 leaves), at most 512.
    let z = |s: &[usize], dtype| Tensor::zeros(s, dtype, &Device::Cpu).unwrap();
    let n = path_x.len();
    let (coef, u) = (
        z(&[8, n, 1, 1], DType::F32),
        z(&[16, 8, n, 1, 1], DType::F32),
    );
    let o = TreeSolveOptions::default();
    let p = backward_plans(&path_x, &coef, &coef, &coef, &u, o, h100).unwrap();
    let p = p.last().unwrap();
    assert_eq!(
        (p.kernel.as_str(), p.block),
        ("tree_sweep_bwd_f32", [1, 512, 1])
    );
    let binary = Tree::perfect(4096, 2).unwrap();
    let n = binary.len();
    let (coef, u) = (
        z(&[8, n, 1, 1, 2], DType::F64),
        z(&[16, 8, n, 1, 1, 2], DType::F64),
    );
    let o = TreeSolveOptions {
        complex: true,
        layout: TreeLayout::Sweep,
    };
    let p = forward_plans(&binary, &coef, &coef, &coef, &u, o, h100).unwrap();
    let p = p.last().unwrap();
    assert_eq!(
        (p.kernel.as_str(), p.block),
        ("tree_sweep_fwd_f64_c", [1, 512, 1])
    );
    // 1,024 leaves, 4-ary, at (16, 256): 16 lanes would give 256 blocks, 8 give 512; a thread
    // per parent of the leaves (256), each lane's 341 nodes above them at an odd stride, and
    // the head's pivots (3 · 1,365 values), which each block eliminates itself: one launch.
    let sweep = TreeLayout::Sweep;
    let p = plan(16, 256, &quad, true, DType::F32, sweep, h100).unwrap();
    assert_eq!((p.grid, p.block), ([512, 1, 1], [8, 32, 1]));
    assert_eq!(p.shared_bytes, (8 * 341 + 3 * 1365) * 4);
    assert_eq!(p.args[12], KernelArg::I32(1), "staged");
    // Per-sample coefficients: a block per tree, each with its own pivots.
    let p = plan(16, 256, &quad, false, DType::F32, sweep, h100).unwrap();
    assert_eq!((p.grid, p.block), ([4096, 1, 1], [1, 256, 1]));
    assert_eq!(p.shared_bytes, (341 + 3 * 1365) * 4);
    let pivots = forward_plans(
        &path_x,
        &Tensor::zeros((8, 32767, 1, 1), DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros((8, 32767, 1, 1), DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros((8, 32767, 1, 1), DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros((16, 8, 32767, 1, 1), DType::F32, &Device::Cpu).unwrap(),
        TreeSolveOptions::default(),
        h100,
    )
    .unwrap()
    .remove(0);
    // A block per head, a thread per parent of the leaves (at most 1,024, at least 512).
    assert_eq!(
        (pivots.kernel.as_str(), pivots.grid, pivots.block),
        ("tree_pivots_f32", [8, 1, 1], [1024, 1, 1])
    );
    assert_eq!(pivots.outputs, vec![3 * 8 * 32767]);
    // Not in f16 (the pivots are kept in the storage type), nor for per-sample coefficients,
    // nor where a tree's right-hand sides exceed shared memory (V100, f64: 262 KB).
    let p = plan(16, 8, &path_x, true, DType::F16, auto, h100).unwrap();
    assert_eq!(p.kernel, "tree_fwd_f16");
    let p = plan(16, 8, &path_x, false, DType::F32, auto, h100).unwrap();
    assert_eq!(p.kernel, "tree_fwd_f32");
    let v100 = DeviceLimits::V100;
    let p = plan(16, 8, &path_x, true, DType::F64, auto, v100).unwrap();
    assert_eq!(p.kernel, "tree_fwd_f64");
    let err = plan(16, 8, &path_x, true, DType::F64, TreeLayout::Sweep, v100).unwrap_err();
    assert!(err.to_string().contains("sweep layout needs"), "{err}");
    let err = plan(16, 8, &path_x, true, DType::F32, TreeLayout::Lanes, h100).unwrap_err();
    assert!(err.to_string().contains("lanes layout needs"), "{err}");
    let p = plan(16, 8, &quad, true, DType::F32, TreeLayout::Tree, h100).unwrap();
    assert_eq!(p.kernel, "tree_fwd_f32");
    let n = quad.len();
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap();
    let (coef, u) = (z(&[4, n, 2, 2]), z(&[8, 4, n, 2, 1]));
    let p = forward_plan(&quad, &coef, &coef, &coef, &u, opts_real(), h100).unwrap();
    assert_eq!(p.kernel, "tree_block_fwd_f32");
    let o = TreeSolveOptions {
        layout: TreeLayout::Lanes,
        ..opts_real()
    };
    let p = forward_plan(&quad, &coef, &coef, &coef, &u, o, h100).unwrap();
    assert_eq!(p.kernel, "tree_lanes_block_fwd_f32");
    // 2 x 2 blocks, 8 samples of 4 heads: (3 · 4 + L · 2) · 1,365 values (odd strides); no
    // width gives 264 blocks: two lanes, 16 blocks.
    assert_eq!((p.grid, p.block), ([16, 1, 1], [2, 128, 1]));
    assert_eq!(
        p.shared_bytes,
        (3 * ((4 * 1365) | 1) + 2 * ((2 * 1365) | 1)) * 4
    );
    let lanes = TreeSolveOptions {
        layout: TreeLayout::Lanes,
        ..opts_real()
    };
    let (coef, u) = (z(&[4, n, 5, 5]), z(&[8, 4, n, 5, 1]));
    let err = forward_plan(&quad, &coef, &coef, &coef, &u, lanes, h100).unwrap_err();
    assert!(
        err.to_string().contains("blocks up to d = 4 (d = 5)"),
        "{err}"
    );
    // 4 x 4 blocks shared by 16 samples: two lanes would hold (3 · 16 + 2 · 4) · 1,365 values,
    // 306 KB; the sweep, after the pivots of the 16 heads, samples of a head across the lanes
    // of a block of 256 threads, each lane's 4 · 1,365 right-hand sides at an odd stride: 8
    // lanes fit (16 do not), none gives 264 blocks, so two lanes, 128 blocks. Per-sample
    // blocks: a block per tree.
    let (coef, u) = (z(&[16, n, 4, 4]), z(&[16, 16, n, 4, 1]));
    let o = TreeSolveOptions::default();
    let p = forward_plans(&quad, &coef, &coef, &coef, &u, o, h100).unwrap();
    assert_eq!(
        (p[0].kernel.as_str(), p[0].grid, p[0].block),
        ("tree_block_pivots_f32", [16, 1, 1], [256, 1, 1])
    );
    assert_eq!(p[0].outputs, vec![3 * 16 * n * 16]);
    assert_eq!(
        (p[1].kernel.as_str(), p[1].grid, p[1].block),
        ("tree_sweep_block_fwd_f32", [128, 1, 1], [2, 128, 1])
    );
    assert_eq!(p[1].shared_bytes, 2 * ((n * 4) | 1) * 4);
    let p = forward_plans(&quad, &coef, &coef, &coef, &u, o, few_sms).unwrap();
    assert_eq!((p[1].grid, p[1].block), ([32, 1, 1], [8, 32, 1]));
    let per_sample = z(&[16, 16, n, 4, 4]);
    let p = forward_plan(&quad, &per_sample, &per_sample, &per_sample, &u, o, h100).unwrap();
    assert_eq!(p.kernel, "tree_block_fwd_f32");
    let sweep = TreeSolveOptions {
        layout: TreeLayout::Sweep,
        ..opts_real()
    };
    let (coef, u) = (z(&[4, n, 5, 5]), z(&[8, 4, n, 5, 1]));
    let err = forward_plans(&quad, &coef, &coef, &coef, &u, sweep, h100).unwrap_err();
    assert!(
        err.to_string()
            .contains("sweep layout needs blocks up to d = 4 (d = 5)"),
        "{err}"
    );
    // The backward of shared coefficients writes a gradient row per block of samples.
    let (coef, x) = (z(&[64, n, 1, 1]), z(&[16, 64, n, 1, 1]));
    let o = TreeSolveOptions::default();
    let p = backward_plan(&quad, &coef, &coef, &coef, &x, o, h100).unwrap();
    assert_eq!(p.block, [2, 128, 1]);
    assert_eq!(p.outputs, vec![16 * 64 * n, 3 * 8 * 64 * n]);
}

/// Auto's choice per pass, the layouts measured fastest on an H100 (docs/performance.md): for
/// shared scalar blocks a block per tree (small real trees) or the sweep forward and the lanes
/// backward; the sweep for shared d × d blocks; a block per tree for per-sample coefficients.
#[test]
fn auto_chooses_the_layout_per_pass() {
    let h100 = DeviceLimits::H100;
    let quad = Tree::perfect(1024, 4).unwrap();
    let path_x = Tree::perfect(16384, 2).unwrap();
    // The kernel of each pass's last launch, for (batch, heads) trees of d × d blocks.
    let kernels = |tree: &Tree, (batch, heads): (usize, usize), d, shared, complex| {
        let w = if complex { vec![2] } else { vec![] };
        let n = tree.len();
        let z = |s: &[usize]| Tensor::zeros([s, &w[..]].concat(), DType::F32, &Device::Cpu);
        let coef = match shared {
            true => z(&[heads, n, d, d]),
            false => z(&[batch, heads, n, d, d]),
        }
        .unwrap();
        let u = z(&[batch, heads, n, d, 1]).unwrap();
        let o = TreeSolveOptions {
            complex,
            layout: TreeLayout::Auto,
        };
        let last = |p: Vec<LaunchPlan>| p.last().unwrap().kernel.clone();
        (
            last(forward_plans(tree, &coef, &coef, &coef, &u, o, h100).unwrap()),
            last(backward_plans(tree, &coef, &coef, &coef, &u, o, h100).unwrap()),
        )
    };
    let pair = |f: &str, b: &str| (f.to_string(), b.to_string());
    assert_eq!(
        kernels(&quad, (16, 256), 1, true, false),
        pair("tree_fwd_f32", "tree_lanes_bwd_f32")
    );
    assert_eq!(
        kernels(&quad, (16, 256), 1, true, true),
        pair("tree_sweep_fwd_f32_c", "tree_lanes_bwd_f32_c")
    );
    assert_eq!(
        kernels(&path_x, (16, 8), 1, true, false),
        pair("tree_sweep_fwd_f32", "tree_sweep_bwd_f32")
    );
    assert_eq!(
        kernels(&quad, (16, 64), 1, false, false),
        pair("tree_fwd_f32", "tree_bwd_f32")
    );
    assert_eq!(
        kernels(&quad, (16, 64), 2, true, false),
        pair("tree_sweep_block_fwd_f32", "tree_sweep_block_bwd_f32")
    );
    assert_eq!(
        kernels(&quad, (16, 64), 2, false, false),
        pair("tree_block_fwd_f32", "tree_block_bwd_f32")
    );
}

/// The block kernels' workspace: n·d·(d + r) values plus one d × d LU block per thread that
/// can own a parent at once, in shared memory when the device grants it.
#[test]
fn block_plans_place_the_workspace_by_the_device_limit() {
    let plan = |tree: &Tree, d: usize, r: usize, dtype: DType, shared: DeviceLimits| {
        let n = tree.len();
        let z = |s: &[usize]| Tensor::zeros(s, dtype, &Device::Cpu).unwrap();
        let (coef, u) = (z(&[3, n, d, d]), z(&[2, 3, n, d, r]));
        forward_plan(tree, &coef, &coef, &coef, &u, opts_real(), shared).unwrap()
    };
    // zMNIST's quad tree of 32 × 32 pixels: 1,365 nodes, 256 parents in the widest level.
    let quad = Tree::quad(32, 32).unwrap();
    assert_eq!((quad.len(), lu_slots(&quad)), (1365, 256));
    let p = plan(&quad, 2, 1, DType::F32, DeviceLimits::V100);
    assert_eq!(p.kernel, "tree_block_fwd_f32");
    assert_eq!(
        (p.shared_bytes, p.workspace_bytes),
        ((1365 * 6 + 256 * 4) * 4, 0)
    );
    assert_eq!(&p.args[8..10], &[KernelArg::I32(2), KernelArg::I32(1)]);
    assert_eq!(p.args[13], KernelArg::I32(256));
    // d = 16, r = 1: 1365 · 272 + 256 · 256 values of 4 bytes: global on H100 too.
    let bytes = (1365 * 272 + 256 * 256) * 4;
    let p = plan(&quad, 16, 1, DType::F32, DeviceLimits::H100);
    assert_eq!((p.shared_bytes, p.workspace_bytes), (0, 6 * bytes));
    assert_eq!(p.args[14], KernelArg::Workspace);
    // A chain has one parent per level: one LU block.
    let chain = Tree::chain(40).unwrap();
    assert_eq!(lu_slots(&chain), 1);
    let p = plan(
        &chain,
        4,
        2,
        DType::F64,
        DeviceLimits {
            shared_per_block: DeviceLimits::DEFAULT_SHARED,
            ..DeviceLimits::H100
        },
    );
    assert_eq!(p.shared_bytes, (40 * 4 * 6 + 16) * 8);
    // The gradient blocks: (3, batch, heads, nodes, d, d).
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap();
    let n = quad.len();
    let (coef, x) = (z(&[3, n, 2, 2]), z(&[2, 3, n, 2, 1]));
    let p = backward_plan(
        &quad,
        &coef,
        &coef,
        &coef,
        &x,
        opts_real(),
        DeviceLimits::H100,
    );
    assert_eq!(p.unwrap().outputs, vec![2 * 3 * n * 2, 3 * 2 * 3 * n * 4]);
}

fn opts_real() -> TreeSolveOptions {
    TreeSolveOptions {
        layout: TreeLayout::Tree,
        ..TreeSolveOptions::default()
    }
}
