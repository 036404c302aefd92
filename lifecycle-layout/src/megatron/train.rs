//! The Megatron-Core training layout: TP × PP × DP ranks, per-(stage, TP rank) parameter buffers.

use std::ops::Range;

use super::error::MegatronLayoutError;
use super::experts::{ExpertCoords, ExpertParallel, ExpertPart};
use super::parallel::MegatronParallel;
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
    /// `decoder.layers.{i}.mlp.router.weight` (mixture-of-experts layers: `[experts, hidden]`,
    /// replicated).
    Router,
    /// `decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight`: the shared expert's `[gate
    /// rows; up rows]` of this TP rank (Qwen2-MoE; Megatron-Core's `SharedExpertMLP`).
    SharedFc1,
    /// `decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight` (row-parallel: columns split).
    SharedFc2,
    /// `decoder.layers.{i}.mlp.shared_experts.gate_weight`: the shared expert's sigmoid gate,
    /// `[1, hidden]`, replicated.
    SharedGate,
    /// `decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}`: local expert `j`'s `[gate rows;
    /// up rows]` of this expert tensor-parallel rank (the expert part of the buffer).
    ExpertFc1,
    /// `decoder.layers.{i}.mlp.experts.linear_fc2.weight{j}`: local expert `j`'s columns of
    /// `down` of this expert tensor-parallel rank.
    ExpertFc2,
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
    /// The local expert index `{j}` of an expert tensor ([`ParamKind::ExpertFc1`] /
    /// [`ParamKind::ExpertFc2`]); which global expert it is depends on the rank's
    /// expert-parallel rank ([`MegatronLayout::global_expert`]).
    pub expert: Option<usize>,
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

/// The elements of a rank's parameter buffer that its distributed-optimizer shard covers: a
/// part of the dense parameters (split over the DP group) and a part of the expert parameters
/// (split over the expert data-parallel group); the fp32 main params and the Adam moments hold
/// the dense part first, then the expert part. Built by [`MegatronLayout::optimizer_shard`].
///
/// ```
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::ModelSpec;
/// let l = MegatronLayout::new(ModelSpec::tiny(), 1, 1, 2)?;
/// let s = l.optimizer_shard(1);
/// assert_eq!((s.dense().end, s.experts().len()), (l.stage_len(0), 0)); // dense: no experts
/// assert_eq!(s.indices().count(), s.len());
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OptimizerShard {
    dense: Range<usize>,
    experts: Range<usize>,
}

impl OptimizerShard {
    /// The dense elements owned.
    pub fn dense(&self) -> Range<usize> {
        self.dense.clone()
    }

    /// The expert elements owned (after every dense element of the buffer).
    pub fn experts(&self) -> Range<usize> {
        self.experts.clone()
    }

    /// Elements owned: the length of the main params and of each Adam moment.
    pub fn len(&self) -> usize {
        self.dense.len() + self.experts.len()
    }

    /// Whether nothing is owned.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer elements owned, in main-param order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.dense.clone().chain(self.experts.clone())
    }

    /// Both ranges, dense first; `(buffer range, offset in the main params)`.
    pub fn parts(&self) -> [(Range<usize>, usize); 2] {
        [
            (self.dense.clone(), 0),
            (self.experts.clone(), self.dense.len()),
        ]
    }
}

/// The Megatron-Core training layout of `W = TP × PP × DP` ranks.
///
/// - **Rank order** (Megatron-Core's default `order="tp-cp-ep-dp-pp"`, context parallel of size
///   1): `rank = tp + TP · (dp + DP · pp)` for the attention and dense layers; the expert layers
///   of a mixture-of-experts model decompose the same ranks by ETP × EP × EDP × PP
///   ([`ExpertParallel`], [`MegatronLayout::new_moe`]).
/// - **Stages** own contiguous layer ranges: `layers / PP` each, the first `layers mod PP` stages
///   one more (Megatron's default requires `PP | layers`; the remainder rule is ours). Stage 0
///   holds the embedding; the last stage the final norm and the output layer.
/// - **Buffer order** of one rank, element offsets in [`MegatronLayout::stage_slots`]: word
///   embedding (first stage); then per layer `input_layernorm`, `linear_qkv.weight`,
///   `linear_qkv.bias` (with qkv bias), `q_layernorm` and `k_layernorm` (Qwen3), `linear_proj`,
///   `pre_mlp_layernorm`, then `linear_fc1` and `linear_fc2` (dense layers) or `router` and the
///   shared expert's `shared_experts.linear_fc1`, `linear_fc2`, `gate_weight` (mixture-of-experts
///   layers; the shared expert, if any, split by TP like a dense MLP); then (last stage)
///   `final_layernorm` and `output_layer` (untied, or tied with PP > 1); then the expert part: per mixture-of-experts layer, per
///   local expert `j`, `experts.linear_fc1.weight{j}` and `experts.linear_fc2.weight{j}`. This is
///   module registration order, densely packed; Megatron's DDP buffers store the dense and the
///   expert parameters in two buffers, in reverse order with bucket padding — contents per rank
///   are what matter here. The dense part is the same on the DP replicas of a (stage, TP rank),
///   the expert part on the expert data-parallel replicas of a (stage, ETP rank, EP rank).
/// - **Distributed optimizer**: the fp32 main params, Adam m and v of a buffer's dense part of
///   `L` elements are split across its DP group: DP rank `d` owns `[d·c, min((d+1)·c, L))` with
///   `c = ⌈L / DP⌉`; the expert part likewise across the expert data-parallel group
///   ([`MegatronLayout::optimizer_shard`]).
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
    experts: Option<ExpertParallel>,
    stage_layers: Vec<Range<usize>>,
    stage_slots: Vec<Vec<ParamSlot>>,
    dense_len: Vec<usize>,
}

impl MegatronLayout {
    /// Validates the model and degrees; pads the vocabulary by Megatron's rule (a multiple of
    /// `make_vocab_size_divisible_by × TP`). A mixture-of-experts model gets Megatron's default
    /// expert layout, EP = 1 and expert TP = TP ([`MegatronLayout::new_moe`] sets both).
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
        Self::build(model, tp, pp, dp, padded_vocab, (1, tp))
    }

    /// The layout of a mixture-of-experts model with expert parallelism `ep` and expert tensor
    /// parallelism `etp` (Megatron's `--expert-model-parallel-size` and
    /// `--expert-tensor-parallel-size`), checked as [`ExpertParallel::new`] checks them, beside
    /// what [`MegatronLayout::new`] checks. A dense model accepts only `ep = 1`.
    ///
    /// ```
    /// use lifecycle_layout::megatron::MegatronLayout;
    /// use lifecycle_layout::ModelSpec;
    /// // W = 4 = TP 2 x DP 2; the 4 experts split over EP 2, whole (ETP 1): expert DP = 2
    /// let l = MegatronLayout::new_moe(ModelSpec::tiny_moe(), 2, 1, 2, 2, 1)?;
    /// assert_eq!(l.global_expert(3, 1), 3); // rank 3 is EP rank 1: its local expert 1 is 3
    /// assert_eq!(l.expert_dp_group(0), vec![0, 2]);
    /// assert!(MegatronLayout::new_moe(ModelSpec::tiny_moe(), 2, 1, 2, 3, 1).is_err());
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn new_moe(
        model: ModelSpec,
        tp: usize,
        pp: usize,
        dp: usize,
        ep: usize,
        etp: usize,
    ) -> Result<Self, MegatronLayoutError> {
        model.validate()?;
        if model.moe.is_none() && ep != 1 {
            return Err(MegatronLayoutError::NoExperts { ep });
        }
        let multiple = model.make_vocab_size_divisible_by * tp.max(1);
        let padded = model.vocab.div_ceil(multiple) * multiple;
        Self::build(model, tp, pp, dp, padded, (ep, etp))
    }

    /// The layout of `model` at `parallel`'s degrees (experts included), the embedding padded to
    /// `padded_vocab` rows where given (a live model's `vocab_size`, checked as
    /// [`MegatronLayout::with_padded_vocab`] checks it), else by Megatron's rule with
    /// `parallel`'s `make_vocab_size_divisible_by`.
    ///
    /// ```
    /// use lifecycle_layout::megatron::{MegatronLayout, MegatronParallel};
    /// use lifecycle_layout::ModelSpec;
    /// let degrees = MegatronParallel::new(1, 1, 2).with_experts(2, 1);
    /// let l = MegatronLayout::at(ModelSpec::tiny_moe(), degrees, Some(40))?;
    /// assert_eq!((l.padded_vocab(), l.expert_coords(1).unwrap().ep), (40, 1));
    /// // a dense model has no experts to split
    /// assert!(MegatronLayout::at(ModelSpec::tiny(), degrees, None).is_err());
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn at(
        model: ModelSpec,
        parallel: MegatronParallel,
        padded_vocab: Option<usize>,
    ) -> Result<Self, MegatronLayoutError> {
        let MegatronParallel {
            tp,
            pp,
            dp,
            ep,
            etp,
            make_vocab_size_divisible_by,
        } = parallel;
        model.validate()?;
        if model.moe.is_none() && ep != 1 {
            return Err(MegatronLayoutError::NoExperts { ep });
        }
        let padded = match padded_vocab {
            Some(v) => v,
            None => {
                let multiple = make_vocab_size_divisible_by.max(1) * tp.max(1);
                model.vocab.div_ceil(multiple) * multiple
            }
        };
        Self::build(model, tp, pp, dp, padded, (ep, etp))
    }

    fn build(
        model: ModelSpec,
        tp: usize,
        pp: usize,
        dp: usize,
        padded_vocab: usize,
        (ep, etp): (usize, usize),
    ) -> Result<Self, MegatronLayoutError> {
        model.validate()?;
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
        let experts = match model.moe {
            Some(moe) => Some(ExpertParallel::new(tp * pp * dp, pp, ep, etp, moe)?),
            None => None,
        };
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
            experts,
            stage_layers,
            stage_slots: Vec::new(),
            dense_len: Vec::new(),
        };
        for s in 0..pp {
            let (slots, dense) = layout.build_slots(s);
            layout.stage_slots.push(slots);
            layout.dense_len.push(dense);
        }
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

    /// The parameters of every rank of `stage`, in buffer order (the same names and shapes on
    /// every rank of the stage): the dense part, then the expert part.
    pub fn stage_slots(&self, stage: usize) -> &[ParamSlot] {
        &self.stage_slots[stage]
    }

    /// Elements of the bf16 buffer of a rank of `stage`: its dense part and its expert part.
    pub fn stage_len(&self, stage: usize) -> usize {
        self.stage_slots[stage]
            .last()
            .map_or(0, |s| s.offset + s.numel())
    }

    /// Elements of the dense part of a rank's buffer on `stage` (the expert part starts there).
    pub fn dense_len(&self, stage: usize) -> usize {
        self.dense_len[stage]
    }

    /// The slot of `kind` (and `layer` for per-layer parameters) on `stage`; for expert tensors
    /// the one of local expert 0 ([`MegatronLayout::expert_slot`] names the local expert).
    pub fn slot(&self, stage: usize, kind: ParamKind, layer: Option<usize>) -> Option<&ParamSlot> {
        self.stage_slots[stage]
            .iter()
            .find(|s| s.kind == kind && s.layer == layer)
    }

    /// The slot of local expert `local`'s `part` in mixture-of-experts layer `layer`.
    pub fn expert_slot(&self, layer: usize, local: usize, part: ExpertPart) -> Option<&ParamSlot> {
        let kind = match part {
            ExpertPart::Fc1 => ParamKind::ExpertFc1,
            ExpertPart::Fc2 => ParamKind::ExpertFc2,
        };
        self.stage_slots[self.stage_of_layer(layer)]
            .iter()
            .find(|s| s.kind == kind && s.layer == Some(layer) && s.expert == Some(local))
    }

    /// The fp32 elements of the dense part of its stage buffer that DP rank `dp` owns
    /// (distributed optimizer).
    pub fn dp_shard(&self, stage: usize, dp: usize) -> Range<usize> {
        let len = self.dense_len(stage);
        let c = len.div_ceil(self.dp);
        (dp * c).min(len)..((dp + 1) * c).min(len)
    }

    /// What the distributed optimizer of `rank` owns: its DP rank's share of the dense part
    /// ([`MegatronLayout::dp_shard`]) and its expert data-parallel rank's share of the expert
    /// part.
    pub fn optimizer_shard(&self, rank: usize) -> OptimizerShard {
        let c = self.coords(rank);
        let dense = self.dp_shard(c.pp, c.dp);
        let base = self.dense_len(c.pp);
        let experts = match (&self.experts, self.expert_coords(rank)) {
            (Some(ex), Some(ec)) => {
                let r = ex.edp_shard(self.stage_len(c.pp) - base, ec.edp);
                base + r.start..base + r.end
            }
            _ => base..base,
        };
        OptimizerShard { dense, experts }
    }

    /// The ranks holding the same dense part as `rank` (its DP group, in DP order).
    pub fn dp_group(&self, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.dp).map(|d| self.rank(c.tp, d, c.pp)).collect()
    }

    /// The ranks holding the same expert part as `rank` (its expert data-parallel group, in
    /// order); just `rank` for a dense model.
    pub fn expert_dp_group(&self, rank: usize) -> Vec<usize> {
        match (&self.experts, self.expert_coords(rank)) {
            (Some(ex), Some(c)) => (0..ex.edp())
                .map(|edp| ex.rank(ExpertCoords { edp, ..c }))
                .collect(),
            _ => vec![rank],
        }
    }

    /// The expert layers' decomposition (mixture-of-experts models).
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        self.experts.as_ref()
    }

    /// The expert-layer coordinates of `rank` (mixture-of-experts models).
    pub fn expert_coords(&self, rank: usize) -> Option<ExpertCoords> {
        self.experts.map(|ex| ex.coords(rank))
    }

    /// The global expert that local expert `local` of `rank` is (`local` for a dense model).
    pub fn global_expert(&self, rank: usize, local: usize) -> usize {
        match (&self.experts, self.expert_coords(rank)) {
            (Some(ex), Some(c)) => ex.local_experts(c.ep).start + local,
            _ => local,
        }
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

    /// The parameter slots of pipeline stage `stage` in Megatron-Core's buffer order, and the
    /// buffer's length. Long by design: one slot per parameter kind, in that order.
    fn build_slots(&self, stage: usize) -> (Vec<ParamSlot>, usize) {
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
                expert: None,
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
            match m.moe {
                Some(moe) if m.moe_layer(i) => {
                    push(
                        p("mlp.router.weight"),
                        ParamKind::Router,
                        l,
                        vec![moe.experts, h],
                    );
                    if moe.shared_ffn > 0 {
                        let sf = moe.shared_ffn / tp;
                        push(
                            p("mlp.shared_experts.linear_fc1.weight"),
                            ParamKind::SharedFc1,
                            l,
                            vec![2 * sf, h],
                        );
                        push(
                            p("mlp.shared_experts.linear_fc2.weight"),
                            ParamKind::SharedFc2,
                            l,
                            vec![h, sf],
                        );
                        push(
                            p("mlp.shared_experts.gate_weight"),
                            ParamKind::SharedGate,
                            l,
                            vec![1, h],
                        );
                    }
                }
                _ => {
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
            }
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
        let dense = offset;
        if let Some(ex) = &self.experts {
            // names and shapes are the same on every rank of the stage: rank 0's
            for shard in ex.stage_shards(m, self.stage_layers[stage].clone(), 0) {
                let kind = match shard.part {
                    ExpertPart::Fc1 => ParamKind::ExpertFc1,
                    ExpertPart::Fc2 => ParamKind::ExpertFc2,
                };
                slots.push(ParamSlot {
                    name: shard.name,
                    kind,
                    layer: Some(shard.layer),
                    expert: Some(shard.local),
                    shape: shard.shape.to_vec(),
                    offset: dense + shard.offset,
                });
            }
        }
        (slots, dense)
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
    if let Some(moe) = model.moe
        && !moe.shared_ffn.is_multiple_of(tp)
    {
        return Err(MegatronLayoutError::NotDivisible {
            side,
            what: "shared_expert_intermediate_size",
            size: moe.shared_ffn,
            tp,
            param: if side == "training TP" {
                "mlp.shared_experts.linear_fc1.weight"
            } else {
                "mlp.shared_expert.gate_up_proj.weight"
            },
        });
    }
    if model.has_dense_mlp() && !model.ffn.is_multiple_of(tp) {
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
