//! One transfer: offload copies started first on the copy stream, every rank's bucket plan run
//! as steps by the engine's step runner ([`lifecycle_cuda::run_program`]), then the offload
//! finished and what the policy moves out freed.

use crate::backend::FsdpBackend;
use crate::FsdpError;
use half::bf16;
use lifecycle_layout::fsdp::FsdpPlan;
use lifecycle_layout::RolloutEntry;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use lifecycle_core::{Link, MemoryPolicy, Phase, SwitchContext};
use lifecycle_cuda::{
    peer_bases, record_spans, run_program, CudaError, DeviceProgram, RankExecutor, RankMoved,
    RankSpans, RunOptions, SourceBuf, StreamTimeline,
};

use crate::state::{FsdpTrainState, RankTrain};
use crate::verify::{self, Buffer};

impl FsdpBackend {
    pub(crate) fn entries(plan: &FsdpPlan) -> Vec<RolloutEntry> {
        plan.core
            .ranks
            .first()
            .map(|r0| {
                r0.tensors
                    .iter()
                    .zip(&plan.roll_offsets)
                    .map(|(t, &offset)| {
                        RolloutEntry::new(
                            plan.core.tensors[t.tensor].name.clone(),
                            t.shape.clone(),
                            offset as usize,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
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
        programs.resize_with(state.ranks.len(), || None);
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
            if !prog.as_ref().is_some_and(|(p, _)| Arc::ptr_eq(p, plan)) {
                **prog = None;
                let steps = plan
                    .rank_steps(ctx.rank)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                **prog = Some((plan.clone(), DeviceProgram::new(ctx, steps, batched)?));
            }
            let Some((_, program)) = prog.as_ref() else {
                return Err(CudaError::Invalid("no step program".into()));
            };
            let source = SourceBuf::F32(master);
            let opts = RunOptions::default();
            let mut moved = run_program(ctx, program, source, roll, bases, opts, &mut tl)?;
            moved.timeline = Some(tl);
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
        let bytes_each = state.shards.rank_len * 4;
        let spans = ctx.rec.phase(Phase::Offload, |scope| {
            let mut items: Vec<(&mut RankTrain, Option<StreamTimeline>)> = state
                .ranks
                .iter_mut()
                .zip(moved.iter_mut().map(|m| m.timeline.take()))
                .collect();
            let copies = memory.offload_params || memory.offload_optimizer;
            let spans = self.pool.run_each(&mut items, &|ctx, (rt, tl)| {
                // The transfer waited for its own streams; only the offload copies (copy
                // stream) and the verification hashes queued before them may still run.
                if copies {
                    ctx.wait(&[&ctx.copy], "waiting for the offload copies")?;
                }
                verify::settle_offload_hashes(&mut rt.sums)?;
                let spans = match tl.take() {
                    Some(tl) => tl.finish()?,
                    None => RankSpans::default(),
                };
                if memory.offload_params {
                    rt.master.drop_device();
                }
                if memory.offload_optimizer {
                    rt.m.drop_device();
                    rt.v.drop_device();
                }
                if free_grads {
                    rt.grads = None;
                }
                // Frees are stream-ordered: the memory returns to the pool without a wait.
                Ok(spans)
            })?;
            let per_rank =
                bytes_each * (memory.offload_params as u64 + 2 * memory.offload_optimizer as u64);
            scope.add_bytes(Link::DeviceToHost, per_rank * state.ranks.len() as u64);
            Ok::<Vec<RankSpans>, FsdpError>(spans)
        })?;
        record_spans(ctx, self.pool.local_ranks(), &spans);
        Ok(())
    }
}
