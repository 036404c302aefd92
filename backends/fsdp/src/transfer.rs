//! One transfer: offload copies started first on the copy stream, every rank's bucket plan run
//! as steps by the engine's step runner ([`lifecycle_cuda::run_program`]), then the offload
//! finished and what the policy moves out freed.

use crate::backend::FsdpBackend;
use crate::backend::PlanRef;
use crate::FsdpError;
use half::bf16;
use lifecycle_layout::fsdp::FsdpPlan;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use lifecycle_core::{MemoryPolicy, SwitchContext};
use lifecycle_cuda::{
    peer_bases, run_program, CudaError, ProgramSlot, RankExecutor, RankMoved, RunOptions,
    SourceBuf, StreamTimeline,
};

use crate::state::{FsdpTrainState, RankTrain};
use crate::verify::{self, Buffer};

impl FsdpBackend {
    /// Each local rank's rollout entries, made once per plan and shared by its rollouts.
    pub(crate) fn entries(&self, plan: &Arc<FsdpPlan>) -> crate::backend::RankEntries {
        let mut cache = self
            .entries_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((p, e)) = cache.as_ref() {
            if Arc::ptr_eq(&p.0, plan) {
                return e.clone();
            }
        }
        let entries: crate::backend::RankEntries = Arc::new(
            self.pool
                .local_ranks()
                .iter()
                .map(|&r| plan.entries(r))
                .collect(),
        );
        *cache = Some((PlanRef(plan.clone()), entries.clone()));
        entries
    }

    /// Runs the transfer into `rolls` (one per rank), starting the offload copies of `memory`
    /// first so they overlap it. Returns per-rank statistics.
    pub(crate) fn transfer(
        &self,
        plan: &Arc<FsdpPlan>,
        state: &mut FsdpTrainState,
        rolls: &mut [CudaSlice<bf16>],
        memory: MemoryPolicy,
        tracing: bool,
    ) -> Result<Vec<RankMoved>, FsdpError> {
        // Peer copies write into every rank's rollout buffer: their addresses by global rank.
        let bases = if plan.peer_copy {
            peer_bases(&*self.pool, rolls)?
        } else {
            vec![0u64; self.pool.world()]
        };
        let bases = &bases;
        let mut programs = self
            .programs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        programs.resize_with(state.ranks.len(), ProgramSlot::default);
        let mut items: Vec<_> = state
            .ranks
            .iter_mut()
            .zip(rolls.iter_mut())
            .zip(programs.iter_mut())
            .map(|((rt, roll), prog)| (rt, roll, prog))
            .collect();
        let batched = self.batched_casts;
        let pinned = &*self.pinned;
        let opt = memory.offload_optimizer;
        let offloads = [
            (opt, Buffer::AdamM, "offload Adam m"),
            (opt, Buffer::AdamV, "offload Adam v"),
            (memory.offload_params, Buffer::Master, "offload master"),
        ];
        let moved = self.pool.run_each(&mut items, &|ctx, (rt, roll, prog)| {
            // Pinned chunks first (from the pool: pinned once, then reused): failing here
            // changes nothing.
            for (on, b, what) in offloads {
                if on {
                    rt.buffer_mut(b).reserve_host(ctx, pinned, what)?;
                }
            }
            let mut tl = StreamTimeline::new(ctx, tracing)?;
            // Offload copies on the copy stream: they overlap the NVLink work below (master
            // last: the casts read it meanwhile, which the copy does not disturb).
            for (on, b, what) in offloads {
                if on {
                    rt.buffer_mut(b).start_offload(ctx, pinned, what, &mut tl)?;
                }
            }
            let master = rt
                .master
                .device()
                .ok_or_else(|| CudaError::Invalid("master weights are offloaded".into()))?;
            let key = PlanRef(plan.clone());
            let program = prog.get_or_build(ctx, key, batched, || plan.rank_steps(ctx.rank))?;
            let source = SourceBuf::F32(master);
            let opts = RunOptions::default();
            let mut moved = run_program(ctx, program, source, roll, bases, opts, tl)?;
            // an fp8 plan's quantised slices, from the masters into the same buffer
            moved.local += crate::fp8::quantise_rank(ctx, plan, master, roll)?;
            Ok(moved)
        })?;
        Ok(moved)
    }

    /// Waits for the offload copies, then frees what the policy moves out and the gradients.
    pub(crate) fn finish_offload(
        &self,
        state: &mut FsdpTrainState,
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), FsdpError> {
        let memory = ctx.memory;
        let free_grads = !memory.keep_rollout_resident;
        let copies = memory.offload_params || memory.offload_optimizer;
        lifecycle_cuda::finish_offload(
            &*self.pool,
            ctx,
            &mut state.ranks,
            moved,
            &|ctx, rt: &mut RankTrain| {
                // The transfer waited for its own streams; only the offload copies (copy stream)
                // and the verification hashes queued before them may still run.
                if copies {
                    ctx.wait(&[&ctx.copy], "waiting for the offload copies")?;
                }
                verify::settle_offload_hashes(&mut rt.sums)?;
                let mut bytes = 0;
                if memory.offload_params {
                    bytes += rt.master.drop_device();
                }
                if memory.offload_optimizer {
                    bytes += rt.m.drop_device() + rt.v.drop_device();
                }
                if free_grads {
                    rt.grads = None;
                }
                // Frees are stream-ordered: the memory returns to the pool without a wait.
                Ok(bytes)
            },
        )
    }
}
