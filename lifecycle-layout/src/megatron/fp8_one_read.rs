//! An fp8 rollout written in one read of the parameters: where every rank holds every quantised
//! slice it builds (no byte crosses a link, as with PP = 1 and T a multiple of TP), each 128-row
//! block of the rollout comes from one run of rows of a parameter (rows of a row-parallel slice
//! `src_ld` apart, the parameter's width), so the
//! rank quantises straight from its bf16 parameter buffer into its rollout buffer, in the
//! tensor's own block grid, and copies the bf16 tensors there: no staging buffer, each byte read
//! once and written once. The bytes are those of the staged pass ([`Fp8Rollout`]): the same
//! values quantised in the same 128 × 128 blocks.
//!
//! [`fp8_one_read`] says when a plan allows it and builds it; the staged pass stays for the
//! other plans (rows gathered from several ranks, or runs that split a block).

use crate::fp8::FP8_BLOCK;
use crate::steps::Quantise;

use super::{Fp8Rollout, MegatronPlan, Transfer};

/// How every rank writes its fp8 rollout buffer from its own parameters (see the module docs).
/// Built by [`fp8_one_read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8OneRead {
    /// The plan of the bf16 tensors alone: the plan's transfers of the tensors the fp8 rollout
    /// keeps in bf16 (buckets cut again), written at [`Fp8OneRead::offsets`].
    pub plan: MegatronPlan,
    /// Every tensor's slot in the fp8 rollout buffer (its entry's offset), for the schedules
    /// of [`Fp8OneRead::plan`].
    pub offsets: Vec<usize>,
    /// Per rank (in plan order), the regions of its bf16 parameter buffer it quantises into its
    /// rollout buffer: `src_off` an element of the parameters, runs that continue one another
    /// merged.
    pub quantise: Vec<Vec<Quantise>>,
    /// Slot ranges of every rank's rollout buffer to zero first ([`Fp8Rollout::gaps`]): with
    /// them, the copies and the quantisations, every slot is written.
    pub zero: Vec<std::ops::Range<usize>>,
}

/// The one-read form of `f`, the fp8 rollout of `plan`, or `None` when a rank's quantised rows
/// are not all its own or a run of them starts or ends inside a 128-row block (then only the
/// staged pass builds the rollout). Pure.
///
/// ```
/// use lifecycle_layout::megatron::schedule::rollout_offsets;
/// use lifecycle_layout::megatron::*;
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// let model = ModelSpec { head_dim: 128, hidden: 256, heads: 2, query_groups: 1, ffn: 256, ..ModelSpec::tiny() };
/// let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
/// let plan = plan_megatron_to_tp(&MegatronLayout::from_world(model, 1, 1, 1)?, &rollout, BucketConfig::default())?;
/// let (offsets, _) = rollout_offsets(&plan);
/// let f = fp8_rollout(&plan.tensors, &offsets, Default::default());
/// let one = fp8_one_read(&plan, &f).expect("one rank holds every row");
/// // every quantised element read once from the parameters
/// let read: u64 = one.quantise[0].iter().map(|q| q.rows * q.cols).sum();
/// assert_eq!(read, f.quantise.iter().map(|q| q.rows * q.cols).sum::<u64>());
/// # Ok::<(), MegatronLayoutError>(())
/// ```
pub fn fp8_one_read(plan: &MegatronPlan, f: &Fp8Rollout) -> Option<Fp8OneRead> {
    if plan.remote_bytes() > 0 || f.entries.len() != plan.tensors.len() {
        return None;
    }
    // the quantisation of each quantised tensor, by tensor index
    let mut regions: Vec<Option<&Quantise>> = vec![None; plan.tensors.len()];
    let mut q = f.quantise.iter();
    for (i, e) in f.entries.iter().enumerate() {
        if e.is_fp8() {
            regions[i] = Some(q.next()?);
        }
    }
    let mut quantise = Vec::with_capacity(plan.ranks.len());
    let mut kept_plan = plan.clone();
    for (rp, kept) in plan.ranks.iter().zip(kept_plan.ranks.iter_mut()) {
        let mut mine: Vec<Quantise> = Vec::new();
        let mut transfers = Vec::new();
        let mut buckets = Vec::new();
        for b in &rp.buckets {
            let start = transfers.len();
            for x in &rp.transfers[b.clone()] {
                match regions.get(x.tensor).copied().flatten() {
                    None => transfers.push(*x),
                    Some(whole) => push_merged(&mut mine, rows_of(x, whole)?),
                }
            }
            if transfers.len() > start {
                buckets.push(start..transfers.len());
            }
        }
        kept.transfers = transfers;
        kept.buckets = buckets;
        quantise.push(mine);
    }
    Some(Fp8OneRead {
        plan: kept_plan,
        offsets: f.entries.iter().map(|e| e.offset()).collect(),
        quantise,
        zero: f.gaps(),
    })
}

/// The rows of quantised tensor `whole` (its region in the rollout) that transfer `x` writes,
/// as a region of the parameters (their row pitch the source's: a row-parallel slice of a
/// wider parameter reads every other run of columns), when they are whole rows of the slice
/// starting on a block row and ending on one or at the tensor's end.
fn rows_of(x: &Transfer, whole: &Quantise) -> Option<Quantise> {
    let cols = whole.cols as usize;
    let dense = x.rows == 1 || (x.src_pitch == x.cols && x.dst_pitch == x.cols);
    let n = x.rows * x.cols;
    let (rows, src_ld) = if dense {
        (n.is_multiple_of(cols).then_some(n / cols)?, cols)
    } else {
        let whole_rows = x.cols == cols && x.dst_pitch == cols && x.src_pitch >= cols;
        whole_rows.then_some((x.rows, x.src_pitch))?
    };
    if !x.dst_offset.is_multiple_of(cols) {
        return None;
    }
    let row0 = x.dst_offset / cols;
    let ends_well = rows.is_multiple_of(FP8_BLOCK) || row0 + rows == whole.rows as usize;
    if !row0.is_multiple_of(FP8_BLOCK) || !ends_well || row0 + rows > whole.rows as usize {
        return None;
    }
    let block_cols = cols.div_ceil(FP8_BLOCK) as u64;
    Some(Quantise {
        src_off: x.src_offset as u64,
        dst_byte: whole.dst_byte + (row0 * cols) as u64,
        scale: whole.scale + (row0 / FP8_BLOCK) as u64 * block_cols,
        rows: rows as u64,
        cols: whole.cols,
        src_ld: src_ld as u64,
    })
}

/// Appends `q`, merged into the previous region when it continues it in the parameters, the
/// bytes and the scales (the previous one ending on a block row).
fn push_merged(out: &mut Vec<Quantise>, q: Quantise) {
    if let Some(p) = out.last_mut() {
        let b = FP8_BLOCK as u64;
        let continues = p.cols == q.cols
            && p.src_ld == q.src_ld
            && p.rows.is_multiple_of(b)
            && p.src_off + p.rows * p.src_ld == q.src_off
            && p.dst_byte + p.rows * p.cols == q.dst_byte
            && p.scale + p.blocks() == q.scale;
        if continues {
            p.rows += q.rows;
            return;
        }
    }
    out.push(q);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::Fp8Keep;
    use crate::megatron::schedule::rollout_offsets;
    use crate::megatron::{fp8_rollout, plan_megatron_to_tp, BucketConfig, MegatronLayout};
    use crate::{ModelSpec, RolloutLayout, RolloutVocab};

    /// The fp8 pass's test model; its shared expert widened to 256 so that its `[gate; up]`
    /// parts keep whole blocks at T = 2 from TP = 1 (a split would be refused by name).
    fn model(moe: bool) -> ModelSpec {
        let m = crate::megatron::fp8_rollout::tests::moe_model();
        let wide = m.moe.map(|e| crate::MoeSpec {
            shared_ffn: 256,
            ..e
        });
        ModelSpec {
            moe: if moe { wide } else { None },
            ..m
        }
    }

    /// Every quantised element of the rollout is written by exactly one region, each region
    /// lying in its tensor's rows, and the kept plan moves exactly the bf16 tensors.
    #[test]
    fn regions_cover_the_quantised_rows_once() {
        for moe in [false, true] {
            // (TP, DP) -> T with every row local
            for (tp, dp, t) in [(1, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2), (2, 2, 2)] {
                let train = MegatronLayout::from_world(model(moe), tp * dp, tp, 1).unwrap();
                let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded);
                let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
                let (offsets, _) = rollout_offsets(&plan);
                let f = fp8_rollout(&plan.tensors, &offsets, Fp8Keep::default());
                let label = format!("moe {moe} TP{tp} DP{dp} T{t}");
                let one = fp8_one_read(&plan, &f).unwrap_or_else(|| panic!("{label}: local"));
                for (r, regions) in one.quantise.iter().enumerate() {
                    let mut written = vec![0u8; 2 * f.len];
                    for q in regions {
                        for b in q.dst_byte..q.dst_byte + q.rows * q.cols {
                            written[b as usize] += 1;
                        }
                    }
                    for q in &f.quantise {
                        let bytes =
                            &written[q.dst_byte as usize..(q.dst_byte + q.rows * q.cols) as usize];
                        assert!(bytes.iter().all(|&n| n == 1), "{label} rank {r}");
                    }
                    // a row-parallel slice of a wider parameter: its pitch, the parameter's
                    assert!(regions.iter().all(|q| q.src_ld >= q.cols), "{label}");
                    let pitched = regions.iter().any(|q| q.src_ld > q.cols);
                    assert_eq!(pitched, tp < t, "{label}: o_proj, down_proj slices");
                    let total: u64 = regions.iter().map(|q| q.rows * q.cols).sum();
                    let want: u64 = f.quantise.iter().map(|q| q.rows * q.cols).sum();
                    assert_eq!(total, want, "{label} rank {r}");
                    assert!(regions.len() <= 3 * f.quantise.len() * 8, "{label}: merged");
                    // the kept tensors' copies, the quantisations and the gaps write every slot
                    let mut slots = vec![0u8; f.len];
                    for c in &f.copies {
                        slots[c.dst..c.dst + c.len].iter_mut().for_each(|n| *n += 1);
                    }
                    for q in regions {
                        let (b, n) = (q.dst_byte as usize, (q.rows * q.cols) as usize);
                        let s = 2 * q.scale as usize;
                        let scales = s..s + 2 * q.blocks() as usize;
                        for i in (b / 2..(b + n).div_ceil(2)).chain(scales) {
                            slots[i] += 1;
                        }
                    }
                    for z in &one.zero {
                        slots[z.clone()].iter_mut().for_each(|n| *n += 1);
                    }
                    assert!(slots.iter().all(|&n| n >= 1), "{label}: a slot unwritten");
                    let kept: usize = one.plan.ranks[r].transfers.iter().map(|x| x.numel()).sum();
                    let want: usize = f.copies.iter().map(|c| c.len).sum();
                    assert_eq!(kept, want, "{label} rank {r}");
                }
            }
        }
    }

    #[test]
    fn rows_gathered_from_peers_or_split_blocks_take_the_staged_pass() {
        // T = 1 from TP = 2: half of every tensor lives on the other rank
        let train = MegatronLayout::from_world(model(false), 2, 2, 1).unwrap();
        let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        let (offsets, _) = rollout_offsets(&plan);
        let f = fp8_rollout(&plan.tensors, &offsets, Fp8Keep::default());
        assert!(fp8_one_read(&plan, &f).is_none());
        // head_dim 64: group 0's k head is 64 rows of qkv starting on a block row, ending
        // inside the block its v head starts (a run of its own in Megatron's interleaved rows)
        let small = ModelSpec {
            head_dim: 64,
            heads: 8,
            ..model(false)
        };
        let train = MegatronLayout::from_world(small, 1, 1, 1).unwrap();
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        let (offsets, _) = rollout_offsets(&plan);
        let f = fp8_rollout(&plan.tensors, &offsets, Fp8Keep::default());
        assert!(fp8_one_read(&plan, &f).is_none());
    }
}
