//! FSDP switches over training buffers the backend does not own: each rank's flat fp32 master
//! shards (and the buffers an offload may move) lent by a caller as device addresses, with the
//! caller's stream ([`lifecycle_cuda::driver::LentRank`]). The same plans, the same driver, the
//! same rollout buffers as [`FsdpBackend`]'s own state; the caller keeps updating its buffers
//! (the backend's Adam step refuses them, as it does not own them).

use std::sync::Arc;

use lifecycle_core::{Phase, Reshard, SwitchContext};
use lifecycle_cuda::driver::{LentOffload, LentRank, LentSource, LentStream, NoHooks, RankBuffers};
use lifecycle_cuda::{alloc_rollout_buffers, RankExecutor, RolloutBuffer};
use lifecycle_layout::fsdp::{FsdpPlan, ShardLayout};
use lifecycle_layout::FsdpLayout;

use crate::{FsdpBackend, FsdpError};

/// What a caller lends for one local rank: the flat fp32 master buffer in the padded layout of
/// [`ShardLayout::new`] (read in place), the buffers an offload may move, and the stream the
/// caller's work on them runs on.
pub struct LentParts {
    /// Device address of the rank's flat fp32 master buffer ([`ShardLayout::rank_len`] elements
    /// at least, tensor `i`'s held rows at `slots[i].offset`).
    pub master: u64,
    /// Elements at `master`.
    pub master_len: usize,
    /// Buffers an offload may move, in the order their copies are queued.
    pub offload: Vec<LentOffload>,
    /// The caller's stream, awaited before the switch reads and made to wait after it.
    pub stream: Option<LentStream>,
}

/// An FSDP training state of lent buffers (see the [module docs](self)).
pub struct LentFsdpState {
    layout: FsdpLayout,
    shards: ShardLayout,
    ranks: Vec<LentRank>,
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

/// An [`FsdpBackend`] that switches lent training buffers: [`Reshard`] with
/// [`LentFsdpState`] as the training state. Made by [`FsdpBackend::lending`].
pub struct LentFsdpBackend {
    inner: FsdpBackend,
}

impl FsdpBackend {
    /// This backend, switching lent buffers instead of its own (its settings, plans and pinned
    /// pool kept). Verification mode is refused: its hashes live beside buffers the backend owns.
    pub fn lending(self) -> Result<LentFsdpBackend, FsdpError> {
        if self.verify {
            return Err(FsdpError::Config(
                "verification mode hashes the backend's own training buffers; lent buffers are \
                 switched without it (FsdpBackend::with_verification(false))"
                    .into(),
            ));
        }
        Ok(LentFsdpBackend { inner: self })
    }
}

impl LentFsdpBackend {
    /// The backend it wraps.
    pub fn inner(&self) -> &FsdpBackend {
        &self.inner
    }

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
        let pool = &self.inner.pool;
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
        for (i, p) in parts.iter().enumerate() {
            if (p.master_len as u64) < shards.rank_len {
                return Err(FsdpError::Config(format!(
                    "lent master of local rank {i}: the padded shard layout needs {} fp32 \
                     elements, {} lent",
                    shards.rank_len, p.master_len
                )));
            }
        }
        let mut items: Vec<Option<LentParts>> = parts.into_iter().map(Some).collect();
        let ranks = pool.run_each(&mut items, &|ctx, p| {
            let p = p.take().ok_or_else(|| {
                lifecycle_cuda::CudaError::Invalid("lent parts used twice".into())
            })?;
            let source = LentSource::F32 {
                ptr: p.master,
                len: p.master_len,
            };
            // SAFETY: the caller's promise (this function's contract).
            unsafe { LentRank::new(ctx, source, p.offload, p.stream) }
        })?;
        Ok(LentFsdpState {
            layout,
            shards,
            ranks,
        })
    }
}

impl lifecycle_cuda::RolloutSource for LentFsdpBackend {
    fn rollout_layout(&self) -> &lifecycle_layout::RolloutLayout {
        &self.inner.layout
    }

    fn rank_pool(&self) -> &Arc<lifecycle_cuda::ThreadRankPool> {
        &self.inner.pool
    }
}

impl Reshard for LentFsdpBackend {
    type TrainState = LentFsdpState;
    type Rollout = RolloutBuffer;
    type Plan = Arc<FsdpPlan>;
    type Error = FsdpError;

    fn plan(&self, state: &LentFsdpState) -> Result<Arc<FsdpPlan>, FsdpError> {
        let inner = &self.inner;
        let mut finite = || inner.check_finite_ranks(&state.ranks, &state.shards);
        inner.plan_layout(&state.layout, &mut finite)
    }

    fn enter(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut LentFsdpState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<RolloutBuffer, FsdpError> {
        if state.offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let inner = &self.inner;
        // Rollout buffers first: an OOM here leaves the training state untouched.
        // SAFETY: the plan's casts and receives tile every rollout slice exactly, so every element
        // is written before the buffers are handed out.
        let mut rolls =
            unsafe { alloc_rollout_buffers(&*inner.pool, plan.roll_len as usize, plan.peer_copy)? };
        let mut moved = inner.transfer(plan, &mut state.ranks, &mut rolls, &NoHooks, ctx)?;
        inner.finish_offload(&mut state.ranks, &NoHooks, ctx, &mut moved)?;
        Ok(RolloutBuffer::per_rank_shared(
            rolls,
            inner.pool.local_ranks().to_vec(),
            inner.entries(plan),
            plan.roll_len as usize,
        )?)
    }

    fn refresh(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut LentFsdpState,
        rollout: &mut RolloutBuffer,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        if state.offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        let inner = &self.inner;
        if rollout.len_per_rank() as u64 != plan.roll_len
            || rollout.local_ranks() != inner.pool.local_ranks()
        {
            return Err(FsdpError::RolloutMismatch {
                expected: plan.roll_len,
                found: rollout.len_per_rank() as u64,
            });
        }
        let mut moved =
            inner.transfer(plan, &mut state.ranks, rollout.buffers_mut(), &NoHooks, ctx)?;
        inner.finish_offload(&mut state.ranks, &NoHooks, ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut LentFsdpState,
        rollout: Option<RolloutBuffer>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        let inner = &self.inner;
        if let Some(rollout) = rollout {
            ctx.rec
                .phase(Phase::Release, |_| rollout.release(&*inner.pool))?;
        }
        inner
            .driver()
            .reload::<_, FsdpError>(&mut state.ranks, ctx, &NoHooks)?;
        Ok(())
    }
}
