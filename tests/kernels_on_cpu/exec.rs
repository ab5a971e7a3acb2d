//! Executes a [`LaunchPlan`] with the host harness, as `myosotis::cuda::launch` does on a GPU:
//! every buffer the plan names is allocated here, between canaries. Outputs and the workspace
//! start as 0xff bytes (NaN in every float format), so an element the kernel does not write, or
//! reads before writing, shows up; inputs and tables must come back unchanged and every
//! canary intact.

use std::ffi::c_void;

use candle_core::DType;
use half::{bf16, f16};
use kernels_on_cpu::{launch, Arg, Launch, Order};
use myosotis::ops::dropout::absorb;
use myosotis::ops::epilogue::{Dropout, KeyWord};
use myosotis::ops::plan::{pack_struct, KernelArg, LaunchPlan};

/// Bytes of canary on each side of a buffer (a multiple of the 16-byte alignment).
const CANARY: usize = 64;
const POISON: u8 = 0xff;

/// A buffer with canaries around it, 16-byte aligned.
struct Guarded {
    words: Vec<u128>,
    len: usize,
}

impl Guarded {
    fn filled(len: usize, fill: u8) -> Self {
        let words = vec![u128::from_ne_bytes([POISON; 16]); (2 * CANARY + len).div_ceil(16)];
        let mut g = Guarded { words, len };
        g.data_mut().fill(fill);
        g
    }
    fn with(data: &[u8]) -> Self {
        let mut g = Self::filled(data.len(), 0);
        g.data_mut().copy_from_slice(data);
        g
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: plain bytes of the words.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.words.len() * 16) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe {
            std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.words.len() * 16)
        }
    }
    fn data(&self) -> &[u8] {
        &self.bytes()[CANARY..CANARY + self.len]
    }
    fn data_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.bytes_mut()[CANARY..CANARY + len]
    }
    fn ptr(&mut self) -> *mut c_void {
        self.data_mut().as_mut_ptr().cast()
    }
    fn canaries_intact(&self) -> bool {
        let b = self.bytes();
        b[..CANARY]
            .iter()
            .chain(&b[CANARY + self.len..])
            .all(|&x| x == POISON)
    }
}

/// `v` stored in `dtype` (rounded to nearest even).
pub fn to_bytes(v: &[f64], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F64 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f64(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f64(x).to_le_bytes())
            .collect(),
        dt => panic!("no kernels for {dt:?}"),
    }
}

pub fn from_bytes(b: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        dt => panic!("no kernels for {dt:?}"),
    }
}

/// `v` rounded to `dtype` and back.
pub fn round_to(v: &[f64], dtype: DType) -> Vec<f64> {
    from_bytes(&to_bytes(v, dtype), dtype)
}

/// What a launch produced: the outputs as f64 (then, for an in-place plan, the targets' final
/// values), and the status word.
#[derive(Debug, PartialEq)]
pub struct HostRun {
    pub outputs: Vec<Vec<f64>>,
    /// The same as stored (the bytes of the outputs, then of the targets): what a partial-sum
    /// output holds in another type than the plan's dtype (f32 partials of an f16 op) passes on
    /// to the next launch as these ([`run_bytes_in_every_order`]).
    pub raw: Vec<Vec<u8>>,
    pub status: i32,
    /// The status's second word: 1 + the head of a bad pivot (kernels with heads), else 0.
    pub status_head: i32,
}

thread_local! {
    /// What [`KernelArg::DropoutKey`] points to in this thread's launches.
    static KEY_WORD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Sets the device's key word of this thread's launches (`myosotis::cuda::set_dropout_key`).
pub fn set_key_word(key: u64) {
    KEY_WORD.set(key);
}

/// A dropout of rate `p` for case `k` of a test: keyed by the site hash `hash ^ k`, or with
/// `word`, by the key word (set here to the step key of seed hash `hash` and step 7 + k), from
/// which the kernels make the site hash of site 1 + k; its `site_hash`, what the host makes from
/// the same, keys the reference and the CPU twin.
pub fn test_dropout(word: bool, hash: u64, k: u64, first_row: u64, p: f64) -> Dropout {
    let (step, site) = (7 + k, 1 + k);
    let key_word = word.then(|| {
        set_key_word(absorb(hash, step));
        KeyWord { site }
    });
    Dropout {
        site_hash: match word {
            true => absorb(absorb(hash, step), site),
            false => hash ^ k,
        },
        first_row,
        p,
        key_word,
    }
}

/// Runs `plan` in `dtype` on `inputs` (converted to `dtype`) in thread order `order`.
pub fn run(
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[&[f64]],
    order: Order,
) -> Result<HostRun, String> {
    execute(plan, dtype, &[], &stored(inputs, dtype), order)
}

/// `inputs` as stored in `dtype`.
fn stored(inputs: &[&[f64]], dtype: DType) -> Vec<Vec<u8>> {
    inputs.iter().map(|v| to_bytes(v, dtype)).collect()
}

/// [`run`] for an in-place plan: `targets` (as stored) are what [`KernelArg::Target`]s point
/// to (the only buffers besides the outputs the kernel may change); their final values follow
/// the outputs.
fn execute(
    plan: &LaunchPlan,
    dtype: DType,
    targets: &[Vec<u8>],
    input_bytes: &[Vec<u8>],
    order: Order,
) -> Result<HostRun, String> {
    let esize = dtype.size_in_bytes();
    let mut targets: Vec<Guarded> = targets.iter().map(|t| Guarded::with(t)).collect();
    let mut ins: Vec<Guarded> = input_bytes.iter().map(|b| Guarded::with(b)).collect();
    let mut outs: Vec<Guarded> = plan
        .outputs
        .iter()
        .map(|&n| Guarded::filled(n * esize, POISON))
        .collect();
    let table_bytes: Vec<Vec<u8>> = plan
        .tables
        .iter()
        .map(|t| t.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut tables: Vec<Guarded> = table_bytes.iter().map(|b| Guarded::with(b)).collect();
    let mut workspace = Guarded::filled(plan.workspace_bytes, POISON);
    let mut status = Guarded::filled(8, 0);
    let mut key = Guarded::with(&KEY_WORD.get().to_le_bytes());
    let missing = |what: &str, i: usize| format!("{}: no {what} {i}", plan.kernel);
    // The structs passed by value, packed first: the argument list borrows them.
    let mut structs: Vec<Vec<u64>> = Vec::new();
    for a in &plan.args {
        let KernelArg::Struct(fields) = a else {
            continue;
        };
        let words = pack_struct(fields, |f| {
            let (what, i, ptr) = match f {
                KernelArg::Input(i) => ("input", *i, ins.get_mut(*i).map(Guarded::ptr)),
                KernelArg::Target(i) => ("target", *i, targets.get_mut(*i).map(Guarded::ptr)),
                other => {
                    let e = format!("{}: {other:?} in a struct", plan.kernel);
                    return Err(candle_core::Error::Msg(e));
                }
            };
            ptr.map(|p| p as u64)
                .ok_or_else(|| candle_core::Error::Msg(missing(what, i)))
        })
        .map_err(|e| e.to_string())?;
        structs.push(words);
    }
    let mut packed = structs.iter();
    let mut args = Vec::with_capacity(plan.args.len());
    for a in &plan.args {
        args.push(match a {
            KernelArg::Input(i) => {
                Arg::Ptr(ins.get_mut(*i).ok_or_else(|| missing("input", *i))?.ptr())
            }
            KernelArg::Target(i) => Arg::Ptr(
                targets
                    .get_mut(*i)
                    .ok_or_else(|| missing("target", *i))?
                    .ptr(),
            ),
            KernelArg::Output(i) => {
                Arg::Ptr(outs.get_mut(*i).ok_or_else(|| missing("output", *i))?.ptr())
            }
            KernelArg::Table(i) => Arg::Ptr(
                tables
                    .get_mut(*i)
                    .ok_or_else(|| missing("table", *i))?
                    .ptr(),
            ),
            KernelArg::Workspace => Arg::Ptr(workspace.ptr()),
            KernelArg::Null => Arg::Ptr(std::ptr::null_mut()),
            KernelArg::Status => Arg::Ptr(status.ptr()),
            KernelArg::DropoutKey => Arg::Ptr(key.ptr()),
            KernelArg::I32(v) => Arg::I32(*v),
            KernelArg::U64(v) => Arg::U64(*v),
            KernelArg::Struct(_) => Arg::Struct(packed.next().expect("packed above")),
        });
    }
    let l = Launch {
        kernel: &plan.kernel,
        grid: plan.grid,
        block: plan.block,
        shared_bytes: plan.shared_bytes,
    };
    // SAFETY: every pointer is a buffer sized as the plan says; what the kernel does with them
    // is what this test checks.
    unsafe { launch(&l, &args, order) }?;
    let named = |what: &str, bufs: &[Guarded]| -> Result<(), String> {
        match bufs.iter().position(|b| !b.canaries_intact()) {
            Some(i) => Err(format!("{}: wrote outside {what} {i}", plan.kernel)),
            None => Ok(()),
        }
    };
    named("input", &ins)?;
    named("output", &outs)?;
    named("table", &tables)?;
    named("the workspace", std::slice::from_ref(&workspace))?;
    named("the status word", std::slice::from_ref(&status))?;
    named("the key word", std::slice::from_ref(&key))?;
    if key.data() != KEY_WORD.get().to_le_bytes() {
        return Err(format!("{}: changed the key word", plan.kernel));
    }
    named("target", &targets)?;
    for (i, (g, b)) in ins.iter().zip(input_bytes).enumerate() {
        if g.data() != b.as_slice() {
            return Err(format!("{}: changed input {i}", plan.kernel));
        }
    }
    for (i, (g, b)) in tables.iter().zip(&table_bytes).enumerate() {
        if g.data() != b.as_slice() {
            return Err(format!("{}: changed table {i}", plan.kernel));
        }
    }
    Ok(HostRun {
        // Buffers of several dtypes (U8) are read from `raw` alone.
        outputs: match dtype {
            DType::U8 => vec![],
            _ => outs
                .iter()
                .chain(&targets)
                .map(|g| from_bytes(g.data(), dtype))
                .collect(),
        },
        raw: outs
            .iter()
            .chain(&targets)
            .map(|g| g.data().to_vec())
            .collect(),
        status: i32::from_le_bytes(status.data()[..4].try_into().unwrap()),
        status_head: i32::from_le_bytes(status.data()[4..].try_into().unwrap()),
    })
}

/// Runs `plan` with the threads of each block (and the blocks) in ascending, descending and a
/// shuffled order (from `seed`). The results must be the same bits in every order — a thread
/// that reads what another writes without a barrier between them, or a block what another
/// block writes, sees something else in one of the orders — and are returned once.
pub fn run_in_every_order(
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[&[f64]],
    seed: u64,
) -> HostRun {
    in_every_order(plan, dtype, &[], &stored(inputs, dtype), seed)
}

/// [`run_in_every_order`] on inputs given as stored (say [`HostRun::raw`] of a launch before).
pub fn run_bytes_in_every_order(
    plan: &LaunchPlan,
    dtype: DType,
    inputs: &[Vec<u8>],
    seed: u64,
) -> HostRun {
    in_every_order(plan, dtype, &[], inputs, seed)
}

/// [`run_in_every_order`] for an in-place plan: `targets` as in [`execute`], their final values
/// after the outputs; targets and inputs given as stored, each in its own dtype (f32
/// parameters and their f16 compute copy): read the results from [`HostRun::raw`].
pub fn run_in_place_bytes_in_every_order(
    plan: &LaunchPlan,
    targets: &[Vec<u8>],
    inputs: &[Vec<u8>],
    seed: u64,
) -> HostRun {
    in_every_order(plan, DType::U8, targets, inputs, seed)
}

fn in_every_order(
    plan: &LaunchPlan,
    dtype: DType,
    targets: &[Vec<u8>],
    inputs: &[Vec<u8>],
    seed: u64,
) -> HostRun {
    let go = |order| execute(plan, dtype, targets, inputs, order).unwrap_or_else(|e| panic!("{e}"));
    let first = go(Order::Ascending);
    for order in [Order::Descending, Order::Shuffled(seed)] {
        let other = go(order);
        let same = (first.status, first.status_head) == (other.status, other.status_head)
            && first.raw == other.raw;
        assert!(
            same,
            "{}: the result depends on the order in which threads and blocks run ({order:?} \
             differs from ascending): a missing __syncthreads(), or blocks that share memory",
            plan.kernel
        );
    }
    first
}
