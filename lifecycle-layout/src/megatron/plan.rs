//! The planner: per rollout rank, which element runs come from which training rank, in buckets.

use std::ops::Range;

use super::error::MegatronLayoutError;
use super::rollout::RolloutTensorSpec;
use super::sources::{wants, Want};
use super::train::MegatronLayout;
use crate::RolloutLayout;

/// Bucket settings of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketConfig {
    /// The most bf16 bytes one destination rank receives from peers in one bucket (its staging
    /// buffer). Transfers larger than this are split by rows, and rows by columns.
    pub bucket_bytes: u64,
}

impl Default for BucketConfig {
    /// 256 MB, as the FSDP backend.
    fn default() -> Self {
        BucketConfig {
            bucket_bytes: 256 << 20,
        }
    }
}

/// A 2-D run of bf16 elements copied from one training rank's parameter buffer into one rollout
/// slice: `rows` rows of `cols` elements, rows `src_pitch` apart at the source and `dst_pitch`
/// apart in the slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Index of the rollout tensor ([`MegatronPlan::tensors`]).
    pub tensor: usize,
    /// The training rank read.
    pub src_rank: usize,
    /// Element offset in that rank's bf16 parameter buffer.
    pub src_offset: usize,
    /// Elements between row starts at the source.
    pub src_pitch: usize,
    /// Element offset in the destination slice.
    pub dst_offset: usize,
    /// Elements between row starts in the slice.
    pub dst_pitch: usize,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
}

impl Transfer {
    /// Elements moved.
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// Bytes moved (bf16).
    pub fn bytes(&self) -> u64 {
        (self.numel() * 2) as u64
    }
}

/// What one rollout rank builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// Its rollout TP rank (`rank mod T`).
    pub tp_rank: usize,
    /// Every copy, in rollout-tensor order.
    pub transfers: Vec<Transfer>,
    /// Consecutive ranges of `transfers`; each receives at most the bucket budget from peers.
    pub buckets: Vec<Range<usize>>,
}

impl RankPlan {
    /// Bytes received from other ranks.
    pub fn remote_bytes(&self) -> u64 {
        self.transfers
            .iter()
            .filter(|x| x.src_rank != self.rank)
            .map(Transfer::bytes)
            .sum()
    }

    /// Bytes copied from this rank's own buffer.
    pub fn local_bytes(&self) -> u64 {
        self.transfers
            .iter()
            .filter(|x| x.src_rank == self.rank)
            .map(Transfer::bytes)
            .sum()
    }

    /// Bytes bucket `k` receives from peers.
    pub fn bucket_remote_bytes(&self, k: usize) -> u64 {
        self.transfers[self.buckets[k].clone()]
            .iter()
            .filter(|x| x.src_rank != self.rank)
            .map(Transfer::bytes)
            .sum()
    }
}

/// A validated plan from the Megatron training layout to the fused rollout layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronPlan {
    /// The training layout.
    pub train: MegatronLayout,
    /// The rollout layout.
    pub rollout: RolloutLayout,
    /// Rollout tensors, in rollout order (shapes of one rank's slice).
    pub tensors: Vec<RolloutTensorSpec>,
    /// One plan per rollout rank.
    pub ranks: Vec<RankPlan>,
    /// Settings used.
    pub config: BucketConfig,
}

impl MegatronPlan {
    /// Bytes crossing a device↔device link, summed over ranks.
    pub fn remote_bytes(&self) -> u64 {
        self.ranks.iter().map(RankPlan::remote_bytes).sum()
    }

    /// Bytes copied locally, summed over ranks.
    pub fn local_bytes(&self) -> u64 {
        self.ranks.iter().map(RankPlan::local_bytes).sum()
    }
}

/// Plans the move from the Megatron training layout to the fused TP rollout layout.
///
/// Source choice: every run is read from the destination rank itself when it holds the bytes
/// (its own stage and TP shard, its own experts, or a replicated norm / router / kv head /
/// tied-embedding copy); otherwise from one of the replicas holding them (every DP rank of the
/// owning (stage, TP rank), every expert data-parallel rank of the owning (stage, ETP rank, EP
/// rank), every TP rank for replicated tensors, both copies of a tied embedding), preferring in
/// order: the
/// destination's own DP replica, its own pipeline stage (so its TP group), the nearest rank
/// number, the lower rank. Remote bytes are thus minimal — a byte crosses a link only when the
/// destination holds no copy of it — and traffic stays inside TP groups, then model-parallel
/// groups, which Megatron's rank order puts on consecutive ranks (one node); the sends spread
/// over the DP replicas (with TP = DP = 2, PP = 1, T = 1, ranks 0↔1 and 2↔3 exchange halves).
/// Runs that continue one another in source and destination are merged.
///
/// ```
/// use lifecycle_layout::megatron::*;
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// let m = ModelSpec::tiny();
/// let train = MegatronLayout::new(m, 2, 1, 2)?;
/// let rollout = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4));
/// let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default())?;
/// assert_eq!(plan.remote_bytes(), 0); // T = TP, PP = 1: every rank holds its own slice
/// # Ok::<(), MegatronLayoutError>(())
/// ```
pub fn plan_megatron_to_tp(
    train: &MegatronLayout,
    rollout: &RolloutLayout,
    config: BucketConfig,
) -> Result<MegatronPlan, MegatronLayoutError> {
    if config.bucket_bytes < 2 {
        return Err(MegatronLayoutError::BucketTooSmall {
            bytes: config.bucket_bytes,
        });
    }
    let world = train.world();
    rollout.check_world(world)?;
    let tensors = rollout.fused_tensors(train.model())?;
    let vocab_rows = rollout.vocab_rows(train.model())?;
    let t_deg = rollout.tp();
    let ranks = (0..world)
        .map(|rank| {
            let t = rank % t_deg;
            let mut transfers: Vec<Transfer> = Vec::new();
            for (i, spec) in tensors.iter().enumerate() {
                for want in wants(train, rollout, spec, vocab_rows, t) {
                    let x = choose(train, rank, i, &want);
                    match transfers.last_mut() {
                        Some(prev) if continues(prev, &x) => prev.rows += x.rows,
                        _ => transfers.push(x),
                    }
                }
            }
            let transfers = split_large(transfers, rank, config.bucket_bytes);
            let buckets = bucketize(&transfers, rank, config.bucket_bytes);
            RankPlan {
                rank,
                tp_rank: t,
                transfers,
                buckets,
            }
        })
        .collect();
    Ok(MegatronPlan {
        train: train.clone(),
        rollout: rollout.clone(),
        tensors,
        ranks,
        config,
    })
}

/// Picks the source rank of a want (see [`plan_megatron_to_tp`]).
fn choose(train: &MegatronLayout, rank: usize, tensor: usize, want: &Want) -> Transfer {
    let mut candidates: Vec<(usize, usize)> = want
        .locs
        .iter()
        .flat_map(|l| {
            l.holder
                .ranks(train)
                .into_iter()
                .map(move |r| (r, l.offset))
        })
        .collect();
    let me = train.coords(rank);
    candidates.sort_unstable_by_key(|&(r, _)| {
        let c = train.coords(r);
        (r != rank, c.dp != me.dp, c.pp != me.pp, r.abs_diff(rank), r)
    });
    let (src_rank, src_offset) = candidates[0];
    Transfer {
        tensor,
        src_rank,
        src_offset,
        src_pitch: want.src_pitch,
        dst_offset: want.dst_offset,
        dst_pitch: want.dst_pitch,
        rows: want.rows,
        cols: want.cols,
    }
}

/// Whether `next` continues `prev` row for row (same tensor, source, pitches and width).
fn continues(prev: &Transfer, next: &Transfer) -> bool {
    prev.tensor == next.tensor
        && prev.src_rank == next.src_rank
        && prev.cols == next.cols
        && prev.src_pitch == next.src_pitch
        && prev.dst_pitch == next.dst_pitch
        && prev.src_offset + prev.rows * prev.src_pitch == next.src_offset
        && prev.dst_offset + prev.rows * prev.dst_pitch == next.dst_offset
}

/// Splits remote transfers above the budget: by rows, and single rows by columns.
fn split_large(transfers: Vec<Transfer>, rank: usize, budget: u64) -> Vec<Transfer> {
    let max_elems = (budget / 2) as usize;
    let mut out = Vec::with_capacity(transfers.len());
    for x in transfers {
        if x.src_rank == rank || x.numel() <= max_elems {
            out.push(x);
        } else if x.cols <= max_elems {
            let per = max_elems / x.cols;
            let mut r = 0;
            while r < x.rows {
                let n = per.min(x.rows - r);
                out.push(Transfer {
                    src_offset: x.src_offset + r * x.src_pitch,
                    dst_offset: x.dst_offset + r * x.dst_pitch,
                    rows: n,
                    ..x
                });
                r += n;
            }
        } else {
            for r in 0..x.rows {
                let mut c = 0;
                while c < x.cols {
                    let n = max_elems.min(x.cols - c);
                    out.push(Transfer {
                        src_offset: x.src_offset + r * x.src_pitch + c,
                        dst_offset: x.dst_offset + r * x.dst_pitch + c,
                        rows: 1,
                        cols: n,
                        ..x
                    });
                    c += n;
                }
            }
        }
    }
    out
}

/// Cuts the transfer list into buckets of at most `budget` remote bytes each.
fn bucketize(transfers: &[Transfer], rank: usize, budget: u64) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, x) in transfers.iter().enumerate() {
        let b = if x.src_rank == rank { 0 } else { x.bytes() };
        if bytes + b > budget && i > start {
            buckets.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += b;
    }
    if start < transfers.len() {
        buckets.push(start..transfers.len());
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelSpec;
    use crate::RolloutVocab;

    /// Every element of every slice is written exactly once, except vocabulary padding rows.
    fn check_coverage(plan: &MegatronPlan) {
        let m = plan.train.model();
        let vocab_rows = plan.rollout.vocab_rows(m).unwrap() / plan.rollout.tp();
        for rp in &plan.ranks {
            let mut seen: Vec<Vec<u8>> = plan.tensors.iter().map(|t| vec![0; t.numel()]).collect();
            for x in &rp.transfers {
                for r in 0..x.rows {
                    for c in 0..x.cols {
                        seen[x.tensor][x.dst_offset + r * x.dst_pitch + c] += 1;
                    }
                }
            }
            for (spec, s) in plan.tensors.iter().zip(&seen) {
                let is_vocab =
                    spec.name == "model.embed_tokens.weight" || spec.name == "lm_head.weight";
                for (i, &n) in s.iter().enumerate() {
                    let row = i / spec.cols().max(1);
                    let padding = is_vocab && rp.tp_rank * vocab_rows + row >= m.vocab;
                    assert_eq!(
                        n,
                        u8::from(!padding),
                        "{} rank {} elem {i}",
                        spec.name,
                        rp.rank
                    );
                }
            }
            for k in 0..rp.buckets.len() {
                assert!(rp.bucket_remote_bytes(k) <= plan.config.bucket_bytes);
            }
        }
    }

    #[test]
    fn slices_are_covered_exactly_once() {
        for (groups, tp, pp, dp, t, budget) in [
            (2, 2, 1, 2, 4, 64),
            (2, 4, 2, 1, 2, 1 << 20),
            (8, 8, 1, 1, 1, 10),
            (1, 2, 2, 2, 8, 3),
            (2, 1, 2, 1, 2, 100),
        ] {
            let mut m = ModelSpec::tiny();
            m.query_groups = groups;
            let train = MegatronLayout::new(m, tp, pp, dp).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(2));
            let plan = plan_megatron_to_tp(
                &train,
                &rollout,
                BucketConfig {
                    bucket_bytes: budget,
                },
            )
            .unwrap();
            check_coverage(&plan);
        }
    }

    #[test]
    fn moe_slices_are_covered_exactly_once() {
        use crate::ExpertPlacement;
        let mut m = ModelSpec::tiny_moe(); // 4 experts of intermediate size 6, layer 0 dense
        m.layers = 3;
        // (tp, pp, dp, ep, etp, T, placement, budget)
        for (tp, pp, dp, ep, etp, t, placement, budget) in [
            (1, 1, 4, 4, 1, 2, ExpertPlacement::Partitioned, 1 << 20),
            (2, 1, 2, 2, 1, 4, ExpertPlacement::Partitioned, 64),
            (2, 2, 1, 1, 2, 1, ExpertPlacement::TensorParallel, 1 << 20),
            (1, 2, 2, 2, 1, 2, ExpertPlacement::TensorParallel, 10),
            (2, 1, 4, 2, 2, 2, ExpertPlacement::TensorParallel, 100),
            (4, 1, 2, 4, 2, 4, ExpertPlacement::Partitioned, 1 << 20),
            (1, 3, 2, 2, 1, 2, ExpertPlacement::TensorParallel, 1 << 20),
        ] {
            let train = MegatronLayout::new_moe(m, tp, pp, dp, ep, etp).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(2))
                .with_expert_placement(placement);
            let plan = plan_megatron_to_tp(
                &train,
                &rollout,
                BucketConfig {
                    bucket_bytes: budget,
                },
            )
            .unwrap();
            check_coverage(&plan);
        }
    }

    #[test]
    fn matching_expert_parallelism_reads_experts_locally() {
        use crate::ExpertPlacement;
        // EP 4 = T 4, experts whole on both sides: every rank holds its rollout experts
        let m = ModelSpec::tiny_moe();
        let train = MegatronLayout::new_moe(m, 1, 1, 4, 4, 1).unwrap();
        let rollout = RolloutLayout::fused(4, RolloutVocab::PadToMultipleOf(1))
            .with_expert_placement(ExpertPlacement::Partitioned);
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        for rp in &plan.ranks {
            for x in &rp.transfers {
                if plan.tensors[x.tensor].name.contains("mlp.experts") {
                    assert_eq!(x.src_rank, rp.rank, "{}", plan.tensors[x.tensor].name);
                }
            }
        }
    }

    #[test]
    fn matching_tp_without_pipeline_moves_nothing_remote() {
        // Same vocabulary padding on both sides: the vocab-parallel rows line up too.
        let m = ModelSpec::tiny(); // 2 query groups
        for tp in [1, 2, 4] {
            let train = MegatronLayout::new(m, tp, 1, 2).unwrap();
            let pad = RolloutVocab::PadToMultipleOf(m.make_vocab_size_divisible_by);
            let rollout = RolloutLayout::fused(tp, pad);
            let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
            if tp <= m.query_groups {
                assert_eq!(plan.remote_bytes(), 0, "TP {tp}");
            } else {
                // Megatron-Core's plain qkv chunks at TP 4 > 2 groups: a rollout rank (its q
                // heads and a copy of its group's k, v, as vLLM holds them) reads some heads
                // from a neighbour, and nothing else crosses
                let qkv_layer = (m.heads + 2 * m.query_groups) * m.head_dim * m.hidden;
                let bound = 2 * m.layers * tp * qkv_layer * 2; // bf16, both bias and weight
                assert!(
                    plan.remote_bytes() > 0 && plan.remote_bytes() < bound as u64,
                    "TP {tp}"
                );
            }
        }
    }

    #[test]
    fn nearest_replica_is_read() {
        let m = ModelSpec::tiny();
        let train = MegatronLayout::new(m, 2, 1, 2).unwrap();
        let rollout = RolloutLayout::fused(1, RolloutVocab::PadToMultipleOf(4));
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        let peers = |r: usize| -> Vec<usize> {
            let mut p: Vec<usize> = plan.ranks[r]
                .transfers
                .iter()
                .map(|x| x.src_rank)
                .filter(|&s| s != r)
                .collect();
            p.dedup();
            p
        };
        assert_eq!(peers(0), vec![1]);
        assert_eq!(peers(1), vec![0]);
        assert_eq!(peers(2), vec![3]);
        assert_eq!(peers(3), vec![2]);
    }

    #[test]
    fn tied_embedding_is_read_locally_from_the_last_stage_copy() {
        let mut m = ModelSpec::tiny();
        m.tied_embeddings = true;
        let train = MegatronLayout::new(m, 1, 2, 1).unwrap();
        let rollout = RolloutLayout::fused(1, RolloutVocab::PadToMultipleOf(1));
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        // rank 1 is the last stage: it reads the embedding from its own output-layer copy.
        let emb = plan.ranks[1]
            .transfers
            .iter()
            .find(|x| x.tensor == 0)
            .unwrap();
        assert_eq!(emb.src_rank, 1);
    }
}
