//! Bridging to unfused Hugging Face TP rollouts (the FSDP backends'): their layout and fusing.

use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};
use lifecycle_layout::{Parallel, TensorSpec};

use lifecycle_layout::megatron::RolloutKind;
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
            let get = |name: String| {
                r.tensor(&name)
                    .map(|x| x.data.as_slice())
                    .ok_or(MegatronError::MissingTensor { name })
            };
            let tensors = specs
                .iter()
                .map(|spec| {
                    let layer = |s: &str| hf::layer(spec.layer.unwrap_or_default(), s);
                    let data = match spec.kind {
                        RolloutKind::Qkv | RolloutKind::QkvBias => {
                            let (names, cols) = if spec.kind == RolloutKind::Qkv {
                                ([hf::Q, hf::K, hf::V], model.hidden)
                            } else {
                                ([hf::Q_BIAS, hf::K_BIAS, hf::V_BIAS], 1)
                            };
                            let mut v = get(layer(names[0]))?.to_vec();
                            for n in &names[1..] {
                                let kv = get(layer(n))?;
                                if model.query_groups < t {
                                    let g = tp_rank / (t / model.query_groups);
                                    v.extend_from_slice(&kv[g * hd * cols..(g + 1) * hd * cols]);
                                } else {
                                    v.extend_from_slice(kv);
                                }
                            }
                            v
                        }
                        RolloutKind::GateUp => {
                            let mut v = get(layer(hf::GATE))?.to_vec();
                            v.extend_from_slice(get(layer(hf::UP))?);
                            v
                        }
                        _ => get(spec.name.clone())?.to_vec(),
                    };
                    Ok(RolloutTensor {
                        name: spec.name.clone(),
                        shape: spec.shape.clone(),
                        data,
                        fp8: None,
                    })
                })
                .collect::<Result<Vec<_>, MegatronError>>()?;
            Ok(RankRollout { tensors })
        })
        .collect::<Result<Vec<_>, MegatronError>>()?;
    Ok(HostRollout { ranks })
}
