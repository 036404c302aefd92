//! The issuer: each operation of a program as launches, driver copies, NCCL calls or peer
//! copies on the rank's streams, each marked on its stream's timeline.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use lifecycle_core::{Link, Phase};
use lifecycle_layout::steps::{Buf, CopyRole, Op, Stream};

use crate::agree::{agree_scales, AgreedJobs, Rendezvous};
use crate::quantise::QuantiseSource;
use crate::{copy_2d, peer_base, CudaError, Mark, RankCtx, StreamTimeline};

use super::program::{DeviceProgram, RunOptions, SourceBuf};
use super::scratch::{Fp8Scratch, Slots};

fn span_name(role: CopyRole) -> (String, Link) {
    match role {
        CopyRole::Local(c) => (format!("local copies c{c}"), Link::Local),
        CopyRole::Pack(k) => (format!("pack s{k}"), Link::Local),
        CopyRole::Unpack(k) => (format!("unpack s{k}"), Link::Local),
        CopyRole::Scales => ("fp8 scales".into(), Link::Local),
        CopyRole::Remote { index, peer } => (
            format!("peer tiles s{index} to rank {peer}"),
            Link::DeviceToDevice,
        ),
    }
}

/// What the operations of one run issue against: the program, the device addresses of the
/// rank's buffers (checked against the steps by [`check_buffers`](super::run::check_buffers))
/// and of the staging slots, the peers' rollout buffers, and the streams.
pub(super) struct Issuer<'a> {
    pub(super) ctx: &'a RankCtx,
    pub(super) prog: &'a DeviceProgram,
    pub(super) source: SourceBuf<'a>,
    pub(super) bases: &'a [u64],
    pub(super) meet: Option<&'a Rendezvous>,
    /// The agreed scale grid's and the fp8 stage's addresses.
    pub(super) fp8_addrs: Option<(u64, u64)>,
    pub(super) opts: RunOptions,
    pub(super) nccl: Arc<CudaStream>,
    pub(super) src_base: u64,
    pub(super) rbase: u64,
    pub(super) sbases: Vec<u64>,
    pub(super) rbases: Vec<u64>,
    /// The rank's non-finite flag ([`RankCtx::nonfinite_flag`]), which every cast and
    /// quantisation of the run sets when it reads a NaN or an infinity.
    pub(super) nonfinite: u64,
}

impl Issuer<'_> {
    pub(super) fn stream(&self, st: Stream) -> &Arc<CudaStream> {
        match st {
            Stream::Compute => &self.ctx.compute,
            Stream::Aux => &self.ctx.aux,
            Stream::Net => &self.nccl,
        }
    }

    pub(super) fn missing(&self, what: &str) -> CudaError {
        CudaError::Invalid(format!("rank {}: {what}", self.ctx.rank))
    }

    /// Ends the timeline mark of a transfer-phase step on the auxiliary stream that moved
    /// `bytes` within the device (quantisation, amax, zeroing).
    fn aux_done(
        &self,
        tl: &mut StreamTimeline,
        mark: Mark,
        what: &str,
        bytes: u64,
    ) -> Result<(), CudaError> {
        let (ctx, link) = (self.ctx, Some(Link::Local));
        tl.end(
            ctx,
            &ctx.aux,
            mark,
            Phase::Transfer,
            what,
            "aux",
            bytes,
            link,
        )
    }

    /// The device address of `buf` (staging slot `slot` for the slots).
    pub(super) fn base_of(&self, buf: Buf, slot: usize) -> Result<u64, CudaError> {
        match buf {
            Buf::Source => Ok(self.src_base),
            Buf::Rollout => Ok(self.rbase),
            Buf::SendSlot => self
                .sbases
                .get(slot)
                .copied()
                .ok_or_else(|| self.missing("no send slot")),
            Buf::RecvSlot => self
                .rbases
                .get(slot)
                .copied()
                .ok_or_else(|| self.missing("no receive slot")),
            Buf::Scales => self
                .fp8_addrs
                .map(|(grid, _)| grid)
                .ok_or_else(|| self.missing("no fp8 scale grid")),
            Buf::Fp8Stage => self
                .fp8_addrs
                .map(|(_, stage)| stage)
                .ok_or_else(|| self.missing("no fp8 stage")),
        }
    }

    /// `Op::Quantise`: every quantisation of the steps in one launch on the auxiliary stream.
    pub(super) fn quantise(&self, tl: &mut StreamTimeline) -> Result<(), CudaError> {
        let ctx = self.ctx;
        let jobs = self
            .prog
            .quantise
            .as_ref()
            .ok_or_else(|| self.missing("a quantisation step without its job table"))?;
        let kind = match self.source {
            SourceBuf::F32(_) => QuantiseSource::F32,
            SourceBuf::Bf16(_) => QuantiseSource::Bf16,
        };
        let mark = tl.begin(ctx, &ctx.aux)?;
        // SAFETY: the program's steps were validated against a source of at least
        // `source_elems` and a rollout buffer of at least `rollout_elems` elements (checked
        // against these buffers); both live until the runner synchronised; the regions' bytes
        // are written by no other step; the non-finite flag is the rank's word, alive as long
        // as its context.
        unsafe {
            jobs.launch(
                ctx,
                &ctx.aux,
                kind,
                (self.src_base, self.rbase),
                self.nonfinite,
            )?
        };
        self.aux_done(tl, mark, "fp8 quantisation", jobs.bytes())
    }

    pub(super) fn agreed_jobs(&self) -> Result<&AgreedJobs, CudaError> {
        if !matches!(self.source, SourceBuf::F32(_)) {
            return Err(self.missing("an agreed fp8 switch reads a bf16 training buffer"));
        }
        self.prog
            .agreed
            .as_ref()
            .ok_or_else(|| self.missing("an fp8 agreement without its job tables"))
    }

    /// `Op::Amax`: the partial amaxes into the zeroed grid (the rank's own partial grid on ranks
    /// without NCCL), on the auxiliary stream.
    pub(super) fn amax(
        &self,
        fp8: Option<&mut Fp8Scratch>,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let ctx = self.ctx;
        let jobs = self.agreed_jobs()?;
        let f = fp8.ok_or_else(|| self.missing("an fp8 agreement without its grid"))?;
        let grid = match &mut f.meeting {
            Some((own, _)) => own,
            None => &mut f.grid,
        };
        let mark = tl.begin(ctx, &ctx.aux)?;
        // SAFETY: the source was checked against the validated steps and the grid holds the
        // steps' `grid_elems` entries; both live until the runner synchronised; the program
        // orders every reader of the grid after this stream's event; the non-finite flag is the
        // rank's word, alive as long as its context.
        unsafe { jobs.amax(ctx, &ctx.aux, self.src_base, grid, self.nonfinite)? };
        self.aux_done(tl, mark, "fp8 partial amax", 4 * jobs.grid_elems())
    }

    /// `Op::Agree`: the scale grid agreed by every rank, on the network stream: an all-reduce by
    /// max with NCCL; without it, the peers' partial grids copied at the fp8 meeting.
    pub(super) fn agree(
        &self,
        fp8: Option<&mut Fp8Scratch>,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let (ctx, rank) = (self.ctx, self.ctx.rank);
        let n = self.agreed_jobs()?.grid_elems();
        let f = fp8.ok_or_else(|| self.missing("an fp8 agreement without its grid"))?;
        let grid = ctx.addr_mut(&mut f.grid);
        let mark = tl.begin(ctx, &self.nccl)?;
        match &mut f.meeting {
            None => {
                ctx.comm
                    .all_reduce_in_place(&mut f.grid, &cudarc::nccl::ReduceOp::Max)?;
                // SAFETY: the grid holds `n` floats, alive until the runner synchronised; it is
                // its own only part (read then written entry by entry).
                unsafe { agree_scales(ctx, &self.nccl, &[grid], n, grid)? };
            }
            Some((own, copies)) => {
                let meet = self.meet.ok_or_else(|| {
                    self.missing(
                        "agreeing fp8 scales without NCCL needs every rank in this process",
                    )
                })?;
                let timeout = ctx.collective_timeout();
                // The partial amaxes done before the peers may read them.
                ctx.wait(&[&ctx.aux], "the fp8 partial amaxes")?;
                let mine = ctx.addr_mut(own);
                let grids = meet.publish(rank, mine, timeout)?;
                let base = ctx.addr_mut(copies);
                let mut parts = vec![mine];
                for (p, &addr) in grids.iter().enumerate().filter(|(p, _)| *p != rank) {
                    let at = base + 4 * n * parts.len().saturating_sub(1) as u64;
                    // SAFETY: the peer's partial grid holds `n` floats (the same steps' grid
                    // on every rank), finished (its rank synchronised before publishing it) and
                    // kept until every rank copied it (`Rendezvous::copied` below); the copy
                    // lands in this rank's buffer of `(world - 1) · n` floats.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            at,
                            addr,
                            4 * n as usize,
                            self.nccl.cu_stream(),
                        )
                    }
                    .map_err(ctx.drv(&format!("copying rank {p}'s fp8 grid"), 4 * n))?;
                    parts.push(at);
                }
                // SAFETY: every part holds `n` floats on this device (own and copied grids),
                // the agreed grid `n`; all live until the runner synchronised.
                unsafe { agree_scales(ctx, &self.nccl, &parts, n, grid)? };
                ctx.wait(&[&self.nccl], "copying the peers' fp8 grids")?;
                meet.copied(rank, timeout)?;
            }
        }
        let bytes = 4 * n * ctx.world as u64;
        tl.end(
            ctx,
            &self.nccl,
            mark,
            Phase::Transfer,
            "fp8 agreement",
            "nccl",
            bytes,
            Some(Link::DeviceToDevice),
        )
    }

    /// `Op::QuantiseAgreed`: the pieces quantised with the agreed scales, on the auxiliary
    /// stream.
    pub(super) fn quantise_agreed(&self, tl: &mut StreamTimeline) -> Result<(), CudaError> {
        let ctx = self.ctx;
        let jobs = self.agreed_jobs()?;
        let (grid, stage) = self
            .fp8_addrs
            .ok_or_else(|| self.missing("an fp8 agreement without its grid"))?;
        let mark = tl.begin(ctx, &ctx.aux)?;
        // SAFETY: source, rollout buffer and stage were checked against (or allocated from) the
        // validated steps; the grid was agreed before this stream's wait; all live until the
        // runner synchronised; the bytes written are the steps' own.
        unsafe { jobs.quantise(ctx, &ctx.aux, self.src_base, grid, (self.rbase, stage))? };
        self.aux_done(tl, mark, "fp8 quantisation (agreed scales)", jobs.bytes())
    }

    /// `Op::Zero`: the zero ranges (vocabulary padding) on the auxiliary stream.
    pub(super) fn zero(
        &self,
        roll: &mut CudaSlice<bf16>,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let (ctx, s) = (self.ctx, &self.prog.steps);
        let mark = tl.begin(ctx, &ctx.aux)?;
        for z in &s.zero {
            let r = z.start as usize..z.end as usize;
            ctx.aux
                .memset_zeros(&mut roll.slice_mut(r))
                .map_err(ctx.drv("zeroing vocabulary padding", (z.end - z.start) * 2))?;
        }
        self.aux_done(tl, mark, "zero padding", s.zero_elems() * 2)
    }

    /// `Op::Copies` (operation `i` of the program): the run's multi-tensor casts, single casts,
    /// tiles and driver copies on its stream.
    pub(super) fn copies(
        &self,
        i: usize,
        op: &Op,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let Op::Copies {
            stream: st,
            copies,
            slot,
            peer,
            overlap,
            role,
        } = op
        else {
            return Err(self.missing("a copy operation that is not one"));
        };
        let (ctx, prog, s, rank) = (self.ctx, self.prog, &self.prog.steps, self.ctx.rank);
        let l = prog.launches[i]
            .as_ref()
            .ok_or_else(|| self.missing("copies without a launch"))?;
        let strm = self.stream(*st);
        let src = self.base_of(l.src, *slot)?;
        let dst = match peer {
            Some(p) if l.dst == Buf::Rollout => peer_base(self.bases, *p, rank)?,
            Some(_) => return Err(self.missing("remote copies must write a rollout buffer")),
            None => self.base_of(l.dst, *slot)?,
        };
        let bps = if *overlap {
            self.opts.overlap_blocks_per_sm.max(1)
        } else {
            8
        };
        let descs = prog.descs.as_ref().map_or(0, |d| ctx.addr(d));
        let tiles = ctx.addr(&prog.tiles);
        let mark = tl.begin(ctx, strm)?;
        // SAFETY: the steps were validated: every copy of this run lies inside its source and
        // destination buffers (the training buffer, the rollout buffer of this rank or, for
        // remote copies, of the peer — the same length on every rank — or staging slot `slot`),
        // whose sizes were checked against the steps; the tables were uploaded from the same
        // steps; all buffers stay alive until the run's final synchronisation (peers' until
        // every rank synchronised at the end of the transfer); the program's events order every
        // other reader and writer of these elements.
        unsafe {
            if let (Some((first, count, chunks)), Some(_)) = (&l.casts, &prog.descs) {
                ctx.kernels.cast_multi(
                    strm,
                    src,
                    dst,
                    descs,
                    *first,
                    *count,
                    chunks.clone(),
                    self.nonfinite,
                    rank,
                )?;
            }
            for &c in &l.single_casts {
                let c = &s.copies[c];
                ctx.kernels.cast_f32_bf16(
                    strm,
                    src + 4 * c.src_off,
                    dst + 2 * c.dst_off,
                    c.region,
                    self.nonfinite,
                    rank,
                )?;
            }
            prog.tile_kernel
                .launch(strm, tiles, l.tiles.clone(), src, dst, bps, rank)?;
            for &c in &l.driver {
                let c = &s.copies[c];
                let bytes = (c.numel() * 2) as usize;
                cudarc::driver::result::memcpy_dtod_async(
                    dst + 2 * c.dst_off,
                    src + 2 * c.src_off,
                    bytes,
                    strm.cu_stream(),
                )
                .map_err(ctx.drv("copying a local run", bytes as u64))?;
            }
        }
        if !tl.enabled() {
            return Ok(());
        }
        let (name, link) = span_name(*role);
        let bytes = s.copy_elems(copies.clone()) * 2;
        let track = st.track();
        tl.end(
            ctx,
            strm,
            mark,
            Phase::Transfer,
            name,
            track,
            bytes,
            Some(link),
        )
    }

    /// `Op::Nccl`: network step `step`'s grouped sends and receives (staging slot `slot`),
    /// then its all-gathers, on the network stream.
    pub(super) fn nccl(
        &self,
        step: usize,
        slot: usize,
        roll: &mut CudaSlice<bf16>,
        (sslots, rslots): (&Slots, &mut Slots),
        stage: Option<&CudaSlice<bf16>>,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let (ctx, s, rank) = (self.ctx, &self.prog.steps, self.ctx.rank);
        let st = &s.steps[step];
        let mark = tl.begin(ctx, &self.nccl)?;
        if !st.sends.is_empty() || !st.recvs.is_empty() {
            ctx.group_start()?;
            let mut res = Ok(());
            for m in &st.sends {
                let (lo, hi, peer) = (m.off as usize, (m.off + m.count) as usize, m.peer as i32);
                let r = match (m.buf, self.source) {
                    (Buf::Source, SourceBuf::Bf16(p)) => ctx.comm.send(&p.slice(lo..hi), peer),
                    (Buf::Rollout, _) => ctx.comm.send(&roll.slice(lo..hi), peer),
                    (Buf::SendSlot, _) if slot < sslots.len() => {
                        ctx.comm.send(&sslots[slot].slice(lo..hi), peer)
                    }
                    (Buf::Fp8Stage, _) if stage.is_some() => match stage {
                        Some(st) => ctx.comm.send(&st.slice(lo..hi), peer),
                        None => Err(self.missing("no fp8 stage")),
                    },
                    _ => Err(self.missing("a send from a buffer NCCL cannot read here")),
                };
                if let Err(e) = r {
                    res = Err(CudaError::nccl(rank, "ncclSend", e));
                    break;
                }
            }
            if res.is_ok() {
                for m in &st.recvs {
                    let (lo, hi, peer) =
                        (m.off as usize, (m.off + m.count) as usize, m.peer as i32);
                    let r = match m.buf {
                        Buf::Rollout => ctx.comm.recv(&mut roll.slice_mut(lo..hi), peer),
                        Buf::RecvSlot if slot < rslots.len() => {
                            ctx.comm.recv(&mut rslots[slot].slice_mut(lo..hi), peer)
                        }
                        _ => Err(self.missing("a receive into a buffer NCCL cannot write here")),
                    };
                    if let Err(e) = r {
                        res = Err(CudaError::nccl(rank, "ncclRecv", e));
                        break;
                    }
                }
            }
            // Waits (with the pool's deadline) until the group's work is on the stream.
            let end = ctx.group_end();
            res?;
            end?;
        }
        if !st.gathers.is_empty() {
            all_gather(ctx, st, roll, self.rbase, s.rollout_elems)?;
        }
        if !tl.enabled() {
            return Ok(());
        }
        let what = if st.gathers.is_empty() {
            "send/recv"
        } else {
            "all-gather"
        };
        let name = format!("{what} s{}", st.index);
        let link = Some(Link::DeviceToDevice);
        let bytes = st.recv_elems * 2;
        tl.end(
            ctx,
            &self.nccl,
            mark,
            Phase::Transfer,
            name,
            "nccl",
            bytes,
            link,
        )
    }

    /// `Op::Push`: network step `step`'s peer copies `runs` into rank `peer`'s rollout buffer,
    /// on the network stream.
    pub(super) fn push(
        &self,
        step: usize,
        peer: usize,
        runs: Range<usize>,
        slot: usize,
        tl: &mut StreamTimeline,
    ) -> Result<(), CudaError> {
        let (ctx, s) = (self.ctx, &self.prog.steps);
        let st = &s.steps[step];
        let dst_base = peer_base(self.bases, peer, ctx.rank)?;
        let mark = tl.begin(ctx, &self.nccl)?;
        let mut bytes = 0;
        for r in &st.pushes[runs] {
            let src = self.base_of(r.src, slot)?;
            let g = r.region;
            // SAFETY: the run lies inside this rank's buffer (validated steps, sizes checked
            // against the steps) and the peer's rollout buffer (the same length on every rank;
            // its address came from the peer), both alive until every rank has synchronised at
            // the end of the transfer; peer access is enabled (plans with peer copies exist only
            // then); no other copy writes these elements.
            unsafe {
                copy_2d(
                    ctx,
                    &self.nccl,
                    (dst_base + 2 * r.dst_off, 2 * g.dst_ld as usize),
                    (src + 2 * r.src_off, 2 * g.src_ld as usize),
                    2 * g.cols as usize,
                    g.rows as usize,
                    "copying runs into a peer's rollout buffer",
                )?
            };
            bytes += g.numel() * 2;
        }
        let name = format!("peer copies s{} to rank {peer}", st.index);
        let link = Some(Link::DeviceToDevice);
        tl.end(
            ctx,
            &self.nccl,
            mark,
            Phase::Transfer,
            name,
            "peer",
            bytes,
            link,
        )
    }
}

/// The step's in-place all-gathers into the rollout buffer, as one NCCL group.
fn all_gather(
    ctx: &RankCtx,
    st: &lifecycle_layout::steps::NetStep,
    roll: &mut CudaSlice<bf16>,
    rbase: u64,
    rollout_elems: u64,
) -> Result<(), CudaError> {
    let (rank, w) = (ctx.rank, ctx.world as u64);
    // SAFETY: an alias of the rollout buffer (same pointer, the validated length) so the
    // in-place all-gather can name its send part (inside the receive range), which NCCL supports
    // when sendbuff == recvbuff + rank * count. It is leaked (not freed) right after the group;
    // the real buffer outlives the transfer's final synchronisation.
    let alias: CudaSlice<bf16> = unsafe {
        ctx.compute
            .upgrade_device_ptr(rbase, rollout_elems as usize)
    };
    let mut res = ctx.group_start();
    if res.is_ok() {
        for g in &st.gathers {
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
    end
}
