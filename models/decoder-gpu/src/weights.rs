//! Where each weight of one TP rank lies in the FSDP backend's flat rollout buffer, checked
//! against the config and the layout with the same rules (and errors) as the CPU decoder.

use lifecycle_decoder::{layout_heads, rollout_spec, DecodeError, HeadShare, ModelConfig};
use lifecycle_layout::RolloutEntry;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

/// Element offsets (bf16) of one rank's share of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerOffsets {
    pub input_norm: u64,
    pub post_norm: u64,
    pub q_w: u64,
    pub q_b: Option<u64>,
    /// First row of this rank's kv heads (replicated k/v: offset into the full tensor).
    pub k_w: u64,
    pub k_b: Option<u64>,
    pub v_w: u64,
    pub v_b: Option<u64>,
    pub o_w: u64,
    pub gate_w: u64,
    pub up_w: u64,
    pub down_w: u64,
}

/// One rank's weight offsets and head share.
#[derive(Debug, Clone)]
pub(crate) struct RankOffsets {
    pub embed: u64,
    pub head: u64,
    pub final_norm: u64,
    pub layers: Vec<LayerOffsets>,
    pub share: HeadShare,
}

/// The whole group's plan.
#[derive(Debug, Clone)]
pub(crate) struct GroupOffsets {
    pub ranks: Vec<RankOffsets>,
    /// Query heads per rank.
    pub q_heads: usize,
    /// Intermediate rows per rank.
    pub ffn_part: usize,
    /// Whether embedding / head rows are split over the ranks.
    pub vocab_parallel: bool,
    /// Elements every rank's buffer must hold at least.
    pub min_len: u64,
}

struct Reader<'a> {
    layout: &'a RolloutLayout,
    entries: &'a [RolloutEntry],
    shapes: Vec<(String, Vec<usize>)>,
    min_len: u64,
}

impl Reader<'_> {
    fn spec(&self, name: &str, allowed: &[Parallel]) -> Result<&TensorSpec, DecodeError> {
        rollout_spec(self.layout, &self.shapes, name, allowed)
    }

    /// The offset of `name` in every rank's buffer (the same on every rank), shape-checked.
    fn offset(&mut self, name: &str, allowed: &[Parallel]) -> Result<u64, DecodeError> {
        let spec = self.spec(name, allowed)?;
        let expected = spec.slice_shape(self.layout.tp());
        let e = self
            .entries
            .iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| DecodeError::MissingTensor {
                name: name.to_string(),
                rank: 0,
            })?;
        let numel: usize = expected.iter().product();
        if e.shape() != expected.as_slice() || e.numel() != numel {
            return Err(DecodeError::Shape {
                name: name.to_string(),
                rank: 0,
                expected,
                found: e.shape().to_vec(),
            });
        }
        self.min_len = self.min_len.max(e.range().end as u64);
        Ok(e.offset() as u64)
    }
}

impl GroupOffsets {
    /// Checks every tensor the config needs against the layout and the rollout entries.
    pub(crate) fn new(
        config: &ModelConfig,
        layout: &RolloutLayout,
        entries: &[RolloutEntry],
    ) -> Result<Self, DecodeError> {
        let tp = layout.tp();
        let degree = |reason: String| DecodeError::Degree { tp, reason };
        if tp == 0 {
            return Err(degree("T must be at least 1".into()));
        }
        if !config.num_heads.is_multiple_of(tp) {
            return Err(degree(format!(
                "num_attention_heads {} is not divisible by T",
                config.num_heads
            )));
        }
        if !config.intermediate_size.is_multiple_of(tp) {
            return Err(degree(format!(
                "intermediate_size {} is not divisible by T",
                config.intermediate_size
            )));
        }
        let mut r = Reader {
            layout,
            entries,
            shapes: config.tensor_shapes(),
            min_len: 0,
        };
        let (d, h) = (config.head_dim, config.hidden_size);
        let q_heads = config.num_heads / tp;
        let (kv_split, shares) = layout_heads(config, layout)?;
        if shares.iter().any(|s| s.kv_heads != shares[0].kv_heads) {
            return Err(degree(
                "the ranks would compute different numbers of kv heads".into(),
            ));
        }
        let col = [Parallel::Column];
        let kv = [kv_split];
        let rep = [Parallel::Replicated];
        let row = [Parallel::Row];
        let mut per_layer = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let p = format!("model.layers.{l}");
            let mut bias =
                |name: String, allowed: &[Parallel]| -> Result<Option<u64>, DecodeError> {
                    if config.qkv_bias {
                        r.offset(&name, allowed).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            let q_b = bias(format!("{p}.self_attn.q_proj.bias"), &col)?;
            let k_b = bias(format!("{p}.self_attn.k_proj.bias"), &kv)?;
            let v_b = bias(format!("{p}.self_attn.v_proj.bias"), &kv)?;
            per_layer.push((
                r.offset(&format!("{p}.input_layernorm.weight"), &rep)?,
                r.offset(&format!("{p}.post_attention_layernorm.weight"), &rep)?,
                r.offset(&format!("{p}.self_attn.q_proj.weight"), &col)?,
                q_b,
                r.offset(&format!("{p}.self_attn.k_proj.weight"), &kv)?,
                k_b,
                r.offset(&format!("{p}.self_attn.v_proj.weight"), &kv)?,
                v_b,
                r.offset(&format!("{p}.self_attn.o_proj.weight"), &row)?,
                r.offset(&format!("{p}.mlp.gate_proj.weight"), &col)?,
                r.offset(&format!("{p}.mlp.up_proj.weight"), &col)?,
                r.offset(&format!("{p}.mlp.down_proj.weight"), &row)?,
            ));
        }
        let vocab_spec = r.spec(
            "model.embed_tokens.weight",
            &[Parallel::Column, Parallel::Replicated],
        )?;
        let vocab_parallel = vocab_spec.parallel == Parallel::Column && tp > 1;
        let vocab_allowed = [Parallel::Column, Parallel::Replicated];
        let embed = r.offset("model.embed_tokens.weight", &vocab_allowed)?;
        let head = if config.tie_word_embeddings {
            embed
        } else {
            let head_spec = r.spec("lm_head.weight", &vocab_allowed)?;
            if (head_spec.parallel == Parallel::Column && tp > 1) != vocab_parallel {
                return Err(DecodeError::Split {
                    name: "lm_head.weight".into(),
                    found: head_spec.parallel.name(),
                    expected: "split like model.embed_tokens.weight (build the layout with ModelConfig::rollout_layout)",
                });
            }
            r.offset("lm_head.weight", &vocab_allowed)?
        };
        let final_norm = r.offset("model.norm.weight", &rep)?;
        let ranks = shares
            .iter()
            .map(|&share| {
                // replicated k/v: start at the rows of the kv heads this rank uses
                let kv_shift = |off: u64, width: usize| -> u64 {
                    if kv_split == Parallel::Column {
                        off
                    } else {
                        off + (share.kv_base * d * width) as u64
                    }
                };
                RankOffsets {
                    embed,
                    head,
                    final_norm,
                    share,
                    layers: per_layer
                        .iter()
                        .map(
                            |&(inn, post, q_w, q_b, k_w, k_b, v_w, v_b, o_w, g, u, dn)| {
                                LayerOffsets {
                                    input_norm: inn,
                                    post_norm: post,
                                    q_w,
                                    q_b,
                                    k_w: kv_shift(k_w, h),
                                    k_b: k_b.map(|b| kv_shift(b, 1)),
                                    v_w: kv_shift(v_w, h),
                                    v_b: v_b.map(|b| kv_shift(b, 1)),
                                    o_w,
                                    gate_w: g,
                                    up_w: u,
                                    down_w: dn,
                                }
                            },
                        )
                        .collect(),
                }
            })
            .collect();
        Ok(GroupOffsets {
            ranks,
            q_heads,
            ffn_part: config.intermediate_size / tp,
            vocab_parallel,
            min_len: r.min_len,
        })
    }
}
