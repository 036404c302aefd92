//! How one rank executes a [`MegatronPlan`] on a GPU (pure: nothing here touches memory).
//!
//! Every rank holds its rollout weights in one flat bf16 buffer, tensors back to back in rollout
//! order ([`rollout_offsets`]). A rank's [`RankSchedule`] lists:
//! - **local tiles**: runs it copies from its own parameter buffer into its rollout buffer;
//! - **steps**: step `k` is bucket `k` of every destination rank. In step `k` a rank *packs* the
//!   runs its peers' bucket `k` read from it into a contiguous send slot (one segment per
//!   destination, ascending), sends one message per destination, receives one message per source
//!   (ascending) into a receive slot, and *unpacks* the slot into its rollout buffer. Both sides
//!   derive the segments from the same plan in the same order, so the sends and receives of a
//!   step match one to one;
//! - **zero ranges**: vocabulary padding rows of the rollout, which no transfer writes.
//!
//! Copies are cut into [`Tile`]s of at most [`TILE_ELEMS`] elements, the unit one thread block of
//! the copy kernel moves; runs that continue one another in both buffers are merged first.

use std::ops::Range;

pub use crate::steps::{Tile, TILE_BYTES, TILE_ELEMS};

use super::{MegatronPlan, RolloutKind, Transfer};

/// A 2-D copy between two bf16 buffers: `rows` rows of `cols` elements, rows `src_ld` / `dst_ld`
/// elements apart (element offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First source element.
    pub src: usize,
    /// Source row pitch.
    pub src_ld: usize,
    /// First destination element.
    pub dst: usize,
    /// Destination row pitch.
    pub dst_ld: usize,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
}

impl Run {
    /// Elements copied.
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// The same copy as one row when it is dense on both sides.
    fn flat(self) -> Run {
        if self.rows == 1 || (self.src_ld == self.cols && self.dst_ld == self.cols) {
            let n = self.numel();
            Run {
                src_ld: n,
                dst_ld: n,
                rows: 1,
                cols: n,
                ..self
            }
        } else {
            self
        }
    }
}

/// Appends `run`, merging it into the previous run when it continues it in both buffers and
/// the merged run reads one source parameter: `starts` are the sorted first elements of the
/// source's parameters (empty: a source of one piece, such as a receive slot). A run never
/// reads across a parameter's end, so a source whose parameters lie apart (lent in
/// Megatron-Core's own buffer order) is read where each of them is.
pub fn push_run(runs: &mut Vec<Run>, run: Run, starts: &[usize]) {
    if run.numel() == 0 {
        return;
    }
    let run = run.flat();
    let param = |x: usize| starts.partition_point(|&s| s <= x);
    if let Some(prev) = runs.last_mut() {
        let last = run.src + (run.rows - 1) * run.src_ld + run.cols - 1;
        if param(prev.src) != param(last) {
            runs.push(run);
            return;
        }
        let one_row = prev.rows == 1 && run.rows == 1;
        if one_row && prev.src + prev.cols == run.src && prev.dst + prev.cols == run.dst {
            prev.cols += run.cols;
            prev.src_ld = prev.cols;
            prev.dst_ld = prev.cols;
            return;
        }
        let same_shape = prev.rows > 1
            && run.rows > 1
            && prev.cols == run.cols
            && prev.src_ld == run.src_ld
            && prev.dst_ld == run.dst_ld;
        if same_shape
            && prev.src + prev.rows * prev.src_ld == run.src
            && prev.dst + prev.rows * prev.dst_ld == run.dst
        {
            prev.rows += run.rows;
            return;
        }
    }
    runs.push(run);
}

/// The first element of each parameter of `rank`'s stage in its buffer, sorted (where a run of
/// its source may not cross: [`push_run`]).
fn param_starts(plan: &MegatronPlan, rank: usize) -> Vec<usize> {
    let stage = plan.train.coords(rank).pp;
    let mut starts: Vec<usize> = plan
        .train
        .stage_slots(stage)
        .iter()
        .map(|s| s.offset)
        .collect();
    starts.sort_unstable();
    starts
}

/// Cuts `run` into tiles: row blocks of at most [`TILE_ELEMS`] elements, and rows longer than
/// that into column blocks.
pub fn push_tiles(run: &Run, out: &mut Vec<Tile>) {
    let region = crate::Region2d {
        rows: run.rows as u64,
        cols: run.cols as u64,
        src_ld: run.src_ld as u64,
        dst_ld: run.dst_ld as u64,
    };
    crate::steps::push_tiles(run.src as u64, run.dst as u64, region, out);
}

/// Where a message's elements are: in the step's slot, or straight in the rank's own buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Element offset in the send slot (sends) or the receive slot (receives).
    Slot(usize),
    /// Element offset in the parameter buffer (sends) or the rollout buffer (receives).
    Buffer(usize),
}

/// One NCCL message of a step: `count` elements at `place`, to or from `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The other rank.
    pub peer: usize,
    /// Where the elements are read (sends) or written (receives).
    pub place: Place,
    /// Elements.
    pub count: usize,
}

/// How a plan's copies are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleOptions {
    /// Remote runs of at least this many elements travel as their own message, read straight
    /// from the sender's parameter buffer when they are contiguous there and written straight
    /// into the receiver's rollout buffer when they are contiguous there (no pack, no unpack);
    /// smaller runs are packed into one message per peer and step. `usize::MAX`: pack everything.
    pub direct_min: usize,
    /// Local runs contiguous on both sides with at least this many elements are copied with the
    /// driver's device-to-device copy instead of the tile kernel. `usize::MAX`: tiles only.
    pub memcpy_min: usize,
    /// Remote runs are written by their sender straight into the receiver's rollout buffer
    /// with the copy engines (ranks of one process with peer access): no steps, slots,
    /// packing or NCCL ([`RankSchedule::pushes`]).
    pub peer_copy: bool,
    /// With peer copies, remote runs below this many elements are written by the tile kernel
    /// straight into the peer's memory, all in one launch per peer
    /// ([`RankSchedule::peer_tiles`]), instead of one copy-engine copy each: every copy-engine
    /// copy costs microseconds of setup, which hundreds of bias and norm vectors add up to
    /// milliseconds. `0`: copy engines only.
    pub peer_tile_max: usize,
}

impl Default for ScheduleOptions {
    /// Direct messages from 4 MiB, driver copies from 16 MiB, peer tiles below 1 MiB.
    fn default() -> Self {
        ScheduleOptions {
            direct_min: 2 << 20,
            memcpy_min: 8 << 20,
            peer_copy: false,
            peer_tile_max: 1 << 19,
        }
    }
}

/// A remote run its sender writes straight into a peer's rollout buffer (peer copies): `run.src`
/// is an element offset in the sender's parameter buffer, `run.dst` one in `peer`'s rollout
/// buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Push {
    /// The destination rank.
    pub peer: usize,
    /// The 2-D copy.
    pub run: Run,
}

/// One step of a rank: what it packs and sends, receives and unpacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The global step (bucket index of the destinations).
    pub step: usize,
    /// Messages sent: per destination ascending, the packed message first, then the direct ones
    /// in transfer order.
    pub sends: Vec<Message>,
    /// Messages received, in the same order per source.
    pub recvs: Vec<Message>,
    /// Tiles packing the parameter buffer into the send slot.
    pub pack: Range<usize>,
    /// Tiles unpacking the receive slot into the rollout buffer.
    pub unpack: Range<usize>,
    /// Elements sent.
    pub send_elems: usize,
    /// Elements received.
    pub recv_elems: usize,
    /// Elements of the send slot used.
    pub send_slot: usize,
    /// Elements of the receive slot used.
    pub recv_slot: usize,
}

/// Everything one rank does to build its rollout buffer (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSchedule {
    /// The rank.
    pub rank: usize,
    /// Every tile: the local ones, then per step the pack and unpack tiles.
    pub tiles: Vec<Tile>,
    /// Tiles copying from this rank's own parameter buffer.
    pub local: Range<usize>,
    /// Local runs copied with the driver's device-to-device copy (one row each: source offset
    /// in the parameter buffer, destination offset in the rollout buffer).
    pub local_bulk: Vec<Run>,
    /// Steps with at least one message, in global step order (none with peer copies).
    pub steps: Vec<Step>,
    /// With peer copies: the runs of at least [`ScheduleOptions::peer_tile_max`] elements this
    /// rank's copy engines write into its peers' rollout buffers, by destination rank, then in plan order
    /// (consecutive runs merged).
    pub pushes: Vec<Push>,
    /// With peer copies: per destination rank, the tiles (of [`RankSchedule::tiles`]) that
    /// write its smaller runs into that peer's rollout buffer, one kernel launch each.
    pub peer_tiles: Vec<(usize, Range<usize>)>,
    /// Element ranges of the rollout buffer to zero (vocabulary padding rows).
    pub zero: Vec<Range<usize>>,
    /// Elements of one send slot (the largest step).
    pub send_slot_elems: usize,
    /// Elements of one receive slot (the largest step).
    pub recv_slot_elems: usize,
    /// Elements copied locally.
    pub local_elems: usize,
    /// Elements received from peers.
    pub recv_elems: usize,
    /// Elements sent to peers.
    pub send_elems: usize,
}

/// Cuts `0..items.len()` into at most `n` consecutive chunks of about equal `size` sums.
fn chunks_by<T>(items: &[T], n: usize, size: impl Fn(&T) -> usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let total: usize = items.iter().map(&size).sum::<usize>().max(1);
    let mut out = Vec::with_capacity(n);
    let (mut start, mut acc) = (0, 0usize);
    for (i, it) in items.iter().enumerate() {
        acc += size(it);
        if out.len() + 1 < n && acc * n >= total * (out.len() + 1) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out.push(start..items.len());
    out
}

impl RankSchedule {
    /// The local work cut into `n` consecutive chunks of about equal bytes: per chunk a range
    /// of tiles and a range of [`RankSchedule::local_bulk`].
    pub fn local_chunks(&self, n: usize) -> Vec<(Range<usize>, Range<usize>)> {
        let n = n.max(1);
        let tiles = chunks_by(&self.tiles[self.local.clone()], n, Tile::numel);
        let bulk = chunks_by(&self.local_bulk, n, Run::numel);
        (0..n)
            .map(|i| {
                let t = tiles.get(i).map_or(0..0, |r| {
                    r.start + self.local.start..r.end + self.local.start
                });
                (t, bulk.get(i).cloned().unwrap_or(0..0))
            })
            .collect()
    }

    /// Elements the tiles `range` copy.
    pub fn tile_elems(&self, range: Range<usize>) -> usize {
        self.tiles
            .get(range)
            .map_or(0, |t| t.iter().map(Tile::numel).sum())
    }

    /// Elements one chunk of [`RankSchedule::local_chunks`] copies (its tiles and bulk runs).
    pub fn chunk_elems(&self, chunk: &(Range<usize>, Range<usize>)) -> usize {
        let bulk = self
            .local_bulk
            .get(chunk.1.clone())
            .map_or(0, |r| r.iter().map(Run::numel).sum());
        self.tile_elems(chunk.0.clone()) + bulk
    }

    /// Elements of the rollout buffer zeroed as vocabulary padding.
    pub fn zero_elems(&self) -> usize {
        self.zero.iter().map(Range::len).sum()
    }

    /// The tiles as the kernel reads them ([`Tile::write_bytes`]).
    pub fn tile_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.tiles.len() * TILE_BYTES);
        for t in &self.tiles {
            t.write_bytes(&mut out);
        }
        out
    }

    /// Bytes of staging one step in flight needs (one send and one receive slot).
    pub fn slot_bytes(&self) -> u64 {
        ((self.send_slot_elems + self.recv_slot_elems) * 2) as u64
    }

    /// Messages over all steps (sent, received).
    pub fn messages(&self) -> (usize, usize) {
        self.steps.iter().fold((0, 0), |(s, r), st| {
            (s + st.sends.len(), r + st.recvs.len())
        })
    }
}

/// Element offset of every rollout tensor in a rank's flat buffer (rollout order, back to back)
/// and the buffer's length; the same on every rank.
pub fn rollout_offsets(plan: &MegatronPlan) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(plan.tensors.len());
    let mut at = 0;
    for t in &plan.tensors {
        offsets.push(at);
        at += t.numel();
    }
    (offsets, at)
}

fn src_dense(x: &Transfer) -> bool {
    x.rows == 1 || x.cols == x.src_pitch
}

fn dst_dense(x: &Transfer) -> bool {
    x.rows == 1 || x.cols == x.dst_pitch
}

/// The schedule of `rank` (see the module docs); `offsets` from [`rollout_offsets`].
///
/// Long by design: the schedule's passes in the order the module docs describe them (local
/// runs, then per step its sends, receives, peer runs and tiles), sharing one slot accounting.
pub fn build_rank(
    plan: &MegatronPlan,
    offsets: &[usize],
    rank: usize,
    opts: ScheduleOptions,
) -> RankSchedule {
    let me = &plan.ranks[rank];
    let flat = |x: &Transfer| offsets[x.tensor] + x.dst_offset;
    let starts = param_starts(plan, rank);
    let mut tiles = Vec::new();
    let mut runs = Vec::new();
    for x in me.transfers.iter().filter(|x| x.src_rank == rank) {
        push_run(
            &mut runs,
            Run {
                src: x.src_offset,
                src_ld: x.src_pitch,
                dst: flat(x),
                dst_ld: x.dst_pitch,
                rows: x.rows,
                cols: x.cols,
            },
            &starts,
        );
    }
    let local_elems = runs.iter().map(Run::numel).sum();
    let (local_bulk, tiled): (Vec<Run>, Vec<Run>) = runs
        .into_iter()
        .partition(|r| r.rows == 1 && r.numel() >= opts.memcpy_min);
    for r in &tiled {
        push_tiles(r, &mut tiles);
    }
    let local = 0..tiles.len();
    let zero = zero_ranges(plan, offsets, rank);
    if opts.peer_copy {
        let local = (tiles, local, local_bulk, local_elems);
        return peer_schedule(plan, offsets, rank, local, zero, opts.peer_tile_max);
    }
    let direct = |x: &&Transfer| x.numel() >= opts.direct_min;
    let nsteps = plan
        .ranks
        .iter()
        .map(|p| p.buckets.len())
        .max()
        .unwrap_or(0);
    let mut steps = Vec::new();
    for k in 0..nsteps {
        let mut recvs = Vec::new();
        let mut unpack_runs = Vec::new();
        let (mut off, mut recv_elems) = (0, 0);
        if let Some(b) = me.buckets.get(k) {
            let xs = &me.transfers[b.clone()];
            let mut peers: Vec<usize> = xs
                .iter()
                .map(|x| x.src_rank)
                .filter(|&s| s != rank)
                .collect();
            peers.sort_unstable();
            peers.dedup();
            for p in peers {
                let (big, small): (Vec<&Transfer>, Vec<&Transfer>) =
                    xs.iter().filter(|x| x.src_rank == p).partition(direct);
                let mut unpack = |x: &Transfer, off: &mut usize| {
                    push_run(
                        &mut unpack_runs,
                        Run {
                            src: *off,
                            src_ld: x.cols,
                            dst: flat(x),
                            dst_ld: x.dst_pitch,
                            rows: x.rows,
                            cols: x.cols,
                        },
                        &[],
                    );
                    *off += x.numel();
                };
                let start = off;
                for x in &small {
                    unpack(x, &mut off);
                }
                if off > start {
                    recvs.push(Message {
                        peer: p,
                        place: Place::Slot(start),
                        count: off - start,
                    });
                }
                for x in &big {
                    let place = if dst_dense(x) {
                        Place::Buffer(flat(x))
                    } else {
                        let at = off;
                        unpack(x, &mut off);
                        Place::Slot(at)
                    };
                    recvs.push(Message {
                        peer: p,
                        place,
                        count: x.numel(),
                    });
                }
                recv_elems += small.iter().chain(&big).map(|x| x.numel()).sum::<usize>();
            }
        }
        let mut sends = Vec::new();
        let mut pack_runs = Vec::new();
        let (mut soff, mut send_elems) = (0, 0);
        for (d, dp) in plan.ranks.iter().enumerate() {
            let Some(b) = dp.buckets.get(k).filter(|_| d != rank) else {
                continue;
            };
            let (big, small): (Vec<&Transfer>, Vec<&Transfer>) = dp.transfers[b.clone()]
                .iter()
                .filter(|x| x.src_rank == rank)
                .partition(direct);
            let mut pack = |x: &Transfer, soff: &mut usize| {
                push_run(
                    &mut pack_runs,
                    Run {
                        src: x.src_offset,
                        src_ld: x.src_pitch,
                        dst: *soff,
                        dst_ld: x.cols,
                        rows: x.rows,
                        cols: x.cols,
                    },
                    &starts,
                );
                *soff += x.numel();
            };
            let start = soff;
            for x in &small {
                pack(x, &mut soff);
            }
            if soff > start {
                sends.push(Message {
                    peer: d,
                    place: Place::Slot(start),
                    count: soff - start,
                });
            }
            for x in &big {
                let place = if src_dense(x) {
                    Place::Buffer(x.src_offset)
                } else {
                    let at = soff;
                    pack(x, &mut soff);
                    Place::Slot(at)
                };
                sends.push(Message {
                    peer: d,
                    place,
                    count: x.numel(),
                });
            }
            send_elems += small.iter().chain(&big).map(|x| x.numel()).sum::<usize>();
        }
        if sends.is_empty() && recvs.is_empty() {
            continue;
        }
        let p0 = tiles.len();
        for r in &pack_runs {
            push_tiles(r, &mut tiles);
        }
        let u0 = tiles.len();
        for r in &unpack_runs {
            push_tiles(r, &mut tiles);
        }
        steps.push(Step {
            step: k,
            sends,
            recvs,
            pack: p0..u0,
            unpack: u0..tiles.len(),
            send_elems,
            recv_elems,
            send_slot: soff,
            recv_slot: off,
        });
    }
    RankSchedule {
        rank,
        local,
        local_bulk,
        send_slot_elems: steps.iter().map(|s| s.send_slot).max().unwrap_or(0),
        recv_slot_elems: steps.iter().map(|s| s.recv_slot).max().unwrap_or(0),
        recv_elems: steps.iter().map(|s| s.recv_elems).sum(),
        send_elems: steps.iter().map(|s| s.send_elems).sum(),
        local_elems,
        steps,
        pushes: Vec::new(),
        peer_tiles: Vec::new(),
        zero,
        tiles,
    }
}

/// Element ranges of `rank`'s rollout buffer that hold vocabulary padding rows.
fn zero_ranges(plan: &MegatronPlan, offsets: &[usize], rank: usize) -> Vec<Range<usize>> {
    let me = &plan.ranks[rank];
    let mut zero = Vec::new();
    let vocab = plan.train.model().vocab;
    for (i, spec) in plan.tensors.iter().enumerate() {
        if matches!(spec.kind, RolloutKind::Embedding | RolloutKind::LmHead) {
            let per = spec.shape.first().copied().unwrap_or(0);
            let h = spec.cols();
            let real = vocab.saturating_sub(me.tp_rank * per).min(per);
            if real < per {
                zero.push(offsets[i] + real * h..offsets[i] + per * h);
            }
        }
    }
    zero
}

/// The peer-copy schedule of `rank`: its local work as given (tiles, local tile range, bulk
/// runs, elements), plus the runs it writes into every peer's rollout buffer: those of at
/// least `tile_max` elements by the copy engines, the rest as tiles.
fn peer_schedule(
    plan: &MegatronPlan,
    offsets: &[usize],
    rank: usize,
    (mut tiles, local, local_bulk, local_elems): (Vec<Tile>, Range<usize>, Vec<Run>, usize),
    zero: Vec<Range<usize>>,
    tile_max: usize,
) -> RankSchedule {
    let mut pushes = Vec::new();
    let mut peer_tiles = Vec::new();
    let mut send_elems = 0;
    let starts = param_starts(plan, rank);
    for (d, dp) in plan.ranks.iter().enumerate().filter(|(d, _)| *d != rank) {
        let mut runs = Vec::new();
        for x in dp.transfers.iter().filter(|x| x.src_rank == rank) {
            push_run(
                &mut runs,
                Run {
                    src: x.src_offset,
                    src_ld: x.src_pitch,
                    dst: offsets[x.tensor] + x.dst_offset,
                    dst_ld: x.dst_pitch,
                    rows: x.rows,
                    cols: x.cols,
                },
                &starts,
            );
        }
        send_elems += runs.iter().map(Run::numel).sum::<usize>();
        let first = tiles.len();
        for run in runs {
            if run.numel() < tile_max {
                push_tiles(&run, &mut tiles);
            } else {
                pushes.push(Push { peer: d, run });
            }
        }
        if tiles.len() > first {
            peer_tiles.push((d, first..tiles.len()));
        }
    }
    let recv_elems = plan.ranks[rank]
        .transfers
        .iter()
        .filter(|x| x.src_rank != rank)
        .map(Transfer::numel)
        .sum();
    RankSchedule {
        rank,
        local,
        local_bulk,
        send_slot_elems: 0,
        recv_slot_elems: 0,
        recv_elems,
        send_elems,
        local_elems,
        steps: Vec::new(),
        pushes,
        peer_tiles,
        zero,
        tiles,
    }
}
