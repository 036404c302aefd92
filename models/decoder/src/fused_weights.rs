//! One tensor-parallel group's weights in the fused rollout layout of the Megatron backend
//! (`lifecycle_layout::RolloutLayout`), read into the same views as the unfused layout:
//! a rank's `qkv_proj` is `[q; k; v]` of its heads, so q, k and v are three consecutive row
//! blocks of it; `gate_up_proj` is `[gate; up]`, two row blocks; the vocabulary-parallel
//! embedding and head may carry padding rows, which the decoder never reads. A mixture-of-experts
//! layer's stacked `w13` / `w2` hold the rank's experts in order, each `[gate; up]` and `down` of
//! its share ([`RolloutLayout::expert_share`]): expert `j` of the stack is one `2F × H` and one
//! `H × F` block. No weight is copied.

use crate::math::Mat;
use half::bf16;
use lifecycle_layout::hf;
use lifecycle_layout::RankRollout;
use lifecycle_layout::RolloutLayout;
use lifecycle_layout::{ModelSpec, Parallel};

use crate::config::ModelConfig;
use crate::error::DecodeError;
use crate::heads::head_shares;
use crate::megatron_checkpoint::MEGATRON_VOCAB_MULTIPLE;
use crate::weights::{
    GroupWeights, Layer, Mlp, MlpPart, RankLayer, Routing, SharedExpert, VocabWeight,
};

/// `w` cut after `a` and `a + b` elements.
fn split3(w: &[bf16], a: usize, b: usize) -> (&[bf16], &[bf16], &[bf16]) {
    let (x, rest) = w.split_at(a);
    let (y, z) = rest.split_at(b);
    (x, y, z)
}

impl<'w> GroupWeights<'w> {
    /// Checks every fused tensor the config needs on every rank of the group (present, shaped
    /// as the config and `layout` say), then views them.
    pub(crate) fn fused(
        config: &ModelConfig,
        layout: &RolloutLayout,
        ranks: &[&'w RankRollout],
    ) -> Result<Self, DecodeError> {
        let tp = layout.tp();
        if ranks.len() != tp {
            return Err(DecodeError::GroupSize {
                tp,
                found: ranks.len(),
            });
        }
        // the padding multiple of the training side plays no part in the rollout layout
        let model = config.model_spec(MEGATRON_VOCAB_MULTIPLE);
        let specs = layout.fused_tensors(&model)?;
        for spec in &specs {
            for (rank, r) in ranks.iter().enumerate() {
                let t = r
                    .tensor(&spec.name)
                    .ok_or_else(|| DecodeError::MissingTensor {
                        name: spec.name.clone(),
                        rank,
                    })?;
                let held = t.fp8.as_ref().map_or(t.data.len(), |q| q.data().len());
                if t.shape != spec.shape || held != spec.numel() {
                    return Err(DecodeError::Shape {
                        name: spec.name.clone(),
                        rank,
                        expected: spec.shape.clone(),
                        found: t.shape.clone(),
                    });
                }
            }
        }
        // every tensor is now known to be on every rank with its shape
        let tensor = |name: &str, rank: usize| {
            let r: &'w RankRollout = ranks[rank];
            r.tensor(name).ok_or_else(|| DecodeError::MissingTensor {
                name: name.to_string(),
                rank,
            })
        };
        // read in bf16 (norms, biases, embeddings, routers)
        let get = |name: &str, rank: usize| -> Result<&'w [bf16], DecodeError> {
            let t = tensor(name, rank)?;
            if t.fp8.is_some() {
                return Err(DecodeError::Usage(format!(
                    "`{name}` on rank {rank} is fp8, but the decoder reads it in bf16: an fp8 \
                     rollout of the fused layout quantises the 2-D matrices only"
                )));
            }
            Ok(t.data.as_slice())
        };
        // a matrix, bf16 or fp8
        let mat = |name: &str, rank: usize| -> Result<Mat<'w>, DecodeError> {
            let t = tensor(name, rank)?;
            Ok(match &t.fp8 {
                Some(q) => Mat::fp8(q),
                None => Mat::Bf16(&t.data),
            })
        };
        let kv_split = if config.model.query_groups.is_multiple_of(tp) {
            Parallel::Column
        } else {
            Parallel::Replicated
        };
        let shares = head_shares(config, tp, kv_split)?;
        let (h, d) = (config.model.hidden, config.model.head_dim);
        let q_heads = config.model.heads / tp;
        let ffn_part = config.model.ffn / tp;
        let mut layers = Vec::with_capacity(config.model.layers);
        for l in 0..config.model.layers {
            let mut rank_layers = Vec::with_capacity(tp);
            let mut mlp_parts = Vec::with_capacity(tp);
            for (rank, share) in shares.iter().enumerate() {
                let (q_rows, kv_rows) = (q_heads * d, share.kv_heads * d);
                let qkv_name = hf::layer(l, hf::QKV);
                let qkv = mat(&qkv_name, rank)?;
                if qkv.len() != (q_rows + 2 * kv_rows) * h {
                    // the layout's kv heads per rank differ from the decoder's head shares
                    return Err(DecodeError::Shape {
                        name: qkv_name,
                        rank,
                        expected: vec![q_rows + 2 * kv_rows, h],
                        found: vec![qkv.len() / h, h],
                    });
                }
                let q_w = qkv.rows(0..q_rows, h);
                let k_w = qkv.rows(q_rows..q_rows + kv_rows, h);
                let v_w = qkv.rows(q_rows + kv_rows..q_rows + 2 * kv_rows, h);
                let (q_b, k_b, v_b) = if config.model.qkv_bias {
                    let (q, k, v) =
                        split3(get(&hf::layer(l, hf::QKV_BIAS), rank)?, q_rows, kv_rows);
                    (Some(q), Some(k), Some(v))
                } else {
                    (None, None, None)
                };
                if !model.moe_layer(l) {
                    let gate_up = mat(&hf::layer(l, hf::GATE_UP), rank)?;
                    mlp_parts.push(MlpPart {
                        gate: gate_up.rows(0..ffn_part, h),
                        up: gate_up.rows(ffn_part..2 * ffn_part, h),
                        down: mat(&hf::layer(l, hf::DOWN), rank)?,
                        lora: [None; 3],
                    });
                }
                rank_layers.push(RankLayer {
                    q_w,
                    q_b,
                    k_w,
                    k_b,
                    v_w,
                    v_b,
                    o_w: mat(&hf::layer(l, hf::O), rank)?,
                    lora: [None; 4],
                });
            }
            layers.push(Layer {
                input_norm: get(&hf::layer(l, hf::INPUT_NORM), 0)?,
                post_norm: get(&hf::layer(l, hf::POST_NORM), 0)?,
                qk_norm: if config.model.qk_norm {
                    Some((
                        get(&hf::layer(l, hf::Q_NORM), 0)?,
                        get(&hf::layer(l, hf::K_NORM), 0)?,
                    ))
                } else {
                    None
                },
                ranks: rank_layers,
                mlp: if model.moe_layer(l) {
                    fused_experts(&model, layout, l, &get, &mat)?
                } else {
                    Mlp::Dense(mlp_parts)
                },
            });
        }
        let vocab = |name: &str| -> Result<VocabWeight<'w>, DecodeError> {
            Ok(VocabWeight::Parallel(
                (0..tp).map(|r| get(name, r)).collect::<Result<_, _>>()?,
            ))
        };
        let embed = vocab(hf::EMBED)?;
        let head = if config.model.tied_embeddings {
            embed.clone()
        } else {
            vocab(hf::LM_HEAD)?
        };
        Ok(GroupWeights {
            embed,
            head,
            final_norm: get(hf::NORM, 0)?,
            layers,
            shares,
            q_heads,
            routing: Routing::of(config),
        })
    }
}

/// Rank `r`'s slice of a checked tensor, by name.
type TensorOf<'a, 'w> = dyn Fn(&str, usize) -> Result<&'w [bf16], DecodeError> + 'a;

/// Rank `r`'s slice of a checked matrix (bf16 or fp8), by name.
type MatOf<'a, 'w> = dyn Fn(&str, usize) -> Result<Mat<'w>, DecodeError> + 'a;

/// A mixture-of-experts layer of the fused layout: the router of rank 0 and, per expert, its
/// part on every rank (split by TP) or on its owner (partitioned), cut from the stacks.
fn fused_experts<'w>(
    model: &ModelSpec,
    layout: &RolloutLayout,
    l: usize,
    get: &TensorOf<'_, 'w>,
    mat: &MatOf<'_, 'w>,
) -> Result<Mlp<'w>, DecodeError> {
    let h = model.hidden;
    let experts = model.moe.map_or(0, |m| m.experts);
    let shares: Vec<_> = (0..layout.tp())
        .filter_map(|t| layout.expert_share(model, t))
        .collect();
    let (w13, w2) = (hf::layer(l, hf::EXPERTS_W13), hf::layer(l, hf::EXPERTS_W2));
    let mut parts: Vec<Vec<MlpPart<'w>>> = vec![Vec::new(); experts];
    for (rank, share) in shares.iter().enumerate() {
        let f = share.ffn.len();
        // bf16, or fp8 in the stacks' (experts · rows) × cols views
        let (a, b) = (mat(&w13, rank)?, mat(&w2, rank)?);
        for (j, e) in share.experts.clone().enumerate() {
            parts[e].push(MlpPart {
                gate: a.rows(j * 2 * f..j * 2 * f + f, h),
                up: a.rows(j * 2 * f + f..(j + 1) * 2 * f, h),
                down: b.rows(j * h..(j + 1) * h, f),
                lora: [None; 3],
            });
        }
    }
    let shared = match model.moe {
        Some(moe) if moe.shared_ffn > 0 => {
            let sf = moe.shared_ffn / layout.tp();
            let parts = (0..layout.tp())
                .map(|rank| {
                    let gate_up = mat(&hf::layer(l, hf::SHARED_GATE_UP), rank)?;
                    Ok(MlpPart {
                        gate: gate_up.rows(0..sf, h),
                        up: gate_up.rows(sf..2 * sf, h),
                        down: mat(&hf::layer(l, hf::SHARED_DOWN), rank)?,
                        lora: [None; 3],
                    })
                })
                .collect::<Result<_, DecodeError>>()?;
            Some(SharedExpert {
                parts,
                gate: get(&hf::layer(l, hf::SHARED_EXPERT_GATE), 0)?,
            })
        }
        _ => None,
    };
    Ok(Mlp::Moe {
        router: get(&hf::layer(l, hf::ROUTER), 0)?,
        experts: parts,
        shared,
    })
}
