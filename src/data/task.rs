//! The tasks `myo train --task NAME` knows, one [`Task`] entry each in [`registry`]: where the
//! examples come from, how they become sequences (length, features, normalisation, pixel
//! order), the classes and splits, and what the task implies for the models (Myo's tree, S5's
//! direction). A run's config holds its whole `Task`, so a checkpoint rebuilds its data
//! pipeline from the file alone, and a task defined outside the registry runs the same way.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::dataset::Dataset;
use super::listops::{self, ListOpsConfig};
use super::text;
use crate::nn::{EncoderConfig, TreeSpec};

/// The longest sequence a task may have (2^20 steps, 64 times LRA's longest, Path-X's 16,384
/// pixels): it sizes Myo's tree and the padding before any data is read.
pub const MAX_LEN: usize = 1 << 20;

/// One task: a labelled sequence-classification problem, or a regression at every step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// The name `--task` takes.
    pub name: String,
    pub input: Input,
    /// Classes, or for a regression the outputs at every step.
    pub classes: usize,
    /// Myo's tree over the sequence.
    pub tree: TreeShape,
    /// S5 scans one way (causal) unless told otherwise; bidirectional when false.
    pub causal: bool,
    /// Myo's initial range of the heads' |B| when the task wants another than the layer's
    /// default (`--coupling-init`).
    #[serde(default)]
    pub coupling_init: Option<[f64; 2]>,
}

/// What the examples are and how they become sequences.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Input {
    /// ListOps expressions as tokens of [`listops::VOCAB`], at most `max_len` with EOS.
    Listops { max_len: usize },
    /// Images as pixel sequences.
    Pixels(Pixels),
    /// Documents as byte tokens of [`text::VOCAB`], at most `max_len` with EOS (LRA's Text:
    /// [`super::text`]).
    Text { max_len: usize },
    /// Pairs of such documents, each encoded apart (LRA's Retrieval).
    TextPairs { max_len: usize },
    /// Raw audio of `len` samples (Speech Commands: [`super::speech`]).
    Audio { len: usize },
    /// Irregularly sampled series of grey frames with real targets at every frame: the pendulum
    /// benchmark's `pend_regression.npz` ([`super::pendulum`]).
    Frames(Frames),
}

/// A frame-series task's frames.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frames {
    /// Frames are `side` × `side`.
    pub side: usize,
    /// Frames kept per sequence, drawn without replacement and kept in time order.
    pub keep: usize,
    /// Seeds the draw of the kept frames.
    pub seed: u64,
}

/// An image task's pixels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pixels {
    pub files: ImageFiles,
    /// Images are `side` × `side`.
    pub side: usize,
    /// Convert RGB to one grey value (ITU-R 601 luma, as LRA's image task).
    pub grey: bool,
    /// Per-feature normalisation of values in [0, 1]: (x − mean) / std.
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
    pub order: Order,
    pub split: Split,
}

/// The file formats of the image datasets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageFiles {
    /// MNIST IDX (`train-images-idx3-ubyte`, optionally gzipped, …).
    Mnist,
    /// CIFAR-10 binary batches (`data_batch_1.bin`, …, `test_batch.bin`).
    Cifar10,
    /// An LRA Pathfinder folder (`metadata/*.npy` and `imgs/`) of `side` × `side` images.
    Pathfinder,
}

impl ImageFiles {
    /// Values per pixel in the files.
    pub fn channels(self) -> usize {
        match self {
            ImageFiles::Cifar10 => 3,
            ImageFiles::Mnist | ImageFiles::Pathfinder => 1,
        }
    }
}

/// The order of the pixels in the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Order {
    /// Row by row.
    Raster,
    /// Morton (Z) order: the leaves of the image's quad tree, left to right.
    Morton,
    /// A fixed random permutation drawn with `seed`.
    Permuted { seed: u64 },
}

/// How the examples are split into training, validation and test sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Split {
    /// Test: the test files; validation: a tenth of the training files drawn with `seed`
    /// (S5's choice); training: the rest.
    HoldOut { seed: u64 },
    /// One set of examples, shuffled with `seed` and cut 80 / 10 / 10 into training,
    /// validation and test (S5's Pathfinder split; the permutation is ours, not torch's).
    Shuffle { seed: u64 },
}

/// The tree a Myo layer puts over the task's sequences.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TreeShape {
    /// The quad tree of the image (its leaves in Morton order).
    Quad,
    /// A k-ary tree over the sequence, ragged when the length is not a power of k.
    Ragged { arity: usize },
    /// Level k of the tree grouped by `arities[k]`, the last repeated up to the root (e.g.
    /// 4,7,4,7 follows the rows of a 28 × 28 image in raster order).
    Levels { arities: Vec<usize> },
    /// A chain: Myo as a state-space model (Myosotis §3.4).
    Chain,
}

impl std::str::FromStr for TreeShape {
    type Err = String;

    /// `quad`, `chain`, `K-ary` (K ≥ 2) or arities per level `K1,K2,…` (each ≥ 2).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let expected = || format!("'{s}': expected quad, chain, K-ary or K1,K2,… with every K ≥ 2");
        Ok(match s {
            "quad" => TreeShape::Quad,
            "chain" => TreeShape::Chain,
            _ if s.contains(',') => {
                let arities = s
                    .split(',')
                    .map(|k| k.trim().parse().ok().filter(|&k: &usize| k >= 2))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(expected)?;
                TreeShape::Levels { arities }
            }
            _ => match s.strip_suffix("-ary").map(str::parse) {
                Some(Ok(arity)) if arity >= 2 => TreeShape::Ragged { arity },
                _ => return Err(expected()),
            },
        })
    }
}

/// Where a run's examples are read from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataSource {
    /// Files in a folder, in the task's format.
    Dir { dir: PathBuf },
    /// The Hugging Face Hub (MNIST and CIFAR-10; see [`crate::data::hub`]).
    Hub,
    /// ListOps from the built-in generator.
    Generated(Generated),
}

/// ListOps from the built-in generator: split sizes and generator settings (split k uses
/// `seed + k`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generated {
    pub train: usize,
    pub val: usize,
    pub test: usize,
    pub max_depth: usize,
    pub max_args: usize,
    pub min_length: usize,
    /// Tokens with EOS.
    pub max_length: usize,
    pub seed: u64,
}

impl Generated {
    /// The embedded default: short expressions, so that a CPU run takes minutes.
    pub fn quick(seed: u64) -> Generated {
        Generated {
            train: 4000,
            val: 500,
            test: 500,
            max_depth: 4,
            max_args: 5,
            min_length: 8,
            max_length: 64,
            seed,
        }
    }
}

/// Myo's tree over an image's pixels in `order`: the quad tree when they are in Morton order,
/// else a 4-ary tree over the sequence (Myosotis §5).
fn image_tree(order: Order) -> TreeShape {
    if order == Order::Morton {
        TreeShape::Quad
    } else {
        TreeShape::Ragged { arity: 4 }
    }
}

/// MNIST pixels in `order`.
fn mnist(name: &str, order: Order, causal: bool) -> Task {
    // In raster order Myo's 4-ary tree groups pixels of one row: heads that reach further
    // (|B| over 0.3 … 30 rather than 0.1 … 10) learned sMNIST better with both seeds tried
    // (docs/experiments.md, sMNIST), and zMNIST worse.
    let coupling_init = (order == Order::Raster).then_some([0.3, 30.0]);
    Task {
        name: name.into(),
        input: Input::Pixels(Pixels {
            files: ImageFiles::Mnist,
            side: 28,
            grey: false,
            mean: vec![0.1307],
            std: vec![0.3081],
            order,
            split: Split::HoldOut { seed: 42 },
        }),
        classes: 10,
        tree: image_tree(order),
        causal,
        coupling_init,
    }
}

/// CIFAR-10 RGB pixels (S5's normalisation) in `order`.
fn cifar(name: &str, order: Order) -> Task {
    Task {
        name: name.into(),
        input: Input::Pixels(Pixels {
            files: ImageFiles::Cifar10,
            side: 32,
            grey: false,
            mean: vec![0.4914, 0.4822, 0.4465],
            std: vec![0.247, 0.243, 0.261],
            order,
            split: Split::HoldOut { seed: 42 },
        }),
        classes: 10,
        tree: image_tree(order),
        causal: false,
        coupling_init: None,
    }
}

/// LRA Pathfinder images of `side` × `side`; Myo uses a tree of `arity`.
fn pathfinder(name: &str, side: usize, arity: usize) -> Task {
    Task {
        name: name.into(),
        input: Input::Pixels(Pixels {
            files: ImageFiles::Pathfinder,
            side,
            grey: false,
            mean: vec![0.5],
            std: vec![0.5],
            order: Order::Raster,
            split: Split::Shuffle { seed: 42 },
        }),
        classes: 2,
        tree: TreeShape::Ragged { arity },
        causal: false,
        coupling_init: None,
    }
}

/// Every built-in task. Myo's trees follow Myosotis §5: the quad tree for Morton-ordered
/// images, binary trees for Path-X and token sequences, 4-ary for the other images. S5 runs
/// sMNIST and psMNIST causally (S5 Appendix G.2.2), the others bidirectionally.
pub fn registry() -> Vec<Task> {
    vec![
        Task {
            name: "listops".into(),
            input: Input::Listops { max_len: 2048 },
            classes: 10,
            tree: TreeShape::Ragged { arity: 2 },
            causal: false,
            coupling_init: None,
        },
        mnist("smnist", Order::Raster, true),
        mnist("psmnist", Order::Permuted { seed: 92 }, true),
        mnist("zmnist", Order::Morton, false),
        cifar("scifar", Order::Raster),
        cifar("zcifar", Order::Morton),
        Task {
            name: "lra-image".into(),
            input: Input::Pixels(Pixels {
                files: ImageFiles::Cifar10,
                side: 32,
                grey: true,
                mean: vec![122.6 / 255.0],
                std: vec![61.0 / 255.0],
                order: Order::Raster,
                split: Split::HoldOut { seed: 42 },
            }),
            classes: 10,
            tree: TreeShape::Ragged { arity: 4 },
            causal: false,
            coupling_init: None,
        },
        pathfinder("pathfinder", 32, 4),
        pathfinder("pathx", 128, 2),
        // LRA's byte-level documents: binary trees, as ListOps (Myosotis §5).
        Task {
            name: "text".into(),
            input: Input::Text { max_len: 4096 },
            classes: 2,
            tree: TreeShape::Ragged { arity: 2 },
            causal: false,
            coupling_init: None,
        },
        Task {
            name: "retrieval".into(),
            input: Input::TextPairs { max_len: 4000 },
            classes: 2,
            tree: TreeShape::Ragged { arity: 2 },
            causal: false,
            coupling_init: None,
        },
        // S5 §6.2: bidirectional, as for LRA.
        Task {
            name: "speech".into(),
            input: Input::Audio {
                len: super::speech::LEN,
            },
            classes: super::speech::WORDS.len(),
            tree: TreeShape::Ragged { arity: 2 },
            causal: false,
            coupling_init: None,
        },
        // S5 §6.3: 50 of 100 frames, (sin, cos) of the angle at each, a causal model.
        Task {
            name: "pendulum".into(),
            input: Input::Frames(Frames {
                side: super::pendulum::SIDE,
                keep: 50,
                seed: 0,
            }),
            classes: 2,
            tree: TreeShape::Ragged { arity: 2 },
            causal: true,
            coupling_init: None,
        },
    ]
}

/// The registered task called `name`.
pub fn find(name: &str) -> Result<Task> {
    let all = registry();
    let names: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
    let names = names.join(", ");
    all.into_iter()
        .find(|t| t.name == name)
        .with_context(|| format!("--task {name}: expected one of {names}"))
}

impl Task {
    /// The image pixels, for image tasks.
    pub fn pixels(&self) -> Option<&Pixels> {
        match &self.input {
            Input::Pixels(p) => Some(p),
            _ => None,
        }
    }

    /// Whether the task regresses values at every step (rather than classifying sequences).
    pub fn regression(&self) -> bool {
        matches!(self.input, Input::Frames(_))
    }

    /// Whether each example is a pair of sequences (the model's [`ClassifierConfig::pairs`](crate::nn::ClassifierConfig)).
    pub fn pairs(&self) -> bool {
        matches!(self.input, Input::TextPairs { .. })
    }

    /// The longest sequence (for images, the number of pixels): the padding of Myo's trees.
    pub fn max_len(&self) -> usize {
        match &self.input {
            Input::Listops { max_len } | Input::Text { max_len } | Input::TextPairs { max_len } => {
                *max_len
            }
            Input::Pixels(p) => p.side.saturating_mul(p.side),
            Input::Frames(f) => f.keep,
            Input::Audio { len } => *len,
        }
    }

    /// How the model reads the inputs.
    pub fn encoder(&self) -> EncoderConfig {
        match &self.input {
            Input::Listops { .. } => EncoderConfig::Embedding {
                vocab: listops::VOCAB,
            },
            Input::Text { .. } | Input::TextPairs { .. } => {
                EncoderConfig::Embedding { vocab: text::VOCAB }
            }
            Input::Pixels(p) => EncoderConfig::Linear {
                features: p.features(),
            },
            Input::Frames(f) => EncoderConfig::Frames { side: f.side },
            Input::Audio { .. } => EncoderConfig::Linear { features: 1 },
        }
    }

    /// Myo's tree for the task's sequences.
    pub fn tree_spec(&self) -> Result<TreeSpec> {
        let len = self.max_len();
        Ok(match (&self.tree, self.pixels()) {
            (TreeShape::Quad, Some(p)) => TreeSpec::Quad {
                height: p.side,
                width: p.side,
            },
            (TreeShape::Quad, None) => {
                bail!("task {}: a quad tree needs an image task", self.name)
            }
            (&TreeShape::Ragged { arity }, _) => TreeSpec::Ragged { leaves: len, arity },
            (TreeShape::Levels { arities }, _) => TreeSpec::Levels {
                leaves: len,
                arities: arities.clone(),
            },
            (TreeShape::Chain, _) => TreeSpec::Chain { len },
        })
    }

    /// The dataset `--hub` serves for this task, if any.
    pub fn hub_dataset(&self) -> Option<super::hub::HubDataset> {
        use super::hub::HubDataset;
        match self.pixels()?.files {
            ImageFiles::Mnist => Some(HubDataset::Mnist),
            ImageFiles::Cifar10 => Some(HubDataset::Cifar10),
            ImageFiles::Pathfinder => None,
        }
    }

    /// The training, validation and test splits, read from `data`.
    pub fn load(&self, data: &DataSource) -> Result<[Dataset; 3]> {
        match (&self.input, data) {
            (Input::Listops { .. }, DataSource::Generated(g)) => generate_listops(g),
            (Input::Listops { .. }, DataSource::Dir { dir }) => {
                let read = |s: &str| {
                    listops::read_tsv(&dir.join(format!("basic_{s}.tsv"))).map(listops_set)
                };
                Ok([read("train")?, read("val")?, read("test")?])
            }
            (Input::Listops { .. }, DataSource::Hub) => {
                bail!("--hub serves MNIST and CIFAR-10; ListOps reads --data-dir or the built-in generator")
            }
            (Input::Pixels(_), DataSource::Generated(_)) => {
                bail!("task {}: the generator makes ListOps only", self.name)
            }
            (Input::Pixels(p), DataSource::Dir { dir }) => p.load(dir),
            (Input::Frames(f), DataSource::Dir { dir }) => {
                super::pendulum::load(dir, f.keep, f.seed)
            }
            (Input::Audio { .. }, DataSource::Dir { dir }) => super::speech::load(dir),
            (&Input::Text { max_len }, DataSource::Dir { dir }) => text::load_imdb(dir, max_len),
            (&Input::TextPairs { max_len }, DataSource::Dir { dir }) => {
                text::load_aan(dir, max_len)
            }
            (Input::Text { .. }, _) => bail!(
                "task {} reads the IMDB folder (aclImdb) from --data-dir",
                self.name
            ),
            (Input::TextPairs { .. }, _) => bail!(
                "task {} reads the LRA release's {} from --data-dir",
                self.name,
                text::AAN_FILES.join(", ")
            ),
            (Input::Audio { .. }, _) => bail!(
                "task {} reads the Speech Commands folder from --data-dir",
                self.name
            ),
            (Input::Frames(_), _) => bail!(
                "task {} reads {} from --data-dir (write one with `myo data pendulum`)",
                self.name,
                super::pendulum::FILE
            ),
            (Input::Pixels(p), DataSource::Hub) => {
                let Some(dataset) = self.hub_dataset() else {
                    bail!(
                        "--hub serves MNIST and CIFAR-10 only; {} needs --data-dir (the LRA release)",
                        self.name
                    );
                };
                let (train, test) = super::hub::Hub::from_env().load(dataset)?;
                p.split_pair(&train, &test, Path::new("the Hub's cache"))
            }
        }
    }
    /// The test split alone, read from `data`: where the test examples come in files of their
    /// own (ListOps' `basic_test.tsv`, MNIST's `t10k` files, CIFAR-10's `test_batch.bin`) only
    /// those are read, so they suffice; otherwise the whole dataset is read and split.
    pub fn load_test(&self, data: &DataSource) -> Result<Dataset> {
        match (&self.input, data) {
            (Input::Listops { .. }, DataSource::Generated(g)) => generate_listops_split(g, 2),
            (Input::Listops { .. }, DataSource::Dir { dir }) => {
                listops::read_tsv(&dir.join("basic_test.tsv")).map(listops_set)
            }
            (Input::Pixels(p), DataSource::Dir { dir }) => p.load_test(dir),
            (Input::Frames(f), DataSource::Dir { dir }) => {
                super::pendulum::load_test(dir, f.keep, f.seed)
            }
            (&Input::Text { max_len }, DataSource::Dir { dir }) => {
                text::load_imdb_test(dir, max_len)
            }
            (&Input::TextPairs { max_len }, DataSource::Dir { dir }) => {
                text::read_aan(&dir.join(text::AAN_FILES[2]), max_len)
            }
            _ => {
                let [_, _, test] = self.load(data)?;
                Ok(test)
            }
        }
    }
}

fn listops_set(examples: Vec<listops::Example>) -> Dataset {
    Dataset::Tokens {
        seqs: examples
            .iter()
            .map(|e| listops::tokenize(&e.source))
            .collect(),
        labels: examples.iter().map(|e| e.label as u32).collect(),
    }
}

fn generate_listops(g: &Generated) -> Result<[Dataset; 3]> {
    Ok([
        generate_listops_split(g, 0)?,
        generate_listops_split(g, 1)?,
        generate_listops_split(g, 2)?,
    ])
}

/// Split `k` (0 training, 1 validation, 2 test) of the generated ListOps, each from its own seed.
fn generate_listops_split(g: &Generated, k: usize) -> Result<Dataset> {
    let n = [g.train, g.val, g.test][k];
    // max_length counts tokens with EOS, so expressions stay one shorter.
    let cfg = ListOpsConfig {
        max_depth: g.max_depth,
        max_args: g.max_args,
        min_length: g.min_length,
        max_length: g.max_length - 1,
        seed: g.seed + k as u64,
    };
    let examples = listops::generate(&cfg, n)?
        .iter()
        .map(|e| listops::Example {
            source: e.to_lra_string(),
            label: e.value(),
        })
        .collect();
    Ok(listops_set(examples))
}
