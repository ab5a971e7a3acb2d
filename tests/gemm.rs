//! `ops::gemm`: products of matrices read through explicit strides (rows of a tensor's last
//! dimension, rows of any width, transposes, batches at any stride, a batch of one shared),
//! against an f64 loop over the same addresses, and bit for bit against candle's matmul on the
//! equivalent views where candle has them.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{rel_err, seeded_rng, tensor, to_vec};
use myosotis::ops::gemm::gemm_as_for_cublas;
use myosotis::ops::{gemm, gemm_relaid, Mat};
use rand::rngs::StdRng;
use rand::Rng;

/// A matrix batch of the test: values, dims (batch, rows, cols), strides.
struct Side {
    values: Vec<f64>,
    offset: usize,
    dims: [usize; 3],
    strides: [usize; 3],
}

impl Side {
    fn at(&self, b: usize, r: usize, c: usize) -> f64 {
        let b = if self.dims[0] == 1 { 0 } else { b };
        let [sb, sr, sc] = self.strides;
        self.values[self.offset + b * sb + r * sr + c * sc]
    }
}

/// The product by loops, batch by batch, in f64.
fn reference(a: &Side, b: &Side) -> Vec<f64> {
    let batch = a.dims[0].max(b.dims[0]);
    let (m, k, n) = (a.dims[1], a.dims[2], b.dims[2]);
    let mut out = Vec::with_capacity(batch * m * n);
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|l| a.at(bi, i, l) * b.at(bi, l, j)).sum());
            }
        }
    }
    out
}

fn draw(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// gemm of `a` and `b` (each given as its values, then as a Mat over them) against the loops.
fn check(a: &Side, b: &Side, make: impl Fn(&Tensor, &Tensor) -> (Mat, Mat), what: &str) {
    let want = reference(a, b);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        let ta = tensor(&a.values, &[a.values.len()], dtype, &Device::Cpu);
        let tb = tensor(&b.values, &[b.values.len()], dtype, &Device::Cpu);
        let (ma, mb) = make(&ta, &tb);
        let got = gemm(&ma, &mb, want.len()).unwrap();
        assert!(got.is_contiguous());
        let e = rel_err(&to_vec(&got), &want);
        assert!(e < tol, "{what}, {dtype:?}: {e:e}");
        // The operands as the CUDA path prepares them (copies where cuBLAS cannot read them).
        let blas = gemm_as_for_cublas(&ma, &mb, want.len()).unwrap();
        let e = rel_err(&to_vec(&blas), &want);
        assert!(e < tol, "{what}, {dtype:?}, as for cuBLAS: {e:e}");
    }
}

#[test]
fn gemm_reads_its_operands_through_their_strides() {
    let (mut rng, _) = seeded_rng("gemm", 11);
    for (rows, k, n) in [(1, 1, 1), (5, 3, 4), (37, 1, 9), (64, 67, 2)] {
        let a = Side {
            values: draw(&mut rng, rows * k),
            dims: [1, rows, k],
            strides: [rows * k, k, 1],
            offset: 0,
        };
        // B as the transpose of an (n, k) weight, as a dense layer reads it.
        let w = Side {
            values: draw(&mut rng, n * k),
            dims: [1, k, n],
            strides: [n * k, 1, k],
            offset: 0,
        };
        check(
            &a,
            &w,
            |x, w| {
                let x = x.reshape((rows, k)).unwrap();
                let w = w.reshape((n, k)).unwrap();
                (Mat::rows(&x).unwrap(), Mat::rows(&w).unwrap().t())
            },
            &format!("rows × weightᵀ ({rows}, {k}, {n})"),
        );
        // Aᵀ B with A read as rows of width k: (k, rows) · (rows, n).
        let at = Side {
            dims: [1, k, rows],
            strides: [rows * k, 1, k],
            offset: 0,
            values: a.values.clone(),
        };
        let dy = Side {
            values: draw(&mut rng, rows * n),
            dims: [1, rows, n],
            strides: [rows * n, n, 1],
            offset: 0,
        };
        check(
            &at,
            &dy,
            |x, dy| {
                let x = Mat::matrix(x, k).unwrap().t();
                (x, Mat::matrix(dy, n).unwrap())
            },
            &format!("rowsᵀ × rows ({rows}, {k}, {n})"),
        );
    }
    // A batch over interleaved columns, the other side shared: per head h, Xᵀ ∂U[:, h, :]
    // with ∂U of (rows, heads, 2) — and the shared side on the right.
    let (rows, width, heads) = (13, 6, 5);
    let x = draw(&mut rng, rows * width);
    let du = draw(&mut rng, rows * heads * 2);
    let xt = Side {
        values: x.clone(),
        dims: [1, width, rows],
        strides: [0, 1, width],
        offset: 0,
    };
    let dus = Side {
        values: du,
        dims: [heads, rows, 2],
        strides: [2, 2 * heads, 1],
        offset: 0,
    };
    check(
        &xt,
        &dus,
        |x, du| {
            let x = Mat::matrix(x, width).unwrap().t();
            let du = Mat::strided(du, 0, [heads, rows, 2], [2, 2 * heads, 1]).unwrap();
            (x, du)
        },
        "shared left, strided batch right",
    );
    // Rows of a stacked matrix from an offset, transposed: ∂y R_kᵀ with R_k rows 2p·k.. of R.
    let (h, two_p, dirs) = (7, 6, 2);
    let r = draw(&mut rng, dirs * two_p * h);
    let dy = Side {
        values: draw(&mut rng, rows * h),
        dims: [1, rows, h],
        strides: [0, h, 1],
        offset: 0,
    };
    let rk = Side {
        values: r,
        dims: [1, h, two_p],
        strides: [0, 1, h],
        offset: two_p * h,
    };
    check(
        &dy,
        &rk,
        |dy, r| {
            let dy = Mat::matrix(dy, h).unwrap();
            let r = Mat::strided(r, two_p * h, [1, h, two_p], [0, 1, h]).unwrap();
            (dy, r)
        },
        "an offset",
    );
    let right = Side {
        values: draw(&mut rng, 2 * 3),
        dims: [1, 2, 3],
        strides: [6, 3, 1],
        offset: 0,
    };
    check(
        &dus,
        &right,
        |du, r| {
            let du = Mat::strided(du, 0, [heads, rows, 2], [2, 2 * heads, 1]).unwrap();
            (du, Mat::matrix(r, 3).unwrap())
        },
        "strided batch left, shared right",
    );
}

/// Where candle has the same product as views, the values are its matmul's to the bit; a
/// tensor that is not contiguous is read as its values in order.
#[test]
fn gemm_is_candles_matmul_on_the_same_layouts() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (4, 9, 16), &dev).unwrap();
    let w = Tensor::randn(0f32, 1., (24, 16), &dev).unwrap();
    let want = x
        .reshape((36, 16))
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap()
        .reshape((4, 9, 24))
        .unwrap();
    let got = gemm(
        &Mat::rows(&x).unwrap(),
        &Mat::rows(&w).unwrap().t(),
        (4, 9, 24),
    )
    .unwrap();
    assert_eq!(got.dims(), &[4, 9, 24]);
    let bits = |t: &Tensor| {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(bits(&got), bits(&want));
    let xt = x.transpose(1, 2).unwrap();
    let got = gemm(
        &Mat::rows(&xt).unwrap(),
        &Mat::rows(&Tensor::ones((9, 2), DType::F32, &dev).unwrap()).unwrap(),
        (64, 2),
    )
    .unwrap();
    let want = xt.sum_keepdim(2).unwrap().flatten_all().unwrap();
    let got = got.narrow(1, 0, 1).unwrap().flatten_all().unwrap();
    assert!(rel_err(&to_vec(&got), &to_vec(&want)) < 1e-6);
}

/// `gemm_relaid`: the product written in another order in the same op, as Myo's ∂B_in is
/// (Xᵀ ∂U of (H, heads · 2) into (heads, H, 2)).
#[test]
fn gemm_relaid_writes_the_product_in_the_order_asked() {
    let dev = Device::Cpu;
    let (rows, width, heads) = (11, 5, 3);
    let x = Tensor::randn(0f64, 1., (rows, width), &dev).unwrap();
    let du = Tensor::randn(0f64, 1., (rows, heads, 2), &dev).unwrap();
    let (xm, dum) = (
        Mat::rows(&x).unwrap().t(),
        Mat::matrix(&du, 2 * heads).unwrap(),
    );
    let plain = gemm(&xm, &dum, (width, heads, 2)).unwrap();
    let want = plain.transpose(0, 1).unwrap().contiguous().unwrap();
    let got = gemm_relaid(
        &xm,
        &dum,
        [heads, width, 2],
        [2, 2 * heads, 1],
        (heads, width, 2),
    )
    .unwrap();
    assert_eq!(got.dims(), &[heads, width, 2]);
    assert_eq!(to_vec(&got), to_vec(&want));
    let bad = gemm_relaid(
        &xm,
        &dum,
        [heads, width, 2],
        [2, 2 * heads, 2],
        (heads, width, 2),
    );
    assert!(bad.unwrap_err().to_string().contains("not a layout"));
}

#[test]
fn gemm_refuses_what_is_not_a_product() {
    let dev = Device::Cpu;
    let t = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let a = Mat::rows(&t).unwrap();
    assert!(err(gemm(&a, &a, 36)).contains("not a product"));
    assert!(err(gemm(&a, &a.clone().t(), 35)).contains("cannot be shaped"));
    let bad = Mat::strided(&t, 0, [2, 3, 4], [12, 4, 2]);
    assert!(bad.unwrap_err().to_string().contains("reach past"));
    assert!(Mat::matrix(&t, 5)
        .unwrap_err()
        .to_string()
        .contains("not rows of 5"));
    let three = Mat::strided(&t, 0, [3, 2, 4], [8, 4, 1]).unwrap();
    let two = Mat::strided(&t, 0, [2, 4, 3], [12, 3, 1]).unwrap();
    assert!(err(gemm(&three, &two, 18)).contains("not a product"));
}
