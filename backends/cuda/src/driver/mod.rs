//! The switch driver: the one sequence of a switch on the GPUs, for every training layout and
//! every owner of the training buffers.
//!
//! A backend chooses a plan (a [`RankSteps`] program per rank) and hands its ranks' buffers
//! ([`RankBuffers`]) to the driver, which runs the switch in one direction only:
//!
//! 1. [`SwitchDriver::transfer`]: per rank, the pinned chunks of every buffer the memory policy
//!    moves out are taken first (running out changes nothing), the offload copies queued on the
//!    copy stream, then the rank's step program run by the step runner ([`run_program`]);
//! 2. [`SwitchDriver::finish_offload`]: the offload copies awaited, the moved buffers and the
//!    scratch memory given up (the offload phase); or, overlapped with the rollout,
//!    [`SwitchDriver::finish_offload_overlapped`]: each moved buffer freed in stream order behind
//!    its copy, nothing awaited, the memory to come handed to the rollout as a [`FreeingRoom`]
//!    per rank ([`SwitchDriver::finish_enter`] chooses);
//! 3. [`SwitchDriver::reload`] at exit: every offloaded buffer copied back, the scratch memory
//!    restored, each reloaded buffer checked by the hooks (the reload phase).
//!
//! Verification and fault injection are [`SwitchHooks`]: the driver calls them at fixed points
//! and never calls back into a backend otherwise. Buffers the backend does not own (device
//! pointers lent by a caller, with the caller's stream) are [`LentRank`]s.

mod buffers;
mod lent;

pub use buffers::{
    free_grads, restore_grads, BufferClass, Movable, Offloadable, RankBuffers, RollSlice,
};
pub use lent::{LentMemory, LentOffload, LentRank, LentSource, LentStream};

use std::time::Instant;

use lifecycle_core::{Link, MemoryPolicy, Phase, SwitchContext};
use lifecycle_layout::steps::RankSteps;
use lifecycle_layout::LayoutError;

use std::sync::Arc;

use crate::{
    peer_bases, record_spans, record_transfer, run_program, CudaError, FreeingRoom, Peers,
    PinnedPool, PinnedReservation, ProgramSlot, RankCtx, RankExecutor, RankMoved, RankReservation,
    RankSpans, Rendezvous, RunOptions, StreamTimeline,
};

/// A reloaded buffer whose contents differ from what was offloaded, as a
/// [`SwitchHooks::check_reloaded`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    /// The buffer's name ([`Movable::name`]).
    pub buffer: &'static str,
    /// The tensor whose chunk differs, as the hook names it.
    pub tensor: String,
    /// The hash taken at offload.
    pub expected: u64,
    /// The hash of the reloaded copy.
    pub found: u64,
}

/// Where a switch calls out: verification and fault injection. Every method has a default that
/// does nothing.
pub trait SwitchHooks<B>: Sync {
    /// On each rank before its offload copies are queued (on the copy stream, ahead of them).
    fn before_offload(
        &self,
        _ctx: &RankCtx,
        _rank: &mut B,
        _memory: MemoryPolicy,
    ) -> Result<(), CudaError> {
        Ok(())
    }

    /// On each rank once its offload copies finished, before the device copies are given up.
    fn offload_settled(&self, _ctx: &RankCtx, _rank: &mut B) -> Result<(), CudaError> {
        Ok(())
    }

    /// On each rank after its reload (streams synchronised): `reloaded[i]` says whether
    /// `movable()[i]` came back from the host. Every corruption it returns (by `movable()`
    /// index) leaves that buffer offloaded (its device copy discarded), so a retry fails the
    /// same way; the first one is reported.
    fn check_reloaded(
        &self,
        _ctx: &RankCtx,
        _rank: &mut B,
        _reloaded: &[bool],
    ) -> Result<Vec<(usize, Corruption)>, CudaError> {
        Ok(Vec::new())
    }
}

/// Hooks that do nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl<B> SwitchHooks<B> for NoHooks {}

/// The program a rank runs, as [`SwitchDriver::transfer`] asks for it.
pub struct ProgramSpec<'a, K> {
    /// The plan's identity: a rank's kept program is reused while the key is equal.
    pub key: K,
    /// Whether local casts run batched (one launch per step) when the program is built.
    pub batched_casts: bool,
    /// Launch settings.
    pub opts: RunOptions,
    /// Whether peers write into the rollout buffers (their addresses are then exchanged).
    pub peers_write: bool,
    /// The steps of the local rank at this index (position in `local_ranks()`), reading a source
    /// of the given number of elements; called when the kept program is not this plan's.
    #[allow(clippy::type_complexity)]
    pub steps: &'a (dyn Fn(&RankCtx, usize, u64) -> Result<RankSteps, LayoutError> + Sync),
}

/// What a transfer does beside its plan: the offload of the memory policy, and whether the
/// device spans are traced.
#[derive(Debug, Clone, Copy)]
pub struct TransferMode {
    /// What the offload copies move out.
    pub memory: MemoryPolicy,
    /// Mark the device work on stream timelines (read into the switch's trace).
    pub tracing: bool,
}

/// The switch driver over a rank pool and its pinned pool. See the [module docs](self).
pub struct SwitchDriver<'a, P> {
    pool: &'a P,
    pinned: &'a PinnedPool,
}

impl<'a, P: RankExecutor> SwitchDriver<'a, P> {
    /// A driver over the ranks of `pool`, offloading into `pinned`.
    pub fn new(pool: &'a P, pinned: &'a PinnedPool) -> Self {
        SwitchDriver { pool, pinned }
    }

    /// Runs a transfer into `rolls` (one buffer per local rank), starting the offload copies of
    /// `mode.memory` first so they overlap it; `programs` keeps each rank's compiled program
    /// between switches. Returns what each rank moved, with its device timeline when
    /// `mode.tracing`.
    pub fn transfer<B: RankBuffers, K: Clone + PartialEq + Send + Sync>(
        &self,
        ranks: &mut [B],
        programs: &mut Vec<ProgramSlot<K>>,
        rolls: &mut [RollSlice],
        spec: &ProgramSpec<'_, K>,
        mode: TransferMode,
        hooks: &dyn SwitchHooks<B>,
    ) -> Result<Vec<RankMoved>, CudaError> {
        let TransferMode { memory, tracing } = mode;
        let locals = self.pool.local_ranks().len();
        if ranks.len() != locals || rolls.len() != locals {
            return Err(CudaError::Invalid(format!(
                "the switch driver runs {locals} local ranks but was given {} training states \
                 and {} rollout buffers",
                ranks.len(),
                rolls.len()
            )));
        }
        // Peer copies write into every rank's rollout buffer: their addresses by global rank.
        let bases = if spec.peers_write {
            peer_bases(self.pool, rolls)?
        } else {
            vec![0u64; self.pool.world()]
        };
        let bases = &bases;
        // Ranks without an NCCL communicator (sharing a GPU) agree fp8 scales here; only a
        // process that drives every rank of the job can host the meeting.
        let meet = Rendezvous::new(self.pool.world());
        let peers = Peers {
            bases,
            meet: (locals == self.pool.world()).then_some(&meet),
        };
        programs.resize_with(locals, ProgramSlot::default);
        let mut items: Vec<_> = ranks
            .iter_mut()
            .zip(rolls.iter_mut())
            .zip(programs.iter_mut())
            .enumerate()
            .map(|(i, ((rt, roll), prog))| (i, rt, roll, prog))
            .collect();
        let pinned = self.pinned;
        self.pool
            .run_each(&mut items, &|ctx, (local, rt, roll, prog)| {
                // The owner's pending work on its buffers first (a caller's stream).
                rt.wait_for_owner(ctx)?;
                // Pinned chunks first (from the pool: pinned once, then reused): failing here
                // changes nothing.
                for m in rt.movable() {
                    if m.class.offloaded_by(memory) {
                        m.buf.reserve_host(ctx, pinned, m.name)?;
                    }
                }
                // The timeline's origin is recorded on the compute stream before the copy
                // stream is ordered after it: no copy of this transfer starts before the origin.
                let mut tl = StreamTimeline::new(ctx, tracing)?;
                // The offload copies (and the hooks' work on the copy stream) may read what the
                // last update wrote on the compute stream.
                ctx.order(&ctx.compute, &ctx.copy)?;
                hooks.before_offload(ctx, rt, memory)?;
                // Offload copies on the copy stream: they overlap the transfer below.
                for m in rt.movable() {
                    if m.class.offloaded_by(memory) {
                        let what = format!("offload {}", m.name);
                        m.buf.start_offload(ctx, pinned, &what, &mut tl)?;
                    }
                }
                let source = rt.source()?;
                let len = source.len() as u64;
                let program =
                    prog.get_or_build(ctx, spec.key.clone(), spec.batched_casts, || {
                        (spec.steps)(ctx, *local, len)
                    })?;
                run_program(ctx, program, source, roll, peers, spec.opts, tl)
            })
    }

    /// The offload phase that ends a transfer: on every local rank the offload copies awaited,
    /// the hooks told, the buffers `memory` moves out and (unless `keep_scratch`) the scratch
    /// memory given up; then the transfer's device timeline read into the trace.
    pub fn finish_offload<B: RankBuffers, E: From<CudaError>>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
        hooks: &dyn SwitchHooks<B>,
        keep_scratch: bool,
    ) -> Result<(), E> {
        let memory = ctx.memory;
        let copies = memory.offload_params || memory.offload_optimizer;
        crate::finish_offload(self.pool, ctx, ranks, moved, &|c, rt: &mut B| {
            // The transfer waited for its own streams; only the offload copies (copy stream)
            // and what the hooks queued before them may still run.
            if copies {
                c.wait(&[&c.copy], "waiting for the offload copies")?;
            }
            hooks.offload_settled(c, rt)?;
            let mut bytes = 0;
            for m in rt.movable() {
                if m.class.offloaded_by(memory) {
                    bytes += m.buf.drop_device(c)?;
                }
            }
            if !keep_scratch {
                rt.release_scratch(c)?;
            }
            rt.hand_back(c)?;
            Ok(bytes)
        })
    }

    /// Whether [`SwitchDriver::finish_offload_overlapped`] can overlap the offload of `ranks`
    /// under `memory`: every buffer it moves frees in stream order
    /// ([`Offloadable::frees_in_stream_order`]) and something moves.
    pub fn can_overlap<B: RankBuffers>(ranks: &mut [B], memory: MemoryPolicy) -> bool {
        let mut any = false;
        for rt in ranks.iter_mut() {
            for m in rt.movable() {
                if m.class.offloaded_by(memory) && !m.buf.is_offloaded() {
                    if !m.buf.frees_in_stream_order() {
                        return false;
                    }
                    any = true;
                }
            }
        }
        any
    }

    /// The offload phase that ends a transfer without waiting for its copies (an overlapped
    /// offload): on every local rank the free of each buffer `memory` moves out is queued on
    /// the copy stream behind its offload copy, an event after each; the scratch memory (unless
    /// `keep_scratch`) given up. Returns each local rank's [`FreeingRoom`] (the device's free
    /// memory now, and the frees to come), for the rollout to allocate into as they run.
    ///
    /// The hooks' [`SwitchHooks::offload_settled`] is not called (nothing has settled); callers
    /// with hooks that need it (verification) and traced switches (whose timelines are read
    /// here) use [`SwitchDriver::finish_offload`]. Every buffer moved must
    /// [free in stream order](SwitchDriver::can_overlap). The copies are joined by the next
    /// reload (which synchronises the rank's streams first) or by any reader that synchronises.
    pub fn finish_offload_overlapped<B: RankBuffers, E: From<CudaError>>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
        keep_scratch: bool,
    ) -> Result<Vec<FreeingRoom>, E> {
        let memory = ctx.memory;
        if ctx.rec.tracing() {
            return Err(CudaError::Invalid(
                "an overlapped offload is not traced: its copies run past the switch; use \
                 finish_offload"
                    .into(),
            )
            .into());
        }
        crate::finish_offload_with(self.pool, ctx, ranks, moved, &|c, rt: &mut B| {
            if !keep_scratch {
                rt.release_scratch(c)?;
            }
            // The transfer synchronised its streams; waiting for the compute streams again
            // costs nothing and leaves the copy stream alone using the moved buffers. The free
            // memory is read before any free is queued.
            c.wait(
                &[&c.compute, &c.aux],
                "the transfer before the offload's frees",
            )?;
            let mut room = FreeingRoom::new(c.device_memory()?.0);
            let mut bytes = 0;
            for m in rt.movable() {
                if m.class.offloaded_by(memory) {
                    if !m.buf.frees_in_stream_order() {
                        return Err(CudaError::Invalid(format!(
                            "rank {}: {} cannot be freed in stream order, so its offload \
                             cannot overlap the rollout",
                            c.rank, m.name
                        )));
                    }
                    // SAFETY: its offload copy was queued on the copy stream by the transfer,
                    // and the compute streams that read it are idle (waited for above); the
                    // NCCL stream only moves rollout and staging buffers.
                    let b = unsafe { m.buf.free_after_copy(c)? };
                    if b > 0 {
                        room.push(c, &c.copy, b)?;
                        bytes += b;
                    }
                }
            }
            rt.hand_back(c)?;
            Ok((bytes, room))
        })
    }

    /// The offload phase that ends an enter: [overlapped](SwitchDriver::finish_offload_overlapped)
    /// when `overlap` asks for it and the switch allows it (untraced, every buffer moved frees
    /// in stream order, something moves), returning each local rank's [`FreeingRoom`] for the
    /// rollout buffer; [settled](SwitchDriver::finish_offload) otherwise (`None`).
    pub fn finish_enter<B: RankBuffers, E: From<CudaError>>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
        hooks: &dyn SwitchHooks<B>,
        keep_scratch: bool,
        overlap: bool,
    ) -> Result<Option<Vec<FreeingRoom>>, E> {
        if overlap && !ctx.rec.tracing() && Self::can_overlap(ranks, ctx.memory) {
            let rooms = self.finish_offload_overlapped(ranks, ctx, moved, keep_scratch)?;
            return Ok(Some(rooms));
        }
        self.finish_offload(ranks, ctx, moved, hooks, keep_scratch)?;
        Ok(None)
    }

    /// The reload phase of an exit: every offloaded buffer copied back on the copy stream, the
    /// scratch memory restored, the hooks' check of each reloaded buffer, the pinned chunks of
    /// every buffer now on the device given back. Returns the first corruption found, by local
    /// rank (the buffer stays offloaded).
    pub fn reload<B: RankBuffers, E: From<CudaError>>(
        &self,
        ranks: &mut [B],
        ctx: &mut SwitchContext<'_>,
        hooks: &dyn SwitchHooks<B>,
    ) -> Result<Option<(usize, usize, Corruption)>, E> {
        let tracing = ctx.rec.tracing();
        let pinned = self.pinned;
        let out = ctx.rec.phase(Phase::Reload, |scope| {
            let moved = self.pool.run_each(ranks, &|c, rt| {
                // What ran on the rollout (and peers' copies into it) is done first.
                c.sync_all()?;
                rt.wait_for_owner(c)?;
                let mut tl = StreamTimeline::new(c, tracing)?;
                let mut h2d = 0u64;
                let mut movable = rt.movable();
                let reloaded: Vec<bool> = movable.iter().map(|m| m.buf.is_offloaded()).collect();
                // In the reverse order of the offload: the buffer the plan reads comes back first.
                for m in movable.iter_mut().rev() {
                    let what = format!("reload {}", m.name);
                    h2d += m.buf.start_reload(c, &what, &mut tl)?;
                }
                drop(movable);
                rt.restore_scratch(c)?;
                c.sync_all()?;
                let corrupted = hooks.check_reloaded(c, rt, &reloaded)?;
                let mut movable = rt.movable();
                for (i, _) in &corrupted {
                    if let Some(m) = movable.get_mut(*i) {
                        m.buf.discard_device(c)?;
                    }
                }
                drop(movable);
                // The device copies are authoritative again: their pinned chunks go back to the
                // pool for the next offload.
                for m in rt.movable() {
                    m.buf.release_host(c.rank, pinned);
                }
                rt.hand_back(c)?;
                Ok((h2d, corrupted.into_iter().next(), tl.finish()?))
            })?;
            scope.add_bytes(Link::HostToDevice, moved.iter().map(|m| m.0).sum());
            let mut first = None;
            let mut spans = Vec::with_capacity(moved.len());
            for (local, (_, corrupted, s)) in moved.into_iter().enumerate() {
                if first.is_none() {
                    first = corrupted.map(|(i, c)| (local, i, c));
                }
                spans.push(s);
            }
            Ok::<(Option<(usize, usize, Corruption)>, Vec<RankSpans>), E>((first, spans))
        })?;
        record_spans(ctx, self.pool.local_ranks(), &out.1);
        Ok(out.0)
    }

    /// [`SwitchDriver::transfer`] then the switch's transfer metrics, timed from now.
    pub fn timed_transfer<B: RankBuffers, K: Clone + PartialEq + Send + Sync>(
        &self,
        ranks: &mut [B],
        programs: &mut Vec<ProgramSlot<K>>,
        rolls: &mut [RollSlice],
        spec: &ProgramSpec<'_, K>,
        ctx: &mut SwitchContext<'_>,
        hooks: &dyn SwitchHooks<B>,
    ) -> Result<Vec<RankMoved>, CudaError> {
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        let mode = TransferMode {
            memory: ctx.memory,
            tracing,
        };
        let moved = self.transfer(ranks, programs, rolls, spec, mode, hooks)?;
        record_transfer(ctx, &moved, start);
        Ok(moved)
    }
}

/// Starts pinning, in the background, the host memory that offloads of `ranks` (one training
/// state per local rank of `pool`) under `memory` take, into `pinned`
/// ([`PinnedPool::reserve_in_background`]): called at setup, once the memory policy is known,
/// so that the first switch finds its chunks pinned. Nothing moves; a rank's first offload
/// waits for the rank's reservation to end.
pub fn reserve_in_background<P: RankExecutor, B: RankBuffers>(
    pool: &P,
    pinned: &Arc<PinnedPool>,
    ranks: &mut [B],
    memory: MemoryPolicy,
) -> Result<PinnedReservation, CudaError> {
    let locals = pool.local_ranks().len();
    if ranks.len() != locals {
        return Err(CudaError::Invalid(format!(
            "pinning for {locals} local ranks but {} training states were given",
            ranks.len()
        )));
    }
    let jobs = pool.run_each(ranks, &|ctx, rt| {
        let buffers = rt
            .movable()
            .iter()
            .filter(|m| m.class.offloaded_by(memory) && !m.buf.is_offloaded())
            .map(|m| m.buf.bytes())
            .collect();
        Ok(RankReservation {
            ctx: ctx.ctx.clone(),
            rank: ctx.rank,
            buffers,
        })
    })?;
    Ok(pinned.reserve_in_background(jobs, "the offload of the training state"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SourceBuf, StreamTimeline};

    /// A buffer that only answers what the overlap decision asks.
    struct Fake {
        offloaded: bool,
        in_stream_order: bool,
    }

    impl Offloadable for Fake {
        fn bytes(&self) -> usize {
            4
        }
        fn is_offloaded(&self) -> bool {
            self.offloaded
        }
        fn reserve_host(&mut self, _: &RankCtx, _: &PinnedPool, _: &str) -> Result<(), CudaError> {
            Err(CudaError::Invalid("not on a GPU".into()))
        }
        fn start_offload(
            &mut self,
            _: &RankCtx,
            _: &PinnedPool,
            _: &str,
            _: &mut StreamTimeline,
        ) -> Result<u64, CudaError> {
            Err(CudaError::Invalid("not on a GPU".into()))
        }
        fn drop_device(&mut self, _: &RankCtx) -> Result<u64, CudaError> {
            Err(CudaError::Invalid("not on a GPU".into()))
        }
        fn frees_in_stream_order(&self) -> bool {
            self.in_stream_order
        }
        fn start_reload(
            &mut self,
            _: &RankCtx,
            _: &str,
            _: &mut StreamTimeline,
        ) -> Result<u64, CudaError> {
            Err(CudaError::Invalid("not on a GPU".into()))
        }
        fn discard_device(&mut self, _: &RankCtx) -> Result<(), CudaError> {
            Ok(())
        }
        fn release_host(&mut self, _: usize, _: &PinnedPool) {}
    }

    /// Master weights and one Adam moment.
    struct Rank {
        master: Fake,
        moment: Fake,
    }

    impl RankBuffers for Rank {
        fn source(&self) -> Result<SourceBuf<'_>, CudaError> {
            Err(CudaError::Invalid("not on a GPU".into()))
        }
        fn movable(&mut self) -> Vec<Movable<'_>> {
            vec![
                Movable::new("moment", BufferClass::Optimizer, &mut self.moment),
                Movable::new("master", BufferClass::Params, &mut self.master),
            ]
        }
    }

    fn rank(master: (bool, bool), moment: (bool, bool)) -> Rank {
        let fake = |(offloaded, in_stream_order)| Fake {
            offloaded,
            in_stream_order,
        };
        Rank {
            master: fake(master),
            moment: fake(moment),
        }
    }

    #[test]
    fn an_offload_overlaps_only_when_every_moved_buffer_frees_in_stream_order() {
        type D<'a> = SwitchDriver<'a, crate::ThreadRankPool>;
        let both = MemoryPolicy::default();
        let optimizer = MemoryPolicy {
            offload_params: false,
            ..both
        };
        let ours = (false, true);
        let lent = (false, false);
        // everything moved is ours: overlapped
        assert!(D::can_overlap(&mut [rank(ours, ours)], both));
        // a lent master moves: settled
        assert!(!D::can_overlap(&mut [rank(lent, ours)], both));
        // ... unless the policy leaves it on the device
        assert!(D::can_overlap(&mut [rank(lent, ours)], optimizer));
        // one rank of two with a lent buffer: settled
        assert!(!D::can_overlap(
            &mut [rank(ours, ours), rank(ours, lent)],
            both
        ));
        // nothing moves (resident policy, or already offloaded): nothing to overlap
        assert!(!D::can_overlap(
            &mut [rank(ours, ours)],
            MemoryPolicy::resident()
        ));
        assert!(!D::can_overlap(
            &mut [rank((true, true), (true, true))],
            both
        ));
    }
}
