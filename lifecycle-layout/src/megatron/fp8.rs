//! An fp8 rollout of the fused layout: each quantised tensor in the rollout's own 128 × 128
//! block grid. A fused tensor (`qkv_proj` = `[q; k; v]`, `gate_up_proj` = `[gate; up]`) is
//! quantised whole, which gives the blocks and scales of its parts quantised apart, stacked
//! (what vLLM's fp8 loader builds from a checkpoint's per-part scales) when every part but the
//! last ends on a 128-row boundary; [`check_fused_fp8`] refuses the others, naming the tensor.
//! A stacked expert tensor (`w13` = `[e, 2F, H]`, `w2` = `[e, H, F]`) is quantised in its
//! `(e · rows) × cols` view: each expert's `[gate; up]` or `down` in blocks of its own (vLLM's
//! fused-MoE scales, `[e, rows / 128, cols / 128]`), when every part keeps whole blocks.

use crate::fp8::{Fp8Keep, FP8_BLOCK};
use crate::ModelSpec;

use super::{MegatronLayoutError, ParamKind, ParamSlot, RolloutKind, RolloutTensorSpec};

/// Whether training parameter `slot` feeds a tensor that an fp8 rollout quantises (`keep`
/// choosing the bf16 ones): the attention and MLP projections, shared and routed experts
/// included; never the embedding, the head, the router, the shared-expert gate, norms or
/// biases. The rule of [`Fp8Keep::keeps_bf16`] on the rollout names, read from the training side.
///
/// ```
/// use lifecycle_layout::megatron::{quantised_param, MegatronLayout, ParamKind};
/// use lifecycle_layout::ModelSpec;
/// let layout = MegatronLayout::from_world(ModelSpec::tiny(), 1, 1, 1)?;
/// let slots = layout.stage_slots(0);
/// let qkv = slots.iter().find(|s| s.kind == ParamKind::Qkv).unwrap();
/// let emb = slots.iter().find(|s| s.kind == ParamKind::WordEmbedding).unwrap();
/// assert!(quantised_param(qkv, Default::default()));
/// assert!(!quantised_param(emb, Default::default()));
/// assert!(!quantised_param(qkv, "attention".parse().unwrap()));
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
pub fn quantised_param(slot: &ParamSlot, keep: Fp8Keep) -> bool {
    if slot.layer.is_some_and(|l| keep.layers.contains(l)) {
        return false;
    }
    match slot.kind {
        ParamKind::Qkv | ParamKind::Proj => !keep.attention,
        ParamKind::Fc1
        | ParamKind::Fc2
        | ParamKind::SharedFc1
        | ParamKind::SharedFc2
        | ParamKind::ExpertFc1
        | ParamKind::ExpertFc2 => true,
        _ => false,
    }
}

/// The rows of each part of one rank's slice of `spec` (one part for an unfused tensor), in
/// order, at rollout degree `t`: for a stacked expert tensor, every expert's parts in turn.
///
/// ```
/// use lifecycle_layout::megatron::{fused_parts, RolloutKind};
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// let m = ModelSpec::tiny();
/// let specs = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4)).fused_tensors(&m)?;
/// let qkv = specs.iter().find(|s| s.kind == RolloutKind::Qkv).unwrap();
/// assert_eq!(fused_parts(qkv, &m, 2), vec![8, 2, 2]); // 4 q heads, 1 kv head, head_dim 2
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
pub fn fused_parts(spec: &RolloutTensorSpec, model: &ModelSpec, t: usize) -> Vec<usize> {
    let rows = spec.shape.first().copied().unwrap_or(0);
    match spec.kind {
        RolloutKind::Qkv => {
            let kv = super::train::local_kv_heads(model.query_groups, t) * model.head_dim;
            vec![rows.saturating_sub(2 * kv), kv, kv]
        }
        RolloutKind::GateUp | RolloutKind::SharedGateUp => vec![rows / 2, rows - rows / 2],
        RolloutKind::ExpertsW13 => {
            let f = spec.shape.get(1).copied().unwrap_or(0) / 2;
            vec![f; 2 * rows]
        }
        RolloutKind::ExpertsW2 => vec![spec.shape.get(1).copied().unwrap_or(0); rows],
        _ => vec![rows],
    }
}

/// Checks that an fp8 rollout of the fused `tensors` (one rank's specs at degree `t`; `keep`
/// choosing the bf16 ones) quantises each in its own block grid: a fused tensor whose part ends
/// inside a block is [`MegatronLayoutError::Fp8PartSplit`], a tensor that is neither a matrix
/// nor a stack of expert matrices [`MegatronLayoutError::Fp8NoBlockGrid`], both naming the
/// tensor, and a kept layer the model lacks
/// ([`LayoutError::Fp8KeepLayer`](crate::LayoutError::Fp8KeepLayer)), before anything moves.
pub fn check_fused_fp8(
    tensors: &[RolloutTensorSpec],
    model: &ModelSpec,
    t: usize,
    keep: Fp8Keep,
) -> Result<(), MegatronLayoutError> {
    keep.check_layers(tensors.iter().map(|t| t.name.as_str()))
        .map_err(|e| MegatronLayoutError::Layout(Box::new(e)))?;
    for spec in tensors {
        if keep.keeps_bf16(&spec.name, &spec.shape) {
            continue;
        }
        let stacked = matches!(spec.kind, RolloutKind::ExpertsW13 | RolloutKind::ExpertsW2);
        if spec.shape.len() != 2 && !(stacked && spec.shape.len() == 3) {
            return Err(MegatronLayoutError::Fp8NoBlockGrid {
                name: spec.name.clone(),
            });
        }
        let rows = fused_parts(spec, model, t);
        if let Some(part) = rows[..rows.len() - 1]
            .iter()
            .position(|r| !r.is_multiple_of(FP8_BLOCK))
        {
            return Err(MegatronLayoutError::Fp8PartSplit {
                name: spec.name.clone(),
                rows,
                part,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LayoutError, RolloutLayout, RolloutVocab};

    fn model(head_dim: usize, ffn: usize) -> ModelSpec {
        ModelSpec {
            hidden: 256,
            heads: 4,
            query_groups: 2,
            head_dim,
            ffn,
            vocab: 64,
            layers: 1,
            qkv_bias: false,
            tied_embeddings: false,
            make_vocab_size_divisible_by: 1,
            qk_norm: false,
            moe: None,
        }
    }

    #[test]
    fn parts_on_block_boundaries_pass_and_a_split_block_is_named() {
        let specs = |m: &ModelSpec, t| {
            RolloutLayout::fused(t, RolloutVocab::Unpadded)
                .fused_tensors(m)
                .unwrap()
        };
        // head_dim 128: q, k, v of 2 x 128 / 1 x 128 rows at T = 2; ffn 512: gate and up 256
        let good = model(128, 512);
        assert!(check_fused_fp8(&specs(&good, 2), &good, 2, Fp8Keep::default()).is_ok());
        // head_dim 64: k of 64 rows ends inside the first block
        let bad = model(64, 512);
        let err = check_fused_fp8(&specs(&bad, 2), &bad, 2, Fp8Keep::default()).unwrap_err();
        assert_eq!(
            err,
            MegatronLayoutError::Fp8PartSplit {
                name: "model.layers.0.self_attn.qkv_proj.weight".into(),
                rows: vec![128, 64, 64],
                part: 1
            }
        );
        assert!(err.to_string().contains("--fp8-keep"), "{err}");
        // ... unless attention stays bf16; then gate / up of 96 rows split a block
        let keep: Fp8Keep = "attention".parse().unwrap();
        let ffn = model(64, 192);
        let err = check_fused_fp8(&specs(&ffn, 2), &ffn, 2, keep).unwrap_err();
        assert!(
            matches!(&err, MegatronLayoutError::Fp8PartSplit { name, part: 0, .. } if name.ends_with("gate_up_proj.weight")),
            "{err}"
        );
        assert!(check_fused_fp8(&specs(&bad, 2), &bad, 2, keep).is_ok());
        // a kept layer the model lacks
        let keep: Fp8Keep = "layer:7".parse().unwrap();
        let err = check_fused_fp8(&specs(&good, 2), &good, 2, keep).unwrap_err();
        let MegatronLayoutError::Layout(inner) = &err else {
            panic!("expected the shared layout check, got {err}");
        };
        assert!(
            matches!(**inner, LayoutError::Fp8KeepLayer { layer: 7, .. }),
            "{err}"
        );
    }
}
