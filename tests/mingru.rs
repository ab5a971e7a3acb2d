//! minGRU against its sequential definition in f64, and its gradients.

mod common;

use candle_core::{DType, Device, Module};
use candle_nn::{VarBuilder, VarMap};
use common::{randn, rel_err, to_vec};
use myosotis::nn::{MinGru, MinGruConfig};

fn weights(varmap: &VarMap, name: &str) -> Vec<f64> {
    to_vec(varmap.data().lock().unwrap()[name].as_tensor())
}

#[test]
fn equals_the_sequential_definition() {
    let (mut rng, _) = common::seeded_rng("equals_the_sequential_definition", 137);
    for tanh_impulse in [false, true] {
        let cfg = MinGruConfig {
            d_model: 3,
            hidden: 4,
            tanh_impulse,
            seed: 1,
        };
        let varmap = VarMap::new();
        let layer = MinGru::new(
            cfg.clone(),
            VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu),
        )
        .unwrap();
        let (batch, len) = (2, 70);
        let x = randn(&mut rng, &[batch, len, 3], DType::F64, &Device::Cpu);
        let got = to_vec(&layer.forward(&x).unwrap());
        let xs = to_vec(&x);
        let (wz, bz, wh, bh) = (
            weights(&varmap, "gate.weight"),
            weights(&varmap, "gate.bias"),
            weights(&varmap, "impulse.weight"),
            weights(&varmap, "impulse.bias"),
        );
        let mut want = vec![0.0; batch * len * 4];
        for b in 0..batch {
            let mut h = [0.0f64; 4];
            for t in 0..len {
                let xt = &xs[(b * len + t) * 3..][..3];
                for o in 0..4 {
                    let lin = |w: &[f64], bias: &[f64]| {
                        bias[o] + (0..3).map(|i| w[o * 3 + i] * xt[i]).sum::<f64>()
                    };
                    let z = 1.0 / (1.0 + (-lin(&wz, &bz)).exp());
                    let ht = if tanh_impulse {
                        lin(&wh, &bh).tanh()
                    } else {
                        lin(&wh, &bh)
                    };
                    h[o] = (1.0 - z) * h[o] + z * ht;
                    want[(b * len + t) * 4 + o] = h[o];
                }
            }
        }
        let e = rel_err(&got, &want);
        assert!(e < 1e-12, "error {e:e} (tanh_impulse = {tanh_impulse})");
        let grads = layer
            .forward(&x)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        common::assert_all_gradients(&varmap, &grads, &[], "minGRU");
    }
}
