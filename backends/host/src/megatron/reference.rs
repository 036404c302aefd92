//! The reference the executor is checked against, independent of the planner: rebuild every full
//! Hugging Face tensor from the Megatron shards, then cut each rollout rank's fused slices
//! directly from the full tensors.

use std::collections::HashMap;

use half::bf16;
use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};

use lifecycle_layout::megatron::{
    qkv_head_row, ExpertCoords, ExpertPart, ExpertShare, MegatronLayout, ParamKind, QkvHead,
    RolloutKind,
};
use lifecycle_layout::RolloutLayout;
use lifecycle_layout::{hf, ModelSpec};
use lifecycle_state::megatron::MegatronError;
use lifecycle_state::megatron::MegatronTrainState;

/// A full Hugging Face tensor in bf16.
#[derive(Debug, Clone, PartialEq)]
pub struct FullTensor {
    /// Hugging Face name.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<bf16>,
}

/// Rebuilds every Hugging Face tensor (checkpoint order) from the bf16 parameters of DP rank 0:
/// picks the stage owning each layer, concatenates TP shards (rows for column-parallel, columns
/// for row-parallel), un-fuses `linear_qkv` per query group and `linear_fc1` into gate and up,
/// drops vocabulary padding; reads each expert from expert data-parallel rank 0 of the
/// expert-parallel rank owning it, its ETP shards concatenated. Works on offloaded state too.
///
/// ```
/// use lifecycle_layout::HostTensor;
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::ModelSpec;
/// use lifecycle_host::megatron::{rebuild_hf_tensors, MegatronTrainState};
/// let model = ModelSpec::tiny();
/// let tensors: Vec<HostTensor> = model.hf_tensors().into_iter().map(|(name, shape)| {
///     let n = shape.iter().product();
///     HostTensor::f32(name, shape, (0..n).map(|i| i as f32).collect())
/// }).collect();
/// let state = MegatronTrainState::from_hf(MegatronLayout::new(model, 4, 2, 1)?, tensors)?;
/// let full = rebuild_hf_tensors(&state)?;
/// let k = full.iter().find(|t| t.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
/// assert_eq!(k.data[5].to_f32(), 5.0);
/// # Ok::<(), lifecycle_host::megatron::MegatronError>(())
/// ```
pub fn rebuild_hf_tensors(state: &MegatronTrainState) -> Result<Vec<FullTensor>, MegatronError> {
    let l = state.layout();
    let m = *l.model();
    let buffer = |stage: usize, tp: usize| -> Result<&[bf16], MegatronError> {
        state
            .params_anywhere(l.rank(tp, 0, stage))
            .ok_or_else(|| MegatronError::Inconsistent {
                what: format!("no rank for stage {stage}, TP rank {tp}"),
            })
    };
    let part = |stage: usize, tp: usize, kind: ParamKind, layer: Option<usize>| {
        let slot = l
            .slot(stage, kind, layer)
            .ok_or_else(|| MegatronError::Inconsistent {
                what: format!("no {kind:?} parameter (layer {layer:?}) on stage {stage}"),
            })?;
        Ok::<_, MegatronError>(&buffer(stage, tp)?[slot.offset..slot.offset + slot.numel()])
    };
    let mut out = Vec::new();
    for (name, shape) in m.hf_tensors() {
        let data = match hf::parse_expert(&name) {
            Some((layer, e)) => rebuild_expert(state, &name, layer, e)?,
            None => rebuild_one(l, &m, &name, &part)?,
        };
        out.push(FullTensor { name, shape, data });
    }
    Ok(out)
}

/// One per-expert Hugging Face tensor from the grouped-GEMM tensors of its expert-parallel rank.
fn rebuild_expert(
    state: &MegatronTrainState,
    name: &str,
    layer: usize,
    e: usize,
) -> Result<Vec<bf16>, MegatronError> {
    let l = state.layout();
    let m = l.model();
    let missing = || MegatronError::Inconsistent {
        what: format!("no expert layout holds `{name}`"),
    };
    let (Some(ex), Some(moe)) = (l.expert_parallel(), m.moe) else {
        return Err(missing());
    };
    let per_ep = moe.experts / ex.ep();
    let (ep, local) = (e / per_ep, e % per_ep);
    let is_down = name.ends_with(hf::EXPERT_DOWN);
    let part = if is_down {
        ExpertPart::Fc2
    } else {
        ExpertPart::Fc1
    };
    let slot = l.expert_slot(layer, local, part).ok_or_else(missing)?;
    let pp = l.stage_of_layer(layer);
    let shards: Vec<&[bf16]> = (0..ex.etp())
        .map(|etp| {
            let rank = ex.rank(ExpertCoords {
                etp,
                ep,
                edp: 0,
                pp,
            });
            let buf = state.params_anywhere(rank).ok_or_else(missing)?;
            Ok(&buf[slot.offset..slot.offset + slot.numel()])
        })
        .collect::<Result<_, MegatronError>>()?;
    let h = m.hidden;
    let per = moe.ffn / ex.etp();
    Ok(if is_down {
        (0..h)
            .flat_map(|r| shards.iter().flat_map(move |s| &s[r * per..(r + 1) * per]))
            .copied()
            .collect()
    } else {
        let up = name.ends_with(hf::EXPERT_UP);
        shards
            .iter()
            .flat_map(|s| {
                let half = s.len() / 2;
                if up {
                    &s[half..]
                } else {
                    &s[..half]
                }
            })
            .copied()
            .collect()
    })
}

type PartFn<'a> =
    dyn Fn(usize, usize, ParamKind, Option<usize>) -> Result<&'a [bf16], MegatronError> + 'a;

fn rebuild_one<'a>(
    l: &MegatronLayout,
    m: &ModelSpec,
    name: &str,
    part: &PartFn<'a>,
) -> Result<Vec<bf16>, MegatronError> {
    let (tp, last) = (l.tp(), l.pp() - 1);
    let h = m.hidden;
    if name == hf::EMBED || name == hf::LM_HEAD {
        let (stage, kind) = if name == hf::EMBED {
            (0, ParamKind::WordEmbedding)
        } else {
            (last, ParamKind::OutputLayer)
        };
        let mut v = Vec::new();
        for t in 0..tp {
            v.extend_from_slice(part(stage, t, kind, None)?);
        }
        v.truncate(m.vocab * h);
        return Ok(v);
    }
    if name == hf::NORM {
        return Ok(part(last, 0, ParamKind::FinalNorm, None)?.to_vec());
    }
    let rest = name.strip_prefix("model.layers.").unwrap_or_default();
    let (idx, suffix) = rest.split_once('.').unwrap_or_default();
    let layer: usize = idx.parse().map_err(|_| MegatronError::UnexpectedTensor {
        name: name.to_string(),
    })?;
    let stage = l.stage_of_layer(layer);
    let get = |t: usize, kind| part(stage, t, kind, Some(layer));
    let hd = m.head_dim;
    let v = match suffix {
        hf::INPUT_NORM => get(0, ParamKind::InputNorm)?.to_vec(),
        hf::POST_NORM => get(0, ParamKind::PreMlpNorm)?.to_vec(),
        hf::ROUTER => get(0, ParamKind::Router)?.to_vec(),
        hf::SHARED_EXPERT_GATE => get(0, ParamKind::SharedGate)?.to_vec(),
        hf::Q_NORM => get(0, ParamKind::QNorm)?.to_vec(),
        hf::K_NORM => get(0, ParamKind::KNorm)?.to_vec(),
        hf::Q | hf::K | hf::V | hf::Q_BIAS | hf::K_BIAS | hf::V_BIAS => {
            let bias = suffix.ends_with("bias");
            let (kind, cols) = if bias {
                (ParamKind::QkvBias, 1)
            } else {
                (ParamKind::Qkv, h)
            };
            let head = hd * cols;
            // The TP chunks concatenated are the full fused tensor: per query group its q
            // heads, its k head, its v head.
            let mut fused = Vec::new();
            for t in 0..tp {
                fused.extend_from_slice(get(t, kind)?);
            }
            let heads: Vec<QkvHead> = if suffix.starts_with("self_attn.q_proj") {
                (0..m.heads).map(QkvHead::Q).collect()
            } else if suffix.starts_with("self_attn.k_proj") {
                (0..m.query_groups).map(QkvHead::K).collect()
            } else {
                (0..m.query_groups).map(QkvHead::V).collect()
            };
            let mut v = Vec::with_capacity(heads.len() * head);
            for h in heads {
                let at = qkv_head_row(m, h) * head;
                v.extend_from_slice(&fused[at..at + head]);
            }
            v
        }
        hf::O | hf::DOWN | hf::SHARED_DOWN => {
            let kind = match suffix {
                hf::O => ParamKind::Proj,
                hf::DOWN => ParamKind::Fc2,
                _ => ParamKind::SharedFc2,
            };
            let parts: Vec<&[bf16]> = (0..tp).map(|t| get(t, kind)).collect::<Result<_, _>>()?;
            let per = parts[0].len() / h;
            (0..h)
                .flat_map(|r| parts.iter().flat_map(move |p| &p[r * per..(r + 1) * per]))
                .copied()
                .collect()
        }
        hf::GATE | hf::UP | hf::SHARED_GATE | hf::SHARED_UP => {
            let kind = if suffix == hf::GATE || suffix == hf::UP {
                ParamKind::Fc1
            } else {
                ParamKind::SharedFc1
            };
            let mut v = Vec::new();
            for t in 0..tp {
                let w = get(t, kind)?;
                let half = w.len() / 2;
                v.extend_from_slice(if suffix == hf::GATE || suffix == hf::SHARED_GATE {
                    &w[..half]
                } else {
                    &w[half..]
                });
            }
            v
        }
        _ => {
            return Err(MegatronError::UnexpectedTensor {
                name: name.to_string(),
            })
        }
    };
    Ok(v)
}

/// The rollout weights built the direct way: rebuild the full tensors ([`rebuild_hf_tensors`]),
/// then cut rank `r`'s fused slices (TP rank `r mod T`) from them. Independent of the planner.
pub fn reference_rollout(
    state: &MegatronTrainState,
    rollout: &RolloutLayout,
) -> Result<HostRollout, MegatronError> {
    let m = *state.layout().model();
    rollout.check_world(state.world())?;
    let specs = rollout.fused_tensors(&m)?;
    let vocab_rows = rollout.vocab_rows(&m)?;
    let full: HashMap<String, Vec<bf16>> = rebuild_hf_tensors(state)?
        .into_iter()
        .map(|t| (t.name, t.data))
        .collect();
    let get = |name: &str| full.get(name).map_or(&[][..], Vec::as_slice);
    let t_deg = rollout.tp();
    let h = m.hidden;
    let hd = m.head_dim;
    let shared_ffn = m.moe.map_or(0, |moe| moe.shared_ffn);
    let shares: Vec<ExpertShare> = (0..t_deg)
        .map(|t| {
            rollout.expert_share(&m, t).unwrap_or(ExpertShare {
                experts: 0..0,
                ffn: 0..0,
            })
        })
        .collect();
    let ranks = (0..state.world())
        .map(|rank| {
            let t = rank % t_deg;
            let tensors = specs
                .iter()
                .map(|spec| {
                    let layer = |s: &str| hf::layer(spec.layer.unwrap_or_default(), s);
                    let rows = |src: &[bf16], cols: usize, r: std::ops::Range<usize>| {
                        src[r.start * cols..r.end * cols].to_vec()
                    };
                    let columns = |src: &[bf16], width: usize, c: std::ops::Range<usize>| {
                        (0..h)
                            .flat_map(|r| src[r * width + c.start..r * width + c.end].to_vec())
                            .collect::<Vec<bf16>>()
                    };
                    let data: Vec<bf16> = match spec.kind {
                        RolloutKind::Embedding | RolloutKind::LmHead => {
                            let src = get(if spec.kind == RolloutKind::Embedding {
                                hf::EMBED
                            } else {
                                hf::LM_HEAD
                            });
                            let per = vocab_rows / t_deg;
                            let mut v = vec![bf16::ZERO; per * h];
                            let real = (t * per).min(m.vocab)..((t + 1) * per).min(m.vocab);
                            v[..real.len() * h].copy_from_slice(&rows(src, h, real));
                            v
                        }
                        RolloutKind::InputNorm => get(&layer(hf::INPUT_NORM)).to_vec(),
                        RolloutKind::PostNorm => get(&layer(hf::POST_NORM)).to_vec(),
                        RolloutKind::Norm => get(hf::NORM).to_vec(),
                        RolloutKind::QNorm => get(&layer(hf::Q_NORM)).to_vec(),
                        RolloutKind::KNorm => get(&layer(hf::K_NORM)).to_vec(),
                        RolloutKind::Qkv | RolloutKind::QkvBias => {
                            let (names, cols) = if spec.kind == RolloutKind::Qkv {
                                ([hf::Q, hf::K, hf::V], h)
                            } else {
                                ([hf::Q_BIAS, hf::K_BIAS, hf::V_BIAS], 1)
                            };
                            let q_per = m.q_rows() / t_deg;
                            let kv = if m.query_groups >= t_deg {
                                let per = m.kv_rows() / t_deg;
                                t * per..(t + 1) * per
                            } else {
                                let g = t / (t_deg / m.query_groups);
                                g * hd..(g + 1) * hd
                            };
                            let mut v =
                                rows(get(&layer(names[0])), cols, t * q_per..(t + 1) * q_per);
                            v.extend(rows(get(&layer(names[1])), cols, kv.clone()));
                            v.extend(rows(get(&layer(names[2])), cols, kv));
                            v
                        }
                        RolloutKind::O => {
                            let per = m.q_rows() / t_deg;
                            columns(get(&layer(hf::O)), m.q_rows(), t * per..(t + 1) * per)
                        }
                        RolloutKind::Down => {
                            let per = m.ffn / t_deg;
                            columns(get(&layer(hf::DOWN)), m.ffn, t * per..(t + 1) * per)
                        }
                        RolloutKind::GateUp => {
                            let per = m.ffn / t_deg;
                            let mut v = rows(get(&layer(hf::GATE)), h, t * per..(t + 1) * per);
                            v.extend(rows(get(&layer(hf::UP)), h, t * per..(t + 1) * per));
                            v
                        }
                        RolloutKind::Router => get(&layer(hf::ROUTER)).to_vec(),
                        RolloutKind::SharedGate => get(&layer(hf::SHARED_EXPERT_GATE)).to_vec(),
                        RolloutKind::SharedGateUp => {
                            let per = shared_ffn / t_deg;
                            let r = t * per..(t + 1) * per;
                            let mut v = rows(get(&layer(hf::SHARED_GATE)), h, r.clone());
                            v.extend(rows(get(&layer(hf::SHARED_UP)), h, r));
                            v
                        }
                        RolloutKind::SharedDown => {
                            let per = shared_ffn / t_deg;
                            columns(
                                get(&layer(hf::SHARED_DOWN)),
                                shared_ffn,
                                t * per..(t + 1) * per,
                            )
                        }
                        RolloutKind::ExpertsW13 | RolloutKind::ExpertsW2 => {
                            let (l, share) = (spec.layer.unwrap_or_default(), shares[t].clone());
                            let mut v = Vec::with_capacity(spec.numel());
                            for e in share.experts {
                                let expert = |s: &str| get(&hf::expert(l, e, s));
                                if spec.kind == RolloutKind::ExpertsW13 {
                                    v.extend(rows(expert(hf::EXPERT_GATE), h, share.ffn.clone()));
                                    v.extend(rows(expert(hf::EXPERT_UP), h, share.ffn.clone()));
                                } else {
                                    let width = m.moe.map_or(0, |moe| moe.ffn);
                                    v.extend(columns(
                                        expert(hf::EXPERT_DOWN),
                                        width,
                                        share.ffn.clone(),
                                    ));
                                }
                            }
                            v
                        }
                    };
                    RolloutTensor {
                        name: spec.name.clone(),
                        shape: spec.shape.clone(),
                        data,
                        fp8: None,
                    }
                })
                .collect();
            RankRollout { tensors }
        })
        .collect();
    Ok(HostRollout { ranks })
}
