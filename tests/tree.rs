//! Tree topology and sequence orderings: structural properties on random trees, the level
//! sizes of the trees the paper's tasks use, every rejected description, and the orderings as
//! bijections.

mod common;

use myosotis::ops::plan::Table;
use myosotis::tree::{morton_code, Ordering, Tree};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;

/// Every rule of the reversed BFS numbering, checked from the accessors alone.
fn check_structure(t: &Tree) {
    let n = t.len();
    assert_eq!(t.root(), n - 1);
    assert_eq!(t.parent(t.root()), None);
    assert_eq!(
        t.level(t.levels() - 1),
        t.root()..n,
        "the root alone is the top level"
    );
    assert_eq!(t.level(0).start, 0);
    let level_of = |v: usize| (0..t.levels()).find(|&k| t.level(k).contains(&v)).unwrap();
    for k in 0..t.levels() - 1 {
        assert_eq!(
            t.level(k).end,
            t.level(k + 1).start,
            "levels are contiguous"
        );
    }
    let mut seen_children = vec![];
    for p in 0..n {
        for c in t.children(p) {
            assert_eq!(t.parent(c), Some(p), "child {c} of {p}");
            assert_eq!(
                level_of(c) + 1,
                level_of(p),
                "child {c} one level below {p}"
            );
            seen_children.push(c);
        }
    }
    assert_eq!(
        seen_children,
        (0..n - 1).collect::<Vec<_>>(),
        "every non-root node is a child once"
    );
    for v in 0..n - 1 {
        let p = t.parent(v).unwrap();
        assert!(p > v && t.children(p).contains(&v));
    }
    // The kernels' tables hold the same numbers.
    for (table, values) in [
        (t.level_table(), t.level_starts()),
        (t.child_table(), t.child_starts()),
        (t.parent_table(), t.parents()),
    ] {
        let wide: Vec<usize> = table.iter().map(|&x| x as usize).collect();
        assert_eq!(wide, values);
    }
}

fn level_sizes(t: &Tree) -> Vec<usize> {
    (0..t.levels()).map(|k| t.level(k).len()).collect()
}

#[test]
fn perfect_and_ragged_trees_have_the_expected_levels() {
    let t = Tree::perfect(64, 4).unwrap();
    assert_eq!(level_sizes(&t), [64, 16, 4, 1]);
    assert_eq!(t.children(64), 0..4);
    assert_eq!(t.children(t.root()), 80..84);
    assert_eq!(
        level_sizes(&Tree::ragged(784, 4).unwrap()),
        [784, 196, 49, 13, 4, 1]
    );
    assert_eq!(
        level_sizes(&Tree::ragged(1000, 4).unwrap()),
        [1000, 250, 63, 16, 4, 1]
    );
    assert_eq!(
        level_sizes(&Tree::ragged(2000, 2).unwrap()),
        [2000, 1000, 500, 250, 125, 63, 32, 16, 8, 4, 2, 1]
    );
    assert_eq!(level_sizes(&Tree::perfect(16384, 2).unwrap()).len(), 15);
    let chain = Tree::chain(5).unwrap();
    assert_eq!(level_sizes(&chain), [1; 5]);
    assert_eq!(chain.parent(2), Some(3));
    let single = Tree::ragged(1, 3).unwrap();
    assert_eq!((single.len(), single.levels(), single.leaves()), (1, 1, 1));
    // Arities per level, the last repeated: 4 pixels, a row of 28, 4 rows, 7 × 4 rows.
    let rows = Tree::by_levels(784, &[4, 7, 4, 7]).unwrap();
    assert_eq!(level_sizes(&rows), [784, 196, 28, 7, 1]);
    assert_eq!(rows.children(784), 0..4);
    assert_eq!(rows.children(784 + 196), 784..791);
    assert_eq!(rows.children(rows.root()), 1008..1015);
    assert_eq!(
        level_sizes(&Tree::by_levels(100, &[2, 5]).unwrap()),
        [100, 50, 10, 2, 1]
    );
    assert_eq!(Tree::by_levels(1000, &[4]), Tree::ragged(1000, 4));
    assert!(Tree::by_levels(10, &[]).is_err());
    assert!(Tree::by_levels(10, &[3, 1]).is_err());
    for t in [
        rows,
        Tree::perfect(64, 4).unwrap(),
        Tree::ragged(1000, 4).unwrap(),
        chain,
        single,
    ] {
        check_structure(&t);
    }
}

/// A random tree built top-down (each node gets 0–4 children, at least one node per level),
/// then numbered in reversed BFS order and described by its parent list.
fn random_parents(rng: &mut StdRng) -> Vec<Option<usize>> {
    let depth = rng.random_range(1..6);
    let mut counts: Vec<Vec<usize>> = vec![]; // child counts per level, root level first
    let mut width = 1;
    for _ in 0..depth {
        let mut c: Vec<usize> = (0..width).map(|_| rng.random_range(0..5)).collect();
        if c.iter().sum::<usize>() == 0 {
            c[0] = 1;
        }
        width = c.iter().sum();
        counts.push(c);
    }
    // Levels bottom-up: sizes, then each node's parent from its level's child counts.
    let mut sizes: Vec<usize> = counts.iter().map(|c| c.iter().sum()).collect();
    sizes.reverse();
    sizes.push(1);
    let mut parents = vec![];
    let mut start = 0;
    for (k, c) in counts.iter().rev().enumerate() {
        let parent_start = start + sizes[k];
        for (i, &m) in c.iter().enumerate() {
            parents.extend(std::iter::repeat_n(Some(parent_start + i), m));
        }
        start = parent_start;
    }
    parents.push(None);
    parents
}

#[test]
fn random_trees_satisfy_the_numbering_rules() {
    let (mut rng, seed) = common::seeded_rng("random trees", 121);
    for _ in 0..300 {
        let parents = random_parents(&mut rng);
        let t = Tree::from_parents(&parents)
            .unwrap_or_else(|e| panic!("{e} for {parents:?} (seed {seed})"));
        check_structure(&t);
        for (v, p) in parents.iter().enumerate() {
            assert_eq!(t.parent(v), *p);
        }
        let (leaves, arity) = (rng.random_range(1..3000), rng.random_range(2..6));
        let t = Tree::ragged(leaves, arity).unwrap();
        check_structure(&t);
        assert_eq!(t.leaves(), leaves);
        assert!((0..t.len()).all(|p| t.children(p).len() <= arity));
    }
}

#[test]
fn invalid_descriptions_are_errors() {
    let cases: Vec<(&str, Vec<Option<usize>>, &str)> = vec![
        ("empty", vec![], "at least one node"),
        ("cycle", vec![Some(1), Some(0), Some(1)], "no root"),
        ("back edge", vec![Some(2), Some(0), None], "numbered after"),
        ("several roots", vec![Some(2), None, None], "several roots"),
        ("root not last", vec![None, Some(0), Some(0)], "last node"),
        ("out of range", vec![Some(7), None], "only 2 nodes"),
        (
            "siblings split",
            vec![Some(4), Some(5), Some(4), Some(5), Some(6), Some(6), None],
            "contiguous",
        ),
        // a child numbered before its parent's level: node 1 (under the root) before node 2
        (
            "child before parent level",
            vec![Some(3), Some(4), Some(3), Some(4), None],
            "contiguous",
        ),
    ];
    for (what, parents, needle) in cases {
        let err = Tree::from_parents(&parents).expect_err(what).to_string();
        assert!(err.contains(needle), "{what}: '{err}' lacks '{needle}'");
    }
    assert!(Tree::perfect(48, 4)
        .unwrap_err()
        .to_string()
        .contains("not a power of 4"));
    assert!(Tree::ragged(10, 1).is_err());
    assert!(Tree::ragged(0, 2).is_err());
    assert!(Tree::chain(0).is_err());
    assert!(Ordering::morton(0, 5).is_err());
}

fn check_bijection(o: &Ordering, n: usize) {
    assert_eq!(o.len(), n);
    let mut sorted = o.perm.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "perm is a permutation");
    for i in 0..n {
        assert_eq!(o.inv[o.perm[i]], i, "inv is its inverse");
    }
}

#[test]
fn orderings_are_bijections_with_their_shapes() {
    for (h, w) in [(1, 1), (3, 5), (28, 28), (32, 32), (7, 16)] {
        let raster = Ordering::raster(h, w).unwrap();
        let snake = Ordering::snake(h, w).unwrap();
        let morton = Ordering::morton(h, w).unwrap();
        for o in [&raster, &snake, &morton] {
            check_bijection(o, h * w);
        }
        assert_eq!(raster.perm, (0..h * w).collect::<Vec<_>>());
        for i in 1..h * w {
            let (a, b) = (snake.perm[i - 1], snake.perm[i]);
            let dist = (a / w).abs_diff(b / w) + (a % w).abs_diff(b % w);
            assert_eq!(dist, 1, "snake positions {} and {i} are neighbours", i - 1);
            let (ma, mb) = (morton.perm[i - 1], morton.perm[i]);
            assert!(
                morton_code(ma / w, ma % w) < morton_code(mb / w, mb % w),
                "morton is sorted"
            );
        }
    }
    // Z-order over 4 x 4: 2 x 2 blocks, each top-left, top-right, bottom-left, bottom-right.
    assert_eq!(
        Ordering::morton(4, 4).unwrap().perm,
        [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    );
}

#[test]
fn quad_tree_follows_the_image_blocks() {
    assert_eq!(Tree::quad(32, 32).unwrap(), Tree::perfect(1024, 4).unwrap());
    let t = Tree::quad(28, 28).unwrap();
    check_structure(&t);
    assert_eq!(level_sizes(&t), [784, 196, 49, 16, 4, 1]);
    // Every node's leaves form one aligned square block of the image (clipped at the edges).
    let order = Ordering::morton(28, 28).unwrap();
    let mut leaves_of: Vec<Vec<usize>> = (0..t.len())
        .map(|v| if v < 784 { vec![order.perm[v]] } else { vec![] })
        .collect();
    for k in 1..t.levels() {
        for p in t.level(k) {
            let kids: Vec<usize> = t.children(p).flat_map(|c| leaves_of[c].clone()).collect();
            leaves_of[p] = kids;
            let side = 1usize << k;
            let (r0, c0) = (
                leaves_of[p][0] / 28 / side * side,
                leaves_of[p][0] % 28 / side * side,
            );
            let block: Vec<usize> = (r0..(r0 + side).min(28))
                .flat_map(|r| (c0..(c0 + side).min(28)).map(move |c| r * 28 + c))
                .collect();
            let mut got = leaves_of[p].clone();
            got.sort_unstable();
            assert_eq!(got, block, "node {p} on level {k}");
        }
    }
    assert_eq!(leaves_of[t.root()].len(), 784);
    for (h, w) in [(1, 1), (5, 3), (17, 40)] {
        let t = Tree::quad(h, w).unwrap();
        check_structure(&t);
        assert_eq!(t.leaves(), h * w);
    }
}

/// The CUDA launch keeps uploaded tables by their values: a table made apart with the same
/// values finds the upload, one with other values does not, and a tree's clone shares its tables.
#[test]
fn kernel_tables_are_found_by_their_values() {
    let tree = Tree::perfect(64, 4).unwrap();
    let mut uploaded = HashMap::new();
    uploaded.insert(tree.child_table().clone(), "children");
    let same = Table::of(tree.child_starts());
    assert_eq!(uploaded.get(&same), Some(&"children"));
    assert_eq!(uploaded.get(tree.clone().child_table()), Some(&"children"));
    let mut other = tree.child_starts().to_vec();
    other[3] += 1;
    assert_eq!(uploaded.get(&Table::of(&other)), None);
    assert_eq!(uploaded.get(tree.level_table()), None);
    assert_ne!(Table::of(&[1, 2]), Table::of(&[1, 2, 0]));
}
