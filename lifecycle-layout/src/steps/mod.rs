//! The step plans every executor runs, whatever layout produced them.
//!
//! A rank's [`RankSteps`] says, in data, everything its switch does:
//! - **copies** ([`Copy`](struct@Copy)): 2-D regions copied (or cast, when the source is fp32) between the
//!   rank's buffers — its training buffer ([`Buf::Source`]), its rollout buffer, and the send and
//!   receive staging slots;
//! - **local chunks** ([`LocalChunk`]): runs of copies from the training buffer straight into the
//!   rollout buffer, with the stream they run on and when they are issued;
//! - **network steps** ([`NetStep`]): per step, the copies that pack the send slot, the grouped
//!   NCCL sends / receives / all-gathers, the peer copies written by the copy engines into other
//!   ranks' rollout buffers, and the copies that unpack the receive slot;
//! - **zero ranges**: rollout elements no transfer writes (vocabulary padding);
//! - **quantisations** ([`Quantise`]): regions of the fp32 training buffer written into the
//!   rollout buffer as block-scaled e4m3 (fp8 rollouts): one `scale_inv` per 128 × 128 block,
//!   every element `e4m3(x / scale_inv)`;
//! - **agreed fp8** ([`Fp8Agree`]): at W > 1, the block scales agreed across the ranks (partial
//!   amaxes, one all-reduce by max), then the pieces quantised with them and sent as e4m3 bytes.
//!
//! The FSDP bucket plans ([`crate::fsdp::FsdpPlan::rank_steps`]) and the Megatron schedules
//! ([`crate::megatron::schedule::RankSchedule::rank_steps`]) are two producers of steps;
//! [`compile`] turns steps into the [`Program`] of stream operations and events that the GPU
//! engine issues and the CPU executor simulates.
//!
//! ```
//! use lifecycle_layout::steps::{compile, Buf, Copy, LocalChunk, RankSteps, SourceType, Stream};
//! use lifecycle_layout::Region2d;
//! // One rank, one local cast of 8 fp32 into its rollout buffer: no network step.
//! let steps = RankSteps {
//!     rank: 0,
//!     world: 1,
//!     source: SourceType::F32,
//!     copies: vec![Copy::kernel(Buf::Source, 0, Buf::Rollout, 0, Region2d::flat(8))],
//!     local: vec![LocalChunk::upfront(0..1, Stream::Aux)],
//!     source_elems: 8,
//!     rollout_elems: 8,
//!     ..RankSteps::default()
//! };
//! steps.validate()?;
//! let program = compile(&steps)?;
//! assert_eq!(program.events(), 4);
//! # Ok::<(), lifecycle_layout::LayoutError>(())
//! ```

use std::ops::Range;

use crate::{LayoutError, Region2d};

mod agree;
mod program;
mod tiles;

pub use agree::{AgreedQuantise, Fp8Agree, GridRegion};
pub use program::{compile, CopyRole, Op, Program};
pub use tiles::{push_tiles, Tile, TILE_BYTES, TILE_ELEMS};

/// A buffer of one rank that a step reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The training buffer the switch reads: fp32 masters (FSDP) or bf16 parameters (Megatron).
    Source,
    /// The rank's flat bf16 rollout buffer.
    Rollout,
    /// The current step's send staging slot (bf16).
    SendSlot,
    /// The current step's receive staging slot (bf16).
    RecvSlot,
    /// The fp8 stage ([`Fp8Agree::stage_elems`]): e4m3 bytes of pieces sent, in 2-byte elements.
    Fp8Stage,
    /// The fp8 scale grid ([`Fp8Agree::grid_elems`] f32), read as 2-byte elements (two per
    /// scale, little-endian); only copies and the agreement read it.
    Scales,
}

/// Element type of a rank's [`Buf::Source`] (every other buffer holds bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SourceType {
    /// fp32 masters: a copy out of the source is a round-to-nearest-even cast to bf16.
    #[default]
    F32,
    /// bf16 parameters: copies are bit copies.
    Bf16,
}

/// Which hardware moves a [`Copy`](struct@Copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// A copy (or cast) kernel.
    #[default]
    Kernel,
    /// The driver's device-to-device copy on the copy engines (one dense bf16 row).
    Driver,
}

/// A 2-D copy between two buffers of one rank: `region.rows` rows of `region.cols` elements,
/// rows `src_ld` / `dst_ld` elements apart, starting at element offsets `src_off` / `dst_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Source buffer.
    pub src: Buf,
    /// First source element.
    pub src_off: u64,
    /// Destination buffer (never [`Buf::Source`]).
    pub dst: Buf,
    /// First destination element.
    pub dst_off: u64,
    /// Shape and pitches.
    pub region: Region2d,
    /// Which hardware moves it.
    pub engine: Engine,
}

impl Copy {
    /// A copy run by a kernel.
    pub fn kernel(src: Buf, src_off: u64, dst: Buf, dst_off: u64, region: Region2d) -> Self {
        Copy {
            src,
            src_off,
            dst,
            dst_off,
            region,
            engine: Engine::Kernel,
        }
    }

    /// Elements copied.
    pub fn numel(&self) -> u64 {
        self.region.numel()
    }
}

/// A contiguous run of bf16 sent to or received from a peer by NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The other rank (global).
    pub peer: usize,
    /// The buffer it is read from (sends) or written to (receives).
    pub buf: Buf,
    /// Element offset in that buffer.
    pub off: u64,
    /// Elements.
    pub count: u64,
}

/// An in-place all-gather into the rollout buffer: rank `r` contributes `count` elements at
/// `off + r · count`, every rank ends with `W · count` elements at `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    /// Element offset in the rollout buffer.
    pub off: u64,
    /// Elements each rank contributes.
    pub count: u64,
}

/// A 2-D region the copy engines write from one of this rank's buffers straight into a peer's
/// rollout buffer (peer copies; every rank's rollout buffer has the same length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRun {
    /// Destination rank (global).
    pub peer: usize,
    /// Source buffer ([`Buf::Source`] only when it holds bf16).
    pub src: Buf,
    /// First source element.
    pub src_off: u64,
    /// First element in the peer's rollout buffer.
    pub dst_off: u64,
    /// Shape and pitches.
    pub region: Region2d,
}

/// The streams of a rank, as executors name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Packs, unpacks, remote copies; everything else joins it at the end.
    Compute,
    /// Local copies and zeroing, which never wait for the network.
    Aux,
    /// NCCL groups and peer copies.
    Net,
}

impl Stream {
    /// Every stream.
    pub const ALL: [Stream; 3] = [Stream::Compute, Stream::Aux, Stream::Net];

    /// The trace track of the stream's spans.
    pub fn track(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Aux => "aux",
            Stream::Net => "nccl",
        }
    }
}

/// A run of [`RankSteps::copies`] from the training buffer into the rollout buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalChunk {
    /// Its copies.
    pub copies: Range<usize>,
    /// The stream that runs it.
    pub stream: Stream,
    /// Issued after the network work of this step (position in [`RankSteps::steps`]); `None`:
    /// before any network step.
    pub after_step: Option<usize>,
    /// Waits until the pack of this step (position) is done, giving way to it.
    pub gate: Option<usize>,
    /// Shares the GPU with network copies (executors launch it on fewer blocks).
    pub overlap: bool,
}

impl LocalChunk {
    /// A chunk issued before any network step, gated by nothing, on `stream`.
    pub fn upfront(copies: Range<usize>, stream: Stream) -> Self {
        LocalChunk {
            copies,
            stream,
            after_step: None,
            gate: None,
            overlap: false,
        }
    }
}

/// One network step of a rank. Steps with the same [`NetStep::index`] on two ranks exchange
/// their messages: the `i`-th send of rank `a` to rank `b` matches the `i`-th receive of `b`
/// from `a`, with the same element count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetStep {
    /// The step's number, the same on every rank.
    pub index: usize,
    /// Copies filling the send slot (compute stream).
    pub pack: Range<usize>,
    /// NCCL sends, in the order the peers post the matching receives.
    pub sends: Vec<Message>,
    /// NCCL receives.
    pub recvs: Vec<Message>,
    /// In-place NCCL all-gathers into the rollout buffer (every rank has the same list).
    pub gathers: Vec<Gather>,
    /// Peer copies (net stream), grouped by destination.
    pub pushes: Vec<PeerRun>,
    /// Per destination rank, copies a kernel writes straight into its rollout buffer (compute
    /// stream; [`Buf::Rollout`] destinations name the peer's buffer).
    pub remote: Vec<(usize, Range<usize>)>,
    /// Copies out of the receive slot (compute stream, after the network work).
    pub unpack: Range<usize>,
    /// The network work waits for this local chunk (it sends from or gathers into rollout
    /// elements the chunk writes).
    pub wait_local: Option<usize>,
    /// bf16 elements this rank receives in the step (its span's size).
    pub recv_elems: u64,
}

impl NetStep {
    /// Whether the step has NCCL work (sends, receives or all-gathers).
    pub fn has_nccl(&self) -> bool {
        !(self.sends.is_empty() && self.recvs.is_empty() && self.gathers.is_empty())
    }
}

/// A region of the training buffer (fp32, or bf16 widened exactly) quantised into the rollout
/// buffer in block-scaled e4m3 (the layout of [`crate::fp8`]): `rows × cols` values (row pitch
/// `src_ld`) from element `src_off` become `rows × cols` bytes from byte `dst_byte` of the
/// rollout buffer (row pitch `cols`) and one f32 `scale_inv` per 128 × 128 block, row-major, from f32 index `scale` of the
/// rollout buffer (its bytes `4 · scale ..`). Each block's scale is
/// [`block_scale_inv`](crate::fp8::block_scale_inv) of its amax; every value becomes
/// [`e4m3_from_f32`](crate::fp8::e4m3_from_f32)`(x / scale_inv)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantise {
    /// First source element.
    pub src_off: u64,
    /// First e4m3 byte in the rollout buffer.
    pub dst_byte: u64,
    /// First scale, as an f32 index into the rollout buffer.
    pub scale: u64,
    /// Rows.
    pub rows: u64,
    /// Columns (the row pitch of the bytes).
    pub cols: u64,
    /// Elements between the starts of source rows (at least `cols`; `cols` for a dense region).
    pub src_ld: u64,
}

impl Quantise {
    /// 128 × 128 blocks (scales) of the region.
    pub fn blocks(&self) -> u64 {
        let b = crate::fp8::FP8_BLOCK as u64;
        self.rows.div_ceil(b) * self.cols.div_ceil(b)
    }

    /// Bytes it writes into the rollout buffer (e4m3 bytes and scales).
    pub fn bytes(&self) -> u64 {
        self.rows * self.cols + 4 * self.blocks()
    }

    /// Source elements from `src_off` to the region's last one, its end included; `None` on
    /// overflow.
    pub fn src_span(&self) -> Option<u64> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.src_ld)
            .and_then(|x| x.checked_add(self.cols))
    }
}

/// Everything one rank does in a switch, as data (see the [module docs](self)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankSteps {
    /// The rank (global).
    pub rank: usize,
    /// Ranks taking part in the switch.
    pub world: usize,
    /// Element type of the training buffer.
    pub source: SourceType,
    /// Every copy; local chunks, packs, unpacks and remote copies name ranges of it.
    pub copies: Vec<Copy>,
    /// Rollout element ranges to zero (vocabulary padding), on the auxiliary stream first.
    pub zero: Vec<Range<u64>>,
    /// Regions of the training buffer (fp32 masters, or bf16 parameters) quantised into the
    /// rollout buffer (fp8 rollouts), on the auxiliary stream after the local chunks.
    pub quantise: Vec<Quantise>,
    /// fp8 at W > 1: the block scales agreed across the ranks, the pieces quantised with them.
    pub agree: Option<Fp8Agree>,
    /// Local chunks, in issue order.
    pub local: Vec<LocalChunk>,
    /// Network steps, in order.
    pub steps: Vec<NetStep>,
    /// Staging slots in flight (steps `j` and `j + in_flight` share a slot); at least 1 when
    /// there are steps.
    pub in_flight: usize,
    /// Elements of one send slot (0: none allocated).
    pub send_slot_elems: u64,
    /// Elements of one receive slot (0: none allocated).
    pub recv_slot_elems: u64,
    /// Elements of the training buffer.
    pub source_elems: u64,
    /// Elements of every rank's rollout buffer.
    pub rollout_elems: u64,
    /// bf16 elements the rank writes from its own training buffer into its rollout buffer.
    pub local_elems: u64,
    /// bf16 elements the rank receives from peers.
    pub recv_elems: u64,
}

impl RankSteps {
    /// Elements of copies `range`.
    pub fn copy_elems(&self, range: Range<usize>) -> u64 {
        self.copies
            .get(range)
            .map_or(0, |c| c.iter().map(Copy::numel).sum())
    }

    /// Elements of the zero ranges.
    pub fn zero_elems(&self) -> u64 {
        self.zero.iter().map(|z| z.end - z.start).sum()
    }

    /// Bytes of staging the rank allocates: the slots in flight, and the fp8 scale grid and
    /// stage of an agreed fp8 switch.
    pub fn staging_bytes(&self) -> u64 {
        let fp8 = self.agree.as_ref().map_or(0, Fp8Agree::scratch_bytes);
        if self.steps.is_empty() {
            return fp8;
        }
        fp8 + self.in_flight as u64 * (self.send_slot_elems + self.recv_slot_elems) * 2
    }

    /// Elements of buffer `buf` (slots: one slot).
    pub fn buf_elems(&self, buf: Buf) -> u64 {
        match buf {
            Buf::Source => self.source_elems,
            Buf::Rollout => self.rollout_elems,
            Buf::SendSlot => self.send_slot_elems,
            Buf::RecvSlot => self.recv_slot_elems,
            Buf::Fp8Stage => self.agree.as_ref().map_or(0, |a| a.stage_elems),
            Buf::Scales => self.agree.as_ref().map_or(0, |a| 2 * a.grid_elems),
        }
    }

    /// Moves every read of the training buffer from one layout of it to another: `segments[i]`
    /// is segment `i`'s `(first element, elements)` where the steps read it now, `to[i]` its
    /// first element in the new layout (segments keep their length and inner layout; gaps
    /// between them are never read). A training state whose tensors are separate allocations
    /// (PyTorch FSDP2's per-parameter shards, lent by address) is read in place this way, as
    /// one source whose base is the lowest address. Every region that reads the source must lie
    /// inside one segment, or the steps are refused naming it; `source_elems` becomes the new
    /// layout's end.
    ///
    /// ```
    /// use lifecycle_layout::steps::{Buf, Copy, LocalChunk, RankSteps, SourceType, Stream};
    /// use lifecycle_layout::Region2d;
    /// let mut steps = RankSteps {
    ///     world: 1,
    ///     source: SourceType::F32,
    ///     copies: vec![
    ///         Copy::kernel(Buf::Source, 0, Buf::Rollout, 0, Region2d::flat(4)),
    ///         Copy::kernel(Buf::Source, 4, Buf::Rollout, 4, Region2d::flat(2)),
    ///     ],
    ///     local: vec![LocalChunk::upfront(0..2, Stream::Aux)],
    ///     source_elems: 6,
    ///     rollout_elems: 6,
    ///     ..RankSteps::default()
    /// };
    /// // the second tensor lives 100 elements after the first
    /// steps.rebase_source(&[(0, 4), (4, 2)], &[0, 100])?;
    /// assert_eq!((steps.copies[1].src_off, steps.source_elems), (100, 102));
    /// # Ok::<(), lifecycle_layout::LayoutError>(())
    /// ```
    pub fn rebase_source(
        &mut self,
        segments: &[(u64, u64)],
        to: &[u64],
    ) -> Result<(), LayoutError> {
        if segments.len() != to.len() {
            return Err(self.bad(format!(
                "rebasing the training buffer: {} segments, {} new places",
                segments.len(),
                to.len()
            )));
        }
        let rank = self.rank;
        // The segment holding [off, off + span), by binary search over the segments' starts.
        let mut order: Vec<usize> = (0..segments.len()).collect();
        order.sort_by_key(|&i| segments[i].0);
        let map = |off: u64, span: u64, what: &str| -> Result<u64, LayoutError> {
            let k = order.partition_point(|&i| segments[i].0 <= off);
            let found = k.checked_sub(1).map(|k| order[k]).filter(|&i| {
                let (start, len) = segments[i];
                off + span <= start + len
            });
            match found {
                Some(i) => Ok(off - segments[i].0 + to[i]),
                None => Err(LayoutError::InvalidSteps {
                    rank,
                    what: format!(
                        "{what} reads training elements {off}..{} outside every segment of the \
                         new layout",
                        off + span
                    ),
                }),
            }
        };
        let span = |r: &Region2d, ld: u64| {
            let r = r.normalized();
            if r.numel() == 0 {
                0
            } else if r.rows == 1 {
                r.cols
            } else {
                (r.rows - 1) * ld + r.cols
            }
        };
        for (i, c) in self.copies.iter_mut().enumerate() {
            if c.src == Buf::Source {
                c.src_off = map(
                    c.src_off,
                    span(&c.region, c.region.src_ld),
                    &format!("copy {i}"),
                )?;
            }
        }
        for (j, st) in self.steps.iter_mut().enumerate() {
            for m in st.sends.iter_mut().filter(|m| m.buf == Buf::Source) {
                m.off = map(m.off, m.count, &format!("a send of step {j}"))?;
            }
            for p in st.pushes.iter_mut().filter(|p| p.src == Buf::Source) {
                let what = format!("a peer copy of step {j}");
                p.src_off = map(p.src_off, span(&p.region, p.region.src_ld), &what)?;
            }
        }
        for (i, q) in self.quantise.iter_mut().enumerate() {
            let span = q.src_span().unwrap_or(u64::MAX);
            q.src_off = map(q.src_off, span, &format!("quantisation {i}"))?;
        }
        if let Some(a) = self.agree.as_mut() {
            let regions = a.amax.iter_mut().map(|r| ("partial amax", r));
            let pieces = a
                .quantise
                .iter_mut()
                .map(|q| ("agreed quantisation", &mut q.region));
            for (i, (what, r)) in regions.chain(pieces).enumerate() {
                let region = Region2d {
                    rows: r.rows,
                    cols: r.cols,
                    src_ld: r.src_ld,
                    dst_ld: r.cols,
                };
                r.src_off = map(r.src_off, span(&region, r.src_ld), &format!("{what} {i}"))?;
            }
        }
        self.source_elems = segments
            .iter()
            .zip(to)
            .map(|(&(_, len), &at)| at + len)
            .max()
            .unwrap_or(0);
        self.validate()
    }

    /// Checks that every copy, message, gather and peer run lies inside its buffers, that every
    /// range names existing copies, and that steps and chunks refer to existing steps and
    /// chunks — what the executors rely on to touch memory.
    pub fn validate(&self) -> Result<(), LayoutError> {
        self.validate_copies()?;
        self.validate_chunks()?;
        self.validate_steps()?;
        self.validate_zero_and_quantise()?;
        self.validate_agree()
    }

    fn bad(&self, what: String) -> LayoutError {
        LayoutError::InvalidSteps {
            rank: self.rank,
            what,
        }
    }

    /// Whether `r` (row pitch `ld`) from element `off` lies inside `buf`.
    fn inside(&self, buf: Buf, off: u64, r: &Region2d, ld: u64) -> bool {
        let r = r.normalized();
        if r.numel() == 0 {
            return true;
        }
        let ld = if r.rows == 1 { r.cols } else { ld };
        ld >= r.cols
            && off
                .checked_add((r.rows - 1) * ld + r.cols)
                .is_some_and(|end| end <= self.buf_elems(buf))
    }

    fn range_ok(&self, r: &Range<usize>) -> bool {
        r.start <= r.end && r.end <= self.copies.len()
    }

    fn validate_copies(&self) -> Result<(), LayoutError> {
        for (i, c) in self.copies.iter().enumerate() {
            if matches!(c.dst, Buf::Source | Buf::Scales | Buf::Fp8Stage) {
                return Err(self.bad(format!(
                    "copy {i} writes the {:?} buffer, which only its own step writes",
                    c.dst
                )));
            }
            if !self.inside(c.src, c.src_off, &c.region, c.region.src_ld)
                || !self.inside(c.dst, c.dst_off, &c.region, c.region.dst_ld)
            {
                return Err(self.bad(format!(
                    "copy {i} ({:?} {} → {:?} {}, {:?}) leaves its buffers",
                    c.src, c.src_off, c.dst, c.dst_off, c.region
                )));
            }
            if c.engine == Engine::Driver
                && (c.region.normalized().rows != 1
                    || (c.src == Buf::Source && self.source == SourceType::F32))
            {
                return Err(self.bad(format!(
                    "copy {i}: the driver copies one dense bf16 row only"
                )));
            }
        }
        Ok(())
    }

    fn validate_chunks(&self) -> Result<(), LayoutError> {
        for (c, chunk) in self.local.iter().enumerate() {
            if !self.range_ok(&chunk.copies) {
                return Err(self.bad(format!("local chunk {c} names missing copies")));
            }
            let out = |s: Option<usize>| s.is_some_and(|s| s >= self.steps.len());
            if out(chunk.after_step) || out(chunk.gate) {
                return Err(self.bad(format!("local chunk {c} names a missing step")));
            }
            if let (Some(after), Some(gate)) = (chunk.after_step, chunk.gate)
                && gate > after + self.in_flight
            {
                return Err(self.bad(format!(
                    "local chunk {c} waits for the pack of step {gate}, not issued by step \
                         {after}"
                )));
            }
            if chunk.stream == Stream::Net {
                return Err(self.bad(format!("local chunk {c} runs on the network stream")));
            }
        }
        Ok(())
    }

    fn validate_steps(&self) -> Result<(), LayoutError> {
        if !self.steps.is_empty() && self.in_flight == 0 {
            return Err(self.bad("steps with no staging slot in flight".into()));
        }
        for (j, st) in self.steps.iter().enumerate() {
            if !self.range_ok(&st.pack) || !self.range_ok(&st.unpack) {
                return Err(self.bad(format!("step {j} names missing copies")));
            }
            if st.remote.iter().any(|(_, r)| !self.range_ok(r)) {
                return Err(self.bad(format!("step {j}: remote copies name missing copies")));
            }
            if st.wait_local.is_some_and(|c| c >= self.local.len()) {
                return Err(self.bad(format!("step {j} waits for a missing local chunk")));
            }
            for (what, m) in st
                .sends
                .iter()
                .map(|m| ("send", m))
                .chain(st.recvs.iter().map(|m| ("receive", m)))
            {
                let flat = Region2d::flat(m.count);
                if !self.inside(m.buf, m.off, &flat, m.count)
                    || m.peer == self.rank
                    || m.peer >= self.world
                {
                    return Err(self.bad(format!(
                        "step {j}: {what} of {} elements at {:?} {} with rank {} leaves its \
                         buffer or names this rank",
                        m.count, m.buf, m.off, m.peer
                    )));
                }
                if what == "receive" && matches!(m.buf, Buf::Source | Buf::Scales | Buf::Fp8Stage) {
                    return Err(self.bad(format!("step {j} receives into the {:?} buffer", m.buf)));
                }
            }
            for g in &st.gathers {
                let end = (self.world as u64)
                    .checked_mul(g.count)
                    .and_then(|n| n.checked_add(g.off));
                if end.is_none_or(|e| e > self.rollout_elems) {
                    return Err(self.bad(format!(
                        "step {j}: all-gather of {} elements per rank at {} leaves the rollout \
                         buffer",
                        g.count, g.off
                    )));
                }
            }
            if st
                .remote
                .iter()
                .any(|(p, _)| *p >= self.world || *p == self.rank)
            {
                return Err(self.bad(format!("step {j}: remote copies name a bad rank")));
            }
            for p in &st.pushes {
                if p.peer >= self.world || p.peer == self.rank {
                    return Err(self.bad(format!("step {j}: peer copy to bad rank {}", p.peer)));
                }
                if !self.inside(p.src, p.src_off, &p.region, p.region.src_ld)
                    || !self.inside(Buf::Rollout, p.dst_off, &p.region, p.region.dst_ld)
                    || (p.src == Buf::Source && self.source == SourceType::F32)
                {
                    return Err(self.bad(format!(
                        "step {j}: peer copy to rank {} leaves its buffers",
                        p.peer
                    )));
                }
            }
        }
        Ok(())
    }

    fn validate_zero_and_quantise(&self) -> Result<(), LayoutError> {
        for z in &self.zero {
            if z.start > z.end || z.end > self.rollout_elems {
                return Err(self.bad(format!("zero range {z:?} leaves the rollout buffer")));
            }
        }
        let roll_bytes = 2 * self.rollout_elems;
        for (i, q) in self.quantise.iter().enumerate() {
            let n = q.rows.checked_mul(q.cols);
            let pitch_ok = q.rows <= 1 || q.src_ld >= q.cols;
            let src_end = q
                .src_span()
                .and_then(|n| n.checked_add(q.src_off))
                .filter(|_| pitch_ok);
            let dst_end = n.and_then(|n| n.checked_add(q.dst_byte));
            let scale_end = q
                .scale
                .checked_add(q.blocks())
                .and_then(|e| e.checked_mul(4));
            if src_end.is_none_or(|e| e > self.source_elems)
                || dst_end.is_none_or(|e| e > roll_bytes)
                || scale_end.is_none_or(|e| e > roll_bytes)
            {
                return Err(self.bad(format!(
                    "quantisation {i} ({} × {} from element {}, bytes at {}, scales at f32 {}) \
                     leaves its buffers",
                    q.rows, q.cols, q.src_off, q.dst_byte, q.scale
                )));
            }
        }
        Ok(())
    }

    fn validate_agree(&self) -> Result<(), LayoutError> {
        let Some(a) = &self.agree else {
            return Ok(());
        };
        if self.source != SourceType::F32 {
            return Err(self.bad("an agreed fp8 switch reads a bf16 training buffer".into()));
        }
        let region_ok = |r: &GridRegion| {
            let rows_ok = r.rows == 0
                || r.cols == 0
                || (r.src_ld >= r.cols
                    && (r.rows - 1)
                        .checked_mul(r.src_ld)
                        .and_then(|x| x.checked_add(r.cols))
                        .and_then(|x| x.checked_add(r.src_off))
                        .is_some_and(|end| end <= self.source_elems));
            let cols_ok = r.col_block0 + r.block_cols() <= r.grid_cols;
            rows_ok && cols_ok && r.grid_end() <= a.grid_elems
        };
        for (i, r) in a.amax.iter().enumerate() {
            if !region_ok(r) {
                return Err(self.bad(format!(
                    "partial amax {i} ({r:?}) leaves the training buffer or the scale grid"
                )));
            }
        }
        for (i, q) in a.quantise.iter().enumerate() {
            let end = q.dst_byte.checked_add(q.bytes());
            let dst_bytes = 2 * self.buf_elems(q.dst);
            if !region_ok(&q.region)
                || !matches!(q.dst, Buf::Rollout | Buf::Fp8Stage)
                || end.is_none_or(|e| e > dst_bytes)
            {
                return Err(self.bad(format!(
                    "agreed quantisation {i} ({:?} into {:?} byte {}) leaves its buffers",
                    q.region, q.dst, q.dst_byte
                )));
            }
        }
        if !self.range_ok(&a.scale_copies)
            || self.copies[a.scale_copies.clone()]
                .iter()
                .any(|c| c.src != Buf::Scales || c.dst != Buf::Rollout)
        {
            return Err(self.bad(
                "the fp8 scale copies must name copies from the scale grid into the rollout \
                 buffer"
                    .into(),
            ));
        }
        if a.step.is_some_and(|j| j >= self.steps.len()) {
            return Err(self.bad("the fp8 bytes' network step is missing".into()));
        }
        Ok(())
    }
}
