//! Runs the kernels of `kernels/*.cu` on the CPU: the files are compiled unchanged as host C++
//! with stand-ins for the CUDA built-ins (`include/cuda_host.h`), and [`launch`] runs a grid
//! with the threads of each block as fibers, serialised from barrier to barrier in a chosen
//! [`Order`]. See `src/launcher.cpp` for what it checks.
//!
//! This is test infrastructure: it tests the kernels' logic and our launch arithmetic, not
//! timing, memory limits or the GPU's memory model (blocks run one after another; warps are not
//! lock-step).

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// One kernel argument: a pointer to memory the kernel reads or writes, an `int`, an
/// `unsigned long long`, or a struct by value (its bytes, as many as the kernel's parameter
/// has).
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Ptr(*mut c_void),
    I32(i32),
    U64(u64),
    Struct(&'a [u64]),
}

/// The order in which the threads of a block (and the blocks of the grid) run between barriers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Ascending,
    Descending,
    /// A fresh permutation every round, from this seed.
    Shuffled(u64),
}

/// A kernel launch: the kernel's name (as in `kernels/*.cu`), grid, block and dynamic shared
/// memory in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Launch<'a> {
    pub kernel: &'a str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: usize,
}

#[repr(C)]
struct HostArg {
    kind: c_int,
    ptr: *mut c_void,
    value: c_int,
    wide: u64,
}

extern "C" {
    fn kernels_on_cpu_divide(n: c_int, d: c_int) -> c_int;
    fn kernels_on_cpu_count() -> usize;
    fn kernels_on_cpu_name(i: usize) -> *const c_char;
    #[allow(clippy::too_many_arguments)]
    fn kernels_on_cpu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: usize,
        args: *const HostArg,
        nargs: usize,
        order: c_int,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// n / d by the tree kernels' index division (`Divisor` in `kernels/tree_steps.cuh`), which
/// takes 0 <= n and 1 <= d.
pub fn divide(n: i32, d: i32) -> i32 {
    assert!(
        n >= 0 && d >= 1,
        "divide({n}, {d}): the division takes n >= 0 and d >= 1"
    );
    // SAFETY: arithmetic on its arguments only.
    unsafe { kernels_on_cpu_divide(n, d) }
}

/// The names of every kernel entry point the harness has compiled.
pub fn kernels() -> Vec<String> {
    (0..unsafe { kernels_on_cpu_count() })
        .map(|i| {
            // SAFETY: names are static C strings of the registry.
            let p = unsafe { kernels_on_cpu_name(i) };
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
        .collect()
}

/// Runs the grid to completion on the calling thread. Errors name what the harness caught: an
/// unknown kernel, an argument list that does not match the kernel's signature, sizes outside
/// CUDA's limits, diverging barriers, writes past the dynamic shared memory.
///
/// # Safety
/// Every pointer argument must point to memory that the kernel may read and write for the
/// extent the launch addresses (the kernel is C++ and checks nothing).
pub unsafe fn launch(l: &Launch, args: &[Arg], order: Order) -> Result<(), String> {
    let name = CString::new(l.kernel).map_err(|e| e.to_string())?;
    let host: Vec<HostArg> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(ptr) => HostArg {
                kind: 0,
                ptr,
                value: 0,
                wide: 0,
            },
            Arg::I32(value) => HostArg {
                kind: 1,
                ptr: std::ptr::null_mut(),
                value,
                wide: 0,
            },
            Arg::U64(wide) => HostArg {
                kind: 2,
                ptr: std::ptr::null_mut(),
                value: 0,
                wide,
            },
            Arg::Struct(words) => HostArg {
                kind: 3,
                ptr: words.as_ptr().cast_mut().cast(),
                value: 0,
                wide: std::mem::size_of_val(words) as u64,
            },
        })
        .collect();
    let (order, seed) = match order {
        Order::Ascending => (0, 0),
        Order::Descending => (1, 0),
        Order::Shuffled(seed) => (2, seed),
    };
    let mut err = vec![0 as c_char; 1024];
    let rc = kernels_on_cpu_launch(
        name.as_ptr(),
        l.grid.as_ptr(),
        l.block.as_ptr(),
        l.shared_bytes,
        host.as_ptr(),
        host.len(),
        order,
        seed,
        err.as_mut_ptr(),
        err.len(),
    );
    if rc == 0 {
        Ok(())
    } else {
        Err(CStr::from_ptr(err.as_ptr()).to_string_lossy().into_owned())
    }
}
