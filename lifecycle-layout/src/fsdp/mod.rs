//! The executable plan: the core planner's pieces turned into per-rank, per-bucket lists of casts,
//! sends and receives over flat device buffers. Pure: computed on the CPU, tested without a GPU.

mod agree;
mod fp8;
mod steps;

pub use fp8::{build_fp8_plan, build_fp8_plan_of, Fp8Slice};

use crate::Region2d;
use crate::{fsdp_rows, FsdpLayout, ReshardPlan};

/// Alignment of every tensor inside a flat buffer, in elements (256 bytes of f32, 128 of bf16):
/// keeps the vectorised cast kernel usable for every tensor.
pub const ALIGN_ELEMS: u64 = 64;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN_ELEMS) * ALIGN_ELEMS
}

/// Where one tensor's FSDP shard sits in a rank's flat training buffers (the same on every rank:
/// shards are padded to `⌈rows / W⌉` rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSlot {
    /// Tensor name.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Columns of the 2-D view (product of the trailing dims).
    pub cols: usize,
    /// Padded rows per rank, `⌈rows / W⌉`.
    pub padded_rows: usize,
    /// Element offset in the flat buffer.
    pub offset: u64,
}

/// The layout of every rank's flat fp32 buffers (master, grads, Adam m and v).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    /// W.
    pub world: usize,
    /// One slot per training tensor, in training order.
    pub slots: Vec<ShardSlot>,
    /// Elements of each rank's flat buffer.
    pub rank_len: u64,
}

impl ShardLayout {
    /// Computes the flat layout of an FSDP layout.
    pub fn new(layout: &FsdpLayout) -> Self {
        let mut offset = 0u64;
        let world = layout.world();
        let slots = layout
            .tensors()
            .iter()
            .map(|(name, shape)| {
                let rows = shape.first().copied().unwrap_or(1);
                let cols: usize = shape.iter().skip(1).product();
                let padded_rows = rows.div_ceil(world);
                let slot = ShardSlot {
                    name: name.clone(),
                    shape: shape.clone(),
                    cols,
                    padded_rows,
                    offset,
                };
                offset = align(offset + (padded_rows * cols) as u64);
                slot
            })
            .collect();
        ShardLayout {
            world,
            slots,
            rank_len: offset.max(ALIGN_ELEMS),
        }
    }

    /// Rows of tensor `i` that `rank` holds (FSDP2 rule).
    pub fn held_rows(&self, i: usize, rank: usize) -> std::ops::Range<usize> {
        let rows = self.slots[i].shape.first().copied().unwrap_or(1);
        fsdp_rows(rows, self.world, rank)
    }
}

/// Which buffer of a rank an operation touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    /// The rank's flat rollout buffer.
    Rollout,
    /// The current bucket's staging slot.
    Staging,
}

/// fp32 master → bf16 cast of a 2-D region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastOp {
    /// Element offset in the master buffer.
    pub src_off: u64,
    /// Destination buffer.
    pub dst: Buf,
    /// Element offset in the destination.
    pub dst_off: u64,
    /// Shape and pitches.
    pub region: Region2d,
}

/// A contiguous run of bf16 sent to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendOp {
    /// Destination rank.
    pub peer: usize,
    /// Source buffer.
    pub buf: Buf,
    /// Element offset.
    pub off: u64,
    /// Elements.
    pub count: u64,
    /// Where the receiver's matching [`RecvOp`] puts these elements in its rollout buffer
    /// (element offset), which is what a peer copy writes; `None` when they land in a receive
    /// staging slot instead ([`GatherMode::Packed`]).
    pub dst_off: Option<u64>,
}

/// A contiguous run of bf16 received from a peer: straight into the rollout buffer
/// ([`Buf::Rollout`]) or, in [`GatherMode::Packed`], into the bucket's receive staging slot
/// ([`Buf::Staging`]), from where [`UnpackOp`]s copy it into place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvOp {
    /// Source rank.
    pub peer: usize,
    /// Where it lands.
    pub into: Buf,
    /// Element offset in that buffer.
    pub off: u64,
    /// Elements.
    pub count: u64,
}

/// A contiguous copy from the receive staging slot into the rollout buffer (after the receives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackOp {
    /// Element offset in the receive staging slot.
    pub src_off: u64,
    /// Element offset in the rollout buffer.
    pub dst_off: u64,
    /// Elements.
    pub count: u64,
}

/// An in-place all-gather of one tensor straight into the rollout buffer (T = 1 only): rank `r`
/// contributes `count` elements at `off + r · count`, every rank ends with `W · count` at `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherOp {
    /// Element offset of the tensor (padded to `W · ⌈rows / W⌉` rows) in the rollout buffer.
    pub off: u64,
    /// Elements each rank contributes (`⌈rows / W⌉ · cols`).
    pub count: u64,
}

/// How bytes cross between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GatherMode {
    /// Grouped NCCL sends and receives of exactly the pieces each rank needs (any T).
    #[default]
    SendRecv,
    /// For T = 1: grouped in-place NCCL all-gathers, one per tensor, straight into the rollout
    /// buffers (tensors padded to `W · ⌈rows / W⌉` rows there). Other T fall back to `SendRecv`.
    /// With 1–4 GiB groups the fastest T = 1 mode measured (10 % ahead of `SendRecv`); it stages
    /// nothing, so the bucket size costs no memory.
    AllGather,
    /// For T > 1: each rank packs every piece a peer needs in a bucket into one contiguous staging
    /// run and sends it as one message; the peer receives it into a receive staging slot and
    /// copies the pieces into place. Fewer, larger NCCL messages for one extra local copy of the
    /// received bytes and a second staging slot per bucket in flight. T = 1 behaves as `SendRecv`.
    /// Measured 1–2 ms slower than `SendRecv` for the 7B model at T = 2 on 2×H200 (BENCHMARKS.md).
    Packed,
}

/// What one rank does in one bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BucketOps {
    /// Casts (local pieces into the rollout buffer, staged pieces into the staging slot).
    pub casts: Vec<CastOp>,
    /// Sends, in the order the peer posts the matching receives.
    pub sends: Vec<SendOp>,
    /// Receives.
    pub recvs: Vec<RecvOp>,
    /// Staging elements used.
    pub staging_elems: u64,
    /// In-place all-gathers (the same list on every rank; [`GatherMode::AllGather`] only).
    pub gathers: Vec<GatherOp>,
    /// Copies out of the receive staging slot ([`GatherMode::Packed`] only).
    pub unpacks: Vec<UnpackOp>,
    /// Receive staging elements used ([`GatherMode::Packed`] only).
    pub recv_staging_elems: u64,
}

/// Transfer settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketConfig {
    /// Byte budget of one bucket: the most bf16 bytes one rank sends (and stages) in one bucket.
    /// The first three buckets get ⅛, ¼ and ½ of it (at least 16 MiB; see [`bucket_budget`]) so
    /// the network starts early.
    pub bucket_bytes: u64,
    /// Buckets in flight (staging slots); at least 2 so NCCL overlaps the next bucket's casts.
    pub in_flight: usize,
    /// How bytes cross between ranks.
    pub mode: GatherMode,
}

impl Default for BucketConfig {
    /// 256 MiB buckets, 2 in flight, grouped sends and receives.
    fn default() -> Self {
        BucketConfig {
            bucket_bytes: 256 << 20,
            in_flight: 2,
            mode: GatherMode::SendRecv,
        }
    }
}

/// The executable plan: the core [`ReshardPlan`] plus per-rank bucket op lists.
#[derive(Debug, Clone)]
pub struct FsdpPlan {
    /// The validated core plan.
    pub core: ReshardPlan,
    /// Flat training layout.
    pub shards: ShardLayout,
    /// `roll_offsets[r][i]`: element offset of rank `r`'s `i`-th rollout tensor
    /// (`core.ranks[r].tensors[i]`) in its flat rollout buffer. The same on every rank unless
    /// the layout has [`Parallel::Owned`](crate::Parallel::Owned) tensors.
    pub roll_offsets: Vec<Vec<u64>>,
    /// Elements of each rank's flat rollout buffer (the largest rank's).
    pub roll_len: u64,
    /// `ranks[r][k]`: what rank `r` does in bucket `k` (every rank has the same bucket count).
    pub ranks: Vec<Vec<BucketOps>>,
    /// Elements of one staging slot (0 when no rank stages anything).
    pub slot_elems: u64,
    /// Elements of one receive staging slot (0 unless [`GatherMode::Packed`]).
    pub recv_slot_elems: u64,
    /// Settings used.
    pub config: BucketConfig,
    /// Whether the executor writes each send straight into the receiver's rollout buffer with
    /// the copy engines (peer copies) instead of NCCL; set by the backend, `false` from
    /// [`build_plan`]. Only plans that are [`FsdpPlan::peer_copyable`] may set it.
    pub peer_copy: bool,
    /// `fp8[r]`: the fp8 slices of rank `r` ([`build_fp8_plan`]), quantised from the masters
    /// after the buckets ran, placed after the bf16 tensors; empty in a bf16 plan.
    pub fp8: Vec<Vec<Fp8Slice>>,
}

impl FsdpPlan {
    /// Whether every byte that crosses ranks is a send with a known place in the receiver's
    /// rollout buffer ([`SendOp::dst_off`]): no all-gathers, no receive staging. Such a plan
    /// can run as peer copies.
    pub fn peer_copyable(&self) -> bool {
        self.ranks.iter().flatten().all(|b| {
            b.gathers.is_empty()
                && b.unpacks.is_empty()
                && b.sends.iter().all(|s| s.dst_off.is_some())
        })
    }

    /// Number of buckets.
    pub fn buckets(&self) -> usize {
        self.ranks.first().map_or(0, Vec::len)
    }

    /// bf16 bytes rank `r` receives from peers.
    pub fn recv_bytes(&self, r: usize) -> u64 {
        let w = self.core.world as u64;
        self.ranks[r]
            .iter()
            .map(|b| {
                b.recvs
                    .iter()
                    .filter(|x| x.into == Buf::Rollout)
                    .map(|x| x.count * 2)
                    .sum::<u64>()
                    + b.unpacks.iter().map(|x| x.count * 2).sum::<u64>()
                    + b.gathers.iter().map(|g| (w - 1) * g.count * 2).sum::<u64>()
            })
            .sum()
    }

    /// Receive staging slots rank `r` needs (0 unless [`GatherMode::Packed`] stages receives).
    pub fn recv_staging_slots(&self, r: usize) -> usize {
        if self.ranks[r].iter().any(|b| b.recv_staging_elems > 0) {
            self.config.in_flight.min(self.buckets()).max(1)
        } else {
            0
        }
    }

    /// bf16 bytes rank `r` writes by casting (local pieces and staged pieces).
    pub fn cast_bytes(&self, r: usize) -> u64 {
        self.ranks[r]
            .iter()
            .flat_map(|b| &b.casts)
            .map(|c| c.region.numel() * 2)
            .sum()
    }

    /// Staging slots rank `r` needs (0 if it stages nothing).
    pub fn staging_slots(&self, r: usize) -> usize {
        if self.ranks[r].iter().any(|b| b.staging_elems > 0) {
            self.config.in_flight.min(self.buckets()).max(1)
        } else {
            0
        }
    }

    /// Bytes of rollout weights on the rank that holds the most.
    pub fn rollout_bytes(&self) -> u64 {
        self.core
            .ranks
            .iter()
            .map(|r| r.total_elements() as u64 * 2)
            .max()
            .unwrap_or(0)
    }

    /// Where rank `r`'s rollout tensors sit in its flat buffer: one [`RolloutEntry`] per
    /// tensor it holds, in rollout order.
    ///
    /// [`RolloutEntry`]: crate::RolloutEntry
    pub fn entries(&self, r: usize) -> Vec<crate::RolloutEntry> {
        let bf16 = self.core.ranks[r]
            .tensors
            .iter()
            .zip(&self.roll_offsets[r])
            .map(|(t, &offset)| {
                let e = crate::RolloutEntry::new(
                    self.core.tensors[t.tensor].name.clone(),
                    t.shape.clone(),
                    offset as usize,
                );
                (t.tensor, e)
            });
        let fp8 = self
            .fp8
            .get(r)
            .into_iter()
            .flatten()
            .map(|f| (f.tensor.tensor, f.entry.clone()));
        let mut all: Vec<_> = bf16.chain(fp8).collect();
        all.sort_by_key(|(tensor, _)| *tensor);
        all.into_iter().map(|(_, e)| e).collect()
    }
}

struct Item {
    src: usize,
    dst: usize,
    /// Position of the tensor in the destination's tensor list.
    at: usize,
    rows: std::ops::Range<usize>,
}

/// The T = 1 all-gather plan: per bucket of whole tensors, each rank casts its padded shard into
/// its part of the (padded) tensor in the rollout buffer, then one grouped in-place all-gather per
/// tensor fills the rest.
fn build_gather_plan(
    core: ReshardPlan,
    train: &FsdpLayout,
    config: BucketConfig,
    keep: &dyn Fn(&str) -> bool,
) -> FsdpPlan {
    let world = core.world;
    let shards = ShardLayout::new(train);
    let w = world as u64;
    let mut roll_offsets = Vec::with_capacity(core.tensors.len());
    let mut off = 0u64;
    let mut ranks: Vec<Vec<BucketOps>> = vec![Vec::new(); world];
    let mut cur: Vec<BucketOps> = vec![BucketOps::default(); world];
    let mut fill = 0u64;
    for t in &core.ranks[0].tensors {
        let slot = &shards.slots[t.train_index];
        let count = (slot.padded_rows * slot.cols) as u64;
        roll_offsets.push(off);
        if !keep(&core.tensors[t.tensor].name) {
            off = align(off + w * count);
            continue;
        }
        let bytes = 2 * w * count;
        if fill > 0 && fill + bytes > bucket_budget(config.bucket_bytes, ranks[0].len()) {
            for (r, b) in cur.iter_mut().enumerate() {
                ranks[r].push(std::mem::take(b));
            }
            fill = 0;
        }
        fill += bytes;
        for (r, b) in cur.iter_mut().enumerate() {
            b.casts.push(CastOp {
                src_off: slot.offset,
                dst: Buf::Rollout,
                dst_off: off + r as u64 * count,
                region: Region2d {
                    rows: slot.padded_rows as u64,
                    cols: slot.cols as u64,
                    src_ld: slot.cols as u64,
                    dst_ld: slot.cols as u64,
                },
            });
            b.gathers.push(GatherOp { off, count });
        }
        off = align(off + w * count);
    }
    if fill > 0 {
        for (r, b) in cur.iter_mut().enumerate() {
            ranks[r].push(std::mem::take(b));
        }
    }
    FsdpPlan {
        core,
        shards,
        roll_offsets: vec![roll_offsets; world],
        roll_len: off.max(ALIGN_ELEMS),
        ranks,
        slot_elems: 0,
        recv_slot_elems: 0,
        peer_copy: false,
        config,
        fp8: vec![Vec::new(); world],
    }
}

/// The byte budget of bucket `k`: the first buckets ramp up (⅛, ¼, ½ of `budget`, at least
/// [`RAMP_MIN_BYTES`]) so the network starts after a small first bucket's casts instead of a full
/// one's; from the fourth bucket on, the full budget.
pub fn bucket_budget(budget: u64, k: usize) -> u64 {
    let first = (budget / 8).max(RAMP_MIN_BYTES);
    budget.min(first.saturating_mul(1u64 << k.min(32)))
}

/// The smallest ramped bucket budget (16 MiB).
pub const RAMP_MIN_BYTES: u64 = 16 << 20;

/// Builds the executable plan from a validated core plan.
pub fn build_plan(core: ReshardPlan, train: &FsdpLayout, config: BucketConfig) -> FsdpPlan {
    build_plan_of(core, train, config, &|_| true)
}

/// The executable plan of the rollout tensors whose names `keep` accepts: their casts, sends and
/// gathers as [`build_plan`] makes them (in buckets of their own), every tensor's place in the
/// rollout buffers as there, so that it rewrites those tensors in a rollout the whole plan made
/// and leaves every other byte as it was (a LoRA model's adapters over its resident base).
///
/// ```
/// use lifecycle_layout::fsdp::{build_plan, build_plan_of, BucketConfig};
/// use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
/// let specs = vec![
///     TensorSpec::new("q.weight", [8, 4], Parallel::Column),
///     TensorSpec::new("q.lora_A.weight", [2, 4], Parallel::Replicated),
/// ];
/// let train = FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
/// let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(1, specs)?)?;
/// let all = build_plan(core.clone(), &train, BucketConfig::default());
/// let adapters = build_plan_of(core, &train, BucketConfig::default(), &|n| n.contains("lora_"));
/// assert_eq!((adapters.roll_offsets.clone(), adapters.roll_len), (all.roll_offsets.clone(), all.roll_len));
/// // rank 0 casts its row of A and receives the other: 2 × 4 bf16 elements, nothing of q
/// assert_eq!((adapters.cast_bytes(0), adapters.recv_bytes(0)), (8, 8));
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
///
/// Long by design: one pass over the rollout tensors packs every rank's buckets (casts,
/// sends, receives, unpacks) at once, so that the ranks' buckets stay in step.
pub fn build_plan_of(
    core: ReshardPlan,
    train: &FsdpLayout,
    config: BucketConfig,
    keep: &dyn Fn(&str) -> bool,
) -> FsdpPlan {
    if config.mode == GatherMode::AllGather && core.tp == 1 && core.world > 1 {
        return build_gather_plan(core, train, config, keep);
    }
    let world = core.world;
    let shards = ShardLayout::new(train);
    // Each rank's tensors packed in rollout order: the same offsets on every rank unless some
    // tensors are owned by one rank (partitioned experts), which only that rank's buffer holds.
    let mut roll_offsets = Vec::with_capacity(world);
    let mut roll_len = ALIGN_ELEMS;
    // pos[j][r]: where rollout tensor j sits in rank r's tensor list, if r holds it
    let mut pos = vec![vec![None; world]; core.tensors.len()];
    for (r, rank) in core.ranks.iter().enumerate() {
        let mut off = 0u64;
        let mut offsets = Vec::with_capacity(rank.tensors.len());
        for (i, t) in rank.tensors.iter().enumerate() {
            pos[t.tensor][r] = Some(i);
            offsets.push(off);
            off = align(off + t.numel() as u64);
        }
        roll_len = roll_len.max(off);
        roll_offsets.push(offsets);
    }
    let slot_elems_cfg = (config.bucket_bytes / 2).max(1);

    // Global item list: per tensor, per source rank, first the source's own piece (cast into its
    // rollout buffer), then the pieces it sends, each cut into row chunks of at most one bucket.
    let mut items = Vec::new();
    for (held, tensor) in pos.iter().zip(&core.tensors) {
        if !keep(&tensor.name) {
            continue;
        }
        for src in 0..world {
            let mut dsts: Vec<usize> = (0..world).collect();
            dsts.sort_by_key(|&d| (d != src, d));
            for dst in dsts {
                let Some(at) = held[dst] else { continue };
                let tp = &core.ranks[dst].tensors[at];
                let chunk = (slot_elems_cfg as usize / tp.cols.len().max(1)).max(1);
                for p in tp.pieces.iter().filter(|p| p.src_rank == src) {
                    let mut r = p.rows.start;
                    while r < p.rows.end {
                        let end = ((r / chunk + 1) * chunk).min(p.rows.end);
                        items.push(Item {
                            src,
                            dst,
                            at,
                            rows: r..end,
                        });
                        r = end;
                    }
                }
            }
        }
    }

    let mut ranks: Vec<Vec<BucketOps>> = vec![Vec::new(); world];
    let mut cur: Vec<BucketOps> = vec![BucketOps::default(); world];
    let mut sent = vec![0u64; world];
    let mut local = vec![0u64; world];
    let mut max_staging = 0u64;
    let local_cap = 4 * slot_elems_cfg;
    let flush = |ranks: &mut Vec<Vec<BucketOps>>,
                 cur: &mut Vec<BucketOps>,
                 sent: &mut Vec<u64>,
                 local: &mut Vec<u64>| {
        if cur
            .iter()
            .any(|b| !b.casts.is_empty() || !b.sends.is_empty() || !b.recvs.is_empty())
        {
            for (r, b) in cur.iter_mut().enumerate() {
                ranks[r].push(std::mem::take(b));
            }
        }
        sent.iter_mut().for_each(|x| *x = 0);
        local.iter_mut().for_each(|x| *x = 0);
    };
    for it in &items {
        let tp_dst = &core.ranks[it.dst].tensors[it.at];
        let ti = tp_dst.train_index;
        let slot = &shards.slots[ti];
        let held = shards.held_rows(ti, it.src);
        let ncols = tp_dst.cols.len() as u64;
        let n = it.rows.len() as u64 * ncols;
        let src_off =
            slot.offset + ((it.rows.start - held.start) * slot.cols + tp_dst.cols.start) as u64;
        let roll_off = roll_offsets[it.dst][it.at]
            + tp_dst.dst_offset(it.rows.start, tp_dst.cols.start) as u64;
        let region = Region2d {
            rows: it.rows.len() as u64,
            cols: ncols,
            src_ld: slot.cols as u64,
            dst_ld: ncols,
        };
        if it.src == it.dst {
            if local[it.src] + n > local_cap && local[it.src] > 0 {
                flush(&mut ranks, &mut cur, &mut sent, &mut local);
            }
            local[it.src] += n;
            cur[it.src].casts.push(CastOp {
                src_off,
                dst: Buf::Rollout,
                dst_off: roll_off,
                region,
            });
            continue;
        }
        // T = 1: the receiver needs exactly the rows the sender cast into its own rollout
        // buffer, so they are sent from there (no staging: an all-gather straight into the
        // rollout buffers). T > 1: pieces are cast into a staging slot, so the NCCL stream never
        // waits for the sender's local casts (which run on their own stream).
        let from_rollout = core.tp == 1;
        let need = if from_rollout {
            n
        } else {
            align(cur[it.src].staging_elems) + n
        };
        let fill = if from_rollout {
            sent[it.src] + n
        } else {
            need.max(sent[it.src] + n)
        };
        let budget = (bucket_budget(config.bucket_bytes, ranks[0].len()) / 2).max(1);
        if fill > budget && (sent[it.src] > 0 || cur[it.src].staging_elems > 0) {
            flush(&mut ranks, &mut cur, &mut sent, &mut local);
        }
        sent[it.src] += n;
        let (buf, off) = if from_rollout {
            (Buf::Rollout, roll_off)
        } else {
            let b = &mut cur[it.src];
            let at = align(b.staging_elems);
            b.staging_elems = at + n;
            max_staging = max_staging.max(b.staging_elems);
            b.casts.push(CastOp {
                src_off,
                dst: Buf::Staging,
                dst_off: at,
                region,
            });
            (Buf::Staging, at)
        };
        cur[it.src].sends.push(SendOp {
            peer: it.dst,
            buf,
            off,
            count: n,
            dst_off: Some(roll_off),
        });
        cur[it.dst].recvs.push(RecvOp {
            peer: it.src,
            into: Buf::Rollout,
            off: roll_off,
            count: n,
        });
    }
    flush(&mut ranks, &mut cur, &mut sent, &mut local);
    let mut recv_slot_elems = 0;
    if config.mode == GatherMode::Packed && core.tp > 1 {
        for k in 0..ranks.first().map_or(0, Vec::len) {
            recv_slot_elems = recv_slot_elems.max(pack_bucket(&mut ranks, k));
        }
    }
    for b in ranks.iter().flatten() {
        max_staging = max_staging.max(b.staging_elems);
    }
    FsdpPlan {
        core,
        shards,
        roll_offsets,
        roll_len,
        ranks,
        recv_slot_elems: align(recv_slot_elems),
        slot_elems: if max_staging > 0 {
            align(max_staging)
        } else {
            0
        },
        config,
        peer_copy: false,
        fp8: vec![Vec::new(); world],
    }
}

/// One sender's packed run for one peer: start, length, and each piece's (offset from the start,
/// elements), in send order.
type PeerPack = (u64, u64, Vec<(u64, u64)>);

/// Rewrites bucket `k` of every rank for [`GatherMode::Packed`]: each sender's staged pieces are
/// laid out per peer contiguously (the casts retargeted), one send per peer; each receiver gets one
/// receive per peer into its receive staging slot and one unpack per piece. Returns the largest
/// receive staging size of the bucket.
fn pack_bucket(ranks: &mut [Vec<BucketOps>], k: usize) -> u64 {
    let world = ranks.len();
    // (src, dst) -> packed start and the pieces' new offsets, in send order.
    let mut packed: Vec<Vec<PeerPack>> = vec![Vec::new(); world];
    if ranks
        .iter()
        .any(|r| r[k].sends.iter().any(|s| s.buf != Buf::Staging))
    {
        return 0; // only all-staged buckets are packed (T > 1)
    }
    for (src, rank) in ranks.iter_mut().enumerate() {
        let b = &mut rank[k];
        let mut cursor = 0u64;
        let mut remap: Vec<(u64, u64)> = Vec::new();
        let mut per_peer = vec![(0u64, 0u64, Vec::new()); world];
        for (peer, slot) in per_peer.iter_mut().enumerate() {
            let start = align(cursor);
            cursor = start;
            for s in b.sends.iter().filter(|s| s.peer == peer) {
                let at = align(cursor);
                remap.push((s.off, at));
                slot.2.push((at - start, s.count));
                cursor = at + s.count;
            }
            *slot = (start, cursor - start, std::mem::take(&mut slot.2));
        }
        for c in b.casts.iter_mut().filter(|c| c.dst == Buf::Staging) {
            if let Some(&(_, new)) = remap.iter().find(|(old, _)| *old == c.dst_off) {
                c.dst_off = new;
            }
        }
        b.sends = per_peer
            .iter()
            .enumerate()
            .filter(|(_, (_, len, _))| *len > 0)
            .map(|(peer, &(start, len, _))| SendOp {
                peer,
                buf: Buf::Staging,
                off: start,
                count: len,
                dst_off: None,
            })
            .collect();
        b.staging_elems = cursor;
        packed[src] = per_peer;
    }
    let mut max_recv = 0;
    for (dst, rank) in ranks.iter_mut().enumerate() {
        let b = &mut rank[k];
        let old: Vec<RecvOp> = std::mem::take(&mut b.recvs);
        let mut cursor = 0u64;
        for (src, peers) in packed.iter().enumerate() {
            let Some((_, len, pieces)) = peers.get(dst) else {
                continue;
            };
            if *len == 0 {
                continue;
            }
            let base = align(cursor);
            b.recvs.push(RecvOp {
                peer: src,
                into: Buf::Staging,
                off: base,
                count: *len,
            });
            for (r, &(rel, count)) in old.iter().filter(|r| r.peer == src).zip(pieces) {
                debug_assert_eq!(r.count, count);
                b.unpacks.push(UnpackOp {
                    src_off: base + rel,
                    dst_off: r.off,
                    count,
                });
            }
            cursor = base + len;
        }
        b.recv_staging_elems = cursor;
        max_recv = max_recv.max(cursor);
    }
    max_recv
}
