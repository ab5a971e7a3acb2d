//! Data parallelism over processes: one process per rank, started by `mpirun` or `srun`.
//!
//! Every rank holds the whole model and the whole dataset, draws the same shuffled global
//! batches, and computes only its part of each batch ([`part`]: the batch cut into `size`
//! contiguous, nearly equal parts, as the threads of one process cut it). The gradients of the
//! parts are summed in rank order, so every rank takes the same optimiser step, bit for bit the
//! step of one process that cuts each batch into as many shards (`--threads` = ranks). Rank 0
//! alone writes the run's files and shows progress.
//!
//! The collectives are MPI's (the `mpi` cargo feature; Open MPI or any MPI library): a sum in
//! rank order is an all-gather followed by the same fold on every rank, which MPI's own
//! all-reduce does not promise. On GPUs with the `nccl` feature the gradients and the batch
//! losses are summed by NCCL on the devices instead (`train::nccl`), the same on every rank but
//! in NCCL's order; without it they go through the host and MPI. Each MPI collective waits at
//! most [`World::timeout`]; a rank that died or cannot be reached ends the run (`mpirun` also
//! names a rank that died). NCCL's communicator is non-blocking and bounded the same way: its
//! setup, the queueing of each sum and, before the trainer reads results back
//! ([`World::wait_for_devices`]), the sums' completion on the GPUs each wait at most the
//! timeout, after which the rank aborts its communicator and fails (and `myo` ends the others).

use std::time::Duration;

use anyhow::Result;

/// Environment variables by which the MPI launchers announce a rank (Open MPI's `mpirun`;
/// MPICH's and Slurm's PMI; PMIx, as `srun --mpi=pmix` sets).
const LAUNCHED_BY: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

/// The ranks of a run and their collectives; one rank (`size` 1) when not started by a launcher.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    timeout: Duration,
    /// The thread that set up MPI and NCCL: the only one that calls them.
    owner: std::thread::ThreadId,
    #[cfg(feature = "mpi")]
    mpi: Option<mpi_world::Mpi>,
    /// NCCL among the ranks' GPUs, once [`World::use_device`] has set it up.
    #[cfg(all(feature = "mpi", feature = "nccl"))]
    nccl: std::sync::OnceLock<super::nccl::Nccl>,
}

// SAFETY: MPI is initialised `Funneled` (only the thread that initialised it calls it), and NCCL
// is set up on the same thread. Every MPI or NCCL call goes through a method that first checks,
// with `World::on_owner`, that it runs on that thread and refuses otherwise, and `Mpi` finalises
// MPI only when dropped there; so the handles may be shared with, and sent to, other threads
// (a BatchNorm's statistics op holds the world in the graph of a training step).
#[cfg(feature = "mpi")]
unsafe impl Send for World {}
#[cfg(feature = "mpi")]
unsafe impl Sync for World {}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "World {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

impl World {
    /// One process alone.
    pub fn single() -> World {
        World {
            rank: 0,
            size: 1,
            local_rank: 0,
            timeout: Duration::from_secs(300),
            owner: std::thread::current().id(),
            #[cfg(feature = "mpi")]
            mpi: None,
            #[cfg(all(feature = "mpi", feature = "nccl"))]
            nccl: std::sync::OnceLock::new(),
        }
    }

    /// The ranks `mpirun` or `srun` started this process among, or [`World::single`] when no
    /// launcher did (then no MPI library is touched). Each collective waits at most `timeout`.
    pub fn from_env(timeout: Duration) -> Result<World> {
        if !LAUNCHED_BY.iter().any(|v| std::env::var_os(v).is_some()) {
            return Ok(World {
                timeout,
                ..World::single()
            });
        }
        #[cfg(feature = "mpi")]
        {
            let (mpi, rank, size, local_rank) = mpi_world::Mpi::init()?;
            Ok(World {
                rank,
                size,
                local_rank,
                timeout,
                owner: std::thread::current().id(),
                mpi: Some(mpi),
                #[cfg(feature = "nccl")]
                nccl: std::sync::OnceLock::new(),
            })
        }
        #[cfg(not(feature = "mpi"))]
        {
            let size: usize = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
                .iter()
                .find_map(|v| std::env::var(v).ok()?.parse().ok())
                .unwrap_or(1);
            if size > 1 {
                anyhow::bail!(
                    "started by an MPI launcher with {size} ranks, but this myo was built without \
                     MPI: build it with `--features mpi`"
                );
            }
            Ok(World {
                timeout,
                ..World::single()
            })
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank among those on this machine (the GPU a rank uses).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Rank 0, which writes the run's files.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// Ends every rank at once after an error on this one (MPI_Abort), rather than waiting in
    /// MPI's finalisation for ranks that wait for this one. Returns with one rank.
    pub fn abort_others(&self) {
        #[cfg(feature = "mpi")]
        if let (Some(mpi), true) = (&self.mpi, self.size > 1) {
            mpi.abort();
        }
    }

    /// Sets up the collectives for training on `device`: on a CUDA device with several ranks,
    /// NCCL (rank 0 makes the id and sends it over MPI). Elsewhere nothing.
    pub fn use_device(&self, device: &candle_core::Device) -> Result<()> {
        self.on_owner()?;
        #[cfg(all(feature = "mpi", feature = "nccl"))]
        if self.size > 1 && device.is_cuda() && self.nccl.get().is_none() {
            let mut id = if self.is_root() {
                super::nccl::unique_id()?
            } else {
                [0; 128]
            };
            self.broadcast(&mut id)?;
            let nccl = super::nccl::Nccl::new(device, self.rank, self.size, id, self.timeout)?;
            let _ = self.nccl.set(nccl);
        }
        let _ = device;
        Ok(())
    }

    /// Whether [`World::device_sum`] sums on the GPUs.
    pub fn sums_on_device(&self) -> bool {
        #[cfg(all(feature = "mpi", feature = "nccl"))]
        return self.nccl.get().is_some();
        #[cfg(not(all(feature = "mpi", feature = "nccl")))]
        false
    }

    /// The sum over every rank of `t` on the GPU (NCCL, in its own order, the same bits on
    /// every rank), or `None` when the ranks have no NCCL ([`World::use_device`]).
    pub fn device_sum(&self, t: &candle_core::Tensor) -> Result<Option<candle_core::Tensor>> {
        self.on_owner()?;
        #[cfg(all(feature = "mpi", feature = "nccl"))]
        if let Some(nccl) = self.nccl.get() {
            return nccl.sum(t).map(Some);
        }
        let _ = t;
        Ok(None)
    }

    /// Waits for the sums [`World::device_sum`] queued on the GPUs to finish, at most the
    /// timeout (then fails): called before results are read back, so that a rank that stopped
    /// ends the run instead of leaving the host waiting on the device without end.
    pub fn wait_for_devices(&self) -> Result<()> {
        self.on_owner()?;
        #[cfg(all(feature = "mpi", feature = "nccl"))]
        if let Some(nccl) = self.nccl.get() {
            return nccl.wait();
        }
        Ok(())
    }

    /// Rank 0's values of `tensors` on every rank (same shapes and dtypes everywhere; f64 on
    /// the way, exact for every dtype a model or an optimiser state holds).
    pub fn broadcast_tensors(
        &self,
        tensors: &[candle_core::Tensor],
    ) -> Result<Vec<candle_core::Tensor>> {
        tensors
            .iter()
            .map(|t| {
                if self.size == 1 {
                    return Ok(t.clone());
                }
                let mut values = t
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F64)?
                    .to_vec1::<f64>()?;
                self.broadcast(&mut values)?;
                Ok(
                    candle_core::Tensor::from_vec(values, t.shape(), t.device())?
                        .to_dtype(t.dtype())?,
                )
            })
            .collect()
    }

    /// How long a collective waits for the other ranks.
    /// Refuses a collective on a thread other than the one that set up MPI and NCCL.
    fn on_owner(&self) -> Result<()> {
        if self.size > 1 && std::thread::current().id() != self.owner {
            anyhow::bail!(
                "rank {}: a collective was called from a thread that did not set up MPI",
                self.rank
            );
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The sum over ranks `0..ranks` of each rank's `values` (equal lengths on every rank),
    /// added in rank order, so that every rank gets the same bits: those of
    /// `((v₀ + v₁) + v₂) + …`. Ranks from `ranks` on contribute nothing (their parts of a short
    /// batch are empty). With one rank, `values` itself.
    pub fn sum_in_rank_order<T: Value>(&self, values: &[T], ranks: usize) -> Result<Vec<T>> {
        if self.size == 1 {
            return Ok(values.to_vec());
        }
        let all = self.all_gather(values)?;
        let n = values.len();
        let mut sum = all[..n].to_vec();
        for part in all.chunks(n.max(1)).take(ranks.min(self.size)).skip(1) {
            for (s, v) in sum.iter_mut().zip(part) {
                *s = *s + *v;
            }
        }
        Ok(sum)
    }

    /// Every rank's `values` (equal lengths), concatenated in rank order.
    fn all_gather<T: Value>(&self, values: &[T]) -> Result<Vec<T>> {
        self.on_owner()?;
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return mpi.all_gather(values, self.rank, self.timeout);
        }
        Ok(values.to_vec())
    }

    /// Rank 0's `values` on every rank (equal lengths).
    pub fn broadcast<T: Value>(&self, values: &mut [T]) -> Result<()> {
        self.on_owner()?;
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return mpi.broadcast(values, self.rank, self.timeout);
        }
        let _ = values;
        Ok(())
    }

    /// Waits until every rank gets here (the end of a run, before MPI's finalisation, which
    /// would wait without end for a rank that stopped answering).
    pub fn barrier(&self) -> Result<()> {
        self.on_owner()?;
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            mpi.barrier(self.rank, self.timeout);
        }
        Ok(())
    }

    /// Rank 0's bytes on every rank, of any length.
    pub fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<()> {
        let mut len = [bytes.len() as u64];
        self.broadcast(&mut len)?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast(bytes)
    }
}

/// The element types the collectives move.
#[cfg(feature = "mpi")]
pub trait Value: Copy + Default + std::ops::Add<Output = Self> + mpi::traits::Equivalence {}
/// The element types the collectives move.
#[cfg(not(feature = "mpi"))]
pub trait Value: Copy + Default + std::ops::Add<Output = Self> {}

impl Value for f32 {}
impl Value for f64 {}
impl Value for u64 {}
impl Value for u8 {}

/// The part of a global batch of `len` examples that `rank` of `size` computes: a range of
/// positions in the batch. The batch is cut into `size` contiguous parts whose lengths differ
/// by at most one, the longer first (a batch shorter than `size` leaves the last parts empty).
pub fn part(len: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let size = size.max(1);
    let (base, extra) = (len / size, len % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(feature = "mpi")]
mod mpi_world {
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result};
    use mpi::topology::{Communicator, SimpleCommunicator};
    use mpi::traits::*;

    use super::Value;

    /// MPI, initialised once for the process, and its world communicator.
    pub struct Mpi {
        world: SimpleCommunicator,
        /// Dropping it finalises MPI, which only the thread that initialised it may do.
        universe: std::mem::ManuallyDrop<mpi::environment::Universe>,
        owner: std::thread::ThreadId,
    }

    impl Drop for Mpi {
        fn drop(&mut self) {
            if std::thread::current().id() == self.owner {
                // SAFETY: not used again; dropped once, here.
                unsafe { std::mem::ManuallyDrop::drop(&mut self.universe) }
            }
        }
    }

    impl Mpi {
        /// (MPI, rank, size, local rank).
        pub fn init() -> Result<(Mpi, usize, usize, usize)> {
            // Only the main thread calls MPI (rayon's workers compute the shards).
            let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
                .context("MPI could not be initialised")?;
            let world = universe.world();
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            let local = world.split_shared(world.rank()).rank() as usize;
            Ok((
                Mpi {
                    world,
                    universe: std::mem::ManuallyDrop::new(universe),
                    owner: std::thread::current().id(),
                },
                rank,
                size,
                local,
            ))
        }

        pub fn all_gather<T: Value>(
            &self,
            values: &[T],
            rank: usize,
            timeout: Duration,
        ) -> Result<Vec<T>> {
            let mut all = vec![T::default(); values.len() * self.world.size() as usize];
            mpi::request::scope(|scope| {
                let req = self
                    .world
                    .immediate_all_gather_into(scope, values, &mut all[..]);
                self.finish(req, rank, timeout, "gathering gradients")
            });
            Ok(all)
        }

        pub fn broadcast<T: Value>(
            &self,
            values: &mut [T],
            rank: usize,
            timeout: Duration,
        ) -> Result<()> {
            mpi::request::scope(|scope| {
                let req = self
                    .world
                    .process_at_rank(0)
                    .immediate_broadcast_into(scope, values);
                self.finish(req, rank, timeout, "receiving rank 0's values")
            });
            Ok(())
        }

        pub fn barrier(&self, rank: usize, timeout: Duration) {
            let req = self.world.immediate_barrier();
            self.finish(req, rank, timeout, "waiting for the others to finish");
        }

        pub fn abort(&self) -> ! {
            self.world.abort(1)
        }

        /// Waits for `req` at most `timeout`; past it, ends every rank (MPI_Abort) with a
        /// message naming this rank and what it waited for.
        fn finish<'a, R: ?Sized, S: mpi::request::Scope<'a>>(
            &self,
            mut req: mpi::request::Request<'a, R, S>,
            rank: usize,
            timeout: Duration,
            what: &str,
        ) {
            let start = Instant::now();
            loop {
                match req.test() {
                    Ok(_) => return,
                    Err(r) => req = r,
                }
                if start.elapsed() > timeout {
                    eprintln!(
                        "error: rank {rank}: no answer from the other ranks for {} s while {what} \
                         (a rank died or cannot be reached); stopping every rank",
                        timeout.as_secs()
                    );
                    self.world.abort(1);
                }
                if start.elapsed() > Duration::from_millis(1) {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }
}
