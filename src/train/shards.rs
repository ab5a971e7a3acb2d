//! The sums a batch's data-parallel shards share inside a training step (BatchNorm's batch
//! statistics, [`crate::nn::ShardSum`]): over the threads of one process, or over the ranks.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::{DType, Result, Tensor};

use super::dist::World;
use crate::nn::ShardSum;

/// `k` threads, one per shard of a batch, that meet at every sum: each leaves its part, the last
/// to arrive adds the parts in shard order, and all leave with that total. The threads must run
/// at the same time (not on a pool that might run them one after another).
pub struct ThreadGroup {
    k: usize,
    state: Mutex<Round>,
    done: Condvar,
}

struct Round {
    parts: Vec<Option<Tensor>>,
    arrived: usize,
    /// Counts the completed sums: a waiting thread leaves when it moves on.
    generation: u64,
    total: Option<Tensor>,
    /// The first shard that failed: the others stop waiting for it.
    failed: Option<usize>,
}

impl ThreadGroup {
    pub fn new(k: usize) -> Arc<ThreadGroup> {
        Arc::new(ThreadGroup {
            k,
            state: Mutex::new(Round {
                parts: vec![None; k],
                arrived: 0,
                generation: 0,
                total: None,
                failed: None,
            }),
            done: Condvar::new(),
        })
    }

    /// Shard `index`'s handle.
    pub fn shard(self: &Arc<Self>, index: usize) -> Arc<dyn ShardSum> {
        Arc::new(Shard {
            group: self.clone(),
            index,
        })
    }

    /// Shard `index` failed: whoever waits for it, or comes to wait, gets an error instead.
    pub fn fail(&self, index: usize) {
        let mut state = self.lock();
        state.failed.get_or_insert(index);
        self.done.notify_all();
    }

    /// The first shard that failed.
    pub fn failed(&self) -> Option<usize> {
        self.lock().failed
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A panic in a shard is re-raised when its thread is joined; the state stays usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Shard {
    group: Arc<ThreadGroup>,
    index: usize,
}

impl ShardSum for Shard {
    fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let group = &self.group;
        let mut state = group.lock();
        let stopped = |failed: usize| {
            candle_core::Error::Msg(format!(
                "shard {} stopped: shard {failed} of the batch failed",
                self.index
            ))
        };
        if let Some(failed) = state.failed {
            return Err(stopped(failed));
        }
        state.parts[self.index] = Some(t.clone());
        state.arrived += 1;
        if state.arrived == group.k {
            let mut parts = state.parts.iter_mut().map(|p| p.take());
            let missing = || crate::train::trainer::internal("a shard left no part to sum");
            let mut total = parts.next().flatten().ok_or_else(missing)?;
            for part in parts {
                total = (total + part.ok_or_else(missing)?)?;
            }
            state.total = Some(total);
            state.arrived = 0;
            state.generation += 1;
            group.done.notify_all();
        } else {
            let generation = state.generation;
            while state.generation == generation {
                if let Some(failed) = state.failed {
                    return Err(stopped(failed));
                }
                state = group.done.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }
        state
            .total
            .clone()
            .ok_or_else(|| crate::train::trainer::internal("a shard sum was not made"))
    }

    fn leads(&self) -> bool {
        self.index == 0
    }
}

/// The ranks of `world`, one shard each (`ranks` of them hold examples of the batch): the
/// sum in rank order on the host ([`World::sum_in_rank_order`]), or NCCL's on the GPUs.
pub struct RankSum {
    pub world: Arc<World>,
    pub ranks: usize,
}

impl ShardSum for RankSum {
    fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let failed = |e: anyhow::Error| candle_core::Error::Msg(format!("{e:#}"));
        if self.world.sums_on_device() {
            return self
                .world
                .device_sum(t)
                .map_err(failed)?
                .ok_or_else(|| crate::train::trainer::internal("no device collective"));
        }
        let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let sum = self
            .world
            .sum_in_rank_order(&values, self.ranks)
            .map_err(failed)?;
        Tensor::new(sum, t.device())?
            .to_dtype(t.dtype())?
            .reshape(t.shape())
    }

    fn leads(&self) -> bool {
        true
    }
}
