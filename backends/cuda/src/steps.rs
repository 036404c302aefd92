//! The step runner: one rank's [`RankSteps`], compiled into its [`Program`], issued on the rank's
//! streams. Every layout's switch runs here (FSDP buckets and Megatron schedules alike).
//!
//! [`DeviceProgram::new`] compiles the steps and uploads, once, the tables their copies need:
//! the multi-tensor cast descriptors for fp32 sources ([`CastBatch`]) and the tile table of the
//! bf16 copy kernel ([`TileKernel`]). [`run_program`] then walks the program's operations in
//! order: events become CUDA events, copies become kernel launches or driver copies, network
//! steps become grouped NCCL calls or peer copies, and each piece of work is marked on the
//! [`StreamTimeline`] of the stream that runs it. The final wait carries the pool's deadline, so a
//! stalled peer ends in a timeout error, not a hang.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use half::bf16;

use lifecycle_core::{Link, Phase};
use lifecycle_layout::steps::{
    compile, push_tiles, Buf, CopyRole, Engine, Op, Program, RankSteps, SourceType, Stream, Tile,
    TILE_BYTES,
};

use crate::agree::{agree_scales, AgreedJobs, Rendezvous};
use crate::quantise::{QuantiseJobs, QuantiseSource};
use crate::{
    alloc_device, alloc_zeros, copy_2d, peer_base, CastBatch, CudaError, RankCtx, RankMoved,
    StreamTimeline, TileKernel,
};

/// How one run of copies is launched.
#[derive(Debug, Clone)]
struct Launch {
    src: Buf,
    dst: Buf,
    /// Descriptors `first .. first + count` of the cast batch, covering chunks `chunks`.
    casts: Option<(usize, usize, Range<u64>)>,
    /// Copies cast by a launch of their own (regions the batched kernel does not take).
    single_casts: Vec<usize>,
    /// Tiles of the tile table.
    tiles: Range<usize>,
    /// Copies run by the driver.
    driver: Vec<usize>,
}

/// A rank's compiled steps with their copy tables on the rank's device.
#[derive(Debug)]
pub struct DeviceProgram {
    steps: RankSteps,
    program: Program,
    launches: Vec<Option<Launch>>,
    descs: Option<CudaSlice<u64>>,
    tiles: CudaSlice<u8>,
    tile_kernel: TileKernel,
    quantise: Option<QuantiseJobs>,
    agreed: Option<AgreedJobs>,
}

/// The training buffer a rank's switch reads.
#[derive(Debug, Clone, Copy)]
pub enum SourceBuf<'a> {
    /// fp32 masters.
    F32(&'a CudaSlice<f32>),
    /// bf16 parameters.
    Bf16(&'a CudaSlice<bf16>),
}

impl SourceBuf<'_> {
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        match self {
            SourceBuf::F32(s) => s.len(),
            SourceBuf::Bf16(s) => s.len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn dtype(&self) -> SourceType {
        match self {
            SourceBuf::F32(_) => SourceType::F32,
            SourceBuf::Bf16(_) => SourceType::Bf16,
        }
    }
}

/// Launch settings of [`run_program`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Thread blocks per SM of the tile kernel for copies that share the GPU with network work
    /// (others use 8).
    pub overlap_blocks_per_sm: u32,
}

impl Default for RunOptions {
    /// 4 blocks per SM next to network work.
    fn default() -> Self {
        RunOptions {
            overlap_blocks_per_sm: 4,
        }
    }
}

impl DeviceProgram {
    /// Compiles `steps` and uploads their copy tables on this rank's compute stream. With
    /// `batched_casts`, fp32 casts go through the multi-tensor kernel (one launch per run of
    /// copies); otherwise each cast is a launch of its own.
    pub fn new(ctx: &RankCtx, steps: RankSteps, batched_casts: bool) -> Result<Self, CudaError> {
        let program = compile(&steps).map_err(|e| CudaError::Invalid(e.to_string()))?;
        let mut batch = CastBatch::default();
        let mut tiles: Vec<Tile> = Vec::new();
        let mut launches = Vec::with_capacity(program.ops().len());
        for op in program.ops() {
            let Op::Copies { copies, .. } = op else {
                launches.push(None);
                continue;
            };
            let Some(first) = steps.copies.get(copies.start) else {
                launches.push(None);
                continue;
            };
            let mut l = Launch {
                src: first.src,
                dst: first.dst,
                casts: None,
                single_casts: Vec::new(),
                tiles: 0..0,
                driver: Vec::new(),
            };
            let (d0, c0, t0) = (batch.len(), batch.chunks(), tiles.len());
            for i in copies.clone() {
                let c = &steps.copies[i];
                if (c.src, c.dst) != (l.src, l.dst) {
                    return Err(CudaError::Invalid(format!(
                        "rank {}: copies {copies:?} mix buffers ({:?} → {:?} and {:?} → {:?}); \
                         one run of copies reads one buffer and writes one",
                        steps.rank, l.src, l.dst, c.src, c.dst
                    )));
                }
                match c.engine {
                    Engine::Driver => l.driver.push(i),
                    Engine::Kernel if c.src == Buf::Source && steps.source == SourceType::F32 => {
                        if !(batched_casts && batch.push(c.src_off, c.dst_off, c.region)) {
                            l.single_casts.push(i);
                        }
                    }
                    Engine::Kernel => push_tiles(c.src_off, c.dst_off, c.region, &mut tiles),
                }
            }
            if batch.len() > d0 {
                l.casts = Some((d0, batch.len() - d0, c0..batch.chunks()));
            }
            l.tiles = t0..tiles.len();
            launches.push(Some(l));
        }
        let upload = |what: &str, n: u64| ctx.drv(what, n);
        let descs = if batch.is_empty() {
            None
        } else {
            let words = batch.words();
            Some(
                ctx.compute
                    .clone_htod(words)
                    .map_err(upload("uploading cast descriptors", 8 * words.len() as u64))?,
            )
        };
        let mut bytes = Vec::with_capacity(tiles.len().max(1) * TILE_BYTES);
        for t in &tiles {
            t.write_bytes(&mut bytes);
        }
        bytes.resize(bytes.len().max(TILE_BYTES), 0);
        let tiles = ctx
            .compute
            .clone_htod(&bytes)
            .map_err(upload("uploading the copy tiles", bytes.len() as u64))?;
        let quantise = QuantiseJobs::upload(ctx, &steps.quantise)?;
        let agreed = match &steps.agree {
            Some(a) => Some(AgreedJobs::upload(ctx, a)?),
            None => None,
        };
        Ok(DeviceProgram {
            steps,
            program,
            launches,
            descs,
            tiles,
            tile_kernel: TileKernel::load(ctx)?,
            quantise,
            agreed,
        })
    }

    /// The steps this program runs.
    pub fn steps(&self) -> &RankSteps {
        &self.steps
    }

    /// The compiled program.
    pub fn program(&self) -> &Program {
        &self.program
    }
}

/// A rank's step program kept while the plan it was built for is current (`K` names the plan:
/// an id, or a handle that compares by identity).
#[derive(Debug)]
pub struct ProgramSlot<K> {
    entry: Option<(K, DeviceProgram)>,
}

impl<K> Default for ProgramSlot<K> {
    fn default() -> Self {
        ProgramSlot { entry: None }
    }
}

impl<K: PartialEq> ProgramSlot<K> {
    /// The program built for `key`: the kept one, or a new one from `steps()` (compiled and
    /// uploaded on this rank, replacing the old one).
    pub fn get_or_build(
        &mut self,
        ctx: &RankCtx,
        key: K,
        batched_casts: bool,
        steps: impl FnOnce() -> Result<RankSteps, lifecycle_layout::LayoutError>,
    ) -> Result<&DeviceProgram, CudaError> {
        if !self.entry.as_ref().is_some_and(|(k, _)| *k == key) {
            self.entry = None;
            let steps = steps().map_err(|e| CudaError::Invalid(e.to_string()))?;
            self.entry = Some((key, DeviceProgram::new(ctx, steps, batched_casts)?));
        }
        match &self.entry {
            Some((_, program)) => Ok(program),
            None => Err(CudaError::Invalid(format!(
                "rank {}: no step program",
                ctx.rank
            ))),
        }
    }
}

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
fn check_buffers(
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

type Slots = Vec<CudaSlice<bf16>>;

/// The send and receive staging slots of the steps in flight.
fn alloc_slots(ctx: &RankCtx, s: &RankSteps) -> Result<(Slots, Slots), CudaError> {
    let rank = ctx.rank;
    let slots = if s.steps.is_empty() { 0 } else { s.in_flight };
    let (mut sslots, mut rslots) = (Vec::new(), Vec::new());
    for _ in 0..slots {
        if s.send_slot_elems > 0 {
            // SAFETY: a step's sends read only slot elements its pack wrote first (the program
            // orders the network work after the pack).
            sslots.push(unsafe {
                alloc_device::<bf16>(
                    &ctx.compute,
                    s.send_slot_elems as usize,
                    rank,
                    "send staging",
                )?
            });
        }
        if s.recv_slot_elems > 0 {
            // SAFETY: a step's unpack reads only slot elements its receives wrote first.
            rslots.push(unsafe {
                alloc_device::<bf16>(
                    &ctx.compute,
                    s.recv_slot_elems as usize,
                    rank,
                    "receive staging",
                )?
            });
        }
    }
    Ok((sslots, rslots))
}

/// The device buffers of an agreed fp8 switch, for one run: the agreed scale grid, the fp8
/// stage and, on ranks without NCCL, the rank's partial grid and its copies of its peers'.
struct Fp8Scratch {
    grid: CudaSlice<f32>,
    stage: CudaSlice<bf16>,
    /// Without NCCL: the rank's own partial amaxes (its peers read them) and the peers' copied
    /// next to each other.
    meeting: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl Fp8Scratch {
    fn alloc(ctx: &RankCtx, s: &RankSteps) -> Result<Option<Fp8Scratch>, CudaError> {
        let Some(a) = &s.agree else {
            return Ok(None);
        };
        let (rank, n) = (ctx.rank, a.grid_elems as usize);
        let grid = alloc_zeros::<f32>(&ctx.compute, n, rank, "the fp8 scale grid")?;
        // SAFETY: the stage's bytes are read (sent) only after the agreed quantisation wrote
        // them (the program orders the network step after it).
        let stage = unsafe {
            alloc_device::<bf16>(&ctx.compute, a.stage_elems as usize, rank, "the fp8 stage")?
        };
        let meeting = if ctx.comm.is_available() {
            None
        } else {
            let own = alloc_zeros::<f32>(&ctx.compute, n, rank, "the fp8 partial grid")?;
            let peers = ctx.world.saturating_sub(1).max(1) * n;
            let copies = alloc_zeros::<f32>(&ctx.compute, peers, rank, "the peers' fp8 grids")?;
            Some((own, copies))
        };
        Ok(Some(Fp8Scratch {
            grid,
            stage,
            meeting,
        }))
    }

    /// Bytes of the peers' copied grids (beyond [`RankSteps::staging_bytes`]).
    fn gathered_bytes(&self) -> u64 {
        self.meeting
            .as_ref()
            .map_or(0, |(own, peers)| 4 * (own.len() + peers.len()) as u64)
    }
}

/// What the operations of one run issue against: the program, the device addresses of the
/// rank's buffers (checked against the steps by [`check_buffers`]) and of the staging slots,
/// the peers' rollout buffers, and the streams.
struct Issuer<'a> {
    ctx: &'a RankCtx,
    prog: &'a DeviceProgram,
    source: SourceBuf<'a>,
    bases: &'a [u64],
    meet: Option<&'a Rendezvous>,
    /// The agreed scale grid's and the fp8 stage's addresses.
    fp8_addrs: Option<(u64, u64)>,
    opts: RunOptions,
    nccl: Arc<CudaStream>,
    src_base: u64,
    rbase: u64,
    sbases: Vec<u64>,
    rbases: Vec<u64>,
}

impl Issuer<'_> {
    fn stream(&self, st: Stream) -> &Arc<CudaStream> {
        match st {
            Stream::Compute => &self.ctx.compute,
            Stream::Aux => &self.ctx.aux,
            Stream::Net => &self.nccl,
        }
    }

    fn missing(&self, what: &str) -> CudaError {
        CudaError::Invalid(format!("rank {}: {what}", self.ctx.rank))
    }

    /// The device address of `buf` (staging slot `slot` for the slots).
    fn base_of(&self, buf: Buf, slot: usize) -> Result<u64, CudaError> {
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
    fn quantise(&self, tl: &mut StreamTimeline) -> Result<(), CudaError> {
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
        // are written by no other step.
        unsafe { jobs.launch(ctx, &ctx.aux, kind, self.src_base, self.rbase)? };
        let bytes = jobs.bytes();
        let link = Some(Link::Local);
        let what = "fp8 quantisation";
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

    fn agreed_jobs(&self) -> Result<&AgreedJobs, CudaError> {
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
    fn amax(&self, fp8: Option<&mut Fp8Scratch>, tl: &mut StreamTimeline) -> Result<(), CudaError> {
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
        // orders every reader of the grid after this stream's event.
        unsafe { jobs.amax(ctx, &ctx.aux, self.src_base, grid)? };
        let bytes = 4 * jobs.grid_elems();
        tl.end(
            ctx,
            &ctx.aux,
            mark,
            Phase::Transfer,
            "fp8 partial amax",
            "aux",
            bytes,
            Some(Link::Local),
        )
    }

    /// `Op::Agree`: the scale grid agreed by every rank, on the network stream: an all-reduce by
    /// max with NCCL; without it, the peers' partial grids copied at the fp8 meeting.
    fn agree(
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
    fn quantise_agreed(&self, tl: &mut StreamTimeline) -> Result<(), CudaError> {
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
        let what = "fp8 quantisation (agreed scales)";
        tl.end(
            ctx,
            &ctx.aux,
            mark,
            Phase::Transfer,
            what,
            "aux",
            jobs.bytes(),
            Some(Link::Local),
        )
    }

    /// `Op::Zero`: the zero ranges (vocabulary padding) on the auxiliary stream.
    fn zero(&self, roll: &mut CudaSlice<bf16>, tl: &mut StreamTimeline) -> Result<(), CudaError> {
        let (ctx, s) = (self.ctx, &self.prog.steps);
        let mark = tl.begin(ctx, &ctx.aux)?;
        for z in &s.zero {
            let r = z.start as usize..z.end as usize;
            ctx.aux
                .memset_zeros(&mut roll.slice_mut(r))
                .map_err(ctx.drv("zeroing vocabulary padding", (z.end - z.start) * 2))?;
        }
        let bytes = s.zero_elems() * 2;
        let link = Some(Link::Local);
        let what = "zero padding";
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

    /// `Op::Copies` (operation `i` of the program): the run's multi-tensor casts, single casts,
    /// tiles and driver copies on its stream.
    fn copies(&self, i: usize, op: &Op, tl: &mut StreamTimeline) -> Result<(), CudaError> {
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
    fn nccl(
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
    fn push(
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
