//! The Megatron-Core training layout: TP × PP × DP ranks, per-(stage, TP rank) parameter buffers.

use std::ops::Range;

use super::error::MegatronLayoutError;
use crate::model::ModelSpec;

/// What one parameter of a Megatron stage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// `embedding.word_embeddings.weight`: vocab-parallel rows of the padded vocabulary.
    WordEmbedding,
    /// `decoder.layers.{i}.input_layernorm.weight` (replicated).
    InputNorm,
    /// `decoder.layers.{i}.self_attention.linear_qkv.weight` (fused, per query group).
    Qkv,
    /// `decoder.layers.{i}.self_attention.linear_qkv.bias`.
    QkvBias,
    /// `decoder.layers.{i}.self_attention.q_layernorm.weight` (Qwen3: per-head RMSNorm of q,
    /// `[head_dim]`, replicated).
    QNorm,
    /// `decoder.layers.{i}.self_attention.k_layernorm.weight` (as `QNorm`, of k).
    KNorm,
    /// `decoder.layers.{i}.self_attention.linear_proj.weight` (row-parallel: columns split).
    Proj,
    /// `decoder.layers.{i}.pre_mlp_layernorm.weight` (replicated).
    PreMlpNorm,
    /// `decoder.layers.{i}.mlp.linear_fc1.weight`: `[gate rows; up rows]` of this TP rank.
    Fc1,
    /// `decoder.layers.{i}.mlp.linear_fc2.weight` (row-parallel: columns split).
    Fc2,
    /// `decoder.final_layernorm.weight` (replicated, last stage).
    FinalNorm,
    /// `output_layer.weight`: vocab-parallel, last stage (a copy of the embedding when tied and
    /// PP > 1).
    OutputLayer,
}

/// One parameter in the bf16 buffer of a (stage, TP rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// Megatron-Core name with the global layer index, e.g.
    /// `decoder.layers.3.self_attention.linear_qkv.weight`.
    pub name: String,
    /// What it is.
    pub kind: ParamKind,
    /// Global layer index for per-layer parameters.
    pub layer: Option<usize>,
    /// Shape of this TP rank's part.
    pub shape: Vec<usize>,
    /// Element offset in the stage buffer.
    pub offset: usize,
}

impl ParamSlot {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Product of the trailing dims (1 for 1-D parameters).
    pub fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// Tensor-, pipeline- and data-parallel coordinates of one training rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankCoords {
    /// TP rank.
    pub tp: usize,
    /// DP rank.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

/// The Megatron-Core training layout of `W = TP × PP × DP` ranks.
///
/// - **Rank order** (Megatron-Core's default `order="tp-cp-ep-dp-pp"`, context and expert
///   parallel of size 1): `rank = tp + TP · (dp + DP · pp)`.
/// - **Stages** own contiguous layer ranges: `layers / PP` each, the first `layers mod PP` stages
///   one more (Megatron's default requires `PP | layers`; the remainder rule is ours). Stage 0
///   holds the embedding; the last stage the final norm and the output layer.
/// - **Buffer order** of one (stage, TP rank), element offsets in [`MegatronLayout::stage_slots`]:
///   word embedding (first stage); then per layer `input_layernorm`, `linear_qkv.weight`,
///   `linear_qkv.bias` (with qkv bias), `q_layernorm` and `k_layernorm` (Qwen3), `linear_proj`, `pre_mlp_layernorm`, `linear_fc1`,
///   `linear_fc2`; then (last stage) `final_layernorm` and `output_layer` (untied, or tied with
///   PP > 1). This is module registration order, densely packed; Megatron's DDP buffer stores the
///   same tensors in reverse order with bucket padding — contents per rank are what matter here.
/// - **Distributed optimizer**: the fp32 main params, Adam m and v of a (stage, TP rank) buffer of
///   `L` elements are split across its DP group: DP rank `d` owns `[d·c, min((d+1)·c, L))` with
///   `c = ⌈L / DP⌉`.
///
/// ```
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::ModelSpec;
/// let layout = MegatronLayout::new(ModelSpec::tiny(), 2, 2, 2)?;
/// assert_eq!(layout.world(), 8);
/// assert_eq!(layout.rank(1, 0, 1), 5); // tp 1, dp 0, stage 1
/// assert_eq!(layout.padded_vocab(), 40); // 37 padded to a multiple of 4 × TP
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronLayout {
    model: ModelSpec,
    tp: usize,
    pp: usize,
    dp: usize,
    padded_vocab: usize,
    stage_layers: Vec<Range<usize>>,
    stage_slots: Vec<Vec<ParamSlot>>,
}

impl MegatronLayout {
    /// Validates the model and degrees; pads the vocabulary by Megatron's rule (a multiple of
    /// `make_vocab_size_divisible_by × TP`).
    pub fn new(
        model: ModelSpec,
        tp: usize,
        pp: usize,
        dp: usize,
    ) -> Result<Self, MegatronLayoutError> {
        model.validate()?;
        let multiple = model.make_vocab_size_divisible_by * tp.max(1);
        Self::with_padded_vocab(model, tp, pp, dp, model.vocab.div_ceil(multiple) * multiple)
    }

    /// Like [`MegatronLayout::new`], with an explicit padded vocabulary (as a checkpoint's
    /// `padded_vocab_size` gives it): checked to be at least the vocabulary and a multiple of TP.
    pub fn with_padded_vocab(
        model: ModelSpec,
        tp: usize,
        pp: usize,
        dp: usize,
        padded_vocab: usize,
    ) -> Result<Self, MegatronLayoutError> {
        model.validate()?;
        if model.moe.is_some() {
            return Err(MegatronLayoutError::Unsupported {
                what: "mixture-of-experts MLPs (expert parallelism)",
            });
        }
        for (what, d) in [
            ("training tensor-parallel degree TP", tp),
            ("pipeline-parallel degree PP", pp),
            ("data-parallel degree DP", dp),
        ] {
            if d == 0 {
                return Err(MegatronLayoutError::ZeroSize { what });
            }
        }
        check_tp(&model, "training TP", tp)?;
        if pp > model.layers {
            return Err(MegatronLayoutError::PpExceedsLayers {
                pp,
                layers: model.layers,
            });
        }
        let multiple = model.make_vocab_size_divisible_by * tp;
        let expected = model.vocab.div_ceil(multiple) * multiple;
        if padded_vocab < model.vocab || !padded_vocab.is_multiple_of(tp) {
            return Err(MegatronLayoutError::PaddedVocab {
                padded: padded_vocab,
                vocab: model.vocab,
                tp,
                expected,
            });
        }
        let (base, rem) = (model.layers / pp, model.layers % pp);
        let mut start = 0;
        let stage_layers: Vec<Range<usize>> = (0..pp)
            .map(|s| {
                let n = base + usize::from(s < rem);
                let r = start..start + n;
                start += n;
                r
            })
            .collect();
        let mut layout = MegatronLayout {
            model,
            tp,
            pp,
            dp,
            padded_vocab,
            stage_layers,
            stage_slots: Vec::new(),
        };
        layout.stage_slots = (0..pp).map(|s| layout.build_slots(s)).collect();
        Ok(layout)
    }

    /// The layout of `world` ranks with degrees TP and PP: DP = W / (TP · PP), which must be
    /// exact ([`MegatronLayoutError::WorldMismatch`] otherwise).
    pub fn from_world(
        model: ModelSpec,
        world: usize,
        tp: usize,
        pp: usize,
    ) -> Result<Self, MegatronLayoutError> {
        let tp_pp = tp * pp;
        if tp_pp == 0 || world == 0 || !world.is_multiple_of(tp_pp) {
            let dp = world.checked_div(tp_pp).unwrap_or(0).max(1);
            return Err(MegatronLayoutError::WorldMismatch {
                world,
                tp,
                pp,
                dp,
                product: tp_pp * dp,
            });
        }
        Self::new(model, tp, pp, world / tp_pp)
    }

    /// Checks `world = TP × PP × DP`.
    pub fn check_world(&self, world: usize) -> Result<(), MegatronLayoutError> {
        if world != self.world() {
            return Err(MegatronLayoutError::WorldMismatch {
                world,
                tp: self.tp,
                pp: self.pp,
                dp: self.dp,
                product: self.world(),
            });
        }
        Ok(())
    }

    /// The model.
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// TP.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// PP.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// DP.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// W = TP · PP · DP.
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// Rows of the padded vocabulary (`embedding.word_embeddings.weight` has `padded_vocab / TP`
    /// rows per TP rank; rows `≥ vocab` are padding).
    pub fn padded_vocab(&self) -> usize {
        self.padded_vocab
    }

    /// Global rank of (TP rank, DP rank, stage): `tp + TP · (dp + DP · pp)`.
    pub fn rank(&self, tp: usize, dp: usize, pp: usize) -> usize {
        tp + self.tp * (dp + self.dp * pp)
    }

    /// Coordinates of a global rank.
    pub fn coords(&self, rank: usize) -> RankCoords {
        RankCoords {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// Layers stage `stage` owns.
    pub fn stage_layers(&self, stage: usize) -> Range<usize> {
        self.stage_layers[stage].clone()
    }

    /// The stage owning `layer`.
    pub fn stage_of_layer(&self, layer: usize) -> usize {
        self.stage_layers
            .iter()
            .position(|r| r.contains(&layer))
            .unwrap_or(self.pp - 1)
    }

    /// The parameters of every (stage, TP rank) of `stage`, in buffer order (the same for every
    /// TP rank of the stage).
    pub fn stage_slots(&self, stage: usize) -> &[ParamSlot] {
        &self.stage_slots[stage]
    }

    /// Elements of the bf16 buffer of a (stage, TP rank).
    pub fn stage_len(&self, stage: usize) -> usize {
        self.stage_slots[stage]
            .last()
            .map_or(0, |s| s.offset + s.numel())
    }

    /// The slot of `kind` (and `layer` for per-layer parameters) on `stage`.
    pub fn slot(&self, stage: usize, kind: ParamKind, layer: Option<usize>) -> Option<&ParamSlot> {
        self.stage_slots[stage]
            .iter()
            .find(|s| s.kind == kind && s.layer == layer)
    }

    /// The fp32 elements of its stage buffer that DP rank `dp` owns (distributed optimizer).
    pub fn dp_shard(&self, stage: usize, dp: usize) -> Range<usize> {
        let len = self.stage_len(stage);
        let c = len.div_ceil(self.dp);
        (dp * c).min(len)..((dp + 1) * c).min(len)
    }

    /// Whether the last stage holds an `output_layer` (untied, or tied with PP > 1).
    pub fn has_output_layer(&self) -> bool {
        !self.model.tied_embeddings || self.pp > 1
    }

    /// Rows of the local `linear_qkv` of one TP rank: a plain `1/TP` chunk of the full fused
    /// tensor ([`qkv_head_row`]), as Megatron-Core lays it out. When TP divides the query groups
    /// the chunk holds whole groups; when the groups are fewer than TP (Megatron-Core since
    /// Megatron-LM #2565) there are no k/v replicas: with 4 heads, 1 group and TP 2, rank 0 holds
    /// q heads 0–2 and rank 1 q head 3, k and v.
    ///
    /// ```
    /// use lifecycle_layout::megatron::MegatronLayout;
    /// use lifecycle_layout::ModelSpec;
    /// let model = ModelSpec { heads: 4, query_groups: 1, head_dim: 16, hidden: 48, ..ModelSpec::tiny() };
    /// let layout = MegatronLayout::new(model, 2, 1, 1)?;
    /// assert_eq!(layout.qkv_local_rows(), 48); // (4 + 2) heads of 16 rows, halved
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn qkv_local_rows(&self) -> usize {
        let m = &self.model;
        (m.heads + 2 * m.query_groups) * m.head_dim / self.tp
    }

    fn build_slots(&self, stage: usize) -> Vec<ParamSlot> {
        let m = &self.model;
        let h = m.hidden;
        let tp = self.tp;
        let mut slots = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, kind, layer, shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            slots.push(ParamSlot {
                name,
                kind,
                layer,
                shape,
                offset,
            });
            offset += n;
        };
        if stage == 0 {
            push(
                "embedding.word_embeddings.weight".into(),
                ParamKind::WordEmbedding,
                None,
                vec![self.padded_vocab / tp, h],
            );
        }
        let qkv_rows = self.qkv_local_rows();
        for i in self.stage_layers[stage].clone() {
            let p = |s: &str| format!("decoder.layers.{i}.{s}");
            let l = Some(i);
            push(
                p("input_layernorm.weight"),
                ParamKind::InputNorm,
                l,
                vec![h],
            );
            push(
                p("self_attention.linear_qkv.weight"),
                ParamKind::Qkv,
                l,
                vec![qkv_rows, h],
            );
            if m.qkv_bias {
                push(
                    p("self_attention.linear_qkv.bias"),
                    ParamKind::QkvBias,
                    l,
                    vec![qkv_rows],
                );
            }
            if m.qk_norm {
                for (name, kind) in [
                    ("self_attention.q_layernorm.weight", ParamKind::QNorm),
                    ("self_attention.k_layernorm.weight", ParamKind::KNorm),
                ] {
                    push(p(name), kind, l, vec![m.head_dim]);
                }
            }
            push(
                p("self_attention.linear_proj.weight"),
                ParamKind::Proj,
                l,
                vec![h, m.q_rows() / tp],
            );
            push(
                p("pre_mlp_layernorm.weight"),
                ParamKind::PreMlpNorm,
                l,
                vec![h],
            );
            push(
                p("mlp.linear_fc1.weight"),
                ParamKind::Fc1,
                l,
                vec![2 * m.ffn / tp, h],
            );
            push(
                p("mlp.linear_fc2.weight"),
                ParamKind::Fc2,
                l,
                vec![h, m.ffn / tp],
            );
        }
        if stage + 1 == self.pp {
            push(
                "decoder.final_layernorm.weight".into(),
                ParamKind::FinalNorm,
                None,
                vec![h],
            );
            if self.has_output_layer() {
                push(
                    "output_layer.weight".into(),
                    ParamKind::OutputLayer,
                    None,
                    vec![self.padded_vocab / tp, h],
                );
            }
        }
        slots
    }
}

/// kv heads one rank of the fused rollout layout holds at degree `tp`: `groups / tp`, or 1
/// (replicated, as vLLM does) when `groups < tp`. The Megatron training layout has no replicas:
/// see [`MegatronLayout::qkv_local_rows`].
pub fn local_kv_heads(groups: usize, tp: usize) -> usize {
    (groups / tp).max(1)
}

/// A head of the fused `linear_qkv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkvHead {
    /// Query head `h`.
    Q(usize),
    /// The key head of query group `g`.
    K(usize),
    /// The value head of query group `g`.
    V(usize),
}

/// The first row, in units of `head_dim` rows, of `head` in the full (unsharded) fused
/// `linear_qkv` of Megatron-Core: the query groups in order, each its q heads, then its k head,
/// then its v head (`megatron/core/transformer/attention.py`, `get_query_key_value_tensors`).
///
/// ```
/// use lifecycle_layout::megatron::{qkv_head_row, QkvHead};
/// use lifecycle_layout::ModelSpec;
/// let m = ModelSpec::tiny(); // 8 heads in 2 groups: [q0..q3, k0, v0, q4..q7, k1, v1]
/// assert_eq!(qkv_head_row(&m, QkvHead::Q(5)), 7);
/// assert_eq!(qkv_head_row(&m, QkvHead::V(0)), 5);
/// ```
pub fn qkv_head_row(model: &ModelSpec, head: QkvHead) -> usize {
    let qpg = model.heads_per_group();
    match head {
        QkvHead::Q(h) => (h / qpg) * (qpg + 2) + h % qpg,
        QkvHead::K(g) => g * (qpg + 2) + qpg,
        QkvHead::V(g) => g * (qpg + 2) + qpg + 1,
    }
}

/// Checks the head, group and ffn splits for a TP degree (`side`: `training TP` / `rollout T`).
pub(crate) fn check_tp(
    model: &ModelSpec,
    side: &'static str,
    tp: usize,
) -> Result<(), MegatronLayoutError> {
    let qkv = if side == "training TP" {
        "self_attention.linear_qkv.weight"
    } else {
        "self_attn.qkv_proj.weight"
    };
    if !model.heads.is_multiple_of(tp) {
        return Err(MegatronLayoutError::NotDivisible {
            side,
            what: "attention heads",
            size: model.heads,
            tp,
            param: qkv,
        });
    }
    let g = model.query_groups;
    if !g.is_multiple_of(tp) && !tp.is_multiple_of(g) {
        let choices: Vec<String> = (1..=model.heads)
            .filter(|d| model.heads.is_multiple_of(*d) && (g.is_multiple_of(*d) || d % g == 0))
            .map(|d| d.to_string())
            .collect();
        return Err(MegatronLayoutError::TpGroups {
            side,
            tp,
            groups: g,
            choices: choices.join(", "),
        });
    }
    let fused_rows = (model.heads + 2 * g) * model.head_dim;
    if side == "training TP" && !fused_rows.is_multiple_of(tp) {
        return Err(MegatronLayoutError::NotDivisible {
            side,
            what: "rows of the fused linear_qkv ((heads + 2 · query groups) · head dim)",
            size: fused_rows,
            tp,
            param: qkv,
        });
    }
    if !model.ffn.is_multiple_of(tp) {
        return Err(MegatronLayoutError::NotDivisible {
            side,
            what: "ffn hidden size",
            size: model.ffn,
            tp,
            param: if side == "training TP" {
                "mlp.linear_fc1.weight"
            } else {
                "mlp.gate_up_proj.weight"
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_order_is_tp_then_dp_then_pp() {
        let l = MegatronLayout::new(ModelSpec::tiny(), 2, 2, 2).unwrap();
        for rank in 0..8 {
            let c = l.coords(rank);
            assert_eq!(l.rank(c.tp, c.dp, c.pp), rank);
        }
        assert_eq!(
            l.coords(6),
            RankCoords {
                tp: 0,
                dp: 1,
                pp: 1
            }
        );
    }

    #[test]
    fn stages_cover_layers_and_shards_cover_buffers() {
        let mut m = ModelSpec::tiny();
        m.layers = 5;
        let l = MegatronLayout::new(m, 1, 3, 3).unwrap();
        assert_eq!(l.stage_layers(0), 0..2);
        assert_eq!(l.stage_layers(2), 4..5);
        for s in 0..3 {
            let mut next = 0;
            for d in 0..3 {
                let r = l.dp_shard(s, d);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, l.stage_len(s));
        }
    }

    #[test]
    fn tied_output_layer_only_with_pp() {
        let mut m = ModelSpec::tiny();
        m.tied_embeddings = true;
        let l = MegatronLayout::new(m, 1, 1, 1).unwrap();
        assert!(l.slot(0, ParamKind::OutputLayer, None).is_none());
        let l = MegatronLayout::new(m, 1, 2, 1).unwrap();
        assert!(l.slot(1, ParamKind::OutputLayer, None).is_some());
    }
}
