//! Independent f64 references and random inputs shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use myosotis::ops::{GateShape, ScanOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub mod files;
pub mod half;
pub mod heads;
pub mod models;
pub mod runs;
pub mod trees;

/// A fresh temporary folder `myosotis-{name}-{process id}`, empty, and removed with everything
/// in it when dropped.
pub fn scratch(name: &str) -> Scratch {
    let d = unmade(name);
    std::fs::create_dir_all(&*d).unwrap();
    d
}

/// The path of [`scratch`] with nothing there yet (for what must create its folder itself),
/// removed with everything in it when dropped.
pub fn unmade(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("myosotis-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    Scratch(d)
}

/// A test's folder, removed with everything in it when dropped.
pub struct Scratch(std::path::PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Asserts that every variable of `varmap` (but those whose names end in one of `skip`) has a
/// finite, non-zero gradient in `grads`.
pub fn assert_all_gradients(
    varmap: &candle_nn::VarMap,
    grads: &candle_core::backprop::GradStore,
    skip: &[&str],
    what: &str,
) {
    for (name, var) in varmap.data().lock().unwrap().iter() {
        if skip.iter().any(|s| name.ends_with(s)) {
            continue;
        }
        let g = to_vec(
            grads
                .get(var)
                .unwrap_or_else(|| panic!("{what}: no gradient for {name}")),
        );
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{what}: {name} has a non-finite gradient"
        );
        assert!(
            g.iter().any(|v| *v != 0.0),
            "{what}: {name} has a zero gradient"
        );
    }
}

/// The first CUDA device, or `None` with the reason printed (the CUDA tests then skip).
pub fn gpu(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("{test}: SKIPPED, no CUDA device: {e}");
            None
        }
    }
}

/// Whether this build's CUDA kernels have candle's bf16 arithmetic (a build for compute
/// capability 8.0 or later); else the test's bf16 cases are skipped, and it says so.
#[cfg(feature = "cuda")]
pub fn cuda_bf16(test: &str) -> bool {
    let cap = myosotis::cuda::built_for();
    let has = cap == 0 || cap >= 80;
    if !has {
        println!("{test}: bf16 SKIPPED, the kernels are built for compute capability {cap}");
    }
    has
}

/// A generator seeded with `MYO_TEST_SEED` when set (to explore other inputs), else with
/// `default`, so that a run is reproducible; the seed is printed for a failing run to repeat.
pub fn seeded_rng(test: &str, default: u64) -> (StdRng, u64) {
    let seed = match std::env::var("MYO_TEST_SEED") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("MYO_TEST_SEED={s} is not an unsigned integer")),
        Err(_) => default,
    };
    eprintln!("{test}: seed {seed}");
    (StdRng::seed_from_u64(seed), seed)
}

/// A tensor of standard normal values drawn from `rng` (Box–Muller in f64, then `dtype`), so
/// that tests seeded by [`seeded_rng`] are reproducible (candle's own `randn` on the CPU is not
/// seeded).
pub fn randn(rng: &mut StdRng, shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .collect();
    tensor(&v, shape, dtype, dev)
}

/// A tensor of values uniform in [lo, hi) drawn from `rng`.
pub fn rand_uniform(
    rng: &mut StdRng,
    (lo, hi): (f64, f64),
    shape: &[usize],
    dtype: DType,
    dev: &Device,
) -> Tensor {
    let n: usize = shape.iter().product();
    tensor(&uniform(rng, n, lo, hi), shape, dtype, dev)
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

/// `n` values uniform in [lo, hi).
pub fn uniform(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
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

/// Gradients (∂a, ∂b, ∂h0) of Σ g ⊙ h through the recurrence, by the adjoint recurrence as a
/// plain f64 loop: λ_p = g_p + conj(a_{p+1}) λ_{p+1} over traversal steps p, ∂b = λ,
/// ∂a_p += λ_p conj(h_{p-1}) (h_{-1} = h0), ∂h0 = conj(a_0) λ_0.
pub fn reference_scan_grads(case: &Case, x: &Inputs, g: &[f64]) -> [Vec<f64>; 3] {
    let (bn, l, d, w) = (case.batch, case.len, case.chans, case.width());
    let h = reference_scan(case, x);
    let mut da = vec![0.0; x.a.len()];
    let mut db = vec![0.0; x.b.len()];
    let mut dh0 = vec![0.0; x.h0.len()];
    // (re, im) of a complex product x · conj(y); real numbers have im = 0.
    let mul_conj =
        |x: [f64; 2], y: [f64; 2]| [x[0] * y[0] + x[1] * y[1], x[1] * y[0] - x[0] * y[1]];
    for bi in 0..bn {
        for c in 0..d {
            let time = |p: usize| if case.reverse { l - 1 - p } else { p };
            let gate_at = |p: usize| {
                let t = time(p);
                let e = match case.gate {
                    GateShape::Full => (bi * l + t) * d + c,
                    GateShape::PerStep => t * d + c,
                    GateShape::PerChannel => c,
                };
                e * w
            };
            let elem = |p: usize| ((bi * l + time(p)) * d + c) * w;
            let load = |v: &[f64], i: usize| [v[i], if w == 2 { v[i + 1] } else { 0.0 }];
            let mut lam = [0.0; 2];
            for p in (0..l).rev() {
                let carried = if p + 1 < l {
                    mul_conj(lam, load(&x.a, gate_at(p + 1)))
                } else {
                    [0.0; 2]
                };
                let gp = load(g, elem(p));
                lam = [gp[0] + carried[0], gp[1] + carried[1]];
                let h_prev = if p > 0 {
                    load(&h, elem(p - 1))
                } else {
                    load(&x.h0, (bi * d + c) * w)
                };
                let dap = mul_conj(lam, h_prev);
                for k in 0..w {
                    db[elem(p) + k] = lam[k];
                    da[gate_at(p) + k] += dap[k];
                }
            }
            let d0 = mul_conj(lam, load(&x.a, gate_at(0)));
            for k in 0..w {
                dh0[(bi * d + c) * w + k] = d0[k];
            }
        }
    }
    [da, db, dh0]
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

/// max |x - y| / (max |y| + 1e-30) over the finite references: a relative error that a single
/// wrong element cannot hide in. Infinities must agree exactly (an inf in y does not widen the
/// scale, and x = y = ±inf is a match, not a skipped position); a NaN on either side, or an inf
/// met by anything else, is an infinite error.
pub fn rel_err(x: &[f64], y: &[f64]) -> f64 {
    assert_eq!(x.len(), y.len(), "length mismatch");
    let scale = y
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(v.abs()))
        + 1e-30;
    let mut diff = 0f64;
    for (a, b) in x.iter().zip(y) {
        if a.is_finite() && b.is_finite() {
            diff = diff.max((a - b).abs());
        } else if a != b || a.is_nan() {
            return f64::INFINITY;
        }
    }
    diff / scale
}

/// A spread of awkward cases: length 1, odd and prime lengths, one chunk exactly, more than a
/// chunk, channel counts that are not tile multiples and more than one CPU tile.
pub fn scan_cases() -> Vec<Case> {
    scan_cases_of(&[
        (1, 1, 1),
        (2, 7, 3),
        (3, 13, 5),
        (1, 64, 32),
        (2, 65, 33),
        (2, 131, 17),
        (1, 97, 300),
        (4, 1000, 7),
    ])
}

/// Every gate shape, real and complex, forward and reverse, for each (batch, length, channels),
/// half of them with h0.
pub fn scan_cases_of(shapes: &[(usize, usize, usize)]) -> Vec<Case> {
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

// ---------------------------------------------------------------- tree solve references

use myosotis::tree::Tree;

/// Shapes of one tree-solve case (the tree itself is separate).
#[derive(Clone, Copy, Debug)]
pub struct TreeCase {
    pub batch: usize,
    pub heads: usize,
    pub d: usize,
    pub r: usize,
    pub shared: bool,
    pub complex: bool,
}

impl TreeCase {
    pub fn w(&self) -> usize {
        if self.complex {
            2
        } else {
            1
        }
    }
    fn tail(&self, mut s: Vec<usize>) -> Vec<usize> {
        if self.complex {
            s.push(2);
        }
        s
    }
    pub fn u_shape(&self, n: usize) -> Vec<usize> {
        self.tail(vec![self.batch, self.heads, n, self.d, self.r])
    }
    pub fn coef_shape(&self, n: usize) -> Vec<usize> {
        if self.shared {
            self.tail(vec![self.heads, n, self.d, self.d])
        } else {
            self.tail(vec![self.batch, self.heads, n, self.d, self.d])
        }
    }
    /// Scalar offset of block (tree t, node v) entry (i, j) in a coefficient tensor.
    pub fn coef_at(&self, n: usize, bi: usize, hi: usize, v: usize, i: usize, j: usize) -> usize {
        let t = if self.shared {
            hi
        } else {
            bi * self.heads + hi
        };
        (((t * n + v) * self.d + i) * self.d + j) * self.w()
    }
    /// Scalar offset of u/x entry (bi, hi, v, i, k).
    pub fn rhs_at(&self, n: usize, bi: usize, hi: usize, v: usize, i: usize, k: usize) -> usize {
        ((((bi * self.heads + hi) * n + v) * self.d + i) * self.r + k) * self.w()
    }
}

#[derive(Clone)]
pub struct TreeInputs {
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub c: Vec<f64>,
    pub u: Vec<f64>,
}

/// Random blocks with T_G strictly diagonally dominant by rows (as the layer keeps it): every
/// diagonal entry of A_v exceeds the sum of the moduli of the rest of its row of T_G by 0.5.
pub fn random_tree_inputs(tree: &Tree, case: &TreeCase, rng: &mut StdRng) -> TreeInputs {
    let n = tree.len();
    let coef_len: usize = case.coef_shape(n).iter().product();
    let mut a = uniform(rng, coef_len, -0.5, 0.5);
    let b = uniform(rng, coef_len, -0.5, 0.5);
    let c = uniform(rng, coef_len, -0.5, 0.5);
    let u = uniform(rng, case.u_shape(n).iter().product(), -1.0, 1.0);
    let (d, w) = (case.d, case.w());
    let modulus = |s: &[f64], o: usize| {
        if w == 2 {
            s[o].hypot(s[o + 1])
        } else {
            s[o].abs()
        }
    };
    let trees = if case.shared { 1 } else { case.batch };
    for bi in 0..trees {
        for hi in 0..case.heads {
            for v in 0..n {
                for i in 0..d {
                    let mut row = 0.0;
                    for j in 0..d {
                        if j != i {
                            row += modulus(&a, case.coef_at(n, bi, hi, v, i, j));
                        }
                        if tree.parent(v).is_some() {
                            row += modulus(&b, case.coef_at(n, bi, hi, v, i, j));
                        }
                        for ch in tree.children(v) {
                            row += modulus(&c, case.coef_at(n, bi, hi, ch, i, j));
                        }
                    }
                    let o = case.coef_at(n, bi, hi, v, i, i);
                    let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                    a[o] = sign * (row + 0.5 + rng.random_range(0.0..0.5));
                    if w == 2 {
                        a[o + 1] = 0.0;
                    }
                }
            }
        }
    }
    TreeInputs { a, b, c, u }
}

/// x = T_G⁻¹ u by assembling each (batch, head) T_G densely (complex f64) and solving it by
/// Gaussian elimination with partial pivoting: independent of the tree solver.
pub fn dense_tree_solve(tree: &Tree, case: &TreeCase, x: &TreeInputs) -> Vec<f64> {
    let (n, d, r, w) = (tree.len(), case.d, case.r, case.w());
    let m = n * d;
    let get = |s: &[f64], o: usize| (s[o], if w == 2 { s[o + 1] } else { 0.0 });
    let mut out = vec![0.0; x.u.len()];
    for bi in 0..case.batch {
        for hi in 0..case.heads {
            let mut t = vec![(0.0, 0.0); m * m];
            for v in 0..n {
                for i in 0..d {
                    for j in 0..d {
                        t[(v * d + i) * m + v * d + j] =
                            get(&x.a, case.coef_at(n, bi, hi, v, i, j));
                        if let Some(p) = tree.parent(v) {
                            t[(v * d + i) * m + p * d + j] =
                                get(&x.b, case.coef_at(n, bi, hi, v, i, j));
                            t[(p * d + i) * m + v * d + j] =
                                get(&x.c, case.coef_at(n, bi, hi, v, i, j));
                        }
                    }
                }
            }
            let mut rhs: Vec<(f64, f64)> = (0..m * r)
                .map(|e| get(&x.u, case.rhs_at(n, bi, hi, e / (d * r), e / r % d, e % r)))
                .collect();
            dense_solve(&mut t, &mut rhs, m, r);
            for (e, z) in rhs.iter().enumerate() {
                let o = case.rhs_at(n, bi, hi, e / (d * r), e / r % d, e % r);
                out[o] = z.0;
                if w == 2 {
                    out[o + 1] = z.1;
                }
            }
        }
    }
    out
}

fn cmul(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    (a.0 * b.0 - a.1 * b.1, a.0 * b.1 + a.1 * b.0)
}

fn cdiv(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    let n = b.0 * b.0 + b.1 * b.1;
    ((a.0 * b.0 + a.1 * b.1) / n, (a.1 * b.0 - a.0 * b.1) / n)
}

/// Solves the m × m system t X = rhs (m × k) in place, complex, partial pivoting.
fn dense_solve(t: &mut [(f64, f64)], rhs: &mut [(f64, f64)], m: usize, k: usize) {
    let abs2 = |z: (f64, f64)| z.0 * z.0 + z.1 * z.1;
    for col in 0..m {
        let piv = (col..m)
            .max_by(|&i, &j| abs2(t[i * m + col]).total_cmp(&abs2(t[j * m + col])))
            .unwrap();
        assert!(
            abs2(t[piv * m + col]) > 0.0,
            "dense reference: singular matrix"
        );
        for j in 0..m {
            t.swap(col * m + j, piv * m + j);
        }
        for j in 0..k {
            rhs.swap(col * k + j, piv * k + j);
        }
        for i in col + 1..m {
            let f = cdiv(t[i * m + col], t[col * m + col]);
            if f == (0.0, 0.0) {
                continue;
            }
            for j in col..m {
                let s = cmul(f, t[col * m + j]);
                t[i * m + j] = (t[i * m + j].0 - s.0, t[i * m + j].1 - s.1);
            }
            for j in 0..k {
                let s = cmul(f, rhs[col * k + j]);
                rhs[i * k + j] = (rhs[i * k + j].0 - s.0, rhs[i * k + j].1 - s.1);
            }
        }
    }
    for i in (0..m).rev() {
        for j in 0..k {
            let mut s = rhs[i * k + j];
            for l in i + 1..m {
                let p = cmul(t[i * m + l], rhs[l * k + j]);
                s = (s.0 - p.0, s.1 - p.1);
            }
            rhs[i * k + j] = cdiv(s, t[i * m + i]);
        }
    }
}

/// Each gradient in `grads` of the variables `vars` equals the central difference of `loss` at
/// its first, middle and last entries (step 1e-6, relative error 1e-6; f64 variables).
pub fn assert_central_differences(
    vars: &[(&str, &candle_core::Var)],
    grads: &candle_core::backprop::GradStore,
    loss: impl Fn() -> f64,
    what: &str,
) {
    for (name, var) in vars {
        let analytic = to_vec(grads.get(var).unwrap());
        let values = to_vec(var.as_tensor());
        for e in [0, values.len() / 2, values.len() - 1] {
            let at = |v: f64| {
                let mut all = values.clone();
                all[e] = v;
                var.set(&Tensor::from_vec(all, var.dims(), &Device::Cpu).unwrap())
                    .unwrap();
                loss()
            };
            let eps = 1e-6;
            let numeric = (at(values[e] + eps) - at(values[e] - eps)) / (2.0 * eps);
            at(values[e]);
            let err = (numeric - analytic[e]).abs() / (1.0 + numeric.abs());
            assert!(
                err < 1e-6,
                "∂{name}[{e}]: {} analytic, {numeric} by differences, {what}",
                analytic[e]
            );
        }
    }
}

/// Each variable's gradient in `got` equals its gradient in `want` to the relative error `tol`.
pub fn assert_same_gradients(
    vars: &[(&str, &candle_core::Var)],
    got: &candle_core::backprop::GradStore,
    want: &candle_core::backprop::GradStore,
    tol: f64,
    what: &str,
) {
    for (name, var) in vars {
        let g = got.get(var).unwrap_or_else(|| panic!("no ∂{name}, {what}"));
        let e = rel_err(&to_vec(g), &to_vec(want.get(var).unwrap()));
        assert!(e < tol, "∂{name}: error {e:e}, {what}");
    }
}

/// BatchNorm's running averages after one update, as f64 loops: running·m + batch·(1 − m), the
/// batch's variance made unbiased (× rows / (rows − 1)).
pub fn running_averages_reference(
    [rm, rv]: [&[f64]; 2],
    mean: &[f64],
    var: &[f64],
    rows: usize,
    decay: f64,
) -> [Vec<f64>; 2] {
    // n / (n − 1), and 1 for a single row (no unbiased estimate: σ² kept as it is).
    let k = match rows {
        0 | 1 => 1.0,
        n => n as f64 / (n as f64 - 1.0),
    };
    let m = (0..rm.len())
        .map(|i| rm[i] * decay + mean[i] * (1.0 - decay))
        .collect();
    let v = (0..rv.len())
        .map(|i| rv[i] * decay + var[i] * k * (1.0 - decay))
        .collect();
    [m, v]
}
