//! How `myo train`'s flags resolve into a run: the task's defaults (trees, direction, encoder,
//! classes), presets under flags, and errors that name the flag.

use myosotis::data::task::{self, DataSource, Input};
use myosotis::nn::*;
use myosotis::train::config::{RunArgs, RunConfig};

fn resolve(flags: &[&str]) -> anyhow::Result<RunConfig> {
    RunArgs::from_flags(flags)?.resolve()
}

fn ok(flags: &[&str]) -> RunConfig {
    resolve(flags).unwrap_or_else(|e| panic!("{flags:?}: {e:#}"))
}

fn err(flags: &[&str]) -> String {
    match resolve(flags) {
        Ok(cfg) => panic!("{flags:?} resolved to {cfg:?}"),
        Err(e) => format!("{e:#}"),
    }
}

fn myo_tree(cfg: &RunConfig) -> TreeSpec {
    match &cfg.model.layer {
        SeqLayerConfig::Myo(m) => m.tree.clone(),
        other => panic!("not Myo: {other:?}"),
    }
}

fn s5(cfg: &RunConfig) -> &S5Config {
    match &cfg.model.layer {
        SeqLayerConfig::S5(s) => s,
        other => panic!("not S5: {other:?}"),
    }
}

#[test]
fn no_flags_is_s5_on_generated_listops() {
    let cfg = ok(&[]);
    assert_eq!(cfg, RunArgs::default().resolve().unwrap());
    assert_eq!(cfg.task.name, "listops");
    assert!(matches!(cfg.data, DataSource::Generated(_)));
    // The generator's sequences are at most 64 tokens: the task says so.
    assert_eq!(cfg.task.input, Input::Listops { max_len: 64 });
    assert_eq!(
        cfg.model.encoder,
        EncoderConfig::Embedding {
            vocab: myosotis::data::listops::VOCAB
        }
    );
    assert!(s5(&cfg).bidirectional);
    assert_eq!(
        (cfg.model.d_model, s5(&cfg).state, cfg.model.layers),
        (64, 32, 2)
    );
    assert_eq!(cfg.model.pooling, Pooling::Mean);
}

#[test]
fn myo_trees_follow_the_task() {
    let myo = |task: &str| ok(&["--task", task, "--data-dir", "d", "--model", "myo"]);
    assert_eq!(
        myo_tree(&myo("pathx")),
        TreeSpec::Ragged {
            leaves: 128 * 128,
            arity: 2
        }
    );
    assert_eq!(
        myo_tree(&myo("pathfinder")),
        TreeSpec::Ragged {
            leaves: 1024,
            arity: 4
        }
    );
    assert_eq!(
        myo_tree(&myo("zmnist")),
        TreeSpec::Quad {
            height: 28,
            width: 28
        }
    );
    assert_eq!(
        myo_tree(&myo("zcifar")),
        TreeSpec::Quad {
            height: 32,
            width: 32
        }
    );
    assert_eq!(
        myo_tree(&myo("smnist")),
        TreeSpec::Ragged {
            leaves: 784,
            arity: 4
        }
    );
    assert_eq!(
        myo_tree(&myo("listops")),
        TreeSpec::Ragged {
            leaves: 2048,
            arity: 2
        }
    );
    assert_eq!(myo("zmnist").model.pooling, Pooling::Root);
    // The heads' coupling range: wider on raster-ordered MNIST, the layer's default elsewhere.
    let range = |cfg: &RunConfig| match &cfg.model.layer {
        SeqLayerConfig::Myo(m) => m.coupling_init,
        other => panic!("{other:?}"),
    };
    assert_eq!(range(&myo("smnist")), [0.3, 30.0]);
    assert_eq!(range(&myo("zmnist")), [0.1, 10.0]);
    assert_eq!(range(&myo("listops")), [0.1, 10.0]);
    // The blocks run over every tree node (the paper's layer) unless --all-nodes false.
    let all_nodes = |extra: &[&str]| {
        let mut flags = vec!["--task", "smnist", "--data-dir", "d", "--model", "myo"];
        flags.extend(extra);
        match &ok(&flags).model.layer {
            SeqLayerConfig::Myo(m) => m.all_nodes,
            other => panic!("{other:?}"),
        }
    };
    assert!(all_nodes(&[]));
    assert!(all_nodes(&["--all-nodes"]));
    assert!(all_nodes(&["--all-nodes", "true"]));
    assert!(!all_nodes(&["--all-nodes", "false"]));
    assert!(
        err(&["--model", "myo", "--tree", "chain", "--all-nodes", "false"])
            .contains("--all-nodes false: a chain has one leaf")
    );
    // --tree overrides the task's.
    let with_tree = |task: &str, tree: &str| {
        myo_tree(&ok(&[
            "--task",
            task,
            "--data-dir",
            "d",
            "--model",
            "myo",
            "--tree",
            tree,
        ]))
    };
    assert_eq!(with_tree("zmnist", "chain"), TreeSpec::Chain { len: 784 });
    assert_eq!(
        with_tree("smnist", "2-ary"),
        TreeSpec::Ragged {
            leaves: 784,
            arity: 2
        }
    );
    assert!(err(&["--model", "myo", "--tree", "quad"]).contains("quad tree needs an image"));
    assert_eq!(
        with_tree("smnist", "4,7,4,7"),
        TreeSpec::Levels {
            leaves: 784,
            arities: vec![4, 7, 4, 7]
        }
    );
    for bad in ["1-ary", "4,1", "4,", "4,x"] {
        assert!(
            err(&["--model", "myo", "--tree", bad]).contains("K-ary or K1,K2,… with every K ≥ 2"),
            "{bad}"
        );
    }
}

#[test]
fn smnist_and_psmnist_are_causal_the_others_bidirectional() {
    for (task, causal) in [
        ("smnist", true),
        ("psmnist", true),
        ("zmnist", false),
        ("scifar", false),
        ("lra-image", false),
        ("pathfinder", false),
    ] {
        let cfg = ok(&["--task", task, "--data-dir", "d"]);
        assert_eq!(s5(&cfg).bidirectional, !causal, "{task}");
    }
    let flag = ok(&[
        "--task",
        "smnist",
        "--data-dir",
        "d",
        "--bidirectional",
        "true",
    ]);
    assert!(s5(&flag).bidirectional);
}

#[test]
fn encoders_and_classes_follow_the_task() {
    for (task, features, classes) in [
        ("smnist", 1, 10),
        ("scifar", 3, 10),
        ("lra-image", 1, 10),
        ("pathx", 1, 2),
    ] {
        let cfg = ok(&["--task", task, "--data-dir", "d"]);
        assert_eq!(
            cfg.model.encoder,
            EncoderConfig::Linear { features },
            "{task}"
        );
        assert_eq!(cfg.model.classes, classes, "{task}");
    }
}

#[test]
fn flags_override_the_preset_which_overrides_the_defaults() {
    let cfg = ok(&[
        "--task",
        "smnist",
        "--data-dir",
        "d",
        "--preset",
        "smnist",
        "--d-model",
        "32",
    ]);
    assert_eq!(cfg.model.d_model, 32);
    assert_eq!(s5(&cfg).state, 128);
    assert_eq!(cfg.model.layers, 4);
    assert_eq!(cfg.model.norm, NormKind::Batch);
    assert_eq!(cfg.warmup_epochs, Some(1));
    let psmnist = ok(&[
        "--task",
        "psmnist",
        "--data-dir",
        "d",
        "--preset",
        "psmnist",
    ]);
    assert!(!psmnist.model.prenorm);
    let steps = ok(&["--preset", "listops", "--warmup-steps", "7"]);
    assert_eq!((steps.warmup_epochs, steps.optim.warmup_steps), (None, 7));
    assert_eq!(s5(&steps).c_init, CInit::LecunNormal);
}

/// The reference's scripts: the pendulum's half GLU 2, step range from 0.01 and Flax's dense
/// initialisation, Text's and Retrieval's Δ in the regular group (`dt_global`), Text without
/// warm-up; flags override them.
#[test]
fn the_text_and_pendulum_presets_follow_the_reference_scripts() {
    let pendulum = ok(&["--preset", "pendulum", "--data-dir", "d"]);
    assert_eq!(pendulum.model.activation, Activation::HalfGlu2);
    assert_eq!((s5(&pendulum).dt_min, s5(&pendulum).dt_max), (0.01, 0.1));
    assert!(!s5(&pendulum).dt_global);
    assert_eq!(pendulum.model.decoder, Decoder::Gaussian);
    assert_eq!(pendulum.model.dense_init, DenseInit::Lecun);
    let uniform = ok(&[
        "--preset",
        "pendulum",
        "--data-dir",
        "d",
        "--dense-init",
        "uniform",
    ]);
    assert_eq!(uniform.model.dense_init, DenseInit::Uniform);
    let text = ok(&["--preset", "text", "--data-dir", "d"]);
    assert_eq!(text.model.dense_init, DenseInit::Uniform);
    assert_eq!(
        (text.model.d_model, s5(&text).state, s5(&text).blocks),
        (256, 192, 12)
    );
    assert!(s5(&text).dt_global && s5(&text).bidirectional);
    assert_eq!(text.warmup_epochs, Some(0));
    assert_eq!(s5(&text).dt_min, 0.001);
    let retrieval = ok(&["--preset", "retrieval", "--data-dir", "d"]);
    assert!(s5(&retrieval).dt_global && retrieval.model.pairs);
    assert_eq!((retrieval.batch_size, retrieval.epochs), (32, 20));
    let flags = ok(&[
        "--preset",
        "retrieval",
        "--data-dir",
        "d",
        "--dt-global",
        "false",
        "--dt-min",
        "0.002",
        "--dt-max",
        "0.2",
    ]);
    assert!(!s5(&flags).dt_global);
    assert_eq!((s5(&flags).dt_min, s5(&flags).dt_max), (0.002, 0.2));
    // B̃ and C̃'s groups follow each script's opt_config.
    for (preset, groups) in [
        ("listops", S5Groups::BFastAndCDecay),
        ("scifar", S5Groups::BFastAndCDecay),
        ("pathx", S5Groups::BAndCDecay),
        ("speech", S5Groups::NoBcDecay),
        ("pathfinder", S5Groups::Standard),
        ("text", S5Groups::Standard),
    ] {
        let cfg = ok(&["--preset", preset, "--data-dir", "d"]);
        assert_eq!(s5(&cfg).groups, groups, "{preset}");
    }
    let flag = ok(&[
        "--preset",
        "speech",
        "--data-dir",
        "d",
        "--s5-groups",
        "standard",
    ]);
    assert_eq!(s5(&flag).groups, S5Groups::Standard);
    let e = err(&["--dt-min", "0.5"]);
    assert!(e.contains("--dt-min 0.5, --dt-max 0.1"), "{e}");
    let e = err(&["--model", "myo", "--dt-global", "true"]);
    assert!(e.contains("--dt-global applies to --model s5"), "{e}");
}

#[test]
fn layer_options_reach_the_layers() {
    let bilinear = ok(&["--discretization", "bilinear", "--c-init", "complex_normal"]);
    assert_eq!(s5(&bilinear).discretization, Discretization::Bilinear);
    assert_eq!(s5(&bilinear).c_init, CInit::ComplexNormal);
    let cfg = ok(&[
        "--task",
        "scifar",
        "--data-dir",
        "d",
        "--model",
        "ssm2d",
        "--state-size",
        "6",
    ]);
    match &cfg.model.layer {
        SeqLayerConfig::Ssm2d(s) => {
            assert_eq!((s.height, s.width, s.state, s.directions), (32, 32, 6, 4))
        }
        other => panic!("{other:?}"),
    }
    let myo = ok(&[
        "--model",
        "myo",
        "--coupling",
        "hermitian",
        "--coupling-init",
        "0.5:2",
        "--heads",
        "3",
        "--pooling",
        "top:2",
        "--activation",
        "gelu",
    ]);
    match &myo.model.layer {
        SeqLayerConfig::Myo(m) => {
            assert_eq!(
                (m.coupling, m.coupling_init, m.heads),
                (Coupling::Hermitian, [0.5, 2.0], 3)
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(myo.model.pooling, Pooling::TopLevels { k: 2 });
    assert_eq!(myo.model.activation, Activation::Gelu);
}

/// `--accumulate N` takes N batches per optimiser step in training, one in evaluation.
#[test]
fn accumulation_makes_steps_of_several_batches() {
    let cfg = ok(&["--accumulate", "3", "--batch-size", "8"]);
    assert_eq!(cfg.accumulate, 3);
    assert_eq!(cfg.batching(2, true).step_size(), 24);
    assert_eq!(cfg.batching(2, false).step_size(), 8);
    assert_eq!(ok(&[]).batching(1, true).step_size(), 32);
}

/// A config whose model does not read its task (a hand-edited file, say) is refused in the
/// terms of the flags, not of the code's types.
#[test]
fn a_model_of_another_task_is_described_in_words() {
    let mut cfg = ok(&["--model", "myo", "--task", "zmnist", "--data-dir", "d"]);
    cfg.task = ok(&["--task", "smnist", "--data-dir", "d"]).task;
    let e = format!("{:#}", cfg.check_model().unwrap_err());
    assert_eq!(
        e,
        "the model's tree, a quad tree of 28×28 pixels, is not task smnist's (4-ary tree of \
         784 leaves)"
    );
    let mut cfg = ok(&[]);
    cfg.task = ok(&["--task", "smnist", "--data-dir", "d"]).task;
    let e = format!("{:#}", cfg.check_model().unwrap_err());
    assert!(
        e.starts_with("the model's encoder reads tokens of a "),
        "{e}"
    );
    assert!(
        e.ends_with(", not task smnist's inputs (1 feature per step)"),
        "{e}"
    );
}

#[test]
fn bad_flags_are_errors_that_name_the_flag() {
    for (flags, says) in [
        (
            &["--task", "mnist"][..],
            "--task mnist: expected one of listops, smnist",
        ),
        (&["--task", "smnist"][..], "--task smnist needs --data-dir"),
        (
            &["--task", "pathx", "--hub"][..],
            "--hub serves the MNIST and CIFAR-10 tasks",
        ),
        (
            &["--task", "zmnist", "--data-dir", "d", "--model", "ssm2d"][..],
            "raster order",
        ),
        (
            &["--preset", "mnist"][..],
            "--preset mnist: expected one of",
        ),
        (&["--layers", "0"][..], "--layers must be at least 1"),
        (
            &["--accumulate", "0"][..],
            "--accumulate 0: expected at least 1",
        ),
        (
            &["--model", "myo", "--heads", "0"][..],
            "--heads must be at least 1",
        ),
        (
            &["--model", "myo", "--block-size", "0"][..],
            "--block-size must be at least 1",
        ),
        (&["--blocks", "3"][..], "--blocks 3: the state size 32"),
        (
            &["--max-train-samples", "0"][..],
            "--max-train-samples must be at least 1",
        ),
        (
            &[
                "--task",
                "smnist",
                "--data-dir",
                "d",
                "--model",
                "ssm2d",
                "--directions",
                "3",
            ][..],
            "--directions 3: expected 1, 2 or 4",
        ),
        (&["--dropout", "1"][..], "--dropout 1"),
        (
            &["--bn-momentum", "1.5", "--norm", "batch"][..],
            "--bn-momentum 1.5",
        ),
        (
            &["--model", "myo", "--coupling-init", "2:1"][..],
            "--coupling-init 2:1",
        ),
        (&["--model", "rnn"][..], "'rnn'"),
        (&["--norm", "group"][..], "'group'"),
        (&["--pooling", "top:0"][..], "top:K with K ≥ 1"),
        (&["--data-dir", "d", "--hub"][..], "cannot be used with"),
    ] {
        let e = err(flags);
        assert!(e.contains(says), "{flags:?}: {e}");
    }
}

/// A flag the chosen model would ignore is refused with the models it is for, and a preset is
/// its task's: it implies the task, and another task's preset is refused.
#[test]
fn flags_that_would_be_ignored_are_refused() {
    for (flags, says) in [
        (
            &["--model", "s5", "--heads", "7"][..],
            "--heads applies to --model myo, not s5",
        ),
        (&["--tree", "3-ary"][..], "--tree applies to --model myo"),
        (&["--coupling", "free"][..], "--coupling applies to --model myo"),
        (&["--per-level"][..], "--per-level applies to --model myo"),
        (
            &["--model", "myo", "--blocks", "2"][..],
            "--blocks applies to --model s5, not myo",
        ),
        (
            &["--model", "mingru", "--bidirectional", "true"][..],
            "--bidirectional applies to --model s5, not mingru",
        ),
        (
            &["--model", "mingru", "--state-size", "8"][..],
            "--state-size applies to --model s5 or myo or ssm2d, not mingru",
        ),
        (&["--directions", "2"][..], "--directions applies to --model ssm2d"),
        (&["--pooling", "root"][..], "--pooling root or top:K applies to --model myo"),
        (
            &["--bn-momentum", "0.9"][..],
            "--bn-momentum applies to --norm batch",
        ),
        (
            &["--task", "zmnist", "--data-dir", "d", "--preset", "smnist"][..],
            "--preset smnist holds task smnist's settings, not --task zmnist's (use --preset zmnist)",
        ),
    ] {
        let e = err(flags);
        assert!(e.contains(says), "{flags:?}: {e}");
    }
    // The preset's task, and what it needs (its files).
    let e = err(&["--preset", "smnist"]);
    assert!(e.contains("--task smnist needs --data-dir"), "{e}");
    let cfg = ok(&["--preset", "zmnist", "--data-dir", "d", "--model", "myo"]);
    assert_eq!(cfg.task.name, "zmnist");
    // BatchNorm's decay is taken where the norm is BatchNorm, from the flag or a preset.
    let bn = ok(&["--preset", "listops", "--bn-momentum", "0.8"]);
    assert_eq!(bn.model.bn_momentum, 0.8);
}

#[test]
fn every_registered_task_resolves_and_has_a_preset() {
    for t in task::registry() {
        let cfg = ok(&["--task", &t.name, "--data-dir", "d", "--preset", &t.name]);
        assert_eq!(cfg.task, t);
        assert!(t.max_len() > 0 && t.classes >= 2, "{}", t.name);
    }
}

/// Hyper-parameters that would train into divergence (or not at all) are refused before
/// training, with the flag named; a warm-up of 0 steps and a decay of 0 are valid.
#[test]
fn non_positive_rates_and_clipping_norms_are_refused() {
    for (flags, says) in [
        (
            &["--lr=-1"][..],
            "--lr -1: expected a positive learning rate",
        ),
        (&["--lr", "0"], "--lr 0"),
        (&["--lr", "NaN"], "--lr NaN"),
        (&["--ssm-lr", "0"], "--ssm-lr 0"),
        (&["--ssm-lr", "inf"], "--ssm-lr inf"),
        (&["--weight-decay=-0.1"], "--weight-decay -0.1"),
        (
            &["--clip", "0"],
            "--clip 0: expected a positive gradient norm",
        ),
        (&["--clip=-2"], "--clip -2"),
    ] {
        let e = err(flags);
        assert!(e.contains(says), "{flags:?}: {e}");
    }
    let cfg = ok(&["--warmup-steps", "0", "--weight-decay", "0", "--clip", "1"]);
    assert_eq!(
        (
            cfg.optim.warmup_steps,
            cfg.optim.weight_decay,
            cfg.optim.clip
        ),
        (0, 0.0, Some(1.0))
    );
}

/// `--device cuda` under several ranks: each rank of a machine takes its own GPU when it sees
/// them all, the one it sees when bound to one, and more ranks than GPUs is an error that says
/// what to do.
#[test]
fn cuda_ranks_take_the_gpus_they_see() {
    use myosotis::device::rank_ordinal;
    assert_eq!(rank_ordinal(0, 4).unwrap(), 0);
    assert_eq!(rank_ordinal(3, 4).unwrap(), 3);
    for rank in [0, 1, 7] {
        assert_eq!(rank_ordinal(rank, 1).unwrap(), 0, "bound to one GPU");
    }
    let e = rank_ordinal(2, 2).unwrap_err().to_string();
    assert!(e.contains("rank 2 has no GPU of its own (2 visible"), "{e}");
    assert!(rank_ordinal(0, 0)
        .unwrap_err()
        .to_string()
        .contains("no CUDA device"));
}
