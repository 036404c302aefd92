//! [`run_program`]: one run of a rank's program, its buffers checked, its scratch made, its
//! operations issued in order, the final wait under the pool's deadline.

use cudarc::driver::{CudaEvent, CudaSlice};
use half::bf16;

use lifecycle_layout::steps::{Op, RankSteps};

use crate::agree::{AgreedJobs, Rendezvous};
use crate::quantise::QuantiseJobs;
use crate::{CudaError, RankCtx, RankMoved, StreamTimeline};

use super::issue::Issuer;
use super::program::{DeviceProgram, RunOptions, SourceBuf};
use super::scratch::{alloc_slots, Fp8Scratch};

/// What a rank's program reaches of the other ranks of its process: their rollout buffers'
/// addresses by global rank (for peer and remote copies; 0 where unknown) and, for an agreed
/// fp8 switch on ranks without an NCCL communicator, where they meet.
#[derive(Debug, Clone, Copy)]
pub struct Peers<'a> {
    /// Rollout buffer addresses by global rank.
    pub bases: &'a [u64],
    /// The fp8 meeting of the transfer (every rank of the job in this process).
    pub meet: Option<&'a Rendezvous>,
}

/// Runs `prog` on this rank: reads `source`, writes `roll` (and, with peer copies or remote
/// copies, the peers' rollout buffers at `peers.bases`, by global rank), marks every piece of
/// work on `tl`. Returns what the rank moved, with `tl` in it (read once the offload finished).
/// On an error every stream is synchronised before the staging buffers are freed, and the
/// rank leaves the fp8 meeting so its peers stop waiting.
pub fn run_program(
    ctx: &RankCtx,
    prog: &DeviceProgram,
    source: SourceBuf<'_>,
    roll: &mut CudaSlice<bf16>,
    peers: Peers<'_>,
    opts: RunOptions,
    mut tl: StreamTimeline,
) -> Result<RankMoved, CudaError> {
    match run_inner(ctx, prog, source, roll, peers, opts, &mut tl) {
        Ok(moved) => Ok(RankMoved {
            timeline: Some(tl),
            ..moved
        }),
        Err(e) => {
            if let Some(meet) = peers.meet {
                meet.abandon(ctx.rank, &e.to_string());
            }
            // Nothing may still read or write the rollout or staging buffers when they are
            // freed after an error part-way through.
            let _ = ctx.sync_all();
            // what this run's casts reported is this run's: the next starts with a clear flag
            let _ = ctx.take_nonfinite();
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_inner(
    ctx: &RankCtx,
    prog: &DeviceProgram,
    source: SourceBuf<'_>,
    roll: &mut CudaSlice<bf16>,
    peers: Peers<'_>,
    opts: RunOptions,
    tl: &mut StreamTimeline,
) -> Result<RankMoved, CudaError> {
    let s = &prog.steps;
    check_buffers(ctx.rank, s, source, roll)?;
    let (mut sslots, mut rslots) = alloc_slots(ctx, s)?;
    let mut fp8 = Fp8Scratch::alloc(ctx, s)?;
    let issuer = Issuer {
        ctx,
        prog,
        source,
        bases: peers.bases,
        meet: peers.meet,
        fp8_addrs: fp8
            .as_mut()
            .map(|f| (ctx.addr_mut(&mut f.grid), ctx.addr_mut(&mut f.stage))),
        opts,
        nccl: ctx.nccl_stream(),
        src_base: match source {
            SourceBuf::F32(m) => ctx.addr(m),
            SourceBuf::Bf16(p) => ctx.addr(p),
        },
        rbase: ctx.addr_mut(roll),
        sbases: sslots.iter_mut().map(|x| ctx.addr_mut(x)).collect(),
        rbases: rslots.iter_mut().map(|x| ctx.addr_mut(x)).collect(),
        nonfinite: ctx.nonfinite_flag()?,
    };
    let mut events: Vec<Option<CudaEvent>> = (0..prog.program.events()).map(|_| None).collect();
    let mut used_nccl = false;
    for (i, op) in prog.program.ops().iter().enumerate() {
        match op {
            Op::Record { stream: st, event } => {
                let e = ctx.event()?;
                e.record(issuer.stream(*st))
                    .map_err(ctx.drv("recording an event", 0))?;
                events[*event] = Some(e);
            }
            Op::Wait { stream: st, event } => {
                let e = events[*event].as_ref().ok_or_else(|| {
                    issuer.missing("the program waits for an event not yet recorded")
                })?;
                issuer
                    .stream(*st)
                    .wait(e)
                    .map_err(ctx.drv("waiting on an event", 0))?;
            }
            Op::Quantise => issuer.quantise(tl)?,
            Op::Amax => issuer.amax(fp8.as_mut(), tl)?,
            Op::Agree => issuer.agree(fp8.as_mut(), tl)?,
            Op::QuantiseAgreed => issuer.quantise_agreed(tl)?,
            Op::Zero => issuer.zero(roll, tl)?,
            Op::Copies { .. } => issuer.copies(i, op, tl)?,
            Op::Nccl { step, slot } => {
                used_nccl = true;
                let slots = (&sslots, &mut rslots);
                let stage = fp8.as_ref().map(|f| &f.stage);
                issuer.nccl(*step, *slot, roll, slots, stage, tl)?;
            }
            Op::Push {
                step,
                peer,
                runs,
                slot,
            } => issuer.push(*step, *peer, runs.clone(), *slot, tl)?,
        }
    }
    // With the pool's deadline: a stalled peer ends in a timeout error, not a hang.
    let what = if used_nccl {
        "the transfer's NCCL work"
    } else {
        "the transfer's peer copies"
    };
    ctx.wait(&[&ctx.compute, &issuer.nccl], what)?;
    let staging = s.staging_bytes() + fp8.as_ref().map_or(0, Fp8Scratch::gathered_bytes);
    drop(sslots);
    drop(rslots);
    drop(fp8);
    ctx.compute
        .synchronize()
        .map_err(ctx.drv("freeing staging", 0))?;
    // the casts and quantisations read every source value once: a NaN or an infinity among
    // them set the flag
    if ctx.take_nonfinite()? {
        return Err(CudaError::NonFinite { rank: ctx.rank });
    }
    Ok(RankMoved {
        recv: s.recv_elems * 2,
        local: s.local_elems * 2
            + prog.quantise.as_ref().map_or(0, QuantiseJobs::bytes)
            + prog.agreed.as_ref().map_or(0, AgreedJobs::bytes),
        staging,
        timeline: None,
    })
}

/// The training and rollout buffers must be those the steps were made for (dtype and lengths),
/// which every launch of the run relies on.
pub(super) fn check_buffers(
    rank: usize,
    s: &RankSteps,
    source: SourceBuf<'_>,
    roll: &CudaSlice<bf16>,
) -> Result<(), CudaError> {
    if source.dtype() != s.source
        || (source.len() as u64) < s.source_elems
        || (roll.len() as u64) < s.rollout_elems
    {
        return Err(CudaError::Invalid(format!(
            "rank {rank}: the steps read a {:?} training buffer of {} elements into a rollout \
             buffer of {}, given a {:?} one of {} and a rollout buffer of {}",
            s.source,
            s.source_elems,
            s.rollout_elems,
            source.dtype(),
            source.len(),
            roll.len()
        )));
    }
    Ok(())
}
