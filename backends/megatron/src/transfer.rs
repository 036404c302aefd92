//! One transfer: offload copies first on the copy stream, every rank's step program run by the
//! engine's step runner, then the offload finished and what the policy moves out freed.

use crate::backend::{MegatronGpuBackend, MegatronGpuPlan, RankRes};

use cudarc::driver::CudaSlice;
use half::bf16;
use lifecycle_core::{MemoryPolicy, SwitchContext};
use lifecycle_cuda::{
    peer_bases, run_program, CudaError, RankExecutor, RankMoved, RunOptions, SourceBuf,
    StreamTimeline,
};
use lifecycle_layout::RolloutEntry;

use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};
use lifecycle_layout::megatron::schedule::RankSchedule;
use lifecycle_layout::megatron::StepShape;

impl MegatronGpuBackend {
    pub(crate) fn entries(plan: &MegatronGpuPlan) -> Vec<RolloutEntry> {
        plan.plan
            .tensors
            .iter()
            .zip(&plan.offsets)
            .map(|(t, &offset)| RolloutEntry::new(t.name.clone(), t.shape.clone(), offset))
            .collect()
    }

    /// Runs every local rank's schedule into `rolls`, starting the offload copies of `memory`
    /// first so they overlap it. With `tracing`, each rank's work is marked on a
    /// [`StreamTimeline`] (returned in its [`RankMoved`], read by [`Self::finish_offload`]).
    pub(crate) fn transfer(
        &mut self,
        plan: &MegatronGpuPlan,
        state: &mut MegatronGpuState,
        rolls: &mut [CudaSlice<bf16>],
        memory: MemoryPolicy,
        tracing: bool,
    ) -> Result<Vec<RankMoved>, MegatronGpuError> {
        let pinned = &*self.pinned;
        let config = plan.config;
        // Peer copies write into every rank's rollout buffer: their addresses by global rank.
        let bases = if plan
            .ranks
            .iter()
            .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty())
        {
            peer_bases(&*self.pool, rolls)?
        } else {
            vec![0u64; self.pool.world()]
        };
        let bases = &bases;
        let mut items: Vec<(
            &mut GpuRank,
            &mut RankRes,
            &mut CudaSlice<bf16>,
            &RankSchedule,
        )> = state
            .ranks
            .iter_mut()
            .zip(self.ranks.iter_mut())
            .zip(rolls.iter_mut())
            .zip(&plan.ranks)
            .map(|(((rt, res), roll), s)| (rt, res, roll, s))
            .collect();
        let id = plan.id;
        let moved = self.pool.run_each(&mut items, &|ctx, (rt, res, roll, s)| {
            let mut tl = StreamTimeline::new(ctx, tracing)?;
            ctx.order(&ctx.compute, &ctx.copy)?;
            // Offload copies first, on the copy stream: they overlap everything below.
            if memory.offload_optimizer {
                rt.adam_m
                    .start_offload(ctx, pinned, "offloading Adam m", &mut tl)?;
                rt.adam_v
                    .start_offload(ctx, pinned, "offloading Adam v", &mut tl)?;
            }
            if memory.offload_params {
                rt.main
                    .start_offload(ctx, pinned, "offloading main params", &mut tl)?;
                rt.params
                    .start_offload(ctx, pinned, "offloading bf16 parameters", &mut tl)?;
            }
            let Some(params) = rt.params.device() else {
                return Err(CudaError::Invalid(
                    "the bf16 parameters are offloaded: leave rollout mode first".into(),
                ));
            };
            let shape = StepShape {
                world: ctx.world,
                source_elems: params.len() as u64,
                rollout_elems: plan.len as u64,
                in_flight: config.in_flight,
                peer_copy: plan.peer_copy,
                split_local_bulk: config.split_local_bulk,
            };
            let program = res
                .program
                .get_or_build(ctx, id, true, || s.rank_steps(shape))?;
            let opts = RunOptions {
                overlap_blocks_per_sm: config.overlap_blocks_per_sm,
            };
            let source = SourceBuf::Bf16(params);
            run_program(ctx, program, source, roll, bases, opts, tl)
        })?;
        Ok(moved)
    }

    /// Waits for the offload copies, then frees what the policy moved out, and the grads; reads
    /// the transfer's device timelines (every stream is synchronised by then) into the trace.
    pub(crate) fn finish_offload(
        &self,
        state: &mut MegatronGpuState,
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), MegatronGpuError> {
        let memory = ctx.memory;
        lifecycle_cuda::finish_offload(
            &*self.pool,
            ctx,
            &mut state.ranks,
            moved,
            &|c, rt: &mut GpuRank| {
                c.sync_all()?;
                let mut bytes = 0;
                if memory.offload_params {
                    bytes += rt.params.drop_device() + rt.main.drop_device();
                }
                if memory.offload_optimizer {
                    bytes += rt.adam_m.drop_device() + rt.adam_v.drop_device();
                }
                rt.grads = None;
                c.sync_all()?;
                Ok(bytes)
            },
        )
    }
}
