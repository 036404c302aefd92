//! One tensor-parallel group's rollout weights, checked against the config and the layout, with
//! each rank's share of heads and kv heads worked out. This module reads the unfused layout (Hugging
//! Face names, `lifecycle_core` splits); `fused_weights` reads the Megatron backend's fused one
//! into the same views.

use half::bf16;
use lifecycle_layout::RankRollout;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

use crate::config::ModelConfig;
use crate::error::DecodeError;
use crate::heads::{layout_heads, HeadShare};
use crate::spec_check::rollout_spec;

/// A weight that is either vocabulary-parallel (one slice per rank) or replicated.
#[derive(Debug, Clone)]
pub(crate) enum VocabWeight<'w> {
    /// Rank `r` holds rows `[r·P, (r+1)·P)` of the vocabulary, `P` rows per slice (`V/T`, or
    /// more when the layout pads the vocabulary: rows `≥ V` are padding, never read).
    Parallel(Vec<&'w [bf16]>),
    /// Every rank holds all rows; rank 0's copy is read.
    Replicated(&'w [bf16]),
}

/// One rank's share of one layer.
#[derive(Debug, Clone)]
pub(crate) struct RankLayer<'w> {
    pub q_w: &'w [bf16],
    pub q_b: Option<&'w [bf16]>,
    /// Rows of this rank's kv heads only (`kv_heads` of them, starting at global `kv_base`).
    pub k_w: &'w [bf16],
    pub k_b: Option<&'w [bf16]>,
    pub v_w: &'w [bf16],
    pub v_b: Option<&'w [bf16]>,
    pub o_w: &'w [bf16],
    pub gate_w: &'w [bf16],
    pub up_w: &'w [bf16],
    pub down_w: &'w [bf16],
}

/// One layer: replicated norms and every rank's share.
#[derive(Debug, Clone)]
pub(crate) struct Layer<'w> {
    pub input_norm: &'w [bf16],
    pub post_norm: &'w [bf16],
    pub ranks: Vec<RankLayer<'w>>,
}

/// The whole group's weights.
#[derive(Debug, Clone)]
pub(crate) struct GroupWeights<'w> {
    pub embed: VocabWeight<'w>,
    pub head: VocabWeight<'w>,
    pub final_norm: &'w [bf16],
    pub layers: Vec<Layer<'w>>,
    pub shares: Vec<HeadShare>,
    /// Query heads per rank.
    pub q_heads: usize,
    /// Intermediate rows per rank.
    pub ffn_part: usize,
}

struct Reader<'a, 'w> {
    layout: &'a RolloutLayout,
    ranks: &'a [&'w RankRollout],
    shapes: Vec<(String, Vec<usize>)>,
}

impl<'w> Reader<'_, 'w> {
    /// The spec of `name`, checked to have the config's shape and one of `allowed` splits.
    fn spec(&self, name: &str, allowed: &[Parallel]) -> Result<&TensorSpec, DecodeError> {
        rollout_spec(self.layout, &self.shapes, name, allowed)
    }

    /// TP rank `rank`'s slice of `name`, checked against the layout.
    fn slice(&self, spec: &TensorSpec, rank: usize) -> Result<&'w [bf16], DecodeError> {
        let t = self.ranks[rank]
            .tensor(&spec.name)
            .ok_or_else(|| DecodeError::MissingTensor {
                name: spec.name.clone(),
                rank,
            })?;
        let expected = spec.slice_shape(self.layout.tp());
        if t.shape != expected || t.data.len() != expected.iter().product::<usize>() {
            return Err(DecodeError::Shape {
                name: spec.name.clone(),
                rank,
                expected,
                found: t.shape.clone(),
            });
        }
        Ok(&t.data)
    }

    fn get(
        &self,
        name: &str,
        allowed: &[Parallel],
        rank: usize,
    ) -> Result<&'w [bf16], DecodeError> {
        let spec = self.spec(name, allowed)?;
        self.slice(spec, rank)
    }

    fn vocab(&self, name: &str) -> Result<VocabWeight<'w>, DecodeError> {
        let spec = self.spec(name, &[Parallel::Column, Parallel::Replicated])?;
        Ok(match spec.parallel {
            Parallel::Column => VocabWeight::Parallel(
                (0..self.ranks.len())
                    .map(|r| self.slice(spec, r))
                    .collect::<Result<_, _>>()?,
            ),
            _ => VocabWeight::Replicated(self.slice(spec, 0)?),
        })
    }
}

impl<'w> GroupWeights<'w> {
    /// Checks every tensor the config needs against the layout and the group's slices.
    pub(crate) fn new(
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
        let degree = |reason: String| DecodeError::Degree { tp, reason };
        if !config.num_heads.is_multiple_of(tp) {
            return Err(degree(format!(
                "num_attention_heads {} is not divisible by T",
                config.num_heads
            )));
        }
        let r = Reader {
            layout,
            ranks,
            shapes: config.tensor_shapes(),
        };
        let d = config.head_dim;
        let h = config.hidden_size;
        let q_heads = config.num_heads / tp;
        let (kv_split, shares) = layout_heads(config, layout)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let p = format!("model.layers.{l}");
            let col = [Parallel::Column];
            let kv = [kv_split];
            let mut rank_layers = Vec::with_capacity(tp);
            for (rank, share) in shares.iter().enumerate() {
                let bias =
                    |name: &str, allowed: &[Parallel]| -> Result<Option<&'w [bf16]>, DecodeError> {
                        if config.qkv_bias {
                            r.get(name, allowed, rank).map(Some)
                        } else {
                            Ok(None)
                        }
                    };
                // replicated k/v: keep only the rows of the kv heads this rank uses
                let kv_rows = |w: &'w [bf16], width: usize| -> &'w [bf16] {
                    if kv_split == Parallel::Column {
                        w
                    } else {
                        &w[share.kv_base * d * width..(share.kv_base + share.kv_heads) * d * width]
                    }
                };
                let k_w = r.get(&format!("{p}.self_attn.k_proj.weight"), &kv, rank)?;
                let v_w = r.get(&format!("{p}.self_attn.v_proj.weight"), &kv, rank)?;
                let k_b = bias(&format!("{p}.self_attn.k_proj.bias"), &kv)?;
                let v_b = bias(&format!("{p}.self_attn.v_proj.bias"), &kv)?;
                rank_layers.push(RankLayer {
                    q_w: r.get(&format!("{p}.self_attn.q_proj.weight"), &col, rank)?,
                    q_b: bias(&format!("{p}.self_attn.q_proj.bias"), &col)?,
                    k_w: kv_rows(k_w, h),
                    k_b: k_b.map(|b| kv_rows(b, 1)),
                    v_w: kv_rows(v_w, h),
                    v_b: v_b.map(|b| kv_rows(b, 1)),
                    o_w: r.get(
                        &format!("{p}.self_attn.o_proj.weight"),
                        &[Parallel::Row],
                        rank,
                    )?,
                    gate_w: r.get(&format!("{p}.mlp.gate_proj.weight"), &col, rank)?,
                    up_w: r.get(&format!("{p}.mlp.up_proj.weight"), &col, rank)?,
                    down_w: r.get(&format!("{p}.mlp.down_proj.weight"), &[Parallel::Row], rank)?,
                });
            }
            let rep = [Parallel::Replicated];
            layers.push(Layer {
                input_norm: r.get(&format!("{p}.input_layernorm.weight"), &rep, 0)?,
                post_norm: r.get(&format!("{p}.post_attention_layernorm.weight"), &rep, 0)?,
                ranks: rank_layers,
            });
        }
        let embed = r.vocab("model.embed_tokens.weight")?;
        let head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            r.vocab("lm_head.weight")?
        };
        Ok(GroupWeights {
            embed,
            head,
            final_norm: r.get("model.norm.weight", &[Parallel::Replicated], 0)?,
            layers,
            shares,
            q_heads,
            ffn_part: config.intermediate_size / tp,
        })
    }
}
