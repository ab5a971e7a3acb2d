//! A layer's backward by hand in half precision against the same layer in f32.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use myosotis::nn::{
    ClassifierConfig, DropoutKey, GradSink, Mode, Myo, MyoConfig, S5Config, SequenceClassifier, S5,
};
use rand::rngs::StdRng;

use super::{randn, rel_err, to_vec};

/// The layer (or model) built by `build` in `dtype` (f16 or bf16) on `dev` and run by hand
/// (`run`, on inputs of shape `shapes[0]`, giving outputs of shape `shapes[1]`) follows the same
/// layer in f32 whose parameters and input are the half ones cast up: its output, the input's
/// gradient and every parameter's gradient (which must come in the parameter's dtype) each
/// within `tol` of the f32 layer's (largest difference over largest value), and so its buffers
/// after the pass.
#[allow(clippy::too_many_arguments)]
pub fn assert_half_by_hand_follows_f32<L>(
    dev: &Device,
    dtype: DType,
    shapes: [&[usize]; 2],
    build: impl Fn(VarBuilder) -> L,
    run: impl Fn(&L, &Tensor, &GradSink) -> Tensor,
    rng: &mut StdRng,
    tol: f64,
    what: &str,
) {
    let half_map = VarMap::new();
    let half = build(VarBuilder::from_varmap(&half_map, dtype, dev));
    let full_map = VarMap::new();
    let full = build(VarBuilder::from_varmap(&full_map, DType::F32, dev));
    let half_vars: HashMap<String, Var> = half_map.data().lock().unwrap().clone();
    let full_vars: HashMap<String, Var> = full_map.data().lock().unwrap().clone();
    for (name, v) in &full_vars {
        v.set(&half_vars[name].to_dtype(DType::F32).unwrap())
            .unwrap();
    }
    let x = randn(rng, shapes[0], dtype, dev);
    let g = randn(rng, shapes[1], dtype, dev);
    let pass = |layer: &L, dtype: DType| -> (Var, Tensor, GradStore) {
        let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
        let sink = GradSink::new();
        let y = run(layer, x.as_tensor(), &sink);
        assert_eq!(y.dtype(), dtype, "the output's dtype, {what}");
        let loss = (&y * g.to_dtype(dtype).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let mut grads = loss.backward().unwrap();
        sink.add_to(&mut grads).unwrap();
        (x, y, grads)
    };
    let (hx, hy, hg) = pass(&half, dtype);
    let (fx, fy, fg) = pass(&full, DType::F32);
    let mut worst = 0f64;
    let mut check = |part: &str, got: &Tensor, want: &Tensor, kept: DType| {
        assert_eq!(got.dtype(), kept, "{part}'s dtype, {what}");
        let e = rel_err(&to_vec(got), &to_vec(want));
        assert!(e < tol, "{part}: error {e:e} in {dtype:?}, {what}");
        worst = worst.max(e);
    };
    check("output", &hy, &fy, dtype);
    check("∂x", hg.get(&hx).unwrap(), fg.get(&fx).unwrap(), dtype);
    for (name, v) in &half_vars {
        // Buffers (BatchNorm's running averages, kept in f32) have no gradient in either:
        // their values after the pass are compared.
        let Some(want) = fg.get(&full_vars[name]) else {
            assert!(hg.get(v).is_none(), "∂{name} in {dtype:?} alone, {what}");
            check(name, v.as_tensor(), full_vars[name].as_tensor(), DType::F32);
            continue;
        };
        let got = hg.get(v).unwrap_or_else(|| panic!("no ∂{name}, {what}"));
        check(&format!("∂{name}"), got, want, dtype);
    }
    eprintln!("{what}, {dtype:?}: largest error {worst:.2e}");
}

/// [`assert_half_by_hand_follows_f32`] for the S5 layer of `cfg` on inputs (2, 9, H).
pub fn s5_follows_f32(
    dev: &Device,
    dtype: DType,
    cfg: &S5Config,
    rng: &mut StdRng,
    tol: f64,
    what: &str,
) {
    assert_half_by_hand_follows_f32(
        dev,
        dtype,
        [&[2, 9, cfg.d_model]; 2],
        |vb| S5::new(cfg.clone(), vb).unwrap(),
        |layer, x, sink| layer.forward_by_hand(x, sink).unwrap(),
        rng,
        tol,
        what,
    );
}

/// [`assert_half_by_hand_follows_f32`] for the Myo layer of `cfg` on inputs (2, its tree's
/// nodes, H).
pub fn myo_follows_f32(
    dev: &Device,
    dtype: DType,
    cfg: &MyoConfig,
    rng: &mut StdRng,
    tol: f64,
    what: &str,
) {
    let n = cfg.tree.build().unwrap().len();
    assert_half_by_hand_follows_f32(
        dev,
        dtype,
        [&[2, n, cfg.d_model]; 2],
        |vb| Myo::new(cfg.clone(), vb).unwrap(),
        |layer, x, sink| layer.forward_by_hand(x, sink).unwrap(),
        rng,
        tol,
        what,
    );
}

/// [`assert_half_by_hand_follows_f32`] for a whole model of `cfg` (two features in, four classes)
/// on inputs (3, `len`, 2): a training pass by hand, dropout on.
pub fn classifier_follows_f32(
    dev: &Device,
    dtype: DType,
    cfg: &ClassifierConfig,
    len: usize,
    rng: &mut StdRng,
    tol: f64,
    what: &str,
) {
    let key = DropoutKey {
        seed: 0,
        step: 0,
        first_row: 0,
        key_on_device: false,
    };
    assert_half_by_hand_follows_f32(
        dev,
        dtype,
        [&[3, len, 2], &[3, 4]],
        |vb| SequenceClassifier::new(cfg.clone(), vb).unwrap(),
        |model, x, sink| {
            let mode = Mode::Train(key, None, Some(sink));
            model.logits_timed(x, None, None, mode).unwrap()
        },
        rng,
        tol,
        what,
    );
}
