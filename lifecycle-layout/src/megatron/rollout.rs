//! The fused tensor-parallel rollout layout (vLLM / SGLang style).

use super::error::{divisors, MegatronLayoutError};
use super::train::{check_tp, local_kv_heads};
use crate::model::{hf, ModelSpec};
use crate::{ExpertPlacement, RolloutFormat, RolloutLayout, RolloutVocab};

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
    /// `model.layers.{i}.mlp.gate.weight` (mixture-of-experts layers: the router, `[experts,
    /// hidden]`, replicated).
    Router,
    /// `model.layers.{i}.mlp.experts.w13_weight`: the rank's experts stacked, each `[gate rows;
    /// up rows]` of its share ([`RolloutLayout::expert_share`]).
    ExpertsW13,
    /// `model.layers.{i}.mlp.experts.w2_weight`: the rank's experts' columns of `down` stacked.
    ExpertsW2,
    /// `model.layers.{i}.mlp.shared_expert.gate_up_proj.weight`: the shared expert's `[gate_local;
    /// up_local]` (Qwen2-MoE).
    SharedGateUp,
    /// `model.layers.{i}.mlp.shared_expert.down_proj.weight`: row-parallel (columns split).
    SharedDown,
    /// `model.layers.{i}.mlp.shared_expert_gate.weight`: `[1, hidden]`, replicated.
    SharedGate,
}

/// The experts and the intermediate rows of each that one rank of a fused rollout layout holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertShare {
    /// The global experts, in the order of the stacked tensors.
    pub experts: std::ops::Range<usize>,
    /// The intermediate rows of gate and up (columns of down) of each.
    pub ffn: std::ops::Range<usize>,
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

    /// The experts and intermediate rows rollout TP rank `t` holds in every mixture-of-experts
    /// layer of `model`: all experts, rows `[t·F/T, (t+1)·F/T)` of each when they are split by
    /// tensor parallelism; experts `[t·E/T, (t+1)·E/T)` whole when they are partitioned. `None`
    /// for a dense model. The degree must have been checked ([`RolloutLayout::fused_tensors`]).
    ///
    /// ```
    /// use lifecycle_layout::{ExpertPlacement, ModelSpec, RolloutLayout, RolloutVocab};
    /// let m = ModelSpec::tiny_moe(); // 4 experts of intermediate size 6
    /// let tp = RolloutLayout::fused(2, RolloutVocab::Unpadded);
    /// let share = tp.expert_share(&m, 1).unwrap();
    /// assert_eq!((share.experts, share.ffn), (0..4, 3..6));
    /// let ep = tp.with_expert_placement(ExpertPlacement::Partitioned);
    /// let share = ep.expert_share(&m, 1).unwrap();
    /// assert_eq!((share.experts, share.ffn), (2..4, 0..6));
    /// ```
    pub fn expert_share(&self, model: &ModelSpec, t: usize) -> Option<ExpertShare> {
        let moe = model.moe?;
        let deg = self.tp().max(1);
        Some(match self.expert_placement() {
            ExpertPlacement::TensorParallel => {
                let per = moe.ffn / deg;
                ExpertShare {
                    experts: 0..moe.experts,
                    ffn: t * per..(t + 1) * per,
                }
            }
            ExpertPlacement::Partitioned => {
                let per = moe.experts / deg;
                ExpertShare {
                    experts: t * per..(t + 1) * per,
                    ffn: 0..moe.ffn,
                }
            }
        })
    }

    /// Every tensor of one rank of the fused layout, in rollout order (embedding, per layer input
    /// norm, qkv weight, qkv bias, q and k norms (Qwen3), o, post-attention norm, then gate-up and
    /// down (dense layers) or the router, `w13` and `w2` (mixture-of-experts layers); final norm;
    /// head).
    ///
    /// Per rank: `qkv_proj` = `[q heads of this rank; its kv heads' k; their v]` (kv heads
    /// replicated when `query_groups < T`: rank `t` holds group `t / (T / groups)`),
    /// `gate_up_proj` = `[gate rows; up rows]` of this rank, `o_proj` / `down_proj`
    /// row-parallel, embedding and head vocab-parallel ([`RolloutVocab`]), norms replicated.
    ///
    /// Long by design: one spec per fused tensor kind, in the order of the layout's tensors.
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
        if let Some(moe) = model.moe {
            let placement = self.expert_placement();
            let size = match placement {
                ExpertPlacement::TensorParallel => moe.ffn,
                ExpertPlacement::Partitioned => moe.experts,
            };
            if !size.is_multiple_of(t) {
                return Err(MegatronLayoutError::RolloutExperts { placement, size, t });
            }
        }
        let share = self.expert_share(model, 0);
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
            match (&share, model.moe) {
                (Some(share), Some(moe)) if model.moe_layer(i) => {
                    let (e, f) = (share.experts.len(), share.ffn.len());
                    push(
                        hf::layer(i, hf::ROUTER),
                        RolloutKind::Router,
                        l,
                        vec![moe.experts, h],
                    );
                    push(
                        hf::layer(i, hf::EXPERTS_W13),
                        RolloutKind::ExpertsW13,
                        l,
                        vec![e, 2 * f, h],
                    );
                    push(
                        hf::layer(i, hf::EXPERTS_W2),
                        RolloutKind::ExpertsW2,
                        l,
                        vec![e, h, f],
                    );
                    if moe.shared_ffn > 0 {
                        let sf = moe.shared_ffn / t;
                        push(
                            hf::layer(i, hf::SHARED_GATE_UP),
                            RolloutKind::SharedGateUp,
                            l,
                            vec![2 * sf, h],
                        );
                        push(
                            hf::layer(i, hf::SHARED_DOWN),
                            RolloutKind::SharedDown,
                            l,
                            vec![h, sf],
                        );
                        push(
                            hf::layer(i, hf::SHARED_EXPERT_GATE),
                            RolloutKind::SharedGate,
                            l,
                            vec![1, h],
                        );
                    }
                }
                _ => {
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
            }
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
