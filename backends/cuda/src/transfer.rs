//! What every GPU executor's transfer shares, whatever plan it runs: device addresses, the
//! rollout buffers peers write into, and how a transfer's statistics and device spans reach the
//! lifecycle's metrics and trace.

use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use lifecycle_core::{Link, Phase, PhaseSample, SwitchContext};

use crate::{alloc_device, CudaError, RankCtx, RankExecutor, RankSpans, StreamTimeline};

impl RankCtx {
    /// The device address of `s`, for work queued on the compute stream (where every executor's
    /// kernels read and write).
    pub fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.compute);
        p
    }

    /// The device address of `s`, to be written by work on the compute stream.
    pub fn addr_mut<T>(&self, s: &mut CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr_mut(&self.compute);
        p
    }
}

/// What one rank's transfer moved.
#[derive(Default)]
pub struct RankMoved {
    /// Bytes received from other ranks (NCCL or peer copies).
    pub recv: u64,
    /// Bytes cast or copied within the rank.
    pub local: u64,
    /// Peak staging memory the transfer held (slots, packing buffers).
    pub staging: u64,
    /// The device spans of the transfer, when tracing.
    pub timeline: Option<StreamTimeline>,
}

impl std::fmt::Debug for RankMoved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankMoved")
            .field("recv", &self.recv)
            .field("local", &self.local)
            .field("staging", &self.staging)
            .field("traced", &self.timeline.is_some())
            .finish()
    }
}

/// The device address of every rank's rollout buffer by global rank (0 for ranks of other
/// processes): where peer copies write. `rolls` holds this process's buffers in local-rank order.
pub fn peer_bases(
    pool: &impl RankExecutor,
    rolls: &mut [CudaSlice<bf16>],
) -> Result<Vec<u64>, CudaError> {
    let mut bases = vec![0u64; pool.world()];
    let got = pool.run_each(rolls, &|ctx, roll| Ok(ctx.addr_mut(roll)))?;
    for (&r, b) in pool.local_ranks().iter().zip(got) {
        bases[r] = b;
    }
    Ok(bases)
}

/// The rollout buffer address of rank `to` in `bases` ([`peer_bases`]), for rank `from`'s peer
/// copies; an error naming both when it is unknown.
pub fn peer_base(bases: &[u64], to: usize, from: usize) -> Result<u64, CudaError> {
    bases.get(to).copied().filter(|&b| b != 0).ok_or_else(|| {
        CudaError::Invalid(format!(
            "rank {to}'s rollout buffer is not known to rank {from}: peer copies need every rank in this process"
        ))
    })
}

/// Records a transfer that began at `start` in the switch's metrics (bytes received as
/// device-to-device, local casts and copies as local, peak staging) and, when tracing, as one
/// host span.
pub fn record_transfer(ctx: &mut SwitchContext<'_>, moved: &[RankMoved], start: Instant) {
    let mut sample = PhaseSample::default();
    for m in moved {
        sample.bytes.add(Link::DeviceToDevice, m.recv);
        sample.bytes.add(Link::Local, m.local);
        sample.peak_extra_bytes = sample.peak_extra_bytes.max(m.staging);
    }
    ctx.rec.record_since(Phase::Transfer, start, sample);
}

/// Adds each local rank's device spans to the switch's trace (when tracing); `spans` in the
/// order of `local_ranks`.
pub fn record_spans(ctx: &mut SwitchContext<'_>, local_ranks: &[usize], spans: &[RankSpans]) {
    if let Some(trace) = ctx.rec.trace() {
        for (local, s) in spans.iter().enumerate() {
            let rank = local_ranks.get(local).copied().unwrap_or(local);
            s.record_into(trace, rank);
        }
    }
}

/// The offload phase that ends a transfer, for any layout: on every local rank `free` waits for
/// the rank's offload copies and frees what the memory policy moved out, returning the bytes it
/// moved to the host; then the transfer's device timeline (in `moved`, every stream synchronised
/// by then) is read into the trace. The phase's bytes are the sum of what `free` returned.
pub fn finish_offload<P: RankExecutor, T: Send, E: From<CudaError>>(
    pool: &P,
    ctx: &mut SwitchContext<'_>,
    ranks: &mut [T],
    moved: &mut [RankMoved],
    free: &(dyn Fn(&RankCtx, &mut T) -> Result<u64, CudaError> + Sync),
) -> Result<(), E> {
    finish_offload_with(pool, ctx, ranks, moved, &|c, rt| Ok((free(c, rt)?, ())))?;
    Ok(())
}

/// What [`finish_offload_with`] runs on each rank: the bytes it moved to the host and what the
/// rank keeps.
pub type FreeWith<'a, T, R> = dyn Fn(&RankCtx, &mut T) -> Result<(u64, R), CudaError> + Sync + 'a;

/// As [`finish_offload`], with `free` also returning what each rank keeps of its offload (an
/// overlapped offload's [`FreeingRoom`](crate::FreeingRoom)), in local-rank order. A traced
/// transfer's timelines are read after `free`, so `free` must then have waited for the copies
/// (untraced, nothing is read and the copies may still run).
pub fn finish_offload_with<P: RankExecutor, T: Send, R: Send, E: From<CudaError>>(
    pool: &P,
    ctx: &mut SwitchContext<'_>,
    ranks: &mut [T],
    moved: &mut [RankMoved],
    free: &FreeWith<'_, T, R>,
) -> Result<Vec<R>, E> {
    let (spans, kept) = ctx.rec.phase(Phase::Offload, |scope| {
        let mut items: Vec<(&mut T, Option<StreamTimeline>)> = ranks
            .iter_mut()
            .zip(moved.iter_mut().map(|m| m.timeline.take()))
            .collect();
        let out = pool.run_each(&mut items, &|c, (rt, tl)| {
            let (bytes, kept) = free(c, rt)?;
            let spans = match tl.take() {
                Some(tl) => tl.finish()?,
                None => RankSpans::default(),
            };
            Ok((bytes, spans, kept))
        })?;
        scope.add_bytes(Link::DeviceToHost, out.iter().map(|o| o.0).sum());
        let (spans, kept) = out.into_iter().map(|o| (o.1, o.2)).unzip();
        Ok::<(Vec<RankSpans>, Vec<R>), E>((spans, kept))
    })?;
    record_spans(ctx, pool.local_ranks(), &spans);
    Ok(kept)
}

/// Allocates every local rank's rollout buffer of `len` bf16 elements, uninitialised, before any
/// data moves (an out-of-memory error here leaves the training state untouched). With
/// `peers_write`, each allocation is complete before this returns, as peers may write into it
/// as soon as the transfer starts.
///
/// # Safety
/// The caller's plan must write every element of every buffer (the pieces or tiles cover the
/// buffer exactly) before anything reads it.
pub unsafe fn alloc_rollout_buffers(
    pool: &impl RankExecutor,
    len: usize,
    peers_write: bool,
) -> Result<Vec<CudaSlice<bf16>>, CudaError> {
    let mut unit: Vec<()> = vec![(); pool.local_ranks().len()];
    pool.run_each(&mut unit, &|c, _| {
        // SAFETY: the caller's plan writes every element before it is read.
        let roll = unsafe { alloc_device::<bf16>(&c.compute, len, c.rank, "rollout weights") }?;
        if peers_write {
            c.compute
                .synchronize()
                .map_err(c.drv("allocating the rollout weights", (len * 2) as u64))?;
        }
        Ok(roll)
    })
}
