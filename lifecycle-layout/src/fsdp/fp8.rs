//! The FSDP plan of an fp8 rollout ([`RolloutDtype::Fp8`](crate::fp8::RolloutDtype)): the
//! tensors kept bf16 ([`Fp8Keep`]) run through the bucket plan as in a bf16 rollout; the
//! quantised ones are listed per rank as [`Fp8Slice`]s, placed after the bf16 tensors in the
//! rank's buffer (e4m3 bytes, then one f32 scale per 128 × 128 block), for the executor to
//! quantise from the fp32 masters.

use crate::fp8::{check_fp8_plan, Fp8Keep};
use crate::{FsdpLayout, LayoutError, ReshardPlan, RolloutEntry, TensorPlan};

use super::{align, build_plan_of, BucketConfig, FsdpPlan};

/// One fp8 slice of one rank: what it covers of its tensor (rows, columns, and the source ranks
/// of its pieces) and where it sits in the rank's rollout buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Slice {
    /// The slice's plan (as in a bf16 rollout).
    pub tensor: TensorPlan,
    /// Its place: an fp8 [`RolloutEntry`].
    pub entry: RolloutEntry,
}

/// The FSDP plan of an fp8 rollout over `core` (`keep` choosing the bf16 tensors): the bucket
/// plan of the bf16 tensors
/// ([`build_plan`](super::build_plan)) and, per rank, the fp8 slices after them. Every rank's slice of a quantised
/// tensor must start and end on 128 × 128 block boundaries
/// ([`LayoutError::Fp8BlockSplit`] otherwise, naming the tensor). At W > 1 the pieces that
/// cross ranks move as e4m3 bytes in 2-byte elements: a shard split that would move an odd byte
/// count is refused too ([`LayoutError::InvalidSteps`], naming the tensor).
///
/// ```
/// use lifecycle_layout::fsdp::{build_fp8_plan, BucketConfig};
/// use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
/// let specs = vec![
///     TensorSpec::new("model.layers.0.mlp.up_proj.weight", [256, 128], Parallel::Column),
///     TensorSpec::new("model.norm.weight", [128], Parallel::Replicated),
/// ];
/// let train = FsdpLayout::new(1, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
/// let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(1, specs)?)?;
/// let plan = build_fp8_plan(core, &train, BucketConfig::default(), Default::default())?;
/// let entries = plan.entries(0);
/// assert!(entries[0].is_fp8() && !entries[1].is_fp8());
/// // the norm first (bf16, 64-slot aligned), then 256 x 128 bytes in 16384 slots and 2 scales
/// // in 4, the buffer rounded up to 64 slots
/// assert_eq!((entries[0].offset(), entries[0].slots()), (128, 16384 + 4));
/// assert_eq!(plan.roll_len, 16576);
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
pub fn build_fp8_plan(
    core: ReshardPlan,
    train: &FsdpLayout,
    config: BucketConfig,
    keep: Fp8Keep,
) -> Result<FsdpPlan, LayoutError> {
    build_fp8_plan_of(core, train, config, keep, &|_| true)
}

/// [`build_fp8_plan`] of the rollout tensors whose names `only` accepts, as
/// [`build_plan_of`](super::build_plan_of) is of [`build_plan`](super::build_plan): every tensor's place in the
/// rollout buffers as in the whole plan (bf16 and fp8 alike), the steps of the accepted ones
/// alone, so that it rewrites them in a rollout the whole plan made (a LoRA model's adapters,
/// bf16 in every rollout, over its resident fp8 base).
///
/// ```
/// use lifecycle_layout::fsdp::{build_fp8_plan, build_fp8_plan_of, BucketConfig};
/// use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
/// let specs = vec![
///     TensorSpec::new("model.layers.0.mlp.up_proj.weight", [256, 128], Parallel::Column),
///     TensorSpec::new("model.layers.0.mlp.up_proj.lora_A.weight", [4, 128], Parallel::Replicated),
/// ];
/// let train = FsdpLayout::new(1, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
/// let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(1, specs)?)?;
/// let all = build_fp8_plan(core.clone(), &train, BucketConfig::default(), Default::default())?;
/// let adapters = |n: &str| n.contains(".lora_");
/// let only = build_fp8_plan_of(core, &train, BucketConfig::default(), Default::default(), &adapters)?;
/// // the adapter where the whole plan puts it (the fp8 matrix after it); its 4 x 128 bf16 cast,
/// // the fp8 matrix not quantised again
/// let at = |p: &lifecycle_layout::fsdp::FsdpPlan| {
///     p.entries(0).iter().find(|e| adapters(e.name())).map(|e| e.offset())
/// };
/// assert_eq!((only.roll_len, at(&only)), (all.roll_len, at(&all)));
/// assert_eq!((only.cast_bytes(0), only.fp8[0].len(), all.fp8[0].len()), (4 * 128 * 2, 0, 1));
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
pub fn build_fp8_plan_of(
    core: ReshardPlan,
    train: &FsdpLayout,
    config: BucketConfig,
    keep: Fp8Keep,
    only: &dyn Fn(&str) -> bool,
) -> Result<FsdpPlan, LayoutError> {
    check_fp8_plan(&core, keep)?;
    let mut bf16 = core.clone();
    let mut quantised: Vec<Vec<TensorPlan>> = Vec::with_capacity(core.world);
    for rank in &mut bf16.ranks {
        let (keep, fp8): (Vec<TensorPlan>, Vec<TensorPlan>) = std::mem::take(&mut rank.tensors)
            .into_iter()
            .partition(|t| {
                let spec = &core.tensors[t.tensor];
                keep.keeps_bf16(&spec.name, &spec.shape)
            });
        rank.tensors = keep;
        quantised.push(fp8);
    }
    let mut plan = build_plan_of(bf16, train, config, only);
    let start = plan.roll_len;
    plan.fp8 = quantised
        .into_iter()
        .map(|tensors| {
            let mut off = start;
            let slices: Vec<Fp8Slice> = tensors
                .into_iter()
                .map(|t| {
                    let name = core.tensors[t.tensor].name.clone();
                    let entry = RolloutEntry::fp8(name, t.shape.clone(), off as usize);
                    off = align(off + entry.slots() as u64);
                    Fp8Slice { tensor: t, entry }
                })
                .collect();
            plan.roll_len = plan.roll_len.max(off);
            slices
                .into_iter()
                .filter(|s| only(s.entry.name()))
                .collect()
        })
        .collect();
    // At W > 1 the pieces that cross ranks move as e4m3 bytes: refused now, naming the tensor,
    // if a shard split would move an odd byte count (nothing has moved yet).
    if plan.core.world > 1 {
        for r in 0..plan.core.world {
            plan.rank_agree(r, 0, &mut Vec::new())?;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan_fsdp_to_tp, Parallel, RolloutLayout, TensorSpec};

    #[test]
    fn fp8_slices_follow_the_bf16_tensors_and_entries_keep_rollout_order() {
        let specs = vec![
            TensorSpec::new("model.embed_tokens.weight", [100, 256], Parallel::Column),
            TensorSpec::new(
                "model.layers.0.self_attn.q_proj.weight",
                [256, 256],
                Parallel::Column,
            ),
            TensorSpec::new(
                "model.layers.0.input_layernorm.weight",
                [256],
                Parallel::Replicated,
            ),
            TensorSpec::new(
                "model.layers.0.self_attn.o_proj.weight",
                [256, 300],
                Parallel::Row,
            ),
        ];
        let train =
            FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone()))).unwrap();
        let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(1, specs.clone()).unwrap()).unwrap();
        let plan =
            build_fp8_plan(core, &train, BucketConfig::default(), Fp8Keep::default()).unwrap();
        for r in 0..2 {
            let e = plan.entries(r);
            let names: Vec<&str> = e.iter().map(|e| e.name()).collect();
            let want: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names, want);
            assert_eq!(
                e.iter().map(|e| e.is_fp8()).collect::<Vec<_>>(),
                [false, true, false, true]
            );
            // no two entries overlap and all fit the buffer
            let mut ranges: Vec<_> = e.iter().map(|e| e.range()).collect();
            ranges.sort_by_key(|r| r.start);
            assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
            assert!(ranges.last().unwrap().end as u64 <= plan.roll_len);
            // the bucket plan moves only the bf16 tensors
            assert_eq!(plan.core.ranks[r].tensors.len(), 2);
            assert_eq!(plan.fp8[r].len(), 2);
        }
        // o_proj: 256 x 300 bytes, 2 x 3 blocks
        let o = &plan.fp8[0][1].entry;
        assert_eq!((o.blocks(), o.bytes()), ((2, 3), 256 * 300 + 24));
    }

    #[test]
    fn a_slice_that_cuts_a_block_is_refused_by_name() {
        let specs = vec![TensorSpec::new(
            "model.layers.0.mlp.up_proj.weight",
            [128, 64],
            Parallel::Column,
        )];
        let train =
            FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone()))).unwrap();
        let core = plan_fsdp_to_tp(&train, &RolloutLayout::new(2, specs).unwrap()).unwrap();
        let err = build_fp8_plan(core, &train, BucketConfig::default(), Fp8Keep::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("up_proj"), "{err}");
    }
}
