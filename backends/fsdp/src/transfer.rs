//! One transfer: offload copies started first on the copy stream, every rank's bucket loop
//! ([`crate::buckets`]), then the offload finished and what the policy moves out freed.

use cudarc::driver::{CudaSlice, DevicePtr, PinnedHostSlice};
use half::bf16;
use lifecycle_core::{Link, MemoryPolicy, Phase, SwitchContext};
use lifecycle_cuda::{
    alloc_pinned, peer_bases, record_spans, CudaError, RankCtx, RankExecutor, RankMoved, RankSpans,
    StreamTimeline,
};
use lifecycle_layout::RolloutEntry;

use crate::backend::FsdpBackend;
use crate::buckets::{run_buckets, CastMode};
use crate::state::{FsdpTrainState, RankTrain};
use crate::verify;
use crate::FsdpError;
use lifecycle_layout::fsdp::FsdpPlan;

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
        plan: &FsdpPlan,
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
        let mut items: Vec<(&mut RankTrain, &mut CudaSlice<bf16>)> =
            state.ranks.iter_mut().zip(rolls.iter_mut()).collect();
        let len = state.shards.rank_len as usize;
        let mode = CastMode {
            batched: self.batched_casts,
        };
        let chunk = self.offload_chunk_bytes;
        let moved = self.pool.run_each(&mut items, &|ctx, (rt, roll)| {
            // Pinned host buffers first (allocated once, reused): failing here changes nothing.
            if memory.offload_params && rt.master_host.is_none() {
                // SAFETY: written by the device→host copy below before anything reads it.
                rt.master_host =
                    Some(unsafe { alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded master")? });
            }
            if memory.offload_optimizer {
                if rt.m_host.is_none() {
                    // SAFETY: as above.
                    rt.m_host = Some(unsafe {
                        alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded Adam m")?
                    });
                }
                if rt.v_host.is_none() {
                    // SAFETY: as above.
                    rt.v_host = Some(unsafe {
                        alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded Adam v")?
                    });
                }
            }
            let master = rt
                .master
                .as_ref()
                .ok_or_else(|| CudaError::Invalid("master weights are offloaded".into()))?;
            let mut tl = StreamTimeline::new(ctx, tracing)?;
            // Offload copies on the copy stream: they overlap the NVLink work below.
            let bytes = (len * 4) as u64;
            let opt = memory.offload_optimizer;
            let copies = [
                (opt, rt.m.as_ref(), rt.m_host.as_mut(), "Adam m"),
                (opt, rt.v.as_ref(), rt.v_host.as_mut(), "Adam v"),
                (
                    memory.offload_params,
                    Some(master),
                    rt.master_host.as_mut(),
                    "master",
                ),
            ];
            for (on, dev, host, what) in copies {
                let (true, Some(dev), Some(host)) = (on, dev, host) else {
                    continue;
                };
                let mark = tl.begin(ctx, &ctx.copy)?;
                offload_copy(ctx, dev, host, chunk, what)?;
                let (name, link) = (format!("offload {what}"), Some(Link::DeviceToHost));
                tl.end(
                    ctx,
                    &ctx.copy,
                    mark,
                    Phase::Offload,
                    name,
                    "copy",
                    bytes,
                    link,
                )?;
            }
            let mut moved = run_buckets(ctx, plan, master, roll, mode, bases, &mut tl)?;
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
                    rt.master = None;
                }
                if memory.offload_optimizer {
                    rt.m = None;
                    rt.v = None;
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

/// Queues the device → pinned host copy of `dev` into `host` on the copy stream, in copies of at
/// most `chunk` bytes (`0`: one copy).
pub(crate) fn offload_copy(
    ctx: &RankCtx,
    dev: &CudaSlice<f32>,
    host: &mut PinnedHostSlice<f32>,
    chunk: usize,
    what: &str,
) -> Result<(), CudaError> {
    let n = dev.len();
    let per = chunk / 4;
    if per == 0 || per >= n || host.len() < n {
        return ctx
            .copy
            .memcpy_dtoh(dev, host)
            .map_err(ctx.drv(&format!("offloading {what}"), (n * 4) as u64));
    }
    let hp = host
        .as_mut_ptr()
        .map_err(ctx.drv(&format!("offloading {what}"), 0))?;
    let (dp, _read) = dev.device_ptr(&ctx.copy);
    let mut off = 0;
    while off < n {
        let m = per.min(n - off);
        // SAFETY: `off + m <= n <= host.len()`, so the piece lies inside the pinned buffer, which
        // the caller keeps (and nothing else reads or writes) until the offload wait; the device
        // piece lies inside `dev`, alive and unwritten until then (the wait precedes its free).
        unsafe {
            let dst = std::slice::from_raw_parts_mut(hp.add(off), m);
            cudarc::driver::result::memcpy_dtoh_async(
                dst,
                dp + (off * 4) as u64,
                ctx.copy.cu_stream(),
            )
        }
        .map_err(ctx.drv(&format!("offloading {what}"), (m * 4) as u64))?;
        off += m;
    }
    Ok(())
}
