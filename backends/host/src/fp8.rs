//! fp8 rollout weights made in the switch on the CPU: the FSDP plan's pieces quantised to
//! block-scaled e4m3 ([`lifecycle_layout::fp8`]) from the fp32 masters, never from a bf16 copy.
//!
//! A block's rows may live on several FSDP ranks. The switch agrees each block's amax without
//! gathering the block: every source rank computes the partial amax of the rows it holds
//! ([`partial_amax`]), the partials are combined by max (4-byte messages between the block's
//! sources, counted by [`lifecycle_layout::fp8::fp8_rank_traffic`]), and each source then
//! quantises its own rows with the agreed scale, so only fp8 bytes cross the links. Max is exact
//! in any order, so the result is bit-identical to quantising the full tensor
//! ([`fp8_reference`]).

use half::bf16;
use lifecycle_layout::fp8::{block_scale_inv, e4m3_from_f32, Fp8Keep};
use lifecycle_layout::fp8::{quantize_blocks, BlockQuantized, FP8_BLOCK};
use lifecycle_layout::{plan_fsdp_to_tp, HostRollout, RankRollout, RolloutLayout, RolloutTensor};
use lifecycle_layout::{ReshardPlan, TensorPlan};

use crate::{HostError, HostTrainState};

/// The fp8 rollout of `state` in `layout`, made as the switch makes it: per destination block,
/// partial amaxes on the source ranks, combined, then every piece quantised by its source.
/// Non-finite masters and slices that cut a block are refused before anything is built.
///
/// ```
/// use lifecycle_host::fp8::{fp8_reference, fp8_switch};
/// use lifecycle_host::HostTrainState;
/// use lifecycle_layout::{HostTensor, Parallel, RolloutLayout, TensorSpec};
/// let specs = vec![TensorSpec::new("model.layers.0.mlp.up_proj.weight", [300, 256], Parallel::Column)];
/// let data = (0..300 * 256).map(|i| ((i * 7919) % 1000) as f32 / 977.0 - 0.5).collect();
/// let state = HostTrainState::from_tensors(3, vec![HostTensor::f32(specs[0].name.clone(), vec![300, 256], data)])?;
/// let layout = RolloutLayout::new(1, specs)?;
/// assert_eq!(fp8_switch(&state, &layout)?, fp8_reference(&state, &layout, Default::default())?);
/// # Ok::<(), lifecycle_host::HostError>(())
/// ```
pub fn fp8_switch(
    state: &HostTrainState,
    layout: &RolloutLayout,
) -> Result<HostRollout, HostError> {
    fp8_switch_with(state, layout, Fp8Keep::default())
}

/// [`fp8_switch`] keeping the tensors `keep` chooses in bf16.
pub fn fp8_switch_with(
    state: &HostTrainState,
    layout: &RolloutLayout,
    keep: Fp8Keep,
) -> Result<HostRollout, HostError> {
    let plan = plan_fsdp_to_tp(state.layout(), layout)?;
    state.check_finite()?;
    check_fp8_plan(&plan, keep)?;
    fp8_rollout(state, &plan, keep)
}

/// The plan-time fp8 checks of `plan` (`keep` choosing the bf16 tensors), as
/// [`lifecycle_layout::fp8::check_fp8_plan`] makes them: the layers `keep` names exist, and every
/// rank's slice of every quantised tensor starts and ends on 128 × 128 block boundaries.
pub fn check_fp8_plan(plan: &ReshardPlan, keep: Fp8Keep) -> Result<(), HostError> {
    Ok(lifecycle_layout::fp8::check_fp8_plan(plan, keep)?)
}

/// The fp8 rollout of `state` along a checked `plan` ([`check_fp8_plan`], finite masters), the
/// tensors `keep` chooses cast to bf16: the quantisation [`fp8_switch`] runs.
pub fn fp8_rollout(
    state: &HostTrainState,
    plan: &ReshardPlan,
    keep: Fp8Keep,
) -> Result<HostRollout, HostError> {
    let ranks = plan
        .ranks
        .iter()
        .map(|rp| {
            rp.tensors
                .iter()
                .map(|t| {
                    let spec = &plan.tensors[t.tensor];
                    if keep.keeps_bf16(&spec.name, &spec.shape) {
                        Ok(RolloutTensor::bf16(
                            spec.name.clone(),
                            t.shape.clone(),
                            bf16_slice(state, t),
                        ))
                    } else {
                        fp8_slice(state, t, &spec.name)
                    }
                })
                .collect::<Result<Vec<_>, HostError>>()
                .map(|tensors| RankRollout { tensors })
        })
        .collect::<Result<_, _>>()?;
    Ok(HostRollout { ranks })
}

/// Calls `f(row, col, value)` for every element of slice `t` that source rank `src` (every
/// source when `None`) holds, reading its fp32 master shard: what that rank reads in the switch.
fn each_held(
    state: &HostTrainState,
    t: &TensorPlan,
    src: Option<usize>,
    mut f: impl FnMut(usize, usize, f32),
) {
    let width = state.layout().tensors()[t.train_index]
        .1
        .iter()
        .skip(1)
        .product::<usize>();
    for piece in t
        .pieces
        .iter()
        .filter(|p| src.is_none_or(|s| p.src_rank == s))
    {
        let shard = &state.ranks()[piece.src_rank].shards[t.train_index];
        let values = shard.master.values();
        for row in piece.rows.clone() {
            let base = (row - shard.rows.start) * width;
            for col in piece.cols.clone() {
                f(row, col, values[base + col]);
            }
        }
    }
}

/// Blocks of a slice: row and column block counts.
fn slice_blocks(t: &TensorPlan) -> (usize, usize) {
    (
        t.rows.len().div_ceil(FP8_BLOCK),
        t.cols.len().div_ceil(FP8_BLOCK),
    )
}

/// The partial amax, per block of slice `t`, of the rows source rank `src` holds (0 for the
/// blocks it holds nothing of): what that rank contributes to the agreement.
pub fn partial_amax(state: &HostTrainState, t: &TensorPlan, src: usize) -> Vec<f32> {
    let (rb, cb) = slice_blocks(t);
    let mut amax = vec![0.0f32; rb * cb];
    each_held(state, t, Some(src), |row, col, v| {
        let b = block_of(t, cb, row, col);
        amax[b] = amax[b].max(v.abs());
    });
    amax
}

/// The index of the block of slice `t` (`cb` blocks per row) holding element (`row`, `col`) of
/// the full tensor.
fn block_of(t: &TensorPlan, cb: usize, row: usize, col: usize) -> usize {
    (row - t.rows.start) / FP8_BLOCK * cb + (col - t.cols.start) / FP8_BLOCK
}

fn fp8_slice(
    state: &HostTrainState,
    t: &TensorPlan,
    name: &str,
) -> Result<RolloutTensor, HostError> {
    let (_, cb) = slice_blocks(t);
    let mut sources: Vec<usize> = t.pieces.iter().map(|p| p.src_rank).collect();
    sources.sort_unstable();
    sources.dedup();
    // the agreement: every source's partials, combined by max
    let mut amax = vec![0.0f32; slice_blocks(t).0 * cb];
    for &src in &sources {
        for (a, p) in amax.iter_mut().zip(partial_amax(state, t, src)) {
            *a = a.max(p);
        }
    }
    let scale_inv: Vec<f32> = amax.into_iter().map(block_scale_inv).collect();
    // every source quantises its own rows with the agreed scales
    let mut data = vec![0u8; t.numel()];
    each_held(state, t, None, |row, col, v| {
        data[t.dst_offset(row, col)] = e4m3_from_f32(v / scale_inv[block_of(t, cb, row, col)]);
    });
    let q = BlockQuantized::from_parts(name, t.rows.len(), t.cols.len(), data, scale_inv)?;
    Ok(RolloutTensor::fp8(name, t.shape.clone(), q))
}

fn bf16_slice(state: &HostTrainState, t: &TensorPlan) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; t.numel()];
    each_held(state, t, None, |row, col, v| {
        out[t.dst_offset(row, col)] = bf16::from_f32(v);
    });
    out
}

/// The independent reference (`keep` choosing the bf16 tensors): every full fp32 tensor quantised whole
/// ([`quantize_blocks`]), then each rank's slice and its blocks cut out.
pub fn fp8_reference(
    state: &HostTrainState,
    layout: &RolloutLayout,
    keep: Fp8Keep,
) -> Result<HostRollout, HostError> {
    let plan = plan_fsdp_to_tp(state.layout(), layout)?;
    let ranks = plan
        .ranks
        .iter()
        .map(|rp| {
            rp.tensors
                .iter()
                .map(|t| {
                    let spec = &plan.tensors[t.tensor];
                    let full = state.full_master(&spec.name)?;
                    let (rows, cols) = (spec.rows(), spec.cols());
                    let cells = t
                        .rows
                        .clone()
                        .flat_map(|r| t.cols.clone().map(move |c| r * cols + c));
                    if keep.keeps_bf16(&spec.name, &spec.shape) {
                        return Ok(RolloutTensor::bf16(
                            spec.name.clone(),
                            t.shape.clone(),
                            cells.map(|i| bf16::from_f32(full[i])).collect(),
                        ));
                    }
                    let q = quantize_blocks(&spec.name, &full, rows, cols)?;
                    let bc_full = cols.div_ceil(FP8_BLOCK);
                    let rb0 = t.rows.start / FP8_BLOCK;
                    let cb0 = t.cols.start / FP8_BLOCK;
                    let (rb, cb) = slice_blocks(t);
                    let slice = BlockQuantized::from_parts(
                        &spec.name,
                        t.rows.len(),
                        t.cols.len(),
                        cells.map(|i| q.data()[i]).collect(),
                        (0..rb * cb)
                            .map(|b| q.scale_inv()[(rb0 + b / cb) * bc_full + cb0 + b % cb])
                            .collect(),
                    )?;
                    Ok(RolloutTensor::fp8(
                        spec.name.clone(),
                        t.shape.clone(),
                        slice,
                    ))
                })
                .collect::<Result<Vec<_>, HostError>>()
                .map(|tensors| RankRollout { tensors })
        })
        .collect::<Result<_, _>>()?;
    Ok(HostRollout { ranks })
}
