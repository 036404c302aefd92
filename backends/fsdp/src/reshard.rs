//! [`Reshard`] for [`FsdpBackend`]: plan, enter, refresh and exit as glue over the transfer.

use crate::backend::FsdpBackend;
use crate::FsdpError;
use lifecycle_layout::plan_fsdp_to_tp;
use std::sync::Arc;
use std::time::Instant;

use lifecycle_core::{Link, Phase, Reshard, SwitchContext};
use lifecycle_cuda::{
    alloc_rollout_buffers, alloc_zeros, record_spans, record_transfer, RankExecutor, RankSpans,
    RolloutBuffer, StreamTimeline, Transport,
};

use crate::state::{FsdpTrainState, RankTrain};
use crate::verify::{self, Buffer, Mismatch};
use lifecycle_layout::fp8::RolloutDtype;
use lifecycle_layout::fsdp::{build_fp8_plan, build_plan, FsdpPlan};

impl Reshard for FsdpBackend {
    type TrainState = FsdpTrainState;
    type Rollout = RolloutBuffer;
    /// Shared, so a cached plan is handed out without copying it.
    type Plan = Arc<FsdpPlan>;
    type Error = FsdpError;

    fn plan(&self, state: &FsdpTrainState) -> Result<Arc<FsdpPlan>, FsdpError> {
        if state.world() != self.pool.world() {
            return Err(FsdpError::WorldMismatch {
                state: state.world(),
                pool: self.pool.world(),
            });
        }
        let mut cache = self
            .plan_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((layout, plan)) = cache.as_ref() {
            if *layout == state.layout {
                return Ok(plan.clone());
            }
        }
        let core = plan_fsdp_to_tp(&state.layout, &self.layout)?;
        let mut plan = match self.dtype {
            RolloutDtype::Bf16 => build_plan(core, &state.layout, self.config),
            RolloutDtype::Fp8 => {
                if self.pool.world() != 1 {
                    return Err(FsdpError::Config(format!(
                        "fp8 rollout weights on the GPU are quantised at W = 1 so far (this pool \
                         has W = {}): at W > 1 the amax of blocks whose rows live on several \
                         ranks must be agreed first; use RolloutDtype::Bf16",
                        self.pool.world()
                    )));
                }
                self.check_finite(state)?;
                build_fp8_plan(core, &state.layout, self.config, self.fp8_keep)?
            }
        };
        let peer = self.transport.resolve(&self.pool)?;
        if self.transport == Transport::PeerCopy && !plan.peer_copyable() {
            return Err(FsdpError::Config(format!(
                "transport PeerCopy needs every piece placed in the receivers' rollout buffers, \
                 which gather mode {:?} does not do at T = {}: use GatherMode::SendRecv or \
                 Transport::Auto",
                self.config.mode, plan.core.tp
            )));
        }
        plan.peer_copy = peer && plan.peer_copyable();
        if !plan.peer_copy {
            // This plan moves bytes with NCCL, which a pool with ranks on one GPU lacks.
            self.pool.require_nccl().map_err(|e| {
                FsdpError::Config(format!(
                    "gather mode {:?} at T = {} needs NCCL: {e}; GatherMode::SendRecv uses peer \
                     copies",
                    self.config.mode, plan.core.tp
                ))
            })?;
        }
        let plan = Arc::new(plan);
        if self.verify {
            self.check_finite(state)?;
        }
        *cache = Some((state.layout.clone(), plan.clone()));
        Ok(plan)
    }

    fn enter(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut FsdpTrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<RolloutBuffer, FsdpError> {
        if state.master_offloaded() || state.optimizer_offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let len = plan.roll_len as usize;
        let peers_write = plan.peer_copy;
        // Rollout buffers first: an OOM here leaves the training state untouched.
        // SAFETY: the plan's casts and receives tile every rollout slice exactly, so every element
        // is written before the buffers are handed out.
        let mut rolls = unsafe { alloc_rollout_buffers(&*self.pool, len, peers_write)? };
        // The transfer phase's wall time starts after the rollout allocation (reported apart:
        // enter's total includes it).
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        if self.verify {
            self.queue_offload_hashes(state, ctx.memory)?;
        }
        let mut moved = self.transfer(plan, state, &mut rolls, ctx.memory, tracing)?;
        record_transfer(ctx, &moved, start);
        let entries = self.entries(plan);
        if self.verify {
            self.record_rollout_sums(&rolls, &entries)?;
        }
        self.finish_offload(state, ctx, &mut moved)?;
        Ok(RolloutBuffer::per_rank_shared(
            rolls,
            self.pool.local_ranks().to_vec(),
            entries,
            plan.roll_len as usize,
        )?)
    }

    fn refresh(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut FsdpTrainState,
        rollout: &mut RolloutBuffer,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        if state.master_offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        if rollout.len_per_rank() as u64 != plan.roll_len
            || rollout.local_ranks() != self.pool.local_ranks()
        {
            return Err(FsdpError::RolloutMismatch {
                expected: plan.roll_len,
                found: rollout.len_per_rank() as u64,
            });
        }
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        if self.verify {
            self.queue_offload_hashes(state, ctx.memory)?;
        }
        // The old hashes no longer describe the weights, whatever happens next.
        self.rollout_sums = None;
        let mut moved = self.transfer(plan, state, rollout.buffers_mut(), ctx.memory, tracing)?;
        record_transfer(ctx, &moved, start);
        if self.verify {
            let entries = rollout.all_entries().to_vec();
            self.record_rollout_sums(rollout.buffers(), &entries)?;
        }
        self.finish_offload(state, ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut FsdpTrainState,
        rollout: Option<RolloutBuffer>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        let mut rollout_check = Ok(());
        if let Some(rollout) = rollout {
            rollout_check = self.check_rollout_sums(&rollout);
            ctx.rec
                .phase(Phase::Release, |_| rollout.release(&*self.pool))?;
        }
        let len = state.shards.rank_len as usize;
        let tracing = ctx.rec.tracing();
        let verify_on = self.verify;
        let table = verify::shard_table(&state.shards);
        let local_ranks = self.pool.local_ranks().to_vec();
        let slots = &state.shards.slots;
        let pinned = &*self.pinned;
        let out = ctx.rec.phase(Phase::Reload, |scope| {
            let mut items: Vec<&mut RankTrain> = state.ranks.iter_mut().collect();
            let moved = self.pool.run_each(&mut items, &|c, rt| {
                let mut h2d = 0u64;
                let mut tl = StreamTimeline::new(c, tracing)?;
                let offloaded = Buffer::ALL.map(|b| rt.device(b).is_none());
                for (buf, what) in [
                    (&mut rt.master, "reloading master"),
                    (&mut rt.m, "reloading Adam m"),
                    (&mut rt.v, "reloading Adam v"),
                ] {
                    h2d += buf.start_reload(c, what, &mut tl)?;
                }
                if rt.grads.is_none() {
                    rt.grads = Some(alloc_zeros(&c.compute, len, c.rank, "gradients")?);
                }
                c.sync_all()?;
                let mut corrupted: Option<(Buffer, Mismatch)> = None;
                for b in Buffer::ALL {
                    if !(verify_on && offloaded[b.index()] && rt.sums.has(b)) {
                        continue;
                    }
                    let (buf, sums) = rt.buffer_and_sums(b);
                    let Some(d) = buf.device() else {
                        continue;
                    };
                    // The reloaded copy differs: it stays offloaded (its device copy is dropped,
                    // its pinned copy kept) and keeps its hashes, so a retry fails the same way.
                    if let Some(m) = verify::check_reloaded(c, sums, b, d, &table)? {
                        corrupted.get_or_insert((b, m));
                        rt.buffer_mut(b).discard_device();
                    }
                }
                // The device copies are authoritative again: their pinned chunks go back to the
                // pool for the next offload.
                for b in Buffer::ALL {
                    rt.buffer_mut(b).release_host(c.rank, pinned);
                }
                Ok((h2d, corrupted, tl.finish()?))
            })?;
            scope.add_bytes(Link::HostToDevice, moved.iter().map(|m| m.0).sum());
            for (i, (_, corrupted, _)) in moved.iter().enumerate() {
                if let Some((b, m)) = corrupted {
                    return Err(FsdpError::Corrupted {
                        rank: local_ranks[i],
                        tensor: slots
                            .get(m.tensor)
                            .map(|s| s.name.clone())
                            .unwrap_or_default(),
                        buffer: b.name(),
                        expected: m.expected,
                        found: m.found,
                    });
                }
            }
            Ok::<Vec<RankSpans>, FsdpError>(moved.into_iter().map(|m| m.2).collect())
        })?;
        record_spans(ctx, self.pool.local_ranks(), &out);
        rollout_check
    }
}
