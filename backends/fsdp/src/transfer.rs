//! The FSDP glue over the engine's [switch driver](lifecycle_cuda::driver): a rank's training
//! buffers as [`RankBuffers`] and the plan handed to the driver as a [`ProgramSpec`]
//! (verification, the driver's [`SwitchHooks`](lifecycle_cuda::driver::SwitchHooks), is
//! [`crate::hooks`]).

use crate::backend::FsdpBackend;
use crate::backend::{PlanRef, ProgramKey};
use crate::FsdpError;
use half::bf16;
use lifecycle_layout::fsdp::FsdpPlan;
use std::sync::Arc;

use lifecycle_core::SwitchContext;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::driver::{
    free_grads, restore_grads, BufferClass, Movable, ProgramSpec, RankBuffers, SwitchDriver,
    SwitchHooks,
};
use lifecycle_cuda::{CudaError, RankCtx, RankExecutor, RankMoved, RunOptions, SourceBuf};

use crate::state::RankTrain;
use crate::verify::Buffer;

impl RankBuffers for RankTrain {
    fn source(&self) -> Result<SourceBuf<'_>, CudaError> {
        let master = self
            .master
            .device()
            .ok_or_else(|| CudaError::Invalid("master weights are offloaded".into()))?;
        Ok(SourceBuf::F32(master))
    }

    fn movable(&mut self) -> Vec<Movable<'_>> {
        vec![
            Movable::new(Buffer::AdamM.name(), BufferClass::Optimizer, &mut self.m),
            Movable::new(Buffer::AdamV.name(), BufferClass::Optimizer, &mut self.v),
            Movable::new(Buffer::Master.name(), BufferClass::Params, &mut self.master),
        ]
    }

    fn release_scratch(&mut self, _ctx: &RankCtx) -> Result<u64, CudaError> {
        Ok(free_grads(&mut self.grads))
    }

    fn restore_scratch(&mut self, ctx: &RankCtx) -> Result<(), CudaError> {
        let len = self.master.len();
        restore_grads(ctx, &mut self.grads, len)
    }
}

impl<S: crate::buffers::FsdpBuffers> FsdpBackend<S> {
    /// Each local rank's rollout entries, made once per plan and shared by its rollouts.
    pub(crate) fn entries(&self, plan: &Arc<FsdpPlan>) -> crate::backend::RankEntries {
        let mut cache = self
            .entries_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((p, e)) = cache.as_ref()
            && Arc::ptr_eq(&p.0, plan)
        {
            return e.clone();
        }
        let entries = crate::backend::RankEntries::new(
            self.pool
                .local_ranks()
                .iter()
                .map(|&r| plan.entries(r))
                .collect(),
        );
        *cache = Some((PlanRef(plan.clone()), entries.clone()));
        entries
    }

    /// The driver over this backend's pool and pinned pool.
    pub(crate) fn driver(&self) -> SwitchDriver<'_, lifecycle_cuda::ThreadRankPool> {
        SwitchDriver::new(&*self.pool, &self.pinned)
    }

    /// Runs the transfer of `plan` from `ranks` into `rolls` (one per rank) through the driver,
    /// each rank's steps reading its source where it is ([`RankBuffers::source_offsets`]), the
    /// offload copies of the switch's memory policy overlapping it; records its metrics. A cast
    /// or quantisation that read a NaN or an infinity is named by tensor, rank and element.
    pub(crate) fn transfer<B: RankBuffers + Sync>(
        &self,
        plan: &Arc<FsdpPlan>,
        ranks: &mut [B],
        shards: &lifecycle_layout::fsdp::ShardLayout,
        rolls: &mut [CudaSlice<bf16>],
        hooks: &dyn SwitchHooks<B>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<Vec<RankMoved>, FsdpError> {
        let at: Vec<Option<Vec<u64>>> = ranks
            .iter()
            .map(|r| r.source_offsets().map(<[u64]>::to_vec))
            .collect();
        let steps = |c: &RankCtx, local: usize, _len: u64| match at.get(local) {
            Some(Some(a)) => plan.rank_steps_at(c.rank, a),
            _ => plan.rank_steps(c.rank),
        };
        let spec = ProgramSpec {
            key: ProgramKey {
                plan: PlanRef(plan.clone()),
                at: at.clone(),
            },
            batched_casts: self.batched_casts,
            opts: RunOptions::default(),
            peers_write: plan.peer_copy,
            steps: &steps,
        };
        let mut programs = self
            .programs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let moved = self
            .driver()
            .timed_transfer(ranks, &mut programs, rolls, &spec, ctx, hooks);
        drop(programs);
        moved
            .map_err(FsdpError::from)
            .map_err(|e| self.name_nonfinite(e, ranks, shards))
    }

    /// Waits for the offload copies, then frees what the policy moves out and the gradients
    /// (kept with `keep_rollout_resident`).
    pub(crate) fn finish_offload<B: RankBuffers>(
        &self,
        ranks: &mut [B],
        hooks: &dyn SwitchHooks<B>,
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), FsdpError> {
        let keep_grads = ctx.memory.keep_rollout_resident;
        self.driver()
            .finish_offload(ranks, ctx, moved, hooks, keep_grads)
    }
}
