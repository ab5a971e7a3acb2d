//! Many tensors updated in place by one op. candle's in-place ops hold one to three tensors
//! for writing; [`with_targets`] holds any number, each op running the next inside it, and
//! hands all of them, with read access to the inputs, to one function (one launch).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result, Storage, Tensor};

/// In-place updates applied in this process (an in-place op makes no new tensor, so tensor
/// counts miss it): AdamW's launches and hyper-parameter rows, BatchNorm's running averages.
static UPDATES: AtomicU64 = AtomicU64::new(0);

/// How many in-place updates the ops have applied so far.
pub fn in_place_updates() -> u64 {
    UPDATES.load(Ordering::Relaxed)
}

/// Counts `n` in-place updates (launches) of an op.
pub(crate) fn count_updates(n: u64) {
    UPDATES.fetch_add(n, Ordering::Relaxed);
}

/// The tensors an op updates and reads, by device.
pub(crate) enum Held<'a> {
    Cpu {
        targets: Vec<(&'a mut CpuStorage, &'a Layout)>,
        inputs: Vec<(&'a CpuStorage, &'a Layout)>,
    },
    #[cfg(feature = "cuda")]
    Cuda {
        targets: Vec<(&'a mut candle_core::CudaStorage, &'a Layout)>,
        inputs: Vec<(&'a candle_core::CudaStorage, &'a Layout)>,
    },
}

type Run<'f> = dyn FnMut(Held<'_>) -> Result<()> + 'f;

/// The storages of one device, updated and read, as [`Held`] puts them.
type Make<S> = for<'b> fn(Vec<(&'b mut S, &'b Layout)>, Vec<(&'b S, &'b Layout)>) -> Held<'b>;

/// Runs `f` once with every tensor of `targets` held for writing and every one of `inputs` for
/// reading, all on one device. The targets' storages must be distinct and none shared with an
/// input (`op` names the caller in the error).
pub(crate) fn with_targets(
    op: &str,
    targets: &[&Tensor],
    inputs: &[&Tensor],
    f: &mut Run<'_>,
) -> Result<()> {
    let storage = |t: &Tensor| std::ptr::from_ref(&*t.storage_and_layout().0) as usize;
    let written: Vec<usize> = targets.iter().map(|t| storage(t)).collect();
    for (i, a) in written.iter().enumerate() {
        if written[..i].contains(a) || inputs.iter().any(|t| storage(t) == *a) {
            bail!("{op}: a tensor it updates shares memory with another of its operands");
        }
    }
    let guards: Vec<_> = inputs.iter().map(|t| t.storage_and_layout()).collect();
    let reads: Vec<(&Storage, &Layout)> = guards.iter().map(|(s, l)| (&**s, *l)).collect();
    let Some((first, rest)) = targets.split_first() else {
        bail!("{op}: nothing to update");
    };
    let nest = Nest {
        rest,
        reads: &reads,
        cpu: &RefCell::new(Vec::new()),
        #[cfg(feature = "cuda")]
        cuda: &RefCell::new(Vec::new()),
        f: &RefCell::new(f),
        op,
    };
    first.inplace_op1(&nest)
}

/// One level of the nesting: the storages held so far, the tensors still to hold.
struct Nest<'a, 'f> {
    rest: &'a [&'a Tensor],
    reads: &'a [(&'a Storage, &'a Layout)],
    cpu: &'a RefCell<Vec<(*mut CpuStorage, Layout)>>,
    #[cfg(feature = "cuda")]
    cuda: &'a RefCell<Vec<(*mut candle_core::CudaStorage, Layout)>>,
    f: &'a RefCell<&'a mut Run<'f>>,
    op: &'a str,
}

impl Nest<'_, '_> {
    fn deeper(&self) -> Result<()> {
        let (next, rest) = self.rest.split_first().expect("called with more to hold");
        next.inplace_op1(&Nest { rest, ..*self })
    }

    /// Adds `s` to the storages `held` of its device and holds the next tensor; after the
    /// last, hands them all and the inputs (`read` from their storages) to the function, as
    /// `make` puts them.
    fn hold<S>(
        &self,
        held: &RefCell<Vec<(*mut S, Layout)>>,
        s: &mut S,
        l: &Layout,
        read: fn(&Storage) -> Option<&S>,
        make: Make<S>,
    ) -> Result<()> {
        held.borrow_mut().push((std::ptr::from_mut(s), l.clone()));
        if !self.rest.is_empty() {
            return self.deeper();
        }
        let held = held.borrow();
        // SAFETY: each pointer is a distinct storage (checked by `with_targets`) that an
        // enclosing in-place op holds for writing until this call returns.
        let targets = held.iter().map(|(p, l)| (unsafe { &mut **p }, l)).collect();
        let inputs = self
            .reads
            .iter()
            .map(|(s, l)| read(s).map(|s| (s, *l)).ok_or_else(|| self.mixed()))
            .collect::<Result<_>>()?;
        (self.f.borrow_mut())(make(targets, inputs))
    }

    fn mixed(&self) -> candle_core::Error {
        candle_core::Error::Msg(format!("{}: operands on different devices", self.op))
    }
}

impl Clone for Nest<'_, '_> {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for Nest<'_, '_> {}

impl InplaceOp1 for Nest<'_, '_> {
    fn name(&self) -> &'static str {
        "in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        #[cfg(feature = "cuda")]
        if !self.cuda.borrow().is_empty() {
            return Err(self.mixed());
        }
        self.hold(
            self.cpu,
            s,
            l,
            |s| match s {
                Storage::Cpu(s) => Some(s),
                _ => None,
            },
            |targets, inputs| Held::Cpu { targets, inputs },
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        if !self.cpu.borrow().is_empty() {
            return Err(self.mixed());
        }
        self.hold(
            self.cuda,
            s,
            l,
            |s| match s {
                Storage::Cuda(s) => Some(s),
                _ => None,
            },
            |targets, inputs| Held::Cuda { targets, inputs },
        )
    }
}
