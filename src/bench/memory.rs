//! The most memory a piece of work holds at once beyond what was held before it: on the CPU
//! counted by [`Heap`], a global allocator (`myo` installs it), on CUDA read from the device's
//! stream-ordered memory pool, which candle allocates from.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use candle_core::{Device, Result};
use serde::Serialize;

/// The system allocator, counting the bytes it holds and their peak. A program installs it with
/// `#[global_allocator] static HEAP: Heap = Heap;`. (Of the crates that count, one zeroes and
/// reallocates by copying instead of asking the system, and one cannot restart its peak.)
pub struct Heap;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = HELD.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

fn shrank(by: usize) {
    HELD.fetch_sub(by, Relaxed);
}

// SAFETY: every call goes to the system allocator with the caller's arguments; the counters
// only follow the sizes.
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            match new_size.checked_sub(layout.size()) {
                Some(more) => grew(more),
                None => shrank(layout.size() - new_size),
            }
        }
        p
    }
}

/// Bytes held by [`Heap`] now; `None` where the program has not installed it (it has counted
/// nothing).
pub fn heap_held() -> Option<usize> {
    match HELD.load(Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Memory held when a piece of work began, and the most it held at once beyond that.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Peak {
    pub before: usize,
    pub above: usize,
}

/// Runs `work` and measures its [`Peak`]: on the CPU the heap's bytes ([`Heap`]; `None` where it
/// is not installed), on CUDA the device memory pool's (`work` synchronised before and after;
/// `None` where the pool held nothing).
/// Work on other threads at the same time counts too.
pub fn peak_of<R>(device: &Device, work: impl FnOnce() -> Result<R>) -> Result<(R, Option<Peak>)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        device.synchronize()?;
        let before = crate::cuda::pool_memory(dev, true)?.0;
        let out = work()?;
        device.synchronize()?;
        let high = crate::cuda::pool_memory(dev, false)?.1;
        // Nothing in the pool: the device allocates without it (no stream-ordered allocator).
        let peak = (high > 0).then(|| Peak {
            before,
            above: high.saturating_sub(before),
        });
        return Ok((out, peak));
    }
    let _ = device;
    let Some(before) = heap_held() else {
        return Ok((work()?, None));
    };
    PEAK.store(before, Relaxed);
    let out = work()?;
    let above = PEAK.load(Relaxed).saturating_sub(before);
    Ok((out, Some(Peak { before, above })))
}
