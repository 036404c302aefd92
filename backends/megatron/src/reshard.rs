//! The [`Reshard`] implementation: plan choice, then enter, refresh and exit as glue over the
//! engine's [switch driver](lifecycle_cuda::driver).

use crate::backend::{MegatronGpuBackend, MegatronGpuPlan, NEXT_PLAN};
use lifecycle_layout::settings::Configure;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use lifecycle_core::{Phase, Reshard, SwitchContext};
use lifecycle_cuda::driver::NoHooks;
use lifecycle_cuda::{alloc_rollout_buffers, RolloutBuffer};

use crate::buffers::MegatronBuffers;
use crate::error::MegatronGpuError;
use lifecycle_layout::fp8::RolloutDtype;
use lifecycle_layout::megatron::schedule::{build_rank, rollout_offsets};
use lifecycle_layout::megatron::{
    check_fused_fp8, fp8_one_read, fp8_rollout, plan_megatron_to_tp, BucketConfig,
};

impl<S: MegatronBuffers> Reshard for MegatronGpuBackend<S> {
    type TrainState = S;
    type Rollout = RolloutBuffer;
    type Plan = Arc<MegatronGpuPlan>;
    type Error = MegatronGpuError;

    fn plan(&self, state: &S) -> Result<Arc<MegatronGpuPlan>, MegatronGpuError> {
        self.check_options()
            .map_err(|e| MegatronGpuError::Config(e.to_string()))?;
        self.check_state(state)?;
        let bucket = BucketConfig {
            bucket_bytes: self.config.bucket_bytes,
        };
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cached.as_ref() {
            let same = p.made_for(state.train_layout(), &self.rollout)
                && p.config == self.config
                && p.fp8.is_some() == (self.options.dtype == RolloutDtype::Fp8)
                && p.keep == self.options.fp8_keep
                && p.ranks
                    .iter()
                    .map(|s| s.rank)
                    .eq(self.locals().iter().copied());
            if same {
                return Ok(p.clone());
            }
        }
        let peer_copy = self.config.transport.resolve(&self.pool)?;
        let plan = plan_megatron_to_tp(state.train_layout(), &self.rollout, bucket)?;
        let (offsets, len) = rollout_offsets(&plan);
        let fp8 = match self.options.dtype {
            RolloutDtype::Bf16 => None,
            RolloutDtype::Fp8 => {
                let keep = self.options.fp8_keep;
                check_fused_fp8(&plan.tensors, plan.train.model(), self.rollout.tp(), keep)?;
                self.check_finite(state)?;
                Some(fp8_rollout(&plan.tensors, &offsets, keep))
            }
        };
        let opts = self.config.schedule_options(peer_copy);
        let one = fp8
            .as_ref()
            .and_then(|f| fp8_one_read(&plan, f).map(|o| (o, f.len)));
        let locals = self.locals();
        let (ranks, one_read, len) = match &one {
            // one read: the schedules copy the bf16 tensors into the fp8 rollout buffer itself
            Some((o, fp8_len)) => (
                locals
                    .iter()
                    .map(|&r| build_rank(&o.plan, &o.offsets, r, opts))
                    .collect(),
                Some(locals.iter().map(|&r| o.quantise[r].clone()).collect()),
                *fp8_len,
            ),
            None => (
                locals
                    .iter()
                    .map(|&r| build_rank(&plan, &offsets, r, opts))
                    .collect(),
                None,
                len,
            ),
        };
        let p = Arc::new(MegatronGpuPlan {
            id: NEXT_PLAN.fetch_add(1, Ordering::Relaxed),
            layouts: (state.train_layout().clone(), self.rollout.clone()),
            config: self.config,
            peer_copy,
            plan,
            offsets,
            len,
            ranks,
            fp8,
            one_read,
            one_read_zero: one.as_ref().map_or_else(Vec::new, |(o, _)| {
                o.zero
                    .iter()
                    .map(|z| z.start as u64..z.end as u64)
                    .collect()
            }),
            keep: self.options.fp8_keep,
        });
        *cached = Some(p.clone());
        Ok(p)
    }

    fn enter(
        &mut self,
        plan: &Arc<MegatronGpuPlan>,
        state: &mut S,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<RolloutBuffer, MegatronGpuError> {
        self.check_plan(plan, state)?;
        if state.offloaded() {
            return Err(MegatronGpuError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let len = plan.len;
        let peers_write = plan
            .ranks
            .iter()
            .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty());
        // Rollout buffers first: an OOM here leaves the training state untouched.
        // SAFETY: the schedule's local and unpack tiles and the zeroed vocabulary padding cover
        // each buffer exactly (in an fp8 rollout written in one read, the bf16 tensors' tiles,
        // the quantisations and the zeroed gaps between them: `Fp8Rollout::gaps`), so every
        // element is written before the buffers are handed out.
        let mut rolls = unsafe { alloc_rollout_buffers(&*self.pool, len, peers_write)? };
        // A staged fp8 rollout: `rolls` is the staging buffer, the rollout buffer allocated now.
        let mut fp8 = match &plan.fp8 {
            Some(f) if !plan.fp8_one_read() => Some(self.alloc_fp8_rollouts(f)?),
            _ => None,
        };
        let mut moved =
            self.transfer(plan, state.ranks_mut(), &mut rolls, fp8.as_deref_mut(), ctx)?;
        let rooms = self.finish_enter(state.ranks_mut(), ctx, &mut moved)?;
        let (rolls, entries, len) = match (fp8, &plan.fp8) {
            (Some(written), Some(f)) => {
                drop(rolls);
                (written, f.entries.clone(), f.len)
            }
            // written in one read
            (None, Some(f)) => (rolls, f.entries.clone(), f.len),
            _ => (rolls, Self::entries(plan), len),
        };
        let rollout = RolloutBuffer::new(rolls, self.locals().to_vec(), entries, len)?;
        Ok(match rooms {
            Some(rooms) => rollout.with_freeing(rooms)?,
            None => rollout,
        })
    }

    fn refresh(
        &mut self,
        plan: &Arc<MegatronGpuPlan>,
        state: &mut S,
        rollout: &mut RolloutBuffer,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronGpuError> {
        self.check_plan(plan, state)?;
        if state.offloaded() {
            return Err(MegatronGpuError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        if rollout.len_per_rank() != plan.rollout_len() || rollout.local_ranks() != self.locals() {
            return Err(MegatronGpuError::RolloutMismatch {
                expected: plan.rollout_len(),
                expected_ranks: self.locals().len(),
                found: rollout.len_per_rank(),
                found_ranks: rollout.local_ranks().len(),
            });
        }
        let mut moved = match &plan.fp8 {
            Some(_) if !plan.fp8_one_read() => {
                let peers_write = plan
                    .ranks
                    .iter()
                    .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty());
                // SAFETY: as in enter: the schedules write every element of the staging buffer.
                let mut staging =
                    unsafe { alloc_rollout_buffers(&*self.pool, plan.len, peers_write)? };
                let rolls = Some(rollout.buffers_mut());
                self.transfer(plan, state.ranks_mut(), &mut staging, rolls, ctx)?
            }
            // bf16, or fp8 in one read: straight into the rollout buffers
            _ => self.transfer(plan, state.ranks_mut(), rollout.buffers_mut(), None, ctx)?,
        };
        self.finish_offload(state.ranks_mut(), ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut S,
        rollout: Option<RolloutBuffer>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronGpuError> {
        if let Some(rollout) = rollout {
            ctx.rec
                .phase(Phase::Release, |_| rollout.release(&*self.pool))?;
        }
        self.check_state(state)?;
        // Megatron's buffers carry no verification hashes: nothing can be found corrupted.
        self.driver()
            .reload::<_, MegatronGpuError>(state.ranks_mut(), ctx, &NoHooks)?;
        Ok(())
    }
}
