use std::path::PathBuf;

/// Why a Hugging Face `config.json` could not be read as a [`ModelConfig`](crate::ModelConfig).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not valid JSON, or its top level is not an object.
    #[error("{path}: not a valid model config: {message}")]
    Json {
        /// The file (`config.json` for text given directly).
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A field is missing or has an unusable value.
    #[error("config field `{field}`: {problem}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
    },
}

/// A layout inconsistency, found before any data moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A world size or parallel degree of zero.
    #[error("{what} must be at least 1, found 0")]
    ZeroDegree {
        /// Which degree (`world size W`, `rollout tensor-parallel degree T`).
        what: &'static str,
    },
    /// A model or degree whose vLLM parameters are not known or that vLLM refuses
    /// ([`vllm_names`](crate::vllm::vllm_names)).
    #[error("{0}")]
    Vllm(String),
    /// A model dimension that the tensor-parallel degree does not split.
    #[error("cannot split the model at T = {tp}: {reason}")]
    Split {
        /// The degree.
        tp: usize,
        /// Which dimension does not divide, and the fix.
        reason: String,
    },
    /// The rollout TP degree does not divide the world size.
    #[error(
        "rollout tensor-parallel degree T = {tp} does not divide the world size W = {world}: \
         choose T among the divisors of {world} ({divisors})"
    )]
    TpNotDividingWorld {
        /// T.
        tp: usize,
        /// W.
        world: usize,
        /// The valid choices, rendered.
        divisors: String,
    },
    /// Two tensors share a name.
    #[error("tensor `{name}` appears twice in the {side}: names must be unique")]
    DuplicateTensor {
        /// The name.
        name: String,
        /// `training state` or `rollout layout`.
        side: &'static str,
    },
    /// A tensor with an empty name.
    #[error("a tensor of the {side} has an empty name")]
    EmptyName {
        /// `training state` or `rollout layout`.
        side: &'static str,
    },
    /// A tensor with no elements or no dimensions.
    #[error("tensor `{name}` has shape {shape:?}: every dimension must be at least 1 and there must be at least one")]
    EmptyTensor {
        /// The name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A value that fp8 quantisation cannot scale.
    #[error(
        "tensor `{name}` holds a non-finite value at element {index}: its fp8 block's scale \
         would be poisoned; fix the training state (a NaN or infinite master weight) before \
         switching"
    )]
    NonFinite {
        /// The tensor.
        name: String,
        /// Element index (row-major).
        index: usize,
    },
    /// A rollout slice of an fp8 tensor cuts a 128 × 128 scale block.
    #[error(
        "tensor `{name}`: a rank's slice holds rows {rows:?} and columns {cols:?} of its 2-D \
         view, which cut its 128 x 128 fp8 scale blocks; choose a rollout degree T whose slices \
         are whole blocks (split dims multiples of 128 x T), or keep the tensor bf16"
    )]
    Fp8BlockSplit {
        /// The tensor.
        name: String,
        /// Rows of the slice.
        rows: std::ops::Range<usize>,
        /// Columns of the slice.
        cols: std::ops::Range<usize>,
    },
    /// An fp8 keep setting names a decoder layer the model does not have.
    #[error(
        "fp8 keep layer:{layer}: the model's decoder layers are numbered 0 to {}; name one of \
         those",
        layers.saturating_sub(1)
    )]
    Fp8KeepLayer {
        /// The layer named.
        layer: usize,
        /// The model's decoder layers.
        layers: usize,
    },
    /// A tensor's values do not fill its shape.
    #[error("tensor `{name}` has {found} values, its shape needs {expected}")]
    ValueCount {
        /// The tensor.
        name: String,
        /// Values given.
        found: usize,
        /// Values the shape needs.
        expected: usize,
    },
    /// An owned tensor's rank is not a rank of the rollout group.
    #[error(
        "tensor `{name}` is owned by TP rank {rank}, but the rollout layout has T = {t} ranks \
         (0..{t}): place it on one of them"
    )]
    OwnerOutOfRange {
        /// The tensor.
        name: String,
        /// Its owner.
        rank: usize,
        /// T.
        t: usize,
    },
    /// Experts do not partition evenly over the rollout ranks.
    #[error(
        "layer {layer} has {experts} experts, which do not partition over T = {t} rollout ranks \
         (num_experts must be a multiple of T for expert parallelism): choose T dividing \
         {experts}, or split every expert by tensor parallelism instead"
    )]
    ExpertsNotDivisible {
        /// The layer.
        layer: usize,
        /// Experts in it.
        experts: usize,
        /// T.
        t: usize,
    },
    /// A tensor the rollout layout needs is absent from the training state.
    #[error("tensor `{name}` required by the rollout layout is missing from the training state")]
    MissingTensor {
        /// The name.
        name: String,
    },
    /// A training tensor the rollout layout does not place.
    #[error(
        "tensor `{name}` of the training state has no place in the rollout layout: add it to the \
         layout (replicated if small) or remove it from the training state"
    )]
    ExtraTensor {
        /// The name.
        name: String,
    },
    /// Shapes disagree between the two layouts.
    #[error("tensor `{name}` has shape {train:?} in the training state but the rollout layout expects {rollout:?}")]
    ShapeMismatch {
        /// The name.
        name: String,
        /// Training shape.
        train: Vec<usize>,
        /// Rollout shape.
        rollout: Vec<usize>,
    },
    /// A split dimension is not divisible by T.
    #[error(
        "tensor `{name}` ({parallel}, shape {shape:?}) cannot be split {t} ways: dim {dim} = {size} \
         is not divisible by T = {t}; pick T dividing {size} or mark the tensor replicated"
    )]
    NotDivisible {
        /// The name.
        name: String,
        /// `column-parallel` or `row-parallel`.
        parallel: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The split dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// T.
        t: usize,
    },
    /// A row-parallel tensor that is not 2-D.
    #[error("tensor `{name}` is row-parallel but has shape {shape:?}: row-parallel tensors must be 2-D (split on dim 1)")]
    RowParallelNot2d {
        /// The name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A step plan that would touch memory outside its buffers (a planner bug, refused before
    /// anything runs).
    #[error("rank {rank}: invalid step plan: {what}")]
    InvalidSteps {
        /// The rank whose steps are wrong.
        rank: usize,
        /// What is wrong.
        what: String,
    },
    /// The FSDP planner was given a fused rollout layout.
    #[error(
        "the FSDP executors produce the unfused rollout layout (one tensor per training tensor, \
         split by its Parallel kind): build it with RolloutLayout::new(T, specs); fused layouts \
         (RolloutLayout::fused) are the Megatron executors'"
    )]
    FusedLayout,
}
