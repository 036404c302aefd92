//! [`Reshard`] for [`FsdpBackend`] over either kind of training buffers ([`FsdpBuffers`]: the
//! backend's own or a caller's, lent): plan choice, then enter, refresh and exit as glue over
//! the engine's [switch driver](lifecycle_cuda::driver).

use crate::backend::FsdpBackend;
use crate::FsdpError;
use lifecycle_layout::plan_fsdp_to_tp;
use lifecycle_layout::settings::Configure;
use std::sync::Arc;

use lifecycle_core::{Phase, Reshard, SwitchContext};
use lifecycle_cuda::{alloc_rollout_buffers, RankExecutor, RolloutBuffer, Transport};

use crate::buffers::FsdpBuffers;
use lifecycle_layout::fp8::RolloutDtype;
use lifecycle_layout::fsdp::{
    build_fp8_plan, build_fp8_plan_of, build_plan, build_plan_of, FsdpPlan,
};
use lifecycle_layout::FsdpLayout;

impl<S: FsdpBuffers> FsdpBackend<S> {
    /// The plan from training layout `train` to this backend's rollout (cached while the layout
    /// is the same); `finite` checks the masters when fp8 or verification needs them finite.
    pub(crate) fn plan_layout(
        &self,
        train: &Arc<FsdpLayout>,
        finite: &mut dyn FnMut() -> Result<(), FsdpError>,
    ) -> Result<Arc<FsdpPlan>, FsdpError> {
        if train.world() != self.pool.world() {
            return Err(FsdpError::WorldMismatch {
                state: train.world(),
                pool: self.pool.world(),
            });
        }
        let mut cache = self
            .plan_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((layout, plan)) = cache.as_ref() {
            // The state's own layout (the same allocation) is the common case: no walk over
            // every tensor's name and shape, which costs ~30 ns a tensor (~0.1 ms at 3k).
            if Arc::ptr_eq(layout, train) || layout == train {
                return Ok(plan.clone());
            }
        }
        let core = plan_fsdp_to_tp(train, &self.layout)?;
        self.options
            .trained
            .check(train.tensors().iter().map(|(n, _)| n.as_str()))
            .map_err(|e| FsdpError::Config(e.to_string()))?;
        let mut plan = match self.options.dtype {
            RolloutDtype::Bf16 => build_plan(core, train, self.config),
            RolloutDtype::Fp8 => {
                finite()?;
                build_fp8_plan(core, train, self.config, self.options.fp8_keep)?
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
        if self.options.verify {
            finite()?;
        }
        *cache = Some((train.clone(), plan.clone()));
        Ok(plan)
    }
}

impl<S: FsdpBuffers> FsdpBackend<S> {
    /// The plan of the trained tensors alone ([`build_plan_of`]: the adapters and the whole
    /// tensors beside them, [`SwitchOptions::trained`](lifecycle_layout::settings::SwitchOptions::trained))
    /// made from `plan` (cached beside it), moving bytes as `plan` does (peer copies or NCCL).
    /// In an fp8 rollout the adapters are bf16 tensors beside the quantised base
    /// ([`build_fp8_plan_of`]: every place kept, a trained whole matrix that fp8 quantises
    /// quantised again, nothing else).
    fn adapter_plan(
        &self,
        plan: &Arc<FsdpPlan>,
        train: &FsdpLayout,
    ) -> Result<Arc<FsdpPlan>, FsdpError> {
        let mut cache = self
            .adapter_plan
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((whole, adapters)) = cache.as_ref()
            && Arc::ptr_eq(whole, plan)
        {
            return Ok(adapters.clone());
        }
        let trained = &self.options.trained;
        let moves = |name: &str| trained.moves(name);
        let core = plan.core.clone();
        let mut adapters = match self.options.dtype {
            RolloutDtype::Bf16 => build_plan_of(core, train, plan.config, &moves),
            RolloutDtype::Fp8 => {
                build_fp8_plan_of(core, train, plan.config, self.options.fp8_keep, &moves)?
            }
        };
        adapters.peer_copy = plan.peer_copy && adapters.peer_copyable();
        let adapters = Arc::new(adapters);
        *cache = Some((plan.clone(), adapters.clone()));
        Ok(adapters)
    }
}

impl<S: FsdpBuffers> Reshard for FsdpBackend<S> {
    type TrainState = S;
    type Rollout = RolloutBuffer;
    /// Shared, so a cached plan is handed out without copying it.
    type Plan = Arc<FsdpPlan>;
    type Error = FsdpError;

    fn plan(&self, state: &S) -> Result<Arc<FsdpPlan>, FsdpError> {
        self.check_options()
            .map_err(|e| FsdpError::Config(e.to_string()))?;
        let (ranks, shards) = state.parts();
        let mut finite = || self.check_finite_ranks(ranks, shards);
        self.plan_layout(state.train_layout(), &mut finite)
    }

    fn enter(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut S,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<RolloutBuffer, FsdpError> {
        state.on_device(true)?;
        state.clear_frozen_written();
        let len = plan.roll_len as usize;
        let peers_write = plan.peer_copy;
        // Rollout buffers first: an OOM here leaves the training state untouched.
        // SAFETY: the plan's casts and receives tile every rollout slice exactly, so every element
        // is written before the buffers are handed out.
        let mut rolls = unsafe { alloc_rollout_buffers(&*self.pool, len, peers_write)? };
        // The transfer phase's wall time starts after the rollout allocation (reported apart:
        // enter's total includes it).
        let (ranks, shards) = state.parts_mut();
        let hooks = S::hooks(shards, self.options.verify);
        let mut moved = self.transfer(plan, ranks, shards, &mut rolls, &hooks, ctx)?;
        let entries = self.entries(plan);
        if self.options.verify {
            self.record_rollout_sums(&rolls, entries.ranks())?;
        }
        if self.options.frozen_base {
            self.base_cast
                .store(true, std::sync::atomic::Ordering::Release);
        }
        // Verification hashes what leaves the device once its copies settled: it waits. So do
        // lent buffers, which are not freed in stream order (the driver checks).
        let keep_grads = ctx.memory.keep_rollout_resident;
        let overlap = self.options.offload_overlap && !self.options.verify;
        let rooms = self
            .driver()
            .finish_enter::<_, FsdpError>(ranks, ctx, &mut moved, &hooks, keep_grads, overlap)?;
        let rollout = RolloutBuffer::per_rank_shared(
            rolls,
            self.pool.local_ranks().to_vec(),
            entries,
            plan.roll_len as usize,
        )?;
        Ok(match rooms {
            Some(rooms) => rollout.with_freeing(rooms)?,
            None => rollout,
        })
    }

    fn refresh(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut S,
        rollout: &mut RolloutBuffer,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        state.on_device(false)?;
        if rollout.len_per_rank() as u64 != plan.roll_len
            || rollout.local_ranks() != self.pool.local_ranks()
        {
            return Err(FsdpError::RolloutMismatch {
                expected: plan.roll_len,
                found: rollout.len_per_rank() as u64,
            });
        }
        // The old hashes no longer describe the weights, whatever happens next.
        self.rollout_sums = None;
        // A frozen base stays as enter cast it: the trained tensors alone move, unless the
        // lender wrote the base (the next enter casts it again).
        if self.options.frozen_base
            && let Some(name) = state.frozen_written()
        {
            return Err(FsdpError::Tensor {
                name: name.to_string(),
                problem: "frozen (with_frozen_base) but written since enter: the refresh moves \
                          the trained tensors alone (the adapters and those named with \
                          with_trained), so its rollout form would be stale; write only those (the \
                          next rollout casts every tensor again)"
                    .into(),
            });
        }
        let plan = if self.options.frozen_base {
            self.adapter_plan(plan, state.train_layout())?
        } else {
            plan.clone()
        };
        let (ranks, shards) = state.parts_mut();
        let hooks = S::hooks(shards, self.options.verify);
        let mut moved = self.transfer(&plan, ranks, shards, rollout.buffers_mut(), &hooks, ctx)?;
        if self.options.verify {
            let entries = rollout.all_entries().to_vec();
            self.record_rollout_sums(rollout.buffers(), &entries)?;
        }
        self.finish_offload(ranks, &hooks, ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut S,
        rollout: Option<RolloutBuffer>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        let mut rollout_check = Ok(());
        if let Some(rollout) = rollout {
            rollout_check = self.check_rollout_sums(&rollout);
            ctx.rec
                .phase(Phase::Release, |_| rollout.release(&*self.pool))?;
            self.base_cast
                .store(false, std::sync::atomic::Ordering::Release);
        }
        let (ranks, shards) = state.parts_mut();
        let hooks = S::hooks(shards, self.options.verify);
        let corrupted = self.driver().reload::<_, FsdpError>(ranks, ctx, &hooks)?;
        if let Some((local, _, c)) = corrupted {
            return Err(FsdpError::Corrupted {
                rank: self.pool.local_ranks().get(local).copied().unwrap_or(local),
                tensor: c.tensor,
                buffer: c.buffer,
                expected: c.expected,
                found: c.found,
            });
        }
        rollout_check
    }
}
