//! Launch plans of the CUDA kernels in `kernels/`: everything one launch needs besides the
//! memory itself — kernel name, grid, block, dynamic shared memory, the argument list and the
//! sizes of what the launch allocates — computed by a pure function per op (`scan::cuda`,
//! `tree_solve::cuda`). The CUDA launch (`crate::cuda::launch`, feature `cuda`) executes a plan
//! on candle's device; the host harness in `tests/kernels_on_cpu` executes the same plan with
//! the kernels compiled as C++ on the CPU, so the tests exercise our launch arithmetic too.

use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use candle_core::{bail, DType, Result};

/// One kernel argument, in the kernel's parameter order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelArg {
    /// A pointer to the op's `i`-th input (read only; the order is the plan function's).
    Input(usize),
    /// A pointer to the `i`-th tensor an in-place op updates (read and written; passed to the
    /// launch apart from the inputs, which stay read only).
    Target(usize),
    /// A pointer to the `i`-th output: [`LaunchPlan::outputs`]`[i]` elements of the op's dtype,
    /// uninitialised before the launch (the kernel writes every element).
    Output(usize),
    /// A pointer to [`LaunchPlan::tables`]`[i]`, 32-bit integers copied to the device.
    Table(usize),
    /// A pointer to the global workspace of [`LaunchPlan::workspace_bytes`] bytes,
    /// uninitialised (the kernel writes before it reads).
    Workspace,
    /// A null pointer.
    Null,
    /// A pointer to two `int`s, zero before the launch: the kernel's error report (a kernel
    /// that finds a bad pivot writes 1 + its node to the first and, where it has heads,
    /// 1 + the head to the second).
    Status,
    /// A pointer to the device's key word, an `unsigned long long` written before a training
    /// step (`crate::cuda::set_dropout_key`: the dropout key of its seed and step): what a
    /// launch captured in a CUDA graph reads where an eager launch takes the key by value.
    DropoutKey,
    /// An `int` by value.
    I32(i32),
    /// An `unsigned long long` by value.
    U64(u64),
    /// A struct by value whose fields are these arguments in order (no nested struct), each
    /// at its C alignment: pointers and `unsigned long long`s 8 bytes, `int`s 4; the struct
    /// padded to 8 bytes ([`pack_struct`]). For argument lists that change every launch, such
    /// as the gradients' addresses, which a table in device memory would have to upload.
    Struct(Vec<KernelArg>),
}

/// The bytes of a [`KernelArg::Struct`] with these fields, as 8-byte words: `pointer` gives
/// the address of each pointer field (a [`KernelArg::Null`] is 0).
pub fn pack_struct(
    fields: &[KernelArg],
    mut pointer: impl FnMut(&KernelArg) -> Result<u64>,
) -> Result<Vec<u64>> {
    let mut bytes: Vec<u8> = Vec::new();
    let put = |bytes: &mut Vec<u8>, value: &[u8]| {
        bytes.resize(bytes.len().next_multiple_of(value.len()), 0);
        bytes.extend_from_slice(value);
    };
    for f in fields {
        match f {
            KernelArg::I32(v) => put(&mut bytes, &v.to_ne_bytes()),
            KernelArg::U64(v) => put(&mut bytes, &v.to_ne_bytes()),
            KernelArg::Null => put(&mut bytes, &0u64.to_ne_bytes()),
            KernelArg::Struct(_) => bail!("a kernel struct argument cannot hold a struct"),
            p => put(&mut bytes, &pointer(p)?.to_ne_bytes()),
        }
    }
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    Ok(bytes
        .chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .collect())
}

/// One kernel launch. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// The `extern "C"` kernel name in `kernels/*.cu`.
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes. Above [`DeviceLimits::DEFAULT_SHARED`] the launch
    /// must first raise the kernel's limit (an opt-in).
    pub shared_bytes: usize,
    pub args: Vec<KernelArg>,
    /// Elements of each output.
    pub outputs: Vec<usize>,
    pub tables: Vec<Table>,
    pub workspace_bytes: usize,
}

/// A table of 32-bit integers a launch copies to the device, shared and hashed once: the CUDA
/// launch keeps each table it uploaded by its contents, and a tree's tables, made with the tree
/// ([`crate::tree::Tree::level_table`]), are found again by pointer, without reading them.
#[derive(Clone)]
pub struct Table {
    hash: u64,
    values: Arc<[u32]>,
}

impl Table {
    pub fn new(values: impl Into<Arc<[u32]>>) -> Table {
        let values = values.into();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        values.hash(&mut h);
        Table {
            hash: h.finish(),
            values,
        }
    }

    /// The table of `values`, each of which must fit in 32 bits (node numbers, offsets).
    pub fn of(values: &[usize]) -> Table {
        Table::new(values.iter().map(|&v| v as u32).collect::<Vec<u32>>())
    }
}

impl Deref for Table {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.values
    }
}

impl PartialEq for Table {
    fn eq(&self, other: &Table) -> bool {
        Arc::ptr_eq(&self.values, &other.values)
            || (self.hash == other.hash && self.values == other.values)
    }
}

impl Eq for Table {}

impl Hash for Table {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Table({} values, hash {:016x})",
            self.values.len(),
            self.hash
        )
    }
}

impl LaunchPlan {
    /// Whether the launch needs more dynamic shared memory than a kernel gets by default.
    pub fn opts_in_to_shared(&self) -> bool {
        self.shared_bytes > DeviceLimits::DEFAULT_SHARED
    }
}

/// What a device grants one launch: dynamic shared memory per block, how much global memory a
/// kernel's workspace may take, and how many multiprocessors run its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// The most one block may have, opting in above [`DeviceLimits::DEFAULT_SHARED`]
    /// (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 96 KiB on V100, 163 KiB on A100, 227 KiB on H100).
    pub shared_per_block: usize,
    /// The most global workspace one launch may use, in bytes (kernels whose blocks take
    /// several work items in turn shrink their grid to stay within it).
    pub workspace_bytes: usize,
    /// Streaming multiprocessors: kernels whose blocks can be made wider or narrower choose
    /// by how many blocks each one gets.
    pub sms: usize,
}

impl DeviceLimits {
    /// The shared memory every kernel gets without opting in.
    pub const DEFAULT_SHARED: usize = 48 * 1024;
    /// The largest workspace budget the CUDA launch (`crate::cuda`) gives: 1 GiB, or an eighth
    /// of the device memory free when the budget is first needed, whichever is less.
    pub const MAX_WORKSPACE: usize = 1 << 30;
    pub const V100: DeviceLimits = DeviceLimits {
        shared_per_block: 96 * 1024,
        workspace_bytes: Self::MAX_WORKSPACE,
        sms: 80,
    };
    pub const H100: DeviceLimits = DeviceLimits {
        shared_per_block: 227 * 1024,
        workspace_bytes: Self::MAX_WORKSPACE,
        sms: 132,
    };

    /// Whether a block can have `bytes` of dynamic shared memory.
    pub fn fits_shared(&self, bytes: usize) -> bool {
        bytes <= self.shared_per_block
    }
}

/// The kernel name of `stem` for a dtype, real or complex: `scan_fwd_f32`, `tree_bwd_bf16_c`.
pub fn kernel_name(stem: &str, dtype: DType, complex: bool) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        dt => bail!("no CUDA kernel for dtype {dt:?}"),
    };
    Ok(format!(
        "{stem}_{suffix}{}",
        if complex { "_c" } else { "" }
    ))
}

/// `v` as a kernel `int`, or an error naming `what` of `op`.
pub(crate) fn int_arg(op: &str, what: &str, v: usize) -> Result<i32> {
    match i32::try_from(v) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{op}: {what} {v} is too large for the CUDA kernel"),
    }
}
