//! Tree topology for the Myo layer, and the sequence orderings that put an image on its leaves.
//!
//! Nodes are numbered in reversed breadth-first order (Myosotis paper §3.2, Appendix A): the
//! leaves first (level 0 here, "level 1" in the paper), the root last, every node's parent in
//! the next level, and the children of one parent contiguous and in the order of their parents.
//! So a level is a range of node numbers, and the children of all nodes, taken in node order,
//! are exactly the nodes 0..n-1 except the root: the child ranges form one compressed list.

use std::ops::Range;
use std::sync::Arc;

use crate::ops::plan::Table;

/// An error in a tree or ordering description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid tree: {0}")]
pub struct TreeError(pub String);

/// The layers and ops, which speak candle's error, take a tree error with `?`.
impl From<TreeError> for candle_core::Error {
    fn from(e: TreeError) -> Self {
        candle_core::Error::wrap(e)
    }
}

macro_rules! tree_bail {
    ($($arg:tt)*) => { return Err(TreeError(format!($($arg)*))) };
}

/// A rooted tree in reversed BFS numbering (see the module docs). Cloning one shares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    /// parent[v] for every node; the root (last node) is its own parent.
    parent: Arc<[usize]>,
    /// Level k is the nodes `level_start[k]..level_start[k + 1]`; level 0 holds the leaves.
    level_start: Arc<[usize]>,
    /// The children of node p are the nodes `child_start[p]..child_start[p + 1]`.
    child_start: Arc<[usize]>,
    /// The three above as the CUDA kernels' tables, made once per tree: a launch then neither
    /// converts nor hashes them.
    tables: [Table; 3],
}

impl Tree {
    /// A tree from each node's parent (`None` for the root), checking every rule of the
    /// numbering: one root, numbered last; parents numbered after their children; the children
    /// of a parent contiguous and ordered like their parents; levels contiguous.
    pub fn from_parents(parents: &[Option<usize>]) -> Result<Tree, TreeError> {
        let n = parents.len();
        if n == 0 {
            tree_bail!("a tree needs at least one node");
        }
        let roots: Vec<usize> = (0..n).filter(|&v| parents[v].is_none()).collect();
        match roots.as_slice() {
            [] => tree_bail!("no root (every node has a parent, so there is a cycle)"),
            [r] if *r != n - 1 => {
                tree_bail!(
                    "the root is node {r}; in reversed BFS order it must be the last node, {}",
                    n - 1
                )
            }
            [_] => {}
            [a, b, ..] => tree_bail!(
                "several roots ({} in all), e.g. nodes {a} and {b}",
                roots.len()
            ),
        }
        let mut parent = vec![n - 1; n];
        for v in 0..n - 1 {
            let p = parents[v].expect("only the last node is the root");
            if p >= n {
                tree_bail!("node {v} has parent {p}, but there are only {n} nodes");
            }
            if p <= v {
                tree_bail!(
                    "node {v} has parent {p}: a parent must be numbered after its children \
                     (otherwise the description has a cycle or is not in reversed BFS order)"
                );
            }
            if v > 0 && p < parent[v - 1] {
                tree_bail!(
                    "node {v} has parent {p} but node {} has parent {}: the children of a parent \
                     must be contiguous and ordered like their parents",
                    v - 1,
                    parent[v - 1]
                );
            }
            parent[v] = p;
        }
        // Depth from the root (parents are numbered later, so one backward sweep suffices).
        let mut depth = vec![0usize; n];
        for v in (0..n - 1).rev() {
            depth[v] = depth[parent[v]] + 1;
        }
        // Parents after children and a non-decreasing parent sequence make the depth
        // non-increasing along the numbering (by induction from the root), so the levels are
        // contiguous ranges; a child before its parent's level was rejected above.
        let height = depth[0];
        let mut level_start = vec![0];
        for v in 1..n {
            let (l_prev, l) = (height - depth[v - 1], height - depth[v]);
            debug_assert!(l >= l_prev, "levels follow from the checks above");
            for _ in l_prev..l {
                level_start.push(v);
            }
        }
        level_start.push(n);
        let mut child_start = vec![0usize; n + 1];
        for &p in &parent[..n - 1] {
            child_start[p + 1] += 1;
        }
        for p in 0..n {
            child_start[p + 1] += child_start[p];
        }
        Ok(Tree {
            tables: [&level_start, &child_start, &parent].map(|v| Table::of(v)),
            parent: parent.into(),
            level_start: level_start.into(),
            child_start: child_start.into(),
        })
    }

    /// A k-ary tree over any number of leaves: each level is split into groups of `arity`
    /// consecutive nodes, the last group of a level possibly short (e.g. 4-ary over 784 or 1000
    /// leaves, binary over 2,000 tokens).
    pub fn ragged(leaves: usize, arity: usize) -> Result<Tree, TreeError> {
        Tree::by_levels(leaves, &[arity])
    }

    /// A tree over any number of leaves whose level k is split into groups of `arities[k]`
    /// consecutive nodes (the last group of a level possibly short), the last arity repeated
    /// until one root remains: `[4, 7, 4, 7]` over the 784 pixels of a 28 × 28 image in raster
    /// order groups 4 pixels of a row, the 7 groups of a row, 4 rows, and the 7 groups of rows.
    pub fn by_levels(leaves: usize, arities: &[usize]) -> Result<Tree, TreeError> {
        let Some(&last) = arities.last() else {
            tree_bail!("no arity given");
        };
        if let Some(a) = arities.iter().find(|&&a| a < 2) {
            tree_bail!("arity {a}: a k-ary tree needs k ≥ 2 (k = 1 is a chain)");
        }
        if leaves == 0 {
            tree_bail!("a tree needs at least one leaf");
        }
        let mut parents = Vec::new();
        let (mut start, mut m) = (0, leaves);
        for k in 0.. {
            if m == 1 {
                parents.push(None);
                break;
            }
            let arity = arities.get(k).copied().unwrap_or(last);
            let next = start + m;
            parents.extend((0..m).map(|i| Some(next + i / arity)));
            (start, m) = (next, m.div_ceil(arity));
        }
        Ok(Tree::from_parents(&parents).expect("grouped trees are valid by construction"))
    }

    /// The perfect k-ary tree over `leaves` = k^m leaves.
    pub fn perfect(leaves: usize, arity: usize) -> Result<Tree, TreeError> {
        let mut m = leaves;
        while arity >= 2 && m > 1 && m.is_multiple_of(arity) {
            m /= arity;
        }
        if arity >= 2 && m != 1 {
            tree_bail!("{leaves} leaves is not a power of {arity} (a ragged tree takes any count)");
        }
        Tree::ragged(leaves, arity)
    }

    /// A chain of `len` nodes: node v's parent is v + 1 (each parent has one child). With the
    /// scalar coefficients of paper §3.4 its solve is a linear recurrence.
    pub fn chain(len: usize) -> Result<Tree, TreeError> {
        if len == 0 {
            tree_bail!("a chain needs at least one node");
        }
        let parents: Vec<_> = (0..len).map(|v| (v + 1 < len).then_some(v + 1)).collect();
        Tree::from_parents(&parents)
    }

    /// The quad tree of an `height` × `width` image whose pixels are the leaves in Morton
    /// order ([`Ordering::morton`]): the nodes of level k are the aligned 2^k × 2^k blocks that
    /// hold at least one pixel, each the parent of its non-empty sub-blocks. For sides that are
    /// powers of two this is the perfect 4-ary tree; otherwise blocks on the right and bottom
    /// edges have fewer children (28 × 28: levels of 784, 196, 49, 16, 4, 1 nodes) — a ragged
    /// quad tree, with no padding pixels.
    pub fn quad(height: usize, width: usize) -> Result<Tree, TreeError> {
        let order = Ordering::morton(height, width)?;
        let mut keys: Vec<u64> = order
            .perm
            .iter()
            .map(|&px| morton_code(px / width, px % width))
            .collect();
        let mut parents: Vec<Option<usize>> = Vec::new();
        let mut start = 0;
        loop {
            let next_start = start + keys.len();
            if keys.len() == 1 {
                parents.push(None);
                break;
            }
            let mut up: Vec<u64> = Vec::new();
            for &k in &keys {
                if up.last() != Some(&(k >> 2)) {
                    up.push(k >> 2);
                }
                parents.push(Some(next_start + up.len() - 1));
            }
            keys = up;
            start = next_start;
        }
        Tree::from_parents(&parents)
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.parent.len()
    }

    /// Always false: a tree has a root.
    pub fn is_empty(&self) -> bool {
        self.parent.is_empty()
    }

    /// Number of levels (1 for a single node).
    pub fn levels(&self) -> usize {
        self.level_start.len() - 1
    }

    /// The nodes of level `k` (0 = leaves).
    pub fn level(&self, k: usize) -> Range<usize> {
        self.level_start[k]..self.level_start[k + 1]
    }

    /// Number of leaves (nodes of level 0).
    pub fn leaves(&self) -> usize {
        self.level_start[1]
    }

    /// The root: the last node.
    pub fn root(&self) -> usize {
        self.parent.len() - 1
    }

    /// The parent of `v`, or `None` for the root.
    pub fn parent(&self, v: usize) -> Option<usize> {
        (v != self.root()).then(|| self.parent[v])
    }

    /// The children of `p`: a contiguous range of the previous level.
    pub fn children(&self, p: usize) -> Range<usize> {
        self.child_start[p]..self.child_start[p + 1]
    }

    /// Every node's parent, the root being its own parent (the array the kernels read).
    pub fn parents(&self) -> &[usize] {
        &self.parent
    }

    /// The level boundaries: level k is `level_starts()[k]..level_starts()[k + 1]`.
    pub fn level_starts(&self) -> &[usize] {
        &self.level_start
    }

    /// The child boundaries: node p's children are `child_starts()[p]..child_starts()[p + 1]`.
    pub fn child_starts(&self) -> &[usize] {
        &self.child_start
    }

    /// [`Tree::level_starts`] as a kernel table.
    pub fn level_table(&self) -> &Table {
        &self.tables[0]
    }

    /// [`Tree::child_starts`] as a kernel table.
    pub fn child_table(&self) -> &Table {
        &self.tables[1]
    }

    /// [`Tree::parents`] as a kernel table.
    pub fn parent_table(&self) -> &Table {
        &self.tables[2]
    }
}

/// Morton (Z-order) code of a pixel: the bits of `row` and `col` interleaved, the column in the
/// even bits, so a 2 × 2 block is visited top-left, top-right, bottom-left, bottom-right.
pub fn morton_code(row: usize, col: usize) -> u64 {
    fn spread(mut x: u64) -> u64 {
        x &= 0xffff_ffff;
        x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
        x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
        x = (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
        x = (x | (x << 2)) & 0x3333_3333_3333_3333;
        x = (x | (x << 1)) & 0x5555_5555_5555_5555;
        x
    }
    spread(col as u64) | (spread(row as u64) << 1)
}

/// A sequence ordering of an image's pixels: `perm[i]` is the row-major index of the pixel at
/// sequence position i, and `inv` its inverse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ordering {
    pub perm: Vec<usize>,
    pub inv: Vec<usize>,
}

impl Ordering {
    fn from_perm(perm: Vec<usize>) -> Ordering {
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ordering { perm, inv }
    }

    fn check(height: usize, width: usize) -> Result<(), TreeError> {
        if height == 0 || width == 0 {
            tree_bail!("image of {height} x {width} pixels has no pixels");
        }
        if height > u32::MAX as usize || width > u32::MAX as usize {
            tree_bail!("image of {height} x {width} pixels is too large");
        }
        Ok(())
    }

    /// Row by row, left to right.
    pub fn raster(height: usize, width: usize) -> Result<Ordering, TreeError> {
        Ordering::check(height, width)?;
        Ok(Ordering::from_perm((0..height * width).collect()))
    }

    /// Row by row, alternating direction (paper Fig. 6): even rows left to right, odd rows right
    /// to left, so consecutive positions are always neighbouring pixels.
    pub fn snake(height: usize, width: usize) -> Result<Ordering, TreeError> {
        Ordering::check(height, width)?;
        let perm = (0..height)
            .flat_map(|r| {
                (0..width).map(move |c| r * width + if r % 2 == 0 { c } else { width - 1 - c })
            })
            .collect();
        Ok(Ordering::from_perm(perm))
    }

    /// Morton / Z-order (paper Figs. 3a, 6): pixels sorted by [`morton_code`]. For any side,
    /// powers of two or not; its natural tree is [`Tree::quad`].
    pub fn morton(height: usize, width: usize) -> Result<Ordering, TreeError> {
        Ordering::check(height, width)?;
        let mut perm: Vec<usize> = (0..height * width).collect();
        perm.sort_by_key(|&p| morton_code(p / width, p % width));
        Ok(Ordering::from_perm(perm))
    }

    /// Number of positions.
    pub fn len(&self) -> usize {
        self.perm.len()
    }

    /// True for an empty ordering (never built by the constructors).
    pub fn is_empty(&self) -> bool {
        self.perm.is_empty()
    }
}
