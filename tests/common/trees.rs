//! Transformations of random tree-solve inputs.

use myosotis::tree::Tree;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::{TreeCase, TreeInputs};

/// Permutes the rows of every node's block row of T_G (rows of A_v and B_v, of C_c for its
/// children c, and of u_v) by a random permutation: the solution is unchanged, but the LU of
/// the pivot blocks must now swap rows (diagonally dominant blocks never do).
pub fn permute_block_rows(tree: &Tree, case: &TreeCase, x: &mut TreeInputs, rng: &mut StdRng) {
    let (n, d, r, w) = (tree.len(), case.d, case.r, case.w());
    let coef_trees = if case.shared { 1 } else { case.batch };
    for hi in 0..case.heads {
        for ci in 0..coef_trees {
            for v in 0..n {
                let mut perm: Vec<usize> = (0..d).collect();
                perm.shuffle(rng);
                let rows = |m: &mut Vec<f64>, node: usize| {
                    let old = m.clone();
                    for (i, &pi) in perm.iter().enumerate() {
                        for j in 0..d {
                            let (dst, src) = (
                                case.coef_at(n, ci, hi, node, i, j),
                                case.coef_at(n, ci, hi, node, pi, j),
                            );
                            m[dst..dst + w].copy_from_slice(&old[src..src + w]);
                        }
                    }
                };
                rows(&mut x.a, v);
                rows(&mut x.b, v);
                for ch in tree.children(v) {
                    rows(&mut x.c, ch);
                }
                let batches = if case.shared {
                    0..case.batch
                } else {
                    ci..ci + 1
                };
                for bi in batches {
                    let old = x.u.clone();
                    for (i, &pi) in perm.iter().enumerate() {
                        for k in 0..r {
                            let (dst, src) = (
                                case.rhs_at(n, bi, hi, v, i, k),
                                case.rhs_at(n, bi, hi, v, pi, k),
                            );
                            x.u[dst..dst + w].copy_from_slice(&old[src..src + w]);
                        }
                    }
                }
            }
        }
    }
}
