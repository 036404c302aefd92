/// A Megatron or rollout layout inconsistency, found at plan time before any data moves. Every
/// message names the parameter at fault and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MegatronLayoutError {
    /// A check the layouts share with the FSDP path (e.g. an fp8 keep setting naming a layer
    /// the model lacks).
    #[error(transparent)]
    Layout(Box<crate::LayoutError>),
    /// A fused rollout tensor whose parts would share an fp8 block.
    #[error(
        "fp8 rollout: `{name}` fuses parts of {rows:?} rows, and part {part} does not end on a \
         128-row block boundary, so one 128 x 128 block would mix two parts (vLLM's fp8 loader \
         scales each part's blocks apart): keep it bf16 (--fp8-keep) or use a rollout degree \
         whose parts are multiples of 128 rows"
    )]
    Fp8PartSplit {
        /// The fused tensor.
        name: String,
        /// Rows of each part, in order.
        rows: Vec<usize>,
        /// The part that ends inside a block.
        part: usize,
    },
    /// A matrix of the fused layout that an fp8 rollout has no block grid for (neither 2-D nor
    /// a stacked expert tensor).
    #[error(
        "fp8 rollout: `{name}` is neither a matrix nor a stack of expert matrices, so it has no \
         128 x 128 block grid: keep it bf16 (--fp8-keep layer:N)"
    )]
    Fp8NoBlockGrid {
        /// The tensor.
        name: String,
    },
    /// A model size or parallel degree of zero.
    #[error("{what} must be at least 1, found 0")]
    ZeroSize {
        /// Which size or degree.
        what: &'static str,
    },
    /// A mixture-of-experts model routes each token to more experts than it has.
    #[error(
        "num_experts_per_tok (top-k) = {top_k} exceeds num_experts = {experts}: a token cannot be \
         routed to more experts than the layer has; set top-k to at most {experts}"
    )]
    TopK {
        /// Top-k.
        top_k: usize,
        /// Experts.
        experts: usize,
    },
    /// Attention heads do not split evenly into query groups.
    #[error(
        "attention heads = {heads} is not divisible by query groups (num_query_groups / kv heads) \
         = {groups}: every query group must own the same number of q heads; pick query groups \
         dividing {heads}"
    )]
    HeadsNotDivisibleByGroups {
        /// Heads.
        heads: usize,
        /// Query groups.
        groups: usize,
    },
    /// Neither the query groups nor the TP degree divides the other.
    #[error(
        "{side} tensor-parallel degree {tp} and query groups = {groups} do not divide one another: \
         kv heads are split across TP ranks when TP divides the groups and shared by TP / groups \
         ranks when the groups divide TP; choose a degree among {choices}"
    )]
    TpGroups {
        /// `training TP` or `rollout T`.
        side: &'static str,
        /// The degree.
        tp: usize,
        /// Query groups.
        groups: usize,
        /// Degrees that would work, rendered.
        choices: String,
    },
    /// A dimension split across TP ranks is not divisible by the degree.
    #[error(
        "{what} = {size} is not divisible by the {side} tensor-parallel degree {tp}: \
         `{param}` is split {tp} ways; pick a degree dividing {size}"
    )]
    NotDivisible {
        /// `training TP` or `rollout T`.
        side: &'static str,
        /// The dimension (`attention heads`, `ffn hidden size`, ...).
        what: &'static str,
        /// Its size.
        size: usize,
        /// The degree.
        tp: usize,
        /// A parameter split along it.
        param: &'static str,
    },
    /// More pipeline stages than layers.
    #[error(
        "pipeline-parallel degree PP = {pp} exceeds the {layers} transformer layers: every stage \
         must own at least one layer; use PP ≤ {layers}"
    )]
    PpExceedsLayers {
        /// PP.
        pp: usize,
        /// Layers.
        layers: usize,
    },
    /// The world size is not TP × PP × DP.
    #[error(
        "world size W = {world} is not TP × PP × DP = {tp} × {pp} × {dp} = {product}: \
         set DP = W / (TP · PP) (W must be a multiple of TP · PP)"
    )]
    WorldMismatch {
        /// W.
        world: usize,
        /// TP.
        tp: usize,
        /// PP.
        pp: usize,
        /// DP.
        dp: usize,
        /// TP · PP · DP.
        product: usize,
    },
    /// A Megatron plan asked for an unfused rollout layout.
    #[error(
        "the Megatron executors produce the fused rollout layout (`qkv_proj`, `gate_up_proj`): \
         build it with RolloutLayout::fused(T, vocab); unfused layouts are the FSDP executors'"
    )]
    NotFused,
    /// The rollout TP degree does not divide the world size.
    #[error(
        "rollout tensor-parallel degree T = {t} does not divide the world size W = {world}: \
         choose T among the divisors of {world} ({divisors})"
    )]
    RolloutTpNotDividingWorld {
        /// T.
        t: usize,
        /// W.
        world: usize,
        /// The valid choices, rendered.
        divisors: String,
    },
    /// A padded training vocabulary that contradicts the vocabulary or the TP degree.
    #[error(
        "padded vocab size {padded} of `embedding.word_embeddings.weight` is inconsistent: it must \
         be at least the vocab size {vocab} and a multiple of TP = {tp} (Megatron pads {vocab} to \
         {expected} = a multiple of make_vocab_size_divisible_by × TP); use {expected} or drop the \
         override"
    )]
    PaddedVocab {
        /// The padded size given.
        padded: usize,
        /// The unpadded vocabulary.
        vocab: usize,
        /// TP.
        tp: usize,
        /// What Megatron's rule gives.
        expected: usize,
    },
    /// The rollout keeps the vocabulary unpadded but it does not split `T` ways.
    #[error(
        "vocab size {vocab} of `{param}` is not divisible by the rollout tensor-parallel degree \
         T = {t}: ask the rollout layout to re-pad (`RolloutVocab::PadToMultipleOf`) or pick T \
         dividing {vocab}"
    )]
    RolloutVocab {
        /// The vocabulary.
        vocab: usize,
        /// `model.embed_tokens.weight` or `lm_head.weight`.
        param: &'static str,
        /// T.
        t: usize,
    },
    /// The expert layers' degrees do not tile the world.
    #[error(
        "world size W = {world} is not a multiple of ETP × EP × PP = {etp} × {ep} × {pp}: the \
         expert layers split the ranks into expert tensor-parallel × expert-parallel × expert \
         data-parallel × pipeline groups; pick EP and the expert tensor-parallel degree so that \
         their product with PP divides {world}"
    )]
    ExpertWorld {
        /// W.
        world: usize,
        /// Expert tensor-parallel degree.
        etp: usize,
        /// Expert-parallel degree.
        ep: usize,
        /// PP.
        pp: usize,
    },
    /// The experts do not split evenly over the expert-parallel ranks.
    #[error(
        "num_experts = {experts} is not divisible by the expert-parallel degree EP = {ep}: every \
         expert-parallel rank holds the same number of whole experts; pick EP dividing {experts}"
    )]
    ExpertsNotDivisible {
        /// Experts.
        experts: usize,
        /// EP.
        ep: usize,
    },
    /// Expert parallelism asked of a dense model.
    #[error(
        "expert-parallel degree EP = {ep} needs a mixture-of-experts model, and this one has no \
         experts (no `num_experts` in its config): use EP = 1"
    )]
    NoExperts {
        /// EP.
        ep: usize,
    },
    /// The rollout degree does not split what the expert placement splits: the experts
    /// (partitioned) or their intermediate size (split by TP).
    #[error("{}", rollout_experts(*placement, *size, *t))]
    RolloutExperts {
        /// How the rollout places the experts.
        placement: crate::ExpertPlacement,
        /// `num_experts` (partitioned) or `moe_intermediate_size` (split by TP).
        size: usize,
        /// T.
        t: usize,
    },
    /// A bucket budget that cannot hold one bf16 element.
    #[error("bucket budget of {bytes} bytes cannot hold one bf16 element: use at least 2 bytes")]
    BucketTooSmall {
        /// The budget.
        bytes: u64,
    },
}

/// The message of [`MegatronLayoutError::RolloutExperts`].
fn rollout_experts(placement: crate::ExpertPlacement, size: usize, t: usize) -> String {
    let (what, how, fix) = match placement {
        crate::ExpertPlacement::Partitioned => (
            "num_experts",
            "partitioned over the rollout ranks",
            "split every expert by tensor parallelism (ExpertPlacement::TensorParallel)",
        ),
        crate::ExpertPlacement::TensorParallel => (
            "moe_intermediate_size",
            "split by tensor parallelism",
            "partition the experts (ExpertPlacement::Partitioned)",
        ),
    };
    format!(
        "{what} = {size} is not divisible by the rollout tensor-parallel degree T = {t}: with \
         the experts {how} the rollout splits `mlp.experts.w13_weight` {t} ways; pick T dividing \
         {size}, or {fix}"
    )
}

/// Divisors of `n`, rendered for messages.
pub(crate) fn divisors(n: usize) -> String {
    (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
