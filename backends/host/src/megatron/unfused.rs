//! Bridging to unfused Hugging Face TP rollouts (the FSDP backends'): their layout and fusing.

use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};
use lifecycle_layout::{Parallel, TensorSpec};

use lifecycle_layout::fp8::BlockQuantized;
use lifecycle_layout::megatron::{RolloutKind, RolloutTensorSpec};
use lifecycle_layout::{hf, ModelSpec};
use lifecycle_layout::{RolloutLayout, RolloutVocab};
use lifecycle_state::megatron::MegatronError;

/// The unfused rollout layout of degree `t` for the core planner ([`lifecycle_layout`]):
/// Hugging Face names with their usual splits ([`Parallel::for_hf_name`]), except that k and v
/// (weights and biases) are replicated when the query groups are fewer than `t`.
pub fn unfused_rollout_specs(model: &ModelSpec, t: usize) -> Vec<TensorSpec> {
    model
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let kv = [hf::K, hf::V, hf::K_BIAS, hf::V_BIAS]
                .iter()
                .any(|s| name.ends_with(s));
            let parallel = if kv && model.query_groups < t {
                Parallel::Replicated
            } else {
                Parallel::for_hf_name(&name)
            };
            TensorSpec::new(name, shape, parallel)
        })
        .collect()
}

/// Fuses an unfused rollout of degree `t` laid out by [`unfused_rollout_specs`] into this
/// crate's fused layout (unpadded vocabulary): `qkv_proj` = `[q; k; v]` of each rank (picking
/// the rank's kv head from replicated k / v), `gate_up_proj` = `[gate; up]`, the rest by name.
/// An fp8 rollout's parts are stacked by rows ([`BlockQuantized::stack_rows`]: what quantising
/// the fused tensor whole gives when its parts keep whole blocks); parts that do not are
/// [`MegatronError::Inconsistent`], naming the tensor.
pub fn fuse_unfused_rollout(
    model: &ModelSpec,
    unfused: &HostRollout,
    t: usize,
) -> Result<HostRollout, MegatronError> {
    let specs = RolloutLayout::fused(t, RolloutVocab::Unpadded).fused_tensors(model)?;
    let hd = model.head_dim;
    let ranks = unfused
        .ranks
        .iter()
        .enumerate()
        .map(|(rank, r)| {
            let tp_rank = rank % t;
            let get = |name: String| r.tensor(&name).ok_or(MegatronError::MissingTensor { name });
            let tensors = specs
                .iter()
                .map(|spec| {
                    let layer = |s: &str| hf::layer(spec.layer.unwrap_or_default(), s);
                    // (tensor, rows of it) per part
                    let parts: Vec<(&RolloutTensor, Option<std::ops::Range<usize>>)> =
                        match spec.kind {
                            RolloutKind::Qkv | RolloutKind::QkvBias => {
                                let names = if spec.kind == RolloutKind::Qkv {
                                    [hf::Q, hf::K, hf::V]
                                } else {
                                    [hf::Q_BIAS, hf::K_BIAS, hf::V_BIAS]
                                };
                                let mut p = vec![(get(layer(names[0]))?, None)];
                                for n in &names[1..] {
                                    let kv = get(layer(n))?;
                                    let rows = (model.query_groups < t).then(|| {
                                        let g = tp_rank / (t / model.query_groups);
                                        g * hd..(g + 1) * hd
                                    });
                                    p.push((kv, rows));
                                }
                                p
                            }
                            RolloutKind::GateUp => {
                                vec![(get(layer(hf::GATE))?, None), (get(layer(hf::UP))?, None)]
                            }
                            _ => vec![(get(spec.name.clone())?, None)],
                        };
                    fuse_parts(spec, &parts)
                })
                .collect::<Result<Vec<_>, MegatronError>>()?;
            Ok(RankRollout { tensors })
        })
        .collect::<Result<Vec<_>, MegatronError>>()?;
    Ok(HostRollout { ranks })
}

/// One fused tensor from its parts (all rows of each, or the rows given), bf16 or fp8.
fn fuse_parts(
    spec: &RolloutTensorSpec,
    parts: &[(&RolloutTensor, Option<std::ops::Range<usize>>)],
) -> Result<RolloutTensor, MegatronError> {
    let bad = |what: &str| MegatronError::Inconsistent {
        what: format!("fusing `{}`: {what}", spec.name),
    };
    if parts.iter().all(|(p, _)| p.fp8.is_some()) {
        let blocks = parts
            .iter()
            .map(|(p, rows)| {
                let q = p.fp8.as_ref().ok_or_else(|| bad("a part is not fp8"))?;
                match rows {
                    Some(r) => q
                        .block_rows(r.clone())
                        .ok_or_else(|| bad("a kv head's rows cut an fp8 block")),
                    None => Ok(q.clone()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fp8 = BlockQuantized::stack_rows(&blocks)
            .ok_or_else(|| bad("a part ends inside an fp8 block"))?;
        return Ok(RolloutTensor {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            data: Vec::new(),
            fp8: Some(fp8),
        });
    }
    let mut data = Vec::new();
    for (p, rows) in parts {
        if p.fp8.is_some() {
            return Err(bad("fp8 and bf16 parts"));
        }
        match rows {
            Some(r) => {
                let cols = p.data.len() / p.shape.first().copied().unwrap_or(1).max(1);
                data.extend_from_slice(&p.data[r.start * cols..r.end * cols]);
            }
            None => data.extend_from_slice(&p.data),
        }
    }
    Ok(RolloutTensor {
        name: spec.name.clone(),
        shape: spec.shape.clone(),
        data,
        fp8: None,
    })
}
