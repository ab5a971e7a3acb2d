//! Independent f64 references and random inputs shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use myosotis::ops::{GateShape, ScanOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A fresh seed per run (printed on failure), so every run checks new inputs.
pub fn fresh_rng(test: &str) -> (StdRng, u64) {
    let seed: u64 = rand::rng().random();
    eprintln!("{test}: seed {seed}");
    (StdRng::seed_from_u64(seed), seed)
}

/// One scan case: shapes and options.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub batch: usize,
    pub len: usize,
    pub chans: usize,
    pub gate: GateShape,
    pub complex: bool,
    pub reverse: bool,
    pub with_h0: bool,
}

impl Case {
    pub fn width(&self) -> usize {
        if self.complex {
            2
        } else {
            1
        }
    }
    pub fn opts(&self) -> ScanOptions {
        ScanOptions {
            complex: self.complex,
            reverse: self.reverse,
        }
    }
    fn tail(&self, mut s: Vec<usize>) -> Vec<usize> {
        if self.complex {
            s.push(2);
        }
        s
    }
    pub fn b_shape(&self) -> Vec<usize> {
        self.tail(vec![self.batch, self.len, self.chans])
    }
    pub fn a_shape(&self) -> Vec<usize> {
        match self.gate {
            GateShape::Full => self.b_shape(),
            GateShape::PerStep => self.tail(vec![self.len, self.chans]),
            GateShape::PerChannel => self.tail(vec![self.chans]),
        }
    }
    pub fn h0_shape(&self) -> Vec<usize> {
        self.tail(vec![self.batch, self.chans])
    }
}

/// Inputs of one case in f64: gates of modulus < 1 (so long scans stay bounded but do not
/// vanish), b and h0 uniform in [-1, 1].
#[derive(Clone)]
pub struct Inputs {
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub h0: Vec<f64>,
}

fn uniform(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

pub fn random_inputs(case: &Case, rng: &mut StdRng) -> Inputs {
    let n_a: usize = case.a_shape().iter().product();
    let a = if case.complex {
        // modulus in [0.5, 0.999], any phase
        (0..n_a / 2)
            .flat_map(|_| {
                let r = rng.random_range(0.5..0.999f64);
                let th = rng.random_range(-std::f64::consts::PI..std::f64::consts::PI);
                [r * th.cos(), r * th.sin()]
            })
            .collect()
    } else {
        (0..n_a)
            .map(|_| {
                let m = rng.random_range(0.5..0.999f64);
                if rng.random_bool(0.2) {
                    -m
                } else {
                    m
                }
            })
            .collect()
    };
    let b = uniform(rng, case.b_shape().iter().product(), -1.0, 1.0);
    let h0 = if case.with_h0 {
        uniform(rng, case.h0_shape().iter().product(), -1.0, 1.0)
    } else {
        vec![0.0; case.h0_shape().iter().product()]
    };
    Inputs { a, b, h0 }
}

/// The recurrence as a plain sequential loop in f64, with its own complex arithmetic.
pub fn reference_scan(case: &Case, x: &Inputs) -> Vec<f64> {
    let (bn, l, d, w) = (case.batch, case.len, case.chans, case.width());
    let mut out = vec![0.0; bn * l * d * w];
    for bi in 0..bn {
        for c in 0..d {
            let mut h = [
                x.h0[(bi * d + c) * w],
                if w == 2 {
                    x.h0[(bi * d + c) * w + 1]
                } else {
                    0.0
                },
            ];
            for p in 0..l {
                let t = if case.reverse { l - 1 - p } else { p };
                let ai = match case.gate {
                    GateShape::Full => (bi * l + t) * d + c,
                    GateShape::PerStep => t * d + c,
                    GateShape::PerChannel => c,
                } * w;
                let bi_ = ((bi * l + t) * d + c) * w;
                if w == 1 {
                    h[0] = x.a[ai] * h[0] + x.b[bi_];
                    out[bi_] = h[0];
                } else {
                    let (ar, aim) = (x.a[ai], x.a[ai + 1]);
                    let re = ar * h[0] - aim * h[1] + x.b[bi_];
                    let im = ar * h[1] + aim * h[0] + x.b[bi_ + 1];
                    h = [re, im];
                    out[bi_] = re;
                    out[bi_ + 1] = im;
                }
            }
        }
    }
    out
}

pub fn tensor(v: &[f64], shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

pub fn to_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// max |x - y| / (max |y| + 1e-30): a relative error that a single wrong element cannot hide in.
pub fn rel_err(x: &[f64], y: &[f64]) -> f64 {
    assert_eq!(x.len(), y.len(), "length mismatch");
    let scale = y.iter().fold(0f64, |m, v| m.max(v.abs())) + 1e-30;
    let diff = x.iter().zip(y).fold(0f64, |m, (a, b)| {
        if a.is_nan() || b.is_nan() {
            f64::INFINITY
        } else {
            m.max((a - b).abs())
        }
    });
    diff / scale
}

/// A spread of awkward cases: length 1, odd and prime lengths, one chunk exactly, more than a
/// chunk, channel counts that are not tile multiples and more than one CPU tile.
pub fn scan_cases() -> Vec<Case> {
    let shapes = [
        (1, 1, 1),
        (2, 7, 3),
        (3, 13, 5),
        (1, 64, 32),
        (2, 65, 33),
        (2, 131, 17),
        (1, 97, 300),
        (4, 1000, 7),
    ];
    let gates = [GateShape::Full, GateShape::PerStep, GateShape::PerChannel];
    let mut cases = vec![];
    for (i, &(batch, len, chans)) in shapes.iter().enumerate() {
        for (g, &gate) in gates.iter().enumerate() {
            for complex in [false, true] {
                for reverse in [false, true] {
                    cases.push(Case {
                        batch,
                        len,
                        chans,
                        gate,
                        complex,
                        reverse,
                        with_h0: (i + g + reverse as usize).is_multiple_of(2),
                    });
                }
            }
        }
    }
    cases
}
