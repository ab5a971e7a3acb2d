//! `s5_discretize_*` of kernels/s5_discretize.cu through the harness: bit for bit against the
//! CPU twin (the op's CPU path, its gradients through candle's autograd), forward and backward,
//! ZOH and bilinear, with and without the eigenvalue clip; in f16 and bf16 the same bits as the
//! f32 kernels on the same values with their results rounded.

use candle_core::{DType, Device, Tensor, Var};
use myosotis::ops::s5_discretize::cuda::{backward_plan, forward_plan};
use myosotis::ops::{
    s5_discretize, s5_discretize_backward, s5_discretize_untracked, S5Discretization,
};

use crate::assert_same;
use crate::common::{seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

/// `v`, f32 values, rounded to the half-precision `dtype` (from f32: half's `from_f64` drops
/// low bits before rounding to bf16).
fn narrowed(v: &[f64], dtype: DType) -> Vec<f64> {
    let t = tensor(v, &[v.len()], DType::F32, &Device::Cpu);
    to_vec(&t.to_dtype(dtype).unwrap())
}

#[test]
fn s5_kernels_match_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("s5_discretize_kernels", 24);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let half = matches!(dtype, DType::F16 | DType::BF16);
        // P = 1, a P over the block's 128 threads' channels, H below, at and above 128.
        for (p, h) in [(1, 1), (3, 5), (5, 128), (2, 300)] {
            for (bilinear, clip_eigs) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let how = S5Discretization {
                    bilinear,
                    clip_eigs,
                };
                let what = format!("s5_discretize {dtype:?} P {p} H {h} {how:?}");
                let mut re = uniform(&mut rng, p, -2.0, -0.05);
                if clip_eigs {
                    re[0] = 0.25;
                }
                let (im, log_dt) = (
                    uniform(&mut rng, p, -3.0, 3.0),
                    uniform(&mut rng, p, -6.0, -1.0),
                );
                let params: Vec<f64> =
                    round_to(&[re.clone(), im.clone(), log_dt.clone()].concat(), dtype);
                let b = round_to(&uniform(&mut rng, p * h * 2, -1.0, 1.0), dtype);
                let g = round_to(&uniform(&mut rng, 2 * p + 2 * p * h, -1.0, 1.0), dtype);
                let fwd_inputs = [&params[..p], &params[p..2 * p], &params[2 * p..], &b[..]];
                let bwd_inputs = [&fwd_inputs[..], &[&g[..2 * p], &g[2 * p..]]].concat();
                let kernels = |dtype| {
                    let fwd = forward_plan(p, h, how, dtype).unwrap();
                    let out = run_in_every_order(&fwd, dtype, &fwd_inputs, seed)
                        .outputs
                        .remove(0);
                    let bwd = backward_plan(p, h, how, dtype).unwrap();
                    let grads = run_in_every_order(&bwd, dtype, &bwd_inputs, seed)
                        .outputs
                        .remove(0);
                    (out, grads)
                };
                let (out, grads) = kernels(dtype);
                if half {
                    // The f32 kernels on the same values, their results rounded: the same
                    // bits.
                    let (out32, grads32) = kernels(DType::F32);
                    assert_same(&out, &narrowed(&out32, dtype), &format!("{what}: forward"));
                    let g32 = narrowed(&grads32, dtype);
                    assert_same(&grads, &g32, &format!("{what}: backward"));
                }
                let var = |v: &[f64], s: &[usize]| {
                    Var::from_tensor(&tensor(v, s, dtype, &Device::Cpu)).unwrap()
                };
                let vars = [
                    var(&params[..p], &[p]),
                    var(&params[p..2 * p], &[p]),
                    var(&params[2 * p..], &[p]),
                    var(&b, &[p, h, 2]),
                ];
                let t = |k: usize| vars[k].as_tensor();
                // The twin under candle's autograd (f16 and bf16 take the candle ops there).
                if !half {
                    let (gate, bmat) = s5_discretize(t(0), t(1), t(2), t(3), how).unwrap();
                    let both = Tensor::cat(
                        &[gate.flatten_all().unwrap(), bmat.flatten_all().unwrap()],
                        0,
                    )
                    .unwrap();
                    assert_same(&out, &to_vec(&both), &format!("{what}: forward"));
                    let gt = tensor(&g, &[g.len()], dtype, &Device::Cpu);
                    let store = (both * gt).unwrap().sum_all().unwrap().backward().unwrap();
                    let twin: Vec<f64> = vars
                        .iter()
                        .flat_map(|v| to_vec(store.get(v.as_tensor()).expect("gradient")))
                        .collect();
                    assert_same(&grads, &twin, &format!("{what}: backward"));
                }
                // The entry points of the layers by hand, outside candle's graph.
                let (gate, bmat) = s5_discretize_untracked(t(0), t(1), t(2), t(3), how).unwrap();
                let untracked = [to_vec(&gate), to_vec(&bmat)].concat();
                assert_same(&out, &untracked, &format!("{what}: forward untracked"));
                let dg = tensor(&g[..2 * p], &[p, 2], dtype, &Device::Cpu);
                let db = tensor(&g[2 * p..], &[h, 2 * p], dtype, &Device::Cpu);
                let d = s5_discretize_backward([t(0), t(1), t(2), t(3)], how, &dg, &db).unwrap();
                let by_hand: Vec<f64> = d.iter().flat_map(to_vec).collect();
                assert_same(&grads, &by_hand, &format!("{what}: backward by hand"));
            }
        }
    }
}
