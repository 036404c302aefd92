//! An FSDP bucket plan as [`RankSteps`]: local casts in runs of buckets, one network step per
//! bucket (staged casts, grouped sends / receives or all-gathers or peer copies, unpacks).

use super::{BucketOps, Buf as FsdpBuf, FsdpPlan};
use crate::steps::{
    Buf, Copy, Gather, LocalChunk, Message, NetStep, PeerRun, Quantise, RankSteps, SourceType,
    Stream,
};
use crate::{LayoutError, Region2d};

/// Whether bucket `b`'s network work reads or writes rollout elements that its local casts write
/// (an all-gather of the rank's own part, or a send straight from the rollout buffer).
fn needs_local(b: &BucketOps) -> bool {
    !b.gathers.is_empty() || b.sends.iter().any(|s| s.buf == FsdpBuf::Rollout)
}

fn buf(b: FsdpBuf, slot: Buf) -> Buf {
    match b {
        FsdpBuf::Rollout => Buf::Rollout,
        FsdpBuf::Staging => slot,
    }
}

impl FsdpPlan {
    /// Rank `rank`'s buckets as steps. Local casts (into the rollout buffer) form one chunk per
    /// run of buckets up to one whose network work needs them, all issued first on the auxiliary
    /// stream; bucket `k` is network step `k`: its staged casts pack the send slot, then its
    /// sends and receives (or all-gathers, or with [`FsdpPlan::peer_copy`] its peer copies), then
    /// its unpacks.
    ///
    /// ```
    /// use lifecycle_layout::fsdp::{build_plan, BucketConfig};
    /// use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
    /// let specs = vec![TensorSpec::new("up", [6, 4], Parallel::Column)];
    /// let train = FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
    /// let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(1, specs)?)?;
    /// let plan = build_plan(core, &train, BucketConfig::default());
    /// let steps = plan.rank_steps(0)?;
    /// assert_eq!(steps.recv_elems, 12); // the other rank's three rows of four
    /// # Ok::<(), lifecycle_layout::LayoutError>(())
    /// ```
    pub fn rank_steps(&self, rank: usize) -> Result<RankSteps, LayoutError> {
        let bad = |what: String| LayoutError::InvalidSteps { rank, what };
        let buckets = self
            .ranks
            .get(rank)
            .ok_or_else(|| bad(format!("the plan has {} ranks", self.ranks.len())))?;
        let w = self.core.world as u64;
        let mut copies = Vec::new();
        let mut local = Vec::new();
        let mut chunk_of = vec![0; buckets.len()];
        let (mut first_bucket, mut first_copy) = (0, 0);
        let mut local_elems = 0;
        for (k, b) in buckets.iter().enumerate() {
            for c in b.casts.iter().filter(|c| c.dst == FsdpBuf::Rollout) {
                local_elems += c.region.numel();
                copies.push(Copy::kernel(
                    Buf::Source,
                    c.src_off,
                    Buf::Rollout,
                    c.dst_off,
                    c.region,
                ));
            }
            if needs_local(b) || k + 1 == buckets.len() {
                local.push(LocalChunk::upfront(first_copy..copies.len(), Stream::Aux));
                chunk_of[first_bucket..=k].fill(local.len() - 1);
                (first_bucket, first_copy) = (k + 1, copies.len());
            }
        }
        let mut steps = Vec::with_capacity(buckets.len());
        for (k, b) in buckets.iter().enumerate() {
            let p0 = copies.len();
            for c in b.casts.iter().filter(|c| c.dst == FsdpBuf::Staging) {
                copies.push(Copy::kernel(
                    Buf::Source,
                    c.src_off,
                    Buf::SendSlot,
                    c.dst_off,
                    c.region,
                ));
            }
            let pack = p0..copies.len();
            let u0 = copies.len();
            for u in &b.unpacks {
                copies.push(Copy::kernel(
                    Buf::RecvSlot,
                    u.src_off,
                    Buf::Rollout,
                    u.dst_off,
                    Region2d::flat(u.count),
                ));
            }
            let unpack = u0..copies.len();
            let mut st = NetStep {
                index: k,
                pack,
                unpack,
                gathers: b
                    .gathers
                    .iter()
                    .map(|g| Gather {
                        off: g.off,
                        count: g.count,
                    })
                    .collect(),
                wait_local: needs_local(b).then_some(chunk_of[k]),
                recv_elems: b
                    .recvs
                    .iter()
                    .filter(|r| self.peer_copy || r.into == FsdpBuf::Rollout)
                    .map(|r| r.count)
                    .sum::<u64>()
                    + b.unpacks.iter().map(|u| u.count).sum::<u64>()
                    + b.gathers.iter().map(|g| (w - 1) * g.count).sum::<u64>(),
                ..NetStep::default()
            };
            if self.peer_copy {
                for s in &b.sends {
                    let dst_off = s.dst_off.ok_or_else(|| {
                        bad(format!(
                            "bucket {k}: a send to rank {} has no place in its rollout buffer, \
                             so it cannot run as a peer copy",
                            s.peer
                        ))
                    })?;
                    st.pushes.push(PeerRun {
                        peer: s.peer,
                        src: buf(s.buf, Buf::SendSlot),
                        src_off: s.off,
                        dst_off,
                        region: Region2d::flat(s.count),
                    });
                }
            } else {
                st.sends = b
                    .sends
                    .iter()
                    .map(|s| Message {
                        peer: s.peer,
                        buf: buf(s.buf, Buf::SendSlot),
                        off: s.off,
                        count: s.count,
                    })
                    .collect();
                st.recvs = b
                    .recvs
                    .iter()
                    .map(|r| Message {
                        peer: r.peer,
                        buf: buf(r.into, Buf::RecvSlot),
                        off: r.off,
                        count: r.count,
                    })
                    .collect();
            }
            steps.push(st);
        }
        // fp8 at W > 1: the scales agreed across the ranks; at W = 1 each slice is the
        // rank's own rows, quantised by one kernel that finds each block's amax itself.
        let (mut quantise, mut agree, mut recv_fp8) = (Vec::new(), None, 0);
        if self.core.world > 1 && self.fp8.iter().any(|s| !s.is_empty()) {
            let a = self.rank_agree(rank, steps.len(), &mut copies)?;
            steps.extend(a.step);
            recv_fp8 = a.recv_elems;
            agree = Some(a.agree);
        } else {
            quantise = self.rank_quantise(rank)?;
        }
        let steps = RankSteps {
            rank,
            world: self.core.world,
            source: SourceType::F32,
            copies,
            zero: Vec::new(),
            quantise,
            agree,
            local,
            in_flight: self.config.in_flight.min(buckets.len()).max(1),
            steps,
            send_slot_elems: if self.staging_slots(rank) > 0 {
                self.slot_elems
            } else {
                0
            },
            recv_slot_elems: if self.recv_staging_slots(rank) > 0 {
                self.recv_slot_elems
            } else {
                0
            },
            source_elems: self.shards.rank_len,
            rollout_elems: self.roll_len,
            local_elems,
            recv_elems: self.recv_bytes(rank) / 2 + recv_fp8,
        };
        steps.validate()?;
        Ok(steps)
    }

    /// Rank `rank`'s quantisations at W = 1: one per fp8 slice of the plan, read from the
    /// rank's own master shard (at W > 1 the scales are agreed first: [`Fp8Agree`]). A slice
    /// whose rows the rank does not hold is refused by name.
    ///
    /// [`Fp8Agree`]: crate::steps::Fp8Agree
    fn rank_quantise(&self, rank: usize) -> Result<Vec<Quantise>, LayoutError> {
        let Some(slices) = self.fp8.get(rank) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(slices.len());
        for s in slices {
            let t = &s.tensor;
            let bad = |what: String| LayoutError::InvalidSteps { rank, what };
            let slot =
                self.shards.slots.get(t.train_index).ok_or_else(|| {
                    bad(format!("fp8 slice of training tensor {}", t.train_index))
                })?;
            let held = self.shards.held_rows(t.train_index, rank);
            let whole_cols = t.cols.start == 0 && t.cols.end == slot.cols;
            if t.rows.start < held.start || t.rows.end > held.end || !whole_cols {
                return Err(bad(format!(
                    "the fp8 slice of `{}` (rows {:?}, columns {:?}) is not a block of rank \
                     {rank}'s own shard (rows {held:?}): quantising it needs the amax of \
                     blocks on several ranks agreed first",
                    slot.name, t.rows, t.cols
                )));
            }
            let scale = s
                .entry
                .scale_offset()
                .ok_or_else(|| bad(format!("the fp8 slice of `{}` has no scales", slot.name)))?;
            out.push(Quantise {
                src_off: slot.offset + ((t.rows.start - held.start) * slot.cols) as u64,
                dst_byte: 2 * s.entry.offset() as u64,
                scale: scale as u64 / 2,
                rows: t.rows.len() as u64,
                cols: t.cols.len() as u64,
                src_ld: slot.cols as u64,
            });
        }
        Ok(out)
    }

    /// [`FsdpPlan::rank_steps`] reading rank `rank`'s shards where they are (`at[i]`: the first
    /// element of training tensor `i`'s shard, the held rows only, in one address space whose
    /// base is element 0) instead of at their offsets in the flat padded buffer: a state whose
    /// shards are separate allocations lent by address ([`RankSteps::rebase_source`]).
    pub fn rank_steps_at(&self, rank: usize, at: &[u64]) -> Result<RankSteps, LayoutError> {
        let mut steps = self.rank_steps(rank)?;
        let segments: Vec<(u64, u64)> = self
            .shards
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let rows = self.shards.held_rows(i, rank).len();
                (slot.offset, (rows * slot.cols) as u64)
            })
            .collect();
        steps.rebase_source(&segments, at)?;
        Ok(steps)
    }
}
