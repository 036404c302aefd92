//! The Megatron glue over the engine's [switch driver](lifecycle_cuda::driver): a rank's
//! training buffers as [`RankBuffers`] and the plan's schedules handed to the driver as a
//! [`ProgramSpec`].

use crate::backend::{MegatronGpuBackend, MegatronGpuPlan};
use crate::buffers::MegatronBuffers;

use half::bf16;
use lifecycle_core::SwitchContext;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::driver::{
    free_grads, restore_grads, BufferClass, Movable, NoHooks, ProgramSpec, RankBuffers,
    SwitchDriver, TransferMode,
};
use lifecycle_cuda::{
    record_transfer, CudaError, FreeingRoom, RankCtx, RankMoved, RunOptions, SourceBuf,
};
use lifecycle_layout::megatron::{MegatronLayout, StepShape};
use lifecycle_layout::RolloutEntry;
use std::time::Instant;

use crate::error::MegatronGpuError;
use crate::state::GpuRank;

impl RankBuffers for GpuRank {
    fn source(&self) -> Result<SourceBuf<'_>, CudaError> {
        let params = self.params.device().ok_or_else(|| {
            CudaError::Invalid("the bf16 parameters are offloaded: leave rollout mode first".into())
        })?;
        Ok(SourceBuf::Bf16(params))
    }

    fn movable(&mut self) -> Vec<Movable<'_>> {
        vec![
            Movable::new("adam_m", BufferClass::Optimizer, &mut self.adam_m),
            Movable::new("adam_v", BufferClass::Optimizer, &mut self.adam_v),
            Movable::new("main params", BufferClass::Params, &mut self.main),
            Movable::new("bf16 parameters", BufferClass::Params, &mut self.params),
        ]
    }

    fn release_scratch(&mut self, _ctx: &RankCtx) -> Result<u64, CudaError> {
        Ok(free_grads(&mut self.grads))
    }

    fn restore_scratch(&mut self, ctx: &RankCtx) -> Result<(), CudaError> {
        let len = self.params.len();
        restore_grads(ctx, &mut self.grads, len)
    }
}

/// The parameters of `rank`'s stage as the segments of its buffer in the layout's order:
/// `(offset, elements)` per slot (what a lent source's reads are rebased from).
pub(crate) fn stage_segments(layout: &MegatronLayout, rank: usize) -> Vec<(u64, u64)> {
    let stage = layout.coords(rank).pp;
    layout
        .stage_slots(stage)
        .iter()
        .map(|s| (s.offset as u64, s.numel() as u64))
        .collect()
}

impl<S: MegatronBuffers> MegatronGpuBackend<S> {
    pub(crate) fn entries(plan: &MegatronGpuPlan) -> Vec<RolloutEntry> {
        plan.plan
            .tensors
            .iter()
            .zip(&plan.offsets)
            .map(|(t, &offset)| RolloutEntry::new(t.name.clone(), t.shape.clone(), offset))
            .collect()
    }

    /// The driver over this backend's pool and pinned pool.
    pub(crate) fn driver(&self) -> SwitchDriver<'_, lifecycle_cuda::ThreadRankPool> {
        SwitchDriver::new(&*self.pool, &self.pinned)
    }

    /// Runs every local rank's schedule into `rolls` through the driver, each rank's steps
    /// reading its parameters where they are ([`RankBuffers::source_offsets`]: a lent rank's
    /// reads rebased from the layout's slots onto its tensors), the offload copies of
    /// the switch's memory policy overlapping it; in a staged fp8 rollout `rolls` is the
    /// staging buffer and `fp8` the rollout buffers the plan's [`Fp8Rollout`] pass writes from
    /// it (in one read, `rolls` the rollout buffers and `fp8` `None`).
    /// Records the metrics of both as the transfer phase.
    ///
    /// [`Fp8Rollout`]: lifecycle_layout::megatron::Fp8Rollout
    pub(crate) fn transfer<B: RankBuffers + Sync>(
        &mut self,
        plan: &MegatronGpuPlan,
        ranks: &mut [B],
        rolls: &mut [CudaSlice<bf16>],
        fp8: Option<&mut [CudaSlice<bf16>]>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<Vec<RankMoved>, MegatronGpuError> {
        let start = Instant::now();
        let config = plan.config;
        let at: Vec<Option<Vec<u64>>> = ranks
            .iter()
            .map(|r| r.source_offsets().map(<[u64]>::to_vec))
            .collect();
        let train = &plan.layouts.0;
        let steps = |c: &RankCtx, local: usize, source_elems: u64| {
            let s = plan.ranks.get(local).ok_or_else(|| {
                lifecycle_layout::LayoutError::InvalidSteps {
                    rank: c.rank,
                    what: format!("the plan has no schedule for local rank {local}"),
                }
            })?;
            let lent = at.get(local).and_then(Option::as_ref);
            // a lent rank's steps are made over the layout's buffer, then rebased
            let stage_len = train.stage_len(train.coords(c.rank).pp) as u64;
            let mut steps = s.rank_steps(StepShape {
                world: c.world,
                source_elems: if lent.is_some() {
                    stage_len
                } else {
                    source_elems
                },
                rollout_elems: plan.len as u64,
                in_flight: config.in_flight,
                peer_copy: plan.peer_copy,
                split_local_bulk: config.split_local_bulk,
            })?;
            // fp8 in one read: the rank's quantisations from its parameters join its steps
            if let Some(q) = plan.one_read.as_ref().and_then(|q| q.get(local)) {
                steps.quantise = q.clone();
                steps.zero.extend(plan.one_read_zero.iter().cloned());
                steps.validate()?;
            }
            if let Some(to) = lent {
                steps.rebase_source(&stage_segments(train, c.rank), to)?;
            }
            Ok(steps)
        };
        let spec = ProgramSpec {
            key: (plan.id, at.clone()),
            batched_casts: true,
            opts: RunOptions {
                overlap_blocks_per_sm: config.overlap_blocks_per_sm,
            },
            peers_write: plan
                .ranks
                .iter()
                .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty()),
            steps: &steps,
        };
        let driver = SwitchDriver::new(&*self.pool, &self.pinned);
        let mode = TransferMode {
            memory: ctx.memory,
            tracing: ctx.rec.tracing(),
        };
        let mut moved = driver.transfer(ranks, &mut self.programs, rolls, &spec, mode, &NoHooks)?;
        if let (Some(f), Some(out)) = (&plan.fp8, fp8) {
            let written = self.quantise(f, rolls, out)?;
            for (m, bytes) in moved.iter_mut().zip(written) {
                // the staging buffer counts as staging; the pass's writes as local bytes
                m.staging += 2 * plan.len as u64;
                m.local += bytes;
            }
        }
        record_transfer(ctx, &moved, start);
        Ok(moved)
    }

    /// Waits for the offload copies, then frees what the policy moved out, and the grads; reads
    /// the transfer's device timelines into the trace.
    pub(crate) fn finish_offload<B: RankBuffers>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), MegatronGpuError> {
        self.driver()
            .finish_offload(ranks, ctx, moved, &NoHooks, false)
    }

    /// The offload phase of an enter: overlapped with the rollout when the backend asks for it
    /// and the switch allows it (each rank's [`FreeingRoom`] returned), settled otherwise.
    pub(crate) fn finish_enter<B: RankBuffers>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<Option<Vec<FreeingRoom>>, MegatronGpuError> {
        self.driver().finish_enter(
            ranks,
            ctx,
            moved,
            &NoHooks,
            false,
            self.options.offload_overlap,
        )
    }
}
