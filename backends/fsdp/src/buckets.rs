//! The bucket loop of one rank: local casts, staged casts, NCCL steps or peer copies, unpacks.

use half::bf16;

use cudarc::driver::CudaSlice;

use lifecycle_core::{Link, Phase};
use lifecycle_cuda::{
    alloc_device, peer_base, CastBatch, CudaError, RankCtx, RankMoved, StreamTimeline,
};

use lifecycle_layout::fsdp::{BucketOps, Buf, CastOp, FsdpPlan};

/// How a rank launches its casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CastMode {
    /// Many casts per launch through the multi-tensor kernel (regions it cannot take fall back to
    /// one launch each).
    pub(crate) batched: bool,
}

/// One rank's casts sorted for launching: the batch of every cast the multi-tensor kernel takes
/// (all local casts first, then all staged ones, so each stream's work is one contiguous run of
/// descriptors), per bucket the descriptor and chunk ranges, and the casts that need a launch
/// of their own.
#[derive(Default)]
struct RankCasts<'p> {
    batch: CastBatch,
    local: Vec<BatchRange>,
    staged: Vec<BatchRange>,
    local_single: Vec<Vec<&'p CastOp>>,
    staged_single: Vec<Vec<&'p CastOp>>,
}

/// Descriptors `first .. first + count` of a [`CastBatch`], covering chunks `chunks`.
#[derive(Debug, Clone, Default)]
struct BatchRange {
    first: usize,
    count: usize,
    chunks: std::ops::Range<u64>,
}

impl BatchRange {
    /// The range from `self`'s start to `other`'s end (`other` follows `self` in the batch).
    fn through(&self, other: &BatchRange) -> BatchRange {
        BatchRange {
            first: self.first,
            count: other.first + other.count - self.first,
            chunks: self.chunks.start..other.chunks.end,
        }
    }
}

impl<'p> RankCasts<'p> {
    fn new(buckets: &'p [BucketOps], mode: CastMode) -> Self {
        let mut rc = RankCasts::default();
        for want in [Buf::Rollout, Buf::Staging] {
            for b in buckets {
                let (first, chunk0) = (rc.batch.len(), rc.batch.chunks());
                let mut single = Vec::new();
                for c in b.casts.iter().filter(|c| c.dst == want) {
                    if !(mode.batched && rc.batch.push(c.src_off, c.dst_off, c.region)) {
                        single.push(c);
                    }
                }
                let range = BatchRange {
                    first,
                    count: rc.batch.len() - first,
                    chunks: chunk0..rc.batch.chunks(),
                };
                match want {
                    Buf::Rollout => {
                        rc.local.push(range);
                        rc.local_single.push(single);
                    }
                    Buf::Staging => {
                        rc.staged.push(range);
                        rc.staged_single.push(single);
                    }
                }
            }
        }
        rc
    }
}

/// Whether bucket `b`'s NCCL work reads or writes rollout bytes that its local casts write (an
/// all-gather of the rank's own part, or a send straight from the rollout buffer).
fn needs_local(b: &BucketOps) -> bool {
    !b.gathers.is_empty() || b.sends.iter().any(|s| s.buf == Buf::Rollout)
}

/// The bucket loop of one rank. Local casts (into the rollout buffer) are queued first, all of
/// them, on the auxiliary stream, which never waits for the network: one multi-tensor launch per
/// run of buckets up to one whose NCCL work needs them, with an event after each run. Then per
/// bucket: staged casts on the compute stream (waiting for their staging slot to be free), and the
/// bucket's grouped NCCL sends / receives / all-gathers on the NCCL stream after its staged casts
/// (and, when it needs them, its local casts). Staging slots are reused round-robin.
pub(crate) fn run_buckets(
    ctx: &RankCtx,
    plan: &FsdpPlan,
    master: &CudaSlice<f32>,
    roll: &mut CudaSlice<bf16>,
    mode: CastMode,
    bases: &[u64],
    tl: &mut StreamTimeline,
) -> Result<RankMoved, CudaError> {
    let out = run_buckets_inner(ctx, plan, master, roll, mode, bases, tl);
    if out.is_err() {
        // Nothing may still read or write the rollout or staging buffers when they are freed
        // after an error part-way through: wait for every stream first.
        let _ = ctx.sync_all();
    }
    out
}

fn run_buckets_inner(
    ctx: &RankCtx,
    plan: &FsdpPlan,
    master: &CudaSlice<f32>,
    roll: &mut CudaSlice<bf16>,
    mode: CastMode,
    bases: &[u64],
    tl: &mut StreamTimeline,
) -> Result<RankMoved, CudaError> {
    let rank = ctx.rank;
    let buckets = &plan.ranks[rank];
    let casts = RankCasts::new(buckets, mode);
    let descs = if casts.batch.is_empty() {
        None
    } else {
        Some(
            ctx.compute
                .clone_htod(casts.batch.words())
                .map_err(ctx.drv("uploading cast descriptors", 0))?,
        )
    };
    let nslots = plan.staging_slots(rank);
    let mut staging: Vec<CudaSlice<bf16>> = Vec::with_capacity(nslots);
    for _ in 0..nslots {
        // SAFETY: every staging element read by a send is first written by a cast of the same
        // bucket (the plan places each staged send after its cast).
        staging.push(unsafe {
            alloc_device::<bf16>(
                &ctx.compute,
                plan.slot_elems as usize,
                rank,
                "staging bucket",
            )?
        });
    }
    let nrslots = plan.recv_staging_slots(rank);
    let mut rstaging: Vec<CudaSlice<bf16>> = Vec::with_capacity(nrslots);
    for _ in 0..nrslots {
        // SAFETY: every element an unpack reads is first written by the receive of its bucket.
        rstaging.push(unsafe {
            alloc_device::<bf16>(
                &ctx.compute,
                plan.recv_slot_elems as usize,
                rank,
                "receive staging bucket",
            )?
        });
    }
    let nccl = ctx.nccl_stream();
    // Allocations and the descriptor upload (stream-ordered on compute) and earlier writes are
    // visible to NCCL and to the auxiliary stream that runs the local casts.
    ctx.order(&ctx.compute, &nccl)?;
    ctx.order(&ctx.compute, &ctx.aux)?;
    let mbase = ctx.addr(master);
    let rbase = ctx.addr_mut(roll);
    let dbase = descs.as_ref().map_or(0, |d| ctx.addr(d));
    let sbases: Vec<u64> = staging.iter_mut().map(|s| ctx.addr_mut(s)).collect();
    let rsbases: Vec<u64> = rstaging.iter_mut().map(|s| ctx.addr_mut(s)).collect();
    let mut moved = RankMoved {
        staging: (nslots as u64 * plan.slot_elems + nrslots as u64 * plan.recv_slot_elems) * 2,
        ..Default::default()
    };
    // Local casts, all queued now: runs of buckets end at a bucket whose NCCL work needs them.
    let mut local_done: Vec<Option<usize>> = vec![None; buckets.len()];
    let mut local_events = Vec::new();
    let mut run_start = 0usize;
    for k in 0..buckets.len() {
        if !(needs_local(&buckets[k]) || k + 1 == buckets.len()) {
            continue;
        }
        let range = casts.local[run_start].through(&casts.local[k]);
        let mut bytes = 0u64;
        let mark = tl.begin(ctx, &ctx.aux)?;
        // SAFETY: the plan keeps every region inside its buffer (master: rank_len f32, rollout:
        // roll_len bf16); the descriptors and both buffers outlive the final synchronisation
        // below; the NCCL stream touches these rollout bytes only after the event recorded next.
        unsafe {
            ctx.kernels.cast_multi(
                &ctx.aux,
                mbase,
                rbase,
                dbase,
                range.first,
                range.count,
                range.chunks.clone(),
                rank,
            )?;
        }
        for (bucket, single) in buckets[run_start..=k]
            .iter()
            .zip(&casts.local_single[run_start..=k])
        {
            bytes += bucket
                .casts
                .iter()
                .filter(|c| c.dst == Buf::Rollout)
                .map(|c| c.region.numel() * 2)
                .sum::<u64>();
            for c in single {
                // SAFETY: as above.
                unsafe {
                    ctx.kernels.cast_f32_bf16(
                        &ctx.aux,
                        mbase + 4 * c.src_off,
                        rbase + 2 * c.dst_off,
                        c.region,
                        rank,
                    )?;
                }
            }
        }
        moved.local += bytes;
        tl.end(
            ctx,
            &ctx.aux,
            mark,
            Phase::Transfer,
            format!("local casts b{run_start}..={k}"),
            "aux",
            bytes,
            Some(Link::Local),
        )?;
        let ev = ctx.event()?;
        ev.record(&ctx.aux)
            .map_err(ctx.drv("recording an event", 0))?;
        local_events.push(ev);
        for slot in local_done.iter_mut().take(k + 1).skip(run_start) {
            *slot = Some(local_events.len() - 1);
        }
        run_start = k + 1;
    }
    let mut net_done = Vec::with_capacity(buckets.len());
    for (k, b) in buckets.iter().enumerate() {
        let slot = if nslots > 0 { k % nslots } else { 0 };
        if b.staging_elems > 0 && k >= nslots {
            ctx.compute
                .wait(&net_done[k - nslots])
                .map_err(ctx.drv("waiting for a staging slot", 0))?;
        }
        let staged = &casts.staged[k];
        if staged.count > 0 || !casts.staged_single[k].is_empty() {
            let mark = tl.begin(ctx, &ctx.compute)?;
            // SAFETY: the plan keeps every staged region inside master (rank_len f32) and the
            // staging slot (slot_elems bf16); the slot was last read by the NCCL work of bucket
            // k - nslots, which the compute stream waited for above; all buffers outlive the
            // final synchronisation.
            unsafe {
                ctx.kernels.cast_multi(
                    &ctx.compute,
                    mbase,
                    sbases[slot],
                    dbase,
                    staged.first,
                    staged.count,
                    staged.chunks.clone(),
                    rank,
                )?;
                for c in &casts.staged_single[k] {
                    ctx.kernels.cast_f32_bf16(
                        &ctx.compute,
                        mbase + 4 * c.src_off,
                        sbases[slot] + 2 * c.dst_off,
                        c.region,
                        rank,
                    )?;
                }
            }
            tl.end(
                ctx,
                &ctx.compute,
                mark,
                Phase::Transfer,
                format!("staged casts b{k}"),
                "compute",
                b.staging_elems * 2,
                Some(Link::Local),
            )?;
        }
        // The NCCL work of this bucket starts after its staged casts (compute stream) and, when
        // it sends from or gathers into the rollout buffer, after its local casts (aux stream).
        let has_net = if plan.peer_copy {
            !b.sends.is_empty()
        } else {
            !b.sends.is_empty() || !b.recvs.is_empty() || !b.gathers.is_empty()
        };
        if has_net {
            let ev = ctx.event()?;
            ev.record(&ctx.compute)
                .map_err(ctx.drv("recording an event", 0))?;
            nccl.wait(&ev).map_err(ctx.drv("waiting on an event", 0))?;
            if needs_local(b) {
                if let Some(i) = local_done[k] {
                    nccl.wait(&local_events[i])
                        .map_err(ctx.drv("waiting on an event", 0))?;
                }
            }
        }
        let mut net_mark = if has_net { tl.begin(ctx, &nccl)? } else { None };
        let recv_before = moved.recv;
        if plan.peer_copy {
            let sent = peer_copies(ctx, &nccl, b, bases, rbase, sbases.get(slot).copied())?;
            moved.recv += b.recvs.iter().map(|r| r.count * 2).sum::<u64>();
            if has_net {
                tl.end(
                    ctx,
                    &nccl,
                    net_mark.take(),
                    Phase::Transfer,
                    format!("peer copies b{k}"),
                    "peer",
                    sent,
                    Some(Link::DeviceToDevice),
                )?;
            }
        } else if !b.sends.is_empty() || !b.recvs.is_empty() {
            ctx.group_start()?;
            let mut res = Ok(());
            for s in &b.sends {
                let (lo, hi) = (s.off as usize, (s.off + s.count) as usize);
                let r = match s.buf {
                    Buf::Rollout => ctx.comm.send(&roll.slice(lo..hi), s.peer as i32),
                    Buf::Staging => ctx.comm.send(&staging[slot].slice(lo..hi), s.peer as i32),
                };
                if let Err(e) = r {
                    res = Err(CudaError::nccl(rank, "ncclSend", e));
                    break;
                }
            }
            if res.is_ok() {
                for r in &b.recvs {
                    let (lo, hi) = (r.off as usize, (r.off + r.count) as usize);
                    let got = match r.into {
                        Buf::Rollout => {
                            moved.recv += r.count * 2;
                            ctx.comm.recv(&mut roll.slice_mut(lo..hi), r.peer as i32)
                        }
                        Buf::Staging => ctx.comm.recv(
                            &mut rstaging[k % nrslots.max(1)].slice_mut(lo..hi),
                            r.peer as i32,
                        ),
                    };
                    if let Err(e) = got {
                        res = Err(CudaError::nccl(rank, "ncclRecv", e));
                        break;
                    }
                }
            }
            let end = ctx.group_end();
            res?;
            end?;
        }
        for u in &b.unpacks {
            moved.recv += u.count * 2;
            let region = lifecycle_layout::Region2d {
                rows: 1,
                cols: u.count,
                src_ld: u.count,
                dst_ld: u.count,
            };
            // SAFETY: the plan keeps both runs inside their buffers (receive slot of
            // recv_slot_elems, rollout of roll_len); queued on the NCCL stream right after the
            // receive that fills the slot, and before the slot's next receive on the same stream.
            unsafe {
                ctx.kernels.copy_u16(
                    &nccl,
                    rsbases[k % nrslots.max(1)] + 2 * u.src_off,
                    rbase + 2 * u.dst_off,
                    region,
                    rank,
                )?;
            }
        }
        if !b.gathers.is_empty() {
            let w = ctx.world as u64;
            // SAFETY: an alias of the rollout buffer (same pointer and length) so the in-place
            // all-gather can name its send part (inside the receive range), which NCCL supports
            // when sendbuff == recvbuff + rank * count. It is leaked (not freed) right after the
            // group; the real buffer outlives the synchronisation below.
            let alias: CudaSlice<bf16> = unsafe {
                ctx.compute
                    .upgrade_device_ptr(rbase, plan.roll_len as usize)
            };
            let mut res = ctx.group_start();
            if res.is_ok() {
                for g in &b.gathers {
                    moved.recv += (w - 1) * g.count * 2;
                    let mine = (g.off + rank as u64 * g.count) as usize;
                    let send = alias.slice(mine..mine + g.count as usize);
                    let mut recv = roll.slice_mut(g.off as usize..(g.off + w * g.count) as usize);
                    if let Err(e) = ctx.comm.all_gather(&send, &mut recv) {
                        res = Err(CudaError::nccl(rank, "ncclAllGather", e));
                        break;
                    }
                }
            }
            let end = ctx.group_end();
            alias.leak();
            res?;
            end?;
        }
        if has_net && !plan.peer_copy {
            let what = if b.gathers.is_empty() {
                "send/recv"
            } else {
                "all-gather"
            };
            tl.end(
                ctx,
                &nccl,
                net_mark,
                Phase::Transfer,
                format!("{what} b{k}"),
                "nccl",
                moved.recv - recv_before,
                Some(Link::DeviceToDevice),
            )?;
        }
        let done = ctx.event()?;
        done.record(&nccl)
            .map_err(ctx.drv("recording an event", 0))?;
        net_done.push(done);
    }
    ctx.order(&nccl, &ctx.compute)?;
    ctx.order(&ctx.aux, &ctx.compute)?;
    // Deadline-aware: a peer that stalls or dies ends in a timeout, not a hang.
    ctx.wait(&[&ctx.compute, &nccl], "the transfer's NCCL work")?;
    drop(staging);
    drop(rstaging);
    drop(descs);
    ctx.compute
        .synchronize()
        .map_err(ctx.drv("freeing staging", 0))?;
    Ok(moved)
}

/// Bucket `b`'s sends as peer copies on `stream`: each piece written by the copy engines from
/// this rank's rollout buffer (`rbase`) or staging slot (`staging`) straight to its place in the
/// receiver's rollout buffer (`bases`, by global rank). Returns the bytes sent.
fn peer_copies(
    ctx: &RankCtx,
    stream: &cudarc::driver::CudaStream,
    b: &BucketOps,
    bases: &[u64],
    rbase: u64,
    staging: Option<u64>,
) -> Result<u64, CudaError> {
    let mut sent = 0;
    for s in &b.sends {
        let missing = |what: &str| {
            CudaError::Invalid(format!(
                "peer copy from rank {} to rank {}: {what}",
                ctx.rank, s.peer
            ))
        };
        let dst_off = s
            .dst_off
            .ok_or_else(|| missing("the piece has no place in the receiver's rollout buffer"))?;
        let base = peer_base(bases, s.peer, ctx.rank)?;
        let src = match s.buf {
            Buf::Rollout => rbase,
            Buf::Staging => staging.ok_or_else(|| missing("no staging slot"))?,
        };
        let bytes = (s.count * 2) as usize;
        // SAFETY: the plan keeps the piece inside this rank's rollout buffer or staging slot and
        // inside the receiver's rollout buffer (roll_len elements on every rank), whose address
        // came from the receiver; both stay alive until every rank synchronised at the end of
        // the transfer; peer access is enabled (plans with peer copies exist only then); no
        // other work writes these receiver elements.
        unsafe {
            lifecycle_cuda::copy_2d(
                ctx,
                stream,
                (base + 2 * dst_off, bytes),
                (src + 2 * s.off, bytes),
                bytes,
                1,
                "copying a piece into a peer's rollout buffer",
            )?
        };
        sent += bytes as u64;
    }
    Ok(sent)
}
