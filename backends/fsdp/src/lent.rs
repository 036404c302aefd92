//! FSDP switches over training buffers the backend does not own: each rank's flat fp32 master
//! shards (and the buffers an offload may move) lent by a caller as device addresses, with the
//! caller's stream ([`lifecycle_cuda::driver::LentRank`]). The same plans, the same driver, the
//! same rollout buffers as [`FsdpBackend`]'s own state; the caller keeps updating its buffers
//! (the backend's Adam step refuses them, as it does not own them).

use std::sync::Arc;

use lifecycle_cuda::driver::{LentOffload, LentRank, LentSource, LentStream, RankBuffers};
use lifecycle_cuda::RankExecutor;
use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_layout::FsdpLayout;

use crate::{FsdpBackend, FsdpError};

/// Where a rank's fp32 master shards are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LentMaster {
    /// One flat buffer in the padded layout of [`ShardLayout::new`] ([`ShardLayout::rank_len`]
    /// elements at least, tensor `i`'s held rows at `slots[i].offset`).
    Flat {
        /// Device address.
        ptr: u64,
        /// Elements at `ptr`.
        len: usize,
    },
    /// One allocation per training tensor, in training order, each holding the rank's rows of
    /// the tensor and nothing else (FSDP2's `to_local()` of each parameter: dim-0 chunks by
    /// [`lifecycle_layout::fsdp_rows`], empty on trailing ranks): `(address, elements)`.
    Shards(Vec<(u64, usize)>),
}

/// What a caller lends for one local rank: the fp32 master shards (read in place), the buffers
/// an offload may move, and the stream the caller's work on them runs on.
pub struct LentParts {
    /// The rank's fp32 master shards.
    pub master: LentMaster,
    /// Buffers an offload may move, in the order their copies are queued.
    pub offload: Vec<LentOffload>,
    /// The caller's stream, awaited before the switch reads and made to wait after it.
    pub stream: Option<LentStream>,
}

/// An FSDP training state of lent buffers: each rank's flat fp32 master shards (and the buffers
/// an offload may move) as a caller's device addresses, with its stream
/// ([`LentRank`]); switched by [`LentFsdpBackend`] with the plans, driver and rollout buffers of
/// [`FsdpBackend`]'s own state.
pub struct LentFsdpState {
    pub(crate) layout: Arc<FsdpLayout>,
    pub(crate) shards: ShardLayout,
    pub(crate) ranks: Vec<LentRank>,
    /// A frozen tensor the lender wrote since the last enter ([`LentFsdpState::mark_frozen_written`]).
    pub(crate) frozen_written: Option<String>,
}

impl std::fmt::Debug for LentFsdpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentFsdpState")
            .field("world", &self.layout.world())
            .field("tensors", &self.layout.tensors().len())
            .field("rank_len", &self.shards.rank_len)
            .field("local_ranks", &self.ranks.len())
            .finish()
    }
}

impl LentFsdpState {
    /// Reports that the lender wrote frozen tensor `name` (a LoRA model's base, under
    /// `with_frozen_base`) since the last enter: the next refresh, which would move the trained
    /// tensors alone, is refused naming it, and the enter after it casts every tensor again. The lender
    /// knows its writes (PyTorch's version counters); the backend cannot see them.
    pub fn mark_frozen_written(&mut self, name: &str) {
        if self.frozen_written.is_none() {
            self.frozen_written = Some(name.to_string());
        }
    }

    /// Names and full shapes, in training order.
    pub fn layout(&self) -> &FsdpLayout {
        &self.layout
    }

    /// The flat per-rank layout the lent master buffers follow.
    pub fn shard_layout(&self) -> &ShardLayout {
        &self.shards
    }

    /// Whether any lent buffer is offloaded.
    pub fn offloaded(&mut self) -> bool {
        self.ranks.iter_mut().any(|r| r.any_offloaded())
    }

    /// Each local rank's lent buffers (their current device addresses, pinned bytes held).
    pub fn ranks(&self) -> &[LentRank] {
        &self.ranks
    }
}

/// An [`FsdpBackend`] that switches lent training buffers: its
/// [`Reshard`](lifecycle_core::Reshard) with [`LentFsdpState`] as the training state (the same
/// impl as for the backend's own buffers). Made by [`FsdpBackend::lending`].
///
/// A trainer that holds its own shards (PyTorch's FSDP2: one allocation per parameter, the
/// rank's dim-0 rows) lends their addresses and its stream; the rollout is read from them in
/// place, and nothing of the trainer's memory is freed or moved unless it lends buffers to
/// offload ([`LentOffload`](lifecycle_cuda::driver::LentOffload)):
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::driver::LentStream;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_fsdp::{FsdpBackend, LentMaster, LentParts};
/// use lifecycle_layout::{FsdpLayout, Parallel, RolloutLayout, TensorSpec};
///
/// # fn shard_address(_name: &str) -> u64 { 0 }
/// # fn trainer_stream() -> u64 { 0 }
/// let specs = vec![
///     TensorSpec::new("model.layers.0.self_attn.q_proj.weight", [8, 4], Parallel::Column),
///     TensorSpec::new("model.norm.weight", [4], Parallel::Replicated),
/// ];
/// let train = FsdpLayout::new(1, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
/// let pool = Arc::new(ThreadRankPool::new(1)?);
/// let backend = FsdpBackend::new(pool, RolloutLayout::new(1, specs)?).lending()?;
/// // W = 1: the rank holds every row; each shard's address comes from the trainer
/// let parts = vec![LentParts {
///     master: LentMaster::Shards(vec![
///         (shard_address("model.layers.0.self_attn.q_proj.weight"), 32),
///         (shard_address("model.norm.weight"), 4),
///     ]),
///     offload: Vec::new(),
///     stream: Some(LentStream(trainer_stream())),
/// }];
/// // SAFETY: the addresses are the trainer's live fp32 shards on GPU 0, kept while lent.
/// let state = unsafe { backend.lend(train, parts)? };
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let host = session.backend().download_rollout(&session.weights())?;
/// assert_eq!(host.ranks[0].tensors.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type LentFsdpBackend = FsdpBackend<LentFsdpState>;

impl LentFsdpBackend {
    /// The lent state of the model `layout` (W = the pool's), from each local rank's
    /// [`LentParts`] in `local_ranks()` order. Checked before anything is used: W, one part per
    /// local rank, each master buffer long enough for the padded layout.
    ///
    /// # Safety
    /// Every address must be device memory of its rank's GPU of the stated size, alive until the
    /// state is dropped (the master not written by others during a switch), except what a
    /// [`LentOffload`]'s owner releases when asked; each stream a live stream of that device.
    pub unsafe fn lend(
        &self,
        layout: FsdpLayout,
        parts: Vec<LentParts>,
    ) -> Result<LentFsdpState, FsdpError> {
        let pool = &self.pool;
        if layout.world() != pool.world() {
            return Err(FsdpError::WorldMismatch {
                state: layout.world(),
                pool: pool.world(),
            });
        }
        let locals = pool.local_ranks().len();
        if parts.len() != locals {
            return Err(FsdpError::Config(format!(
                "lent buffers: {} parts given, this process drives {locals} ranks (one part per \
                 local rank, in local_ranks() order)",
                parts.len()
            )));
        }
        let shards = ShardLayout::new(&layout);
        for (i, (p, &rank)) in parts.iter().zip(pool.local_ranks()).enumerate() {
            check_master(&shards, &p.master, i, rank)?;
        }
        let mut items: Vec<Option<LentParts>> = parts.into_iter().map(Some).collect();
        let ranks = pool.run_each(&mut items, &|ctx, p| {
            let p = p.take().ok_or_else(|| {
                lifecycle_cuda::CudaError::Invalid("lent parts used twice".into())
            })?;
            let source = match p.master {
                LentMaster::Flat { ptr, len } => LentSource::F32 { ptr, len },
                LentMaster::Shards(tensors) => LentSource::F32Tensors(tensors),
            };
            // SAFETY: the caller's promise (this function's contract).
            unsafe { LentRank::new(ctx, source, p.offload, p.stream) }
        })?;
        Ok(LentFsdpState {
            layout: Arc::new(layout),
            shards,
            ranks,
            frozen_written: None,
        })
    }
}

/// The lent master of local rank `local` (global `rank`) must fit the shard layout: a flat buffer
/// long enough, or one shard per tensor holding exactly the rank's rows.
fn check_master(
    shards: &ShardLayout,
    master: &LentMaster,
    local: usize,
    rank: usize,
) -> Result<(), FsdpError> {
    match master {
        LentMaster::Flat { len, .. } if (*len as u64) < shards.rank_len => {
            Err(FsdpError::Config(format!(
                "lent master of local rank {local}: the padded shard layout needs {} fp32 \
                 elements, {len} lent",
                shards.rank_len
            )))
        }
        LentMaster::Flat { .. } => Ok(()),
        LentMaster::Shards(t) if t.len() != shards.slots.len() => Err(FsdpError::Config(format!(
            "lent master of local rank {local}: {} shards lent, the model has {} tensors (one \
             shard per tensor, in training order)",
            t.len(),
            shards.slots.len()
        ))),
        LentMaster::Shards(t) => {
            for (i, (slot, &(_, n))) in shards.slots.iter().zip(t).enumerate() {
                let rows = shards.held_rows(i, rank);
                let want = rows.len() * slot.cols;
                if n != want {
                    return Err(FsdpError::Tensor {
                        name: slot.name.clone(),
                        problem: format!(
                            "rank {rank} holds rows {rows:?} of shape {:?} ({want} elements), \
                             its lent shard has {n}",
                            slot.shape
                        ),
                    });
                }
            }
            Ok(())
        }
    }
}
