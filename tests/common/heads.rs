//! Inputs of `head_solve` (the Myo layer's solve in the model's layout) and their f64
//! references through the general layout's dense solve.

use candle_core::{DType, Device, Tensor};
use myosotis::tree::Tree;
use rand::rngs::StdRng;

use super::{dense_tree_solve, tensor, uniform, TreeCase, TreeInputs};

/// How the couplings are drawn: the skew form the layer uses (B = −z, C = z̄, any size), or
/// independent B and C small enough for strict diagonal dominance of the unit diagonal.
#[derive(Clone, Copy, Debug)]
pub enum Coupling {
    Skew,
    Dominant,
}

/// One case, in the op's layout: u (batch, m, heads, 2), bias (internal, heads, 2),
/// b and c (nodes, heads, 2).
#[derive(Clone, Debug)]
pub struct HeadInputs {
    pub batch: usize,
    pub heads: usize,
    pub m: usize,
    pub u: Vec<f64>,
    pub bias: Vec<f64>,
    pub b: Vec<f64>,
    pub c: Vec<f64>,
}

pub fn random_head_inputs(
    tree: &Tree,
    (batch, heads, all_nodes): (usize, usize, bool),
    coupling: Coupling,
    rng: &mut StdRng,
) -> HeadInputs {
    let (n, leaves) = (tree.len(), tree.leaves());
    let m = if all_nodes { n } else { leaves };
    let (b, c) = match coupling {
        Coupling::Skew => {
            let z = uniform(rng, n * heads * 2, -3.0, 3.0);
            let c = z.chunks(2).flat_map(|p| [p[0], -p[1]]).collect();
            (z.iter().map(|v| -v).collect(), c)
        }
        Coupling::Dominant => {
            let k = (0..n).map(|v| tree.children(v).len()).max().unwrap_or(0);
            let s = 0.6 / (1 + k) as f64;
            (
                uniform(rng, n * heads * 2, -s, s),
                uniform(rng, n * heads * 2, -s, s),
            )
        }
    };
    HeadInputs {
        batch,
        heads,
        m,
        u: uniform(rng, batch * m * heads * 2, -1.0, 1.0),
        bias: uniform(rng, (n - leaves) * heads * 2, -1.0, 1.0),
        b,
        c,
    }
}

impl HeadInputs {
    pub fn tensors(&self, tree: &Tree, dtype: DType, dev: &Device) -> [Tensor; 4] {
        let (n, h) = (tree.len(), self.heads);
        let t = |v: &[f64], s: &[usize]| tensor(v, s, dtype, dev);
        [
            t(&self.u, &[self.batch, self.m, h, 2]),
            t(&self.bias, &[n - tree.leaves(), h, 2]),
            t(&self.b, &[n, h, 2]),
            t(&self.c, &[n, h, 2]),
        ]
    }

    /// The skew form's s (heads, nodes, 2) with B = −s, C = conj(s) (for couplings drawn as
    /// [`Coupling::Skew`]), and the bias by head (heads, internal, 2).
    pub fn skew_form(&self, tree: &Tree) -> (Vec<f64>, Vec<f64>) {
        let h = self.heads;
        let by_head = |x: &[f64], rows: usize, sign: f64| {
            let mut out = vec![0.0; x.len()];
            for r in 0..rows {
                for hi in 0..h {
                    for k in 0..2 {
                        out[(hi * rows + r) * 2 + k] = sign * x[(r * h + hi) * 2 + k];
                    }
                }
            }
            out
        };
        let internal = tree.len() - tree.leaves();
        (
            by_head(&self.b, tree.len(), -1.0),
            by_head(&self.bias, internal, 1.0),
        )
    }

    pub fn case(&self) -> TreeCase {
        TreeCase {
            batch: self.batch,
            heads: self.heads,
            d: 1,
            r: 1,
            shared: true,
            complex: true,
        }
    }

    /// The same system in the general solve's layout: A = 1, B and C per (head, node), and
    /// each node's right-hand side (u where given, plus the bias on internal nodes).
    pub fn general(&self, tree: &Tree) -> TreeInputs {
        let (n, leaves, h) = (tree.len(), tree.leaves(), self.heads);
        let by_head = |s: &[f64]| {
            let mut out = vec![0.0; s.len()];
            for v in 0..n {
                for hi in 0..h {
                    for k in 0..2 {
                        out[(hi * n + v) * 2 + k] = s[(v * h + hi) * 2 + k];
                    }
                }
            }
            out
        };
        let mut u = vec![0.0; self.batch * h * n * 2];
        for bi in 0..self.batch {
            for hi in 0..h {
                for v in 0..n {
                    for k in 0..2 {
                        let mut s = 0.0;
                        if v < self.m {
                            s += self.u[((bi * self.m + v) * h + hi) * 2 + k];
                        }
                        if v >= leaves {
                            s += self.bias[((v - leaves) * h + hi) * 2 + k];
                        }
                        u[((bi * h + hi) * n + v) * 2 + k] = s;
                    }
                }
            }
        }
        TreeInputs {
            a: (0..h * n).flat_map(|_| [1.0, 0.0]).collect(),
            b: by_head(&self.b),
            c: by_head(&self.c),
            u,
        }
    }
}

/// (batch, heads, nodes, 2) of the general layout → (batch, nodes, heads, 2).
pub fn to_model_layout(x: &[f64], batch: usize, heads: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..batch {
        for hi in 0..heads {
            for v in 0..n {
                for k in 0..2 {
                    out[((bi * n + v) * heads + hi) * 2 + k] =
                        x[((bi * heads + hi) * n + v) * 2 + k];
                }
            }
        }
    }
    out
}

/// x by the dense f64 solve, in the op's layout.
pub fn dense(tree: &Tree, x: &HeadInputs) -> Vec<f64> {
    let sol = dense_tree_solve(tree, &x.case(), &x.general(tree));
    to_model_layout(&sol, x.batch, x.heads, tree.len())
}

/// The f64 reference of the backward of Σ g ⊙ x: λ = T_G⁻ᴴ g by the dense solve of the adjoint
/// (C̄ at (v, parent), B̄ at (parent, v)); ∂u = λ on the first m nodes, ∂bias = Σ_batch λ on the
/// internal nodes, ∂B_v = −Σ_batch λ_v conj(x_parent), ∂C_v = −Σ_batch λ_parent conj(x_v).
pub fn dense_grads(tree: &Tree, x: &HeadInputs, g: &[f64]) -> [Vec<f64>; 4] {
    let (n, leaves, h, batch) = (tree.len(), tree.leaves(), x.heads, x.batch);
    let conj = |s: &[f64]| -> Vec<f64> { s.chunks(2).flat_map(|p| [p[0], -p[1]]).collect() };
    let mut general = x.general(tree);
    let sol = to_model_layout(&dense_tree_solve(tree, &x.case(), &general), batch, h, n);
    // g in the general layout.
    let mut g_general = vec![0.0; g.len()];
    for bi in 0..batch {
        for hi in 0..h {
            for v in 0..n {
                for k in 0..2 {
                    g_general[((bi * h + hi) * n + v) * 2 + k] = g[((bi * n + v) * h + hi) * 2 + k];
                }
            }
        }
    }
    (general.b, general.c) = (conj(&general.c), conj(&general.b));
    general.u = g_general;
    let lam = to_model_layout(&dense_tree_solve(tree, &x.case(), &general), batch, h, n);
    let at = |s: &[f64], bi: usize, v: usize, hi: usize| {
        let o = ((bi * n + v) * h + hi) * 2;
        (s[o], s[o + 1])
    };
    let mut du = vec![0.0; x.u.len()];
    for bi in 0..batch {
        for v in 0..x.m {
            for hi in 0..h {
                let l = at(&lam, bi, v, hi);
                let o = ((bi * x.m + v) * h + hi) * 2;
                (du[o], du[o + 1]) = l;
            }
        }
    }
    let mut dbias = vec![0.0; x.bias.len()];
    let (mut db, mut dc) = (vec![0.0; x.b.len()], vec![0.0; x.c.len()]);
    for v in 0..n {
        for hi in 0..h {
            let (mut sb, mut sc, mut sl) = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
            for bi in 0..batch {
                let lv = at(&lam, bi, v, hi);
                sl = (sl.0 + lv.0, sl.1 + lv.1);
                if let Some(p) = tree.parent(v) {
                    // λ conj(x): (a + ib)(c − id)
                    let (xp, lp, xv) = (
                        at(&sol, bi, p, hi),
                        at(&lam, bi, p, hi),
                        at(&sol, bi, v, hi),
                    );
                    sb = (
                        sb.0 + lv.0 * xp.0 + lv.1 * xp.1,
                        sb.1 + lv.1 * xp.0 - lv.0 * xp.1,
                    );
                    sc = (
                        sc.0 + lp.0 * xv.0 + lp.1 * xv.1,
                        sc.1 + lp.1 * xv.0 - lp.0 * xv.1,
                    );
                }
            }
            let o = (v * h + hi) * 2;
            (db[o], db[o + 1]) = (-sb.0, -sb.1);
            (dc[o], dc[o + 1]) = (-sc.0, -sc.1);
            if v >= leaves {
                let o = ((v - leaves) * h + hi) * 2;
                (dbias[o], dbias[o + 1]) = sl;
            }
        }
    }
    [du, dbias, db, dc]
}

/// One sample, two heads, whose pivot at the parent of leaf 4 is zero in head 1: with a unit
/// diagonal a parent of leaves has Â_p = 1 − Σ_c C_c B_c, zero when one child has C B = 1 (here
/// B = 2, C = 0.5) and the others 0. `tree` needs at least 5 leaves.
pub fn singular_head_inputs(tree: &Tree) -> HeadInputs {
    let (n, l, heads) = (tree.len(), tree.leaves(), 2);
    let mut x = HeadInputs {
        batch: 1,
        heads,
        m: l,
        u: vec![1.0; l * heads * 2],
        bias: vec![0.0; (n - l) * heads * 2],
        b: vec![0.0; n * heads * 2],
        c: vec![0.0; n * heads * 2],
    };
    x.b[(4 * heads + 1) * 2] = 2.0;
    x.c[(4 * heads + 1) * 2] = 0.5;
    x
}
