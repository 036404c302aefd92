//! The FSDP glue over the engine's [switch driver](lifecycle_cuda::driver): a rank's training
//! buffers as [`RankBuffers`], verification as [`SwitchHooks`], and the
//! plan handed to the driver as a [`ProgramSpec`].

use crate::backend::FsdpBackend;
use crate::backend::{PlanRef, ProgramKey};
use crate::FsdpError;
use half::bf16;
use lifecycle_layout::fsdp::FsdpPlan;
use std::sync::Arc;

use lifecycle_core::{MemoryPolicy, SwitchContext};
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::driver::{
    free_grads, restore_grads, BufferClass, Corruption, Movable, ProgramSpec, RankBuffers,
    SwitchDriver, SwitchHooks,
};
use lifecycle_cuda::{
    ChunkTable, CudaError, RankCtx, RankExecutor, RankMoved, RunOptions, SourceBuf,
};

use crate::state::RankTrain;
use crate::verify::{self, Buffer};

/// The buffers in the order of [`RankTrain::movable`]: Adam state first, the master (which the
/// plan reads) last.
const MOVABLE: [Buffer; 3] = [Buffer::AdamM, Buffer::AdamV, Buffer::Master];

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

/// The FSDP backend's hooks: verification (hashes of what leaves the device, checked when it
/// returns).
pub struct FsdpHooks<'a> {
    /// Verification mode: the chunks of every tensor's shard.
    pub(crate) verify: Option<ChunkTable>,
    /// The state's shard layout: its slots name the tensors of corruption reports (borrowed,
    /// not copied: an MoE layout has thousands of names, and a switch builds its hooks each
    /// time).
    pub(crate) shards: &'a lifecycle_layout::fsdp::ShardLayout,
}

impl SwitchHooks<RankTrain> for FsdpHooks<'_> {
    fn before_offload(
        &self,
        ctx: &RankCtx,
        rt: &mut RankTrain,
        memory: MemoryPolicy,
    ) -> Result<(), CudaError> {
        let Some(table) = &self.verify else {
            return Ok(());
        };
        rt.sums.clear();
        for b in Buffer::ALL {
            let offloads = match b {
                Buffer::Master => memory.offload_params,
                Buffer::AdamM | Buffer::AdamV => memory.offload_optimizer,
            };
            if !offloads {
                continue;
            }
            let (buf, sums) = rt.buffer_and_sums(b);
            if let Some(d) = buf.device() {
                verify::queue_offload_hash(ctx, sums, b, d, table)?;
            }
        }
        Ok(())
    }

    fn offload_settled(&self, _ctx: &RankCtx, rt: &mut RankTrain) -> Result<(), CudaError> {
        verify::settle_offload_hashes(&mut rt.sums)
    }

    fn check_reloaded(
        &self,
        ctx: &RankCtx,
        rt: &mut RankTrain,
        reloaded: &[bool],
    ) -> Result<Vec<(usize, Corruption)>, CudaError> {
        let Some(table) = &self.verify else {
            return Ok(Vec::new());
        };
        let mut found = Vec::new();
        // In the order errors have always been reported: master, Adam m, Adam v.
        for b in Buffer::ALL {
            let Some(i) = MOVABLE.iter().position(|&x| x == b) else {
                continue;
            };
            if !(reloaded.get(i).copied().unwrap_or(false) && rt.sums.has(b)) {
                continue;
            }
            let (buf, sums) = rt.buffer_and_sums(b);
            let Some(d) = buf.device() else {
                continue;
            };
            if let Some(m) = verify::check_reloaded(ctx, sums, b, d, table)? {
                let tensor = self
                    .shards
                    .slots
                    .get(m.tensor)
                    .map(|s| s.name.clone())
                    .unwrap_or_default();
                let c = Corruption {
                    buffer: b.name(),
                    tensor,
                    expected: m.expected,
                    found: m.found,
                };
                found.push((i, c));
            }
        }
        Ok(found)
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
