//! [`RolloutBuffer`]: the rollout weights every GPU executor produces and every GPU reader (the
//! decoder, downloads, verification) consumes, whatever training layout they came from.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;
use lifecycle_layout::{HostRollout, RolloutEntry};

use crate::{CudaError, EntryTable, FreeingRoom, RankExecutor, ThreadRankPool};
use lifecycle_layout::RolloutLayout;

/// The rollout weights of the ranks this process drives: one flat bf16 device buffer per rank
/// and where each tensor sits in it ([`RolloutBuffer::rank_entries`]): the same on every rank,
/// except in layouts whose ranks hold different tensors (partitioned experts).
pub struct RolloutBuffer {
    ranks: Vec<CudaSlice<bf16>>,
    local: Vec<usize>,
    entries: EntryTable,
    len: usize,
    /// Per local rank, the memory an overlapped offload is still freeing (empty otherwise).
    freeing: Vec<Arc<FreeingRoom>>,
}

impl std::fmt::Debug for RolloutBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutBuffer")
            .field("ranks", &self.local)
            .field("tensors", &self.entries.ranks().first().map_or(0, Vec::len))
            .field("elements_per_rank", &self.len)
            .field("freeing", &self.freeing)
            .finish()
    }
}

impl RolloutBuffer {
    /// Wraps the buffers of `local` ranks (global rank numbers, in buffer order), each holding at
    /// least `len` elements, with `entries` inside `0..len`. Checked before anything is kept.
    pub fn new(
        ranks: Vec<CudaSlice<bf16>>,
        local: Vec<usize>,
        entries: Vec<RolloutEntry>,
        len: usize,
    ) -> Result<Self, CudaError> {
        let per_rank = vec![entries; local.len()];
        Self::per_rank(ranks, local, per_rank, len)
    }

    /// As [`RolloutBuffer::new`] with each local rank's own entries (`entries[i]` for the
    /// `i`-th local rank).
    pub fn per_rank(
        ranks: Vec<CudaSlice<bf16>>,
        local: Vec<usize>,
        entries: Vec<Vec<RolloutEntry>>,
        len: usize,
    ) -> Result<Self, CudaError> {
        Self::per_rank_shared(ranks, local, EntryTable::new(entries), len)
    }

    /// As [`RolloutBuffer::per_rank`] with entry lists shared with the caller (a backend that
    /// keeps them per plan hands them to every rollout without copying them, and without a
    /// walk over them: the table knows its furthest end).
    pub fn per_rank_shared(
        ranks: Vec<CudaSlice<bf16>>,
        local: Vec<usize>,
        entries: EntryTable,
        len: usize,
    ) -> Result<Self, CudaError> {
        let bad = CudaError::Invalid;
        if entries.ranks().len() != local.len() {
            return Err(bad(format!(
                "rollout buffer: entry lists for {} ranks, {} local ranks",
                entries.ranks().len(),
                local.len()
            )));
        }
        if ranks.len() != local.len() {
            return Err(bad(format!(
                "rollout buffer: {} device buffers for {} local ranks",
                ranks.len(),
                local.len()
            )));
        }
        if let Some((i, b)) = ranks.iter().enumerate().find(|(_, b)| b.len() < len) {
            return Err(bad(format!(
                "rollout buffer of rank {}: {} elements, the entries need {len}",
                local[i],
                b.len()
            )));
        }
        entries.check_fits(len)?;
        Ok(RolloutBuffer {
            ranks,
            local,
            entries,
            len,
            freeing: Vec::new(),
        })
    }

    /// The same weights, handed out while an overlapped offload still frees training memory:
    /// `rooms[i]` for the `i`-th local rank. A rollout engine orders its allocations after the
    /// frees that make room for them ([`RolloutBuffer::freeing`]).
    pub fn with_freeing(mut self, rooms: Vec<FreeingRoom>) -> Result<Self, CudaError> {
        if rooms.len() != self.local.len() {
            return Err(CudaError::Invalid(format!(
                "rollout buffer: freeing rooms for {} ranks, {} local ranks",
                rooms.len(),
                self.local.len()
            )));
        }
        self.freeing = rooms.into_iter().map(Arc::new).collect();
        Ok(self)
    }

    /// The memory an overlapped offload is still freeing on the `i`-th local rank, if the
    /// switch that made these weights overlapped its offload (`None` when it waited for it).
    pub fn freeing(&self, i: usize) -> Option<&Arc<FreeingRoom>> {
        self.freeing.get(i)
    }

    /// The tensors of the first local rank's buffer, in rollout order: every rank's when
    /// [`RolloutBuffer::uniform`].
    pub fn entries(&self) -> &[RolloutEntry] {
        self.entries.ranks().first().map_or(&[], Vec::as_slice)
    }

    /// Whether every local rank holds the same tensors at the same offsets (false only for
    /// layouts with tensors owned by one rank).
    pub fn uniform(&self) -> bool {
        self.entries.ranks().windows(2).all(|w| w[0] == w[1])
    }

    /// Every local rank's entries, in local-rank order.
    pub fn all_entries(&self) -> &[Vec<RolloutEntry>] {
        self.entries.ranks()
    }

    /// The tensors of the `i`-th local rank's buffer, in rollout order (empty past the last).
    pub fn rank_entries(&self, i: usize) -> &[RolloutEntry] {
        self.entries.ranks().get(i).map_or(&[], Vec::as_slice)
    }

    /// The entry of tensor `name` on the `i`-th local rank, if that rank holds it.
    pub fn rank_entry(&self, i: usize, name: &str) -> Option<&RolloutEntry> {
        self.rank_entries(i).iter().find(|e| e.name() == name)
    }

    /// Elements of rollout weights on each rank.
    pub fn len_per_rank(&self) -> usize {
        self.len
    }

    /// Bytes of rollout weights on each rank.
    pub fn bytes_per_rank(&self) -> u64 {
        (self.len * 2) as u64
    }

    /// The global ranks held, in the order of [`RolloutBuffer::rank_buffer`].
    pub fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    /// The device buffer of the `i`-th local rank (flat, at least
    /// [`len_per_rank`](RolloutBuffer::len_per_rank) elements).
    pub fn rank_buffer(&self, i: usize) -> Option<&CudaSlice<bf16>> {
        self.ranks.get(i)
    }

    /// Every local rank's buffer, to rewrite their contents in place (a refresh); the buffers
    /// themselves stay (readers check their lengths against the entries).
    pub fn buffers(&self) -> &[CudaSlice<bf16>] {
        &self.ranks
    }

    /// Every local rank's buffer, to rewrite their contents in place (a refresh).
    pub fn buffers_mut(&mut self) -> &mut [CudaSlice<bf16>] {
        &mut self.ranks
    }

    /// Downloads every local rank's weights to host memory (rollout order, the CPU executors'
    /// layout), after all work queued on the ranks' streams; for bit comparisons. `pool` must
    /// drive the ranks this buffer holds.
    pub fn download(&self, pool: &impl RankExecutor) -> Result<HostRollout, CudaError> {
        if pool.local_ranks() != self.local.as_slice() {
            return Err(CudaError::Invalid(format!(
                "downloading rollout weights of ranks {:?} through a pool driving ranks {:?}",
                self.local,
                pool.local_ranks()
            )));
        }
        let len = self.len;
        let mut items: Vec<&CudaSlice<bf16>> = self.ranks.iter().collect();
        let flats = pool.run_each(&mut items, &|ctx, buf| {
            ctx.sync_all()?;
            let mut v = ctx
                .compute
                .clone_dtoh(*buf)
                .map_err(ctx.drv("downloading rollout weights", 0))?;
            v.truncate(len);
            Ok(v)
        })?;
        HostRollout::from_rank_flats(self.entries.ranks(), flats).ok_or_else(|| {
            CudaError::Invalid("a downloaded rollout buffer is shorter than its entries".into())
        })
    }

    /// Frees every local rank's buffer on its own thread, after all work queued on the rank's
    /// streams (the memory returns to the device's pool at once). `pool` must drive the ranks
    /// this buffer holds.
    pub fn release(self, pool: &impl RankExecutor) -> Result<(), CudaError> {
        if pool.local_ranks() != self.local.as_slice() {
            return Err(CudaError::Invalid(format!(
                "releasing rollout weights of ranks {:?} through a pool driving ranks {:?}",
                self.local,
                pool.local_ranks()
            )));
        }
        let mut items: Vec<Option<CudaSlice<bf16>>> = self.ranks.into_iter().map(Some).collect();
        pool.run_each(&mut items, &|c, buf| {
            c.sync_all()?;
            drop(buf.take());
            c.compute
                .synchronize()
                .map_err(c.drv("releasing rollout weights", 0))
        })?;
        Ok(())
    }

    /// The device buffers, in local-rank order (to free them).
    pub fn into_buffers(self) -> Vec<CudaSlice<bf16>> {
        self.ranks
    }
}

/// A backend whose rollout weights are [`RolloutBuffer`]s on a [`ThreadRankPool`]: what a GPU
/// decoder or rollout engine needs of it (the layout the buffers follow and the pool they live
/// on), so that models read rollouts without importing any backend. Implemented by the FSDP and
/// Megatron GPU backends.
///
/// ```
/// use std::sync::Arc;
/// use lifecycle_cuda::{RolloutSource, ThreadRankPool};
/// use lifecycle_layout::RolloutLayout;
///
/// struct MyBackend {
///     pool: Arc<ThreadRankPool>,
///     layout: RolloutLayout,
/// }
///
/// impl RolloutSource for MyBackend {
///     fn rollout_layout(&self) -> &RolloutLayout {
///         &self.layout
///     }
///     fn rank_pool(&self) -> &Arc<ThreadRankPool> {
///         &self.pool
///     }
/// }
/// ```
pub trait RolloutSource {
    /// The layout of the rollout weights the backend produces.
    fn rollout_layout(&self) -> &RolloutLayout;

    /// The ranks (GPUs) holding them.
    fn rank_pool(&self) -> &Arc<ThreadRankPool>;
}
