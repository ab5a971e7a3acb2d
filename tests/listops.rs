//! ListOps: generated labels agree with an independent evaluator, bounds hold, the TSV format
//! round-trips, and malformed files are errors naming file and line.

mod common;

use myosotis::data::listops::*;

fn small() -> ListOpsConfig {
    ListOpsConfig {
        max_depth: 6,
        max_args: 5,
        min_length: 20,
        max_length: 120,
        seed: 7,
    }
}

#[test]
fn generated_expressions_have_their_labels_and_bounds() {
    let cfg = small();
    let exprs = generate(&cfg, 300).unwrap();
    assert_eq!(exprs.len(), 300);
    let mut labels = [0usize; 10];
    for e in &exprs {
        let source = e.to_lra_string();
        assert_eq!(evaluate(&source).unwrap(), e.value(), "{source}");
        assert!(
            e.len() > cfg.min_length && e.len() < cfg.max_length,
            "length {}",
            e.len()
        );
        // depth counts the digit level; lists open below max_depth
        assert!(e.depth() <= cfg.max_depth, "depth {}", e.depth());
        let tokens = tokenize(&source);
        assert_eq!(tokens.len(), e.len() + 1, "tokens of {source}");
        assert_eq!(*tokens.last().unwrap(), EOS);
        assert!(tokens
            .iter()
            .all(|&t| t >= 3 && (t as usize) < VOCAB || t == EOS));
        labels[e.value() as usize] += 1;
    }
    assert!(
        labels.iter().filter(|&&c| c > 0).count() >= 5,
        "labels spread: {labels:?}"
    );
    // Same seed, same data; distinct expressions.
    assert_eq!(generate(&cfg, 300).unwrap(), exprs);
    let mut strings: Vec<String> = exprs.iter().map(Expr::to_lra_string).collect();
    strings.sort();
    strings.dedup();
    assert_eq!(strings.len(), 300);
}

#[test]
fn operators_and_the_lra_string_format() {
    let e = Expr::List(Op::Max, vec![Expr::Digit(2), Expr::Digit(9)]);
    assert_eq!(e.to_lra_string(), "( ( ( [MAX 2 ) 9 ) ] )");
    assert_eq!(Op::Med.apply(&[1, 2, 7, 9]), 4); // numpy median 4.5, truncated
    assert_eq!(Op::Med.apply(&[3, 1, 2]), 2);
    assert_eq!(Op::Sm.apply(&[9, 8, 7]), 4);
    assert_eq!(evaluate("[SM [MIN 4 7 ] [MED 1 2 7 9 ] 0 ]").unwrap(), 8);
    for bad in ["[MAX 1", "1 2", "]", "[MIN ]", "[FOO 1 ]"] {
        assert!(evaluate(bad).is_err(), "{bad}");
    }
}

#[test]
fn tsv_round_trip_and_malformed_files() {
    let dir = common::scratch("listops");
    let examples: Vec<Example> = generate(&small(), 20)
        .unwrap()
        .iter()
        .map(|e| Example {
            source: e.to_lra_string(),
            label: e.value(),
        })
        .collect();
    let path = dir.join("basic_train.tsv");
    write_tsv(&path, &examples).unwrap();
    assert_eq!(read_tsv(&path).unwrap(), examples);
    let cases = [
        ("header.tsv", "Input\tLabel\n1\t1\n", "header"),
        (
            "columns.tsv",
            "Source\tTarget\n( [MAX 1 ) ]\n",
            ":2: expected 2",
        ),
        (
            "target.tsv",
            "Source\tTarget\n[MAX 1 ]\t12\n",
            ":2: target '12'",
        ),
        (
            "symbol.tsv",
            "Source\tTarget\n[MAX 1 ]\t1\n[MAX x ]\t3\n",
            ":3: unknown symbol 'x'",
        ),
        ("empty.tsv", "", "is empty"),
    ];
    for (name, body, needle) in cases {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        let err = format!("{:#}", read_tsv(&p).unwrap_err());
        assert!(err.contains(name) && err.contains(needle), "{name}: {err}");
    }
    assert!(format!("{:#}", read_tsv(&dir.join("absent.tsv")).unwrap_err()).contains("absent.tsv"));
}
