//! The fused tensor-parallel rollout layout (vLLM / SGLang style).

use super::error::{divisors, MegatronLayoutError};
use super::train::{check_tp, local_kv_heads};
use crate::model::{hf, ModelSpec};
use crate::{RolloutFormat, RolloutLayout, RolloutVocab};

/// What a rollout tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RolloutKind {
    /// `model.embed_tokens.weight`: vocab-parallel rows.
    Embedding,
    /// `lm_head.weight` (untied models only): vocab-parallel rows.
    LmHead,
    /// `model.layers.{i}.input_layernorm.weight` (replicated).
    InputNorm,
    /// `model.layers.{i}.self_attn.qkv_proj.weight`: `[q_local; k_local; v_local]`.
    Qkv,
    /// `model.layers.{i}.self_attn.qkv_proj.bias`: `[q_local; k_local; v_local]`.
    QkvBias,
    /// `model.layers.{i}.self_attn.q_norm.weight` (Qwen3, `[head_dim]`, replicated).
    QNorm,
    /// `model.layers.{i}.self_attn.k_norm.weight` (Qwen3, `[head_dim]`, replicated).
    KNorm,
    /// `model.layers.{i}.self_attn.o_proj.weight`: row-parallel (columns split).
    O,
    /// `model.layers.{i}.post_attention_layernorm.weight` (replicated).
    PostNorm,
    /// `model.layers.{i}.mlp.gate_up_proj.weight`: `[gate_local; up_local]`.
    GateUp,
    /// `model.layers.{i}.mlp.down_proj.weight`: row-parallel (columns split).
    Down,
    /// `model.norm.weight` (replicated).
    Norm,
}

/// One tensor of a rollout rank: name, this rank's shape, what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutTensorSpec {
    /// Name, e.g. `model.layers.0.self_attn.qkv_proj.weight`.
    pub name: String,
    /// What it is.
    pub kind: RolloutKind,
    /// Layer for per-layer tensors.
    pub layer: Option<usize>,
    /// Shape of every rank's slice (the same on every rank).
    pub shape: Vec<usize>,
}

impl RolloutTensorSpec {
    /// Elements of one rank's slice.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Columns of the 2-D view (1 for 1-D tensors).
    pub fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// The fused layout's tensors, sizes and checks (a [`RolloutLayout`] built with
/// [`RolloutLayout::fused`]).
impl RolloutLayout {
    /// Checks `T` divides `world`.
    pub fn check_world(&self, world: usize) -> Result<(), MegatronLayoutError> {
        if self.tp() == 0 {
            return Err(MegatronLayoutError::ZeroSize {
                what: "rollout tensor-parallel degree T",
            });
        }
        if !world.is_multiple_of(self.tp()) {
            return Err(MegatronLayoutError::RolloutTpNotDividingWorld {
                t: self.tp(),
                world,
                divisors: divisors(world),
            });
        }
        Ok(())
    }

    /// Rows of the rollout vocabulary (all ranks together).
    pub fn vocab_rows(&self, model: &ModelSpec) -> Result<usize, MegatronLayoutError> {
        let t = self.tp().max(1);
        match self.vocab() {
            RolloutVocab::Unpadded => {
                if !model.vocab.is_multiple_of(t) {
                    return Err(MegatronLayoutError::RolloutVocab {
                        vocab: model.vocab,
                        param: hf::EMBED,
                        t,
                    });
                }
                Ok(model.vocab)
            }
            RolloutVocab::PadToMultipleOf(0) => Err(MegatronLayoutError::ZeroSize {
                what: "rollout vocab padding multiple",
            }),
            RolloutVocab::PadToMultipleOf(m) => Ok(model.vocab.div_ceil(m * t) * m * t),
        }
    }

    /// Every tensor of one rank of the fused layout, in rollout order (embedding, per layer input
    /// norm, qkv weight, qkv bias, q and k norms (Qwen3), o, post-attention norm, gate-up, down;
    /// final norm; head).
    ///
    /// Per rank: `qkv_proj` = `[q heads of this rank; its kv heads' k; their v]` (kv heads
    /// replicated when `query_groups < T`: rank `t` holds group `t / (T / groups)`),
    /// `gate_up_proj` = `[gate rows; up rows]` of this rank, `o_proj` / `down_proj`
    /// row-parallel, embedding and head vocab-parallel ([`RolloutVocab`]), norms replicated.
    ///
    /// ```
    /// use lifecycle_layout::{RolloutLayout, RolloutVocab};
    /// use lifecycle_layout::ModelSpec;
    /// let m = ModelSpec::tiny();
    /// let specs = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4)).fused_tensors(&m)?;
    /// let qkv = specs.iter().find(|s| s.name == "model.layers.0.self_attn.qkv_proj.weight").unwrap();
    /// assert_eq!(qkv.shape, vec![(4 + 2 * 1) * 2, 16]); // 4 q heads, 1 kv head, head_dim 2
    /// assert_eq!(specs[0].shape, vec![20, 16]); // vocab 37 padded to 40, split 2 ways
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn fused_tensors(
        &self,
        model: &ModelSpec,
    ) -> Result<Vec<RolloutTensorSpec>, MegatronLayoutError> {
        if self.format() != RolloutFormat::Fused {
            return Err(MegatronLayoutError::NotFused);
        }
        model.validate()?;
        if self.tp() == 0 {
            return Err(MegatronLayoutError::ZeroSize {
                what: "rollout tensor-parallel degree T",
            });
        }
        check_tp(model, "rollout T", self.tp())?;
        let t = self.tp();
        let h = model.hidden;
        let vocab_rows = self.vocab_rows(model)? / t;
        let qkv_rows =
            (model.heads / t + 2 * local_kv_heads(model.query_groups, t)) * model.head_dim;
        let mut out = Vec::new();
        let mut push = |name: String, kind, layer, shape: Vec<usize>| {
            out.push(RolloutTensorSpec {
                name,
                kind,
                layer,
                shape,
            })
        };
        push(
            hf::EMBED.into(),
            RolloutKind::Embedding,
            None,
            vec![vocab_rows, h],
        );
        for i in 0..model.layers {
            let l = Some(i);
            push(
                hf::layer(i, hf::INPUT_NORM),
                RolloutKind::InputNorm,
                l,
                vec![h],
            );
            push(
                hf::layer(i, hf::QKV),
                RolloutKind::Qkv,
                l,
                vec![qkv_rows, h],
            );
            if model.qkv_bias {
                push(
                    hf::layer(i, hf::QKV_BIAS),
                    RolloutKind::QkvBias,
                    l,
                    vec![qkv_rows],
                );
            }
            if model.qk_norm {
                push(
                    hf::layer(i, hf::Q_NORM),
                    RolloutKind::QNorm,
                    l,
                    vec![model.head_dim],
                );
                push(
                    hf::layer(i, hf::K_NORM),
                    RolloutKind::KNorm,
                    l,
                    vec![model.head_dim],
                );
            }
            push(
                hf::layer(i, hf::O),
                RolloutKind::O,
                l,
                vec![h, model.q_rows() / t],
            );
            push(
                hf::layer(i, hf::POST_NORM),
                RolloutKind::PostNorm,
                l,
                vec![h],
            );
            push(
                hf::layer(i, hf::GATE_UP),
                RolloutKind::GateUp,
                l,
                vec![2 * model.ffn / t, h],
            );
            push(
                hf::layer(i, hf::DOWN),
                RolloutKind::Down,
                l,
                vec![h, model.ffn / t],
            );
        }
        push(hf::NORM.into(), RolloutKind::Norm, None, vec![h]);
        if !model.tied_embeddings {
            push(
                hf::LM_HEAD.into(),
                RolloutKind::LmHead,
                None,
                vec![vocab_rows, h],
            );
        }
        Ok(out)
    }
}
