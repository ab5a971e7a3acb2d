//! ListOps (LRA, `lra_benchmarks/data/listops.py`; facts in docs/reference.md): nested lists of
//! operators over digits, `[MAX 2 9 [MIN 4 7 ] 0 ]`, labelled with their value (10 classes).
//!
//! * Operators: `[MIN`, `[MAX`, `[MED` (integer median), `[SM` (sum mod 10); `]` closes a list.
//! * Generator (the LRA algorithm): below `max_depth`, a node is an operator with probability
//!   0.25 and takes 2..=`max_args` arguments, else (and always at `max_depth`) a digit; trees
//!   are drawn until their length (digits + 2 per operator) lies strictly between the bounds.
//! * TSV: header `Source\tTarget`, the source written with the LRA's parentheses
//!   (`( ( [MAX 2 ) 9 ) ]`), which the reader drops as the LRA pipeline does.
//! * Tokens (the S5 pipeline): pad 0, unk 1, eos 2, then the 15 symbols; EOS appended.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A ListOps operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Min,
    Max,
    Med,
    Sm,
}

impl Op {
    const ALL: [Op; 4] = [Op::Min, Op::Max, Op::Med, Op::Sm];

    pub fn token(self) -> &'static str {
        match self {
            Op::Min => "[MIN",
            Op::Max => "[MAX",
            Op::Med => "[MED",
            Op::Sm => "[SM",
        }
    }

    /// The operator applied to its arguments' values.
    pub fn apply(self, args: &[u8]) -> u8 {
        match self {
            Op::Min => *args.iter().min().expect("operators have arguments"),
            Op::Max => *args.iter().max().expect("operators have arguments"),
            Op::Med => {
                // numpy's median (mean of the middle two for an even count), truncated to int
                let mut v = args.to_vec();
                v.sort_unstable();
                let n = v.len();
                if n % 2 == 1 {
                    v[n / 2]
                } else {
                    ((v[n / 2 - 1] as u32 + v[n / 2] as u32) / 2) as u8
                }
            }
            Op::Sm => (args.iter().map(|&a| a as u32).sum::<u32>() % 10) as u8,
        }
    }
}

/// A ListOps expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    Digit(u8),
    List(Op, Vec<Expr>),
}

impl Expr {
    /// Its value, 0..=9.
    pub fn value(&self) -> u8 {
        match self {
            Expr::Digit(d) => *d,
            Expr::List(op, args) => op.apply(&args.iter().map(Expr::value).collect::<Vec<_>>()),
        }
    }

    /// Tokens in the LRA's length: digits, plus the operator and `]` of each list.
    pub fn len(&self) -> usize {
        match self {
            Expr::Digit(_) => 1,
            Expr::List(_, args) => 2 + args.iter().map(Expr::len).sum::<usize>(),
        }
    }

    /// Always false: an expression has at least one token.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Nesting depth: 1 for a digit.
    pub fn depth(&self) -> usize {
        match self {
            Expr::Digit(_) => 1,
            Expr::List(_, args) => 1 + args.iter().map(Expr::depth).max().unwrap_or(0),
        }
    }

    /// The LRA source string, with its parentheses. The reference encodes a list as left-nested
    /// pairs, ((([MAX, 2), 9), ]), and writes each pair in parentheses, so `[MAX 2 9 ]` is
    /// `( ( ( [MAX 2 ) 9 ) ] )`.
    pub fn to_lra_string(&self) -> String {
        let mut s = String::new();
        self.write_lra(&mut s);
        s
    }

    fn write_lra(&self, s: &mut String) {
        match self {
            Expr::Digit(d) => {
                let _ = write!(s, "{d}");
            }
            Expr::List(op, args) => {
                // t = (op, a0); for a in rest: t = (t, a); t = (t, END)
                s.push_str(&"( ".repeat(args.len() + 1));
                s.push_str(op.token());
                for a in args {
                    s.push(' ');
                    a.write_lra(s);
                    s.push_str(" )");
                }
                s.push_str(" ] )");
            }
        }
    }
}

/// Generator settings (the LRA's defaults; also `myo data listops`'s flags).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct ListOpsConfig {
    /// Deepest nesting of operators.
    #[arg(long, default_value_t = 10)]
    pub max_depth: usize,
    /// Most arguments of one operator.
    #[arg(long, default_value_t = 10)]
    pub max_args: usize,
    /// Lengths strictly between --min-length and --max-length are kept.
    #[arg(long, default_value_t = 500)]
    pub min_length: usize,
    /// See --min-length.
    #[arg(long, default_value_t = 2000)]
    pub max_length: usize,
    /// Seeds the generator (each split draws with seed + 0, 1, 2).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for ListOpsConfig {
    fn default() -> Self {
        ListOpsConfig {
            max_depth: 10,
            max_args: 10,
            min_length: 500,
            max_length: 2000,
            seed: 0,
        }
    }
}

/// Probability that a node below the maximum depth is an operator.
const OP_PROBABILITY: f64 = 0.25;

fn generate_tree(rng: &mut StdRng, depth: usize, cfg: &ListOpsConfig) -> Expr {
    let r: f64 = if depth < cfg.max_depth {
        rng.random()
    } else {
        1.0
    };
    if r > OP_PROBABILITY {
        return Expr::Digit(rng.random_range(0..10));
    }
    let n = rng.random_range(2..=cfg.max_args.max(2));
    let args = (0..n).map(|_| generate_tree(rng, depth + 1, cfg)).collect();
    Expr::List(Op::ALL[rng.random_range(0..4)], args)
}

/// `count` distinct expressions within the length bounds, drawn with `cfg.seed`.
pub fn generate(cfg: &ListOpsConfig, count: usize) -> Result<Vec<Expr>> {
    if cfg.min_length + 1 >= cfg.max_length {
        bail!(
            "ListOps: no length lies strictly between {} and {}",
            cfg.min_length,
            cfg.max_length
        );
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(count);
    let mut tries = 0u64;
    while out.len() < count {
        tries += 1;
        if tries > 1_000_000 + 10_000 * count as u64 {
            bail!(
                "ListOps: only {} of {count} expressions found with lengths in ({}, {}) and depth {}; relax the bounds",
                out.len(),
                cfg.min_length,
                cfg.max_length,
                cfg.max_depth
            );
        }
        let e = generate_tree(&mut rng, 1, cfg);
        let len = e.len();
        if len > cfg.min_length && len < cfg.max_length {
            let s = e.to_lra_string();
            if seen.insert(s) {
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// The symbols of a source string, the LRA's parentheses dropped.
pub fn symbols(source: &str) -> impl Iterator<Item = &str> {
    source.split_whitespace().filter(|t| *t != "(" && *t != ")")
}

/// Evaluates a source string with a stack (independently of [`Expr`]): the label it should have.
pub fn evaluate(source: &str) -> Result<u8> {
    let mut stack: Vec<(Option<Op>, Vec<u8>)> = vec![(None, vec![])];
    for tok in symbols(source) {
        match tok {
            "]" => {
                let (op, args) = stack
                    .pop()
                    .filter(|(op, _)| op.is_some())
                    .context("']' without an open list")?;
                if args.is_empty() {
                    bail!("an empty list");
                }
                let v = op.expect("checked").apply(&args);
                stack
                    .last_mut()
                    .context("']' without an open list")?
                    .1
                    .push(v);
            }
            t => {
                if let Some(op) = Op::ALL.iter().find(|o| o.token() == t) {
                    stack.push((Some(*op), vec![]));
                } else if t.len() == 1 && t.as_bytes()[0].is_ascii_digit() {
                    stack
                        .last_mut()
                        .expect("the outer level is never popped")
                        .1
                        .push(t.as_bytes()[0] - b'0');
                } else {
                    bail!("unknown symbol '{t}'");
                }
            }
        }
    }
    match stack.as_slice() {
        [(None, v)] if v.len() == 1 => Ok(v[0]),
        [(None, _)] => bail!("not a single expression"),
        _ => bail!("an unclosed list"),
    }
}

/// Token ids of the S5 pipeline: pad, unk, eos, then digits and the list symbols.
pub const PAD: u32 = 0;
pub const UNK: u32 = 1;
pub const EOS: u32 = 2;
const SYMBOLS: [&str; 15] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "[MIN", "[MAX", "[MED", "[SM", "]",
];
/// Vocabulary size: 3 specials + 15 symbols.
pub const VOCAB: usize = 3 + SYMBOLS.len();

/// Token ids of a source string with EOS appended (unknown symbols map to UNK).
pub fn tokenize(source: &str) -> Vec<u32> {
    symbols(source)
        .map(|t| {
            SYMBOLS
                .iter()
                .position(|s| *s == t)
                .map_or(UNK, |i| 3 + i as u32)
        })
        .chain(std::iter::once(EOS))
        .collect()
}

/// One example of a split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub source: String,
    pub label: u8,
}

/// Writes examples in the LRA TSV format (header `Source\tTarget`).
pub fn write_tsv(path: &Path, examples: &[Example]) -> Result<()> {
    let mut s = String::from("Source\tTarget\n");
    for e in examples {
        let _ = writeln!(s, "{}\t{}", e.source, e.label);
    }
    let tmp = path.with_extension("tsv.tmp");
    std::fs::write(&tmp, s).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Reads an LRA ListOps TSV; every malformed row is an error naming the file and line.
pub fn read_tsv(path: &Path) -> Result<Vec<Example>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read ListOps file {}", path.display()))?;
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, h)) if h.trim_end() == "Source\tTarget" => {}
        Some((_, h)) => bail!(
            "{}:1: expected the header 'Source<TAB>Target', found '{h}'",
            path.display()
        ),
        None => bail!("{} is empty", path.display()),
    }
    let mut out = vec![];
    for (i, line) in lines {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split('\t').collect();
        let [source, target] = cols.as_slice() else {
            bail!(
                "{}:{n}: expected 2 tab-separated columns, found {}",
                path.display(),
                cols.len()
            );
        };
        let label: u8 = target
            .trim()
            .parse()
            .ok()
            .filter(|l: &u8| *l < 10)
            .with_context(|| {
                format!(
                    "{}:{n}: target '{target}' is not a digit 0-9",
                    path.display()
                )
            })?;
        if let Some(bad) = symbols(source).find(|t| !SYMBOLS.contains(t)) {
            bail!(
                "{}:{n}: unknown symbol '{bad}' in the source",
                path.display()
            );
        }
        out.push(Example {
            source: source.to_string(),
            label,
        });
    }
    Ok(out)
}

/// Sizes of the three splits written by [`write_dataset`] (the LRA's by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct Splits {
    /// Training examples.
    #[arg(long, default_value_t = 96_000)]
    pub train: usize,
    /// Validation examples.
    #[arg(long, default_value_t = 2_000)]
    pub val: usize,
    /// Test examples.
    #[arg(long, default_value_t = 2_000)]
    pub test: usize,
}

impl Default for Splits {
    /// The LRA's sizes.
    fn default() -> Self {
        Splits {
            train: 96_000,
            val: 2_000,
            test: 2_000,
        }
    }
}

/// Generates the three splits and writes `basic_{train,val,test}.tsv` into `dir`, as the LRA
/// lays them out. Each split is drawn with its own seed (`cfg.seed` + 0, 1, 2).
pub fn write_dataset(dir: &Path, cfg: &ListOpsConfig, splits: Splits) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (k, (name, count)) in [
        ("train", splits.train),
        ("val", splits.val),
        ("test", splits.test),
    ]
    .into_iter()
    .enumerate()
    {
        let split_cfg = ListOpsConfig {
            seed: cfg.seed.wrapping_add(k as u64),
            ..cfg.clone()
        };
        let examples: Vec<Example> = generate(&split_cfg, count)?
            .iter()
            .map(|e| Example {
                source: e.to_lra_string(),
                label: e.value(),
            })
            .collect();
        write_tsv(&dir.join(format!("basic_{name}.tsv")), &examples)?;
    }
    Ok(())
}
