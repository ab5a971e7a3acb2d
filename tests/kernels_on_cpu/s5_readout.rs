//! `s5_readout_*` of kernels/s5_readout.cu through the harness: bit for bit against the CPU
//! twin (the op's CPU path, its gradient through candle's autograd), in every dtype.

use candle_core::{DType, Device, Var};
use myosotis::ops::s5_readout;
use myosotis::ops::s5_readout::cuda::plan;

use crate::assert_same;
use crate::common::{seeded_rng, tensor, to_vec, uniform};
use crate::exec::{round_to, run_in_every_order};

#[test]
fn s5_readout_kernels_match_the_cpu_twin() {
    let (mut rng, seed) = seeded_rng("s5_readout_kernels", 25);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (h, p, dirs) in [(1, 1, 1), (3, 5, 2), (40, 16, 1), (7, 33, 2)] {
            for conj_sym in [false, true] {
                let what = format!("s5_readout {dtype:?} H {h} P {p} dirs {dirs} {conj_sym}");
                let scale = if conj_sym { 2 } else { 1 };
                let c = round_to(&uniform(&mut rng, h * dirs * p * 2, -1.0, 1.0), dtype);
                let g = round_to(&uniform(&mut rng, h * dirs * p * 2, -1.0, 1.0), dtype);
                let fwd = plan(false, dirs, p, h, scale, dtype).unwrap();
                let r = run_in_every_order(&fwd, dtype, &[&c], seed)
                    .outputs
                    .remove(0);
                let bwd = plan(true, dirs, p, h, scale, dtype).unwrap();
                let dc = run_in_every_order(&bwd, dtype, &[&g], seed)
                    .outputs
                    .remove(0);
                let cv =
                    Var::from_tensor(&tensor(&c, &[h, dirs * p, 2], dtype, &Device::Cpu)).unwrap();
                let rt = s5_readout(cv.as_tensor(), dirs, conj_sym).unwrap();
                assert_same(&r, &to_vec(&rt), &format!("{what}: forward"));
                let gt = tensor(&g, rt.dims(), dtype, &Device::Cpu);
                let grads = (rt * gt).unwrap().sum_all().unwrap().backward().unwrap();
                let twin = to_vec(grads.get(cv.as_tensor()).expect("gradient"));
                assert_same(&dc, &twin, &format!("{what}: backward"));
            }
        }
    }
}
