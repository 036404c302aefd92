//! Errors of checkpoint loading and decoding; each names the tensor, field or file and the fix.

use std::path::PathBuf;

use lifecycle_layout::megatron::MegatronLayoutError;
use lifecycle_layout::LayoutError;
use lifecycle_state::megatron::MegatronError;

/// Why a checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON or a field has the wrong type.
    #[error("{path}: not a valid model config: {message}")]
    ConfigJson {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A config field is missing or has an unusable value.
    #[error("config field `{field}`: {problem}")]
    ConfigField {
        /// The field.
        field: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// `model.safetensors` is truncated or corrupt.
    #[error(
        "{path}: not a valid safetensors file ({message}); the file may be truncated or corrupt"
    )]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A tensor the config needs is not in the file.
    #[error("tensor `{name}` is missing from {path} (the config needs it{hint})")]
    MissingTensor {
        /// The tensor.
        name: String,
        /// The file.
        path: PathBuf,
        /// Extra advice.
        hint: &'static str,
    },
    /// An expert tensor the config has no place for (an expert index past `num_experts`, a layer
    /// the config makes dense, a dense model).
    #[error("tensor `{name}` in {path} has no place in the model: {reason}")]
    UnexpectedTensor {
        /// The tensor.
        name: String,
        /// The file.
        path: PathBuf,
        /// Why, naming the config field.
        reason: String,
    },
    /// A tensor has another shape than the config implies.
    #[error("tensor `{name}` has shape {found:?} but the config implies {expected:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// Shape from the config.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor of an element type the loader does not read.
    #[error("tensor `{name}` has dtype {dtype}: only F32, BF16 and F16 weights can be loaded")]
    DType {
        /// The tensor.
        name: String,
        /// Its dtype as the file names it.
        dtype: String,
    },
    /// A tensor given to the exporter has a data length that does not match its shape.
    #[error("tensor `{name}`: {problem}")]
    Export {
        /// The tensor.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

impl From<lifecycle_layout::ConfigError> for CheckpointError {
    fn from(e: lifecycle_layout::ConfigError) -> Self {
        use lifecycle_layout::ConfigError;
        match e {
            ConfigError::Io { path, source } => CheckpointError::Io { path, source },
            ConfigError::Json { path, message } => CheckpointError::ConfigJson { path, message },
            ConfigError::Field { field, problem } => {
                CheckpointError::ConfigField { field, problem }
            }
        }
    }
}

impl From<lifecycle_layout::ConfigError> for MegatronCheckpointError {
    fn from(e: lifecycle_layout::ConfigError) -> Self {
        MegatronCheckpointError::Checkpoint(e.into())
    }
}

/// Why a decoder could not be built or run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    /// The rollout layout is inconsistent.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The fused (Megatron backend's) rollout layout cannot hold this model at its degree.
    #[error(transparent)]
    FusedLayout(#[from] MegatronLayoutError),
    /// The model cannot be split at this tensor-parallel degree.
    #[error("cannot split the model at T = {tp}: {reason}")]
    Degree {
        /// The degree.
        tp: usize,
        /// Which dimension does not divide, and the fix.
        reason: String,
    },
    /// The TP group does not have `T` ranks.
    #[error("the TP group has {found} ranks but the layout has T = {tp}")]
    GroupSize {
        /// T of the layout.
        tp: usize,
        /// Ranks given.
        found: usize,
    },
    /// A tensor the decoder needs is not in the layout or not on a rank.
    #[error("tensor `{name}` is not in the rollout weights of TP rank {rank}")]
    MissingTensor {
        /// The tensor.
        name: String,
        /// The TP rank.
        rank: usize,
    },
    /// A rollout tensor has another split than the decoder can read.
    #[error("tensor `{name}` is {found} in the rollout layout; the decoder needs it {expected}")]
    Split {
        /// The tensor.
        name: String,
        /// Its split.
        found: &'static str,
        /// What the decoder reads.
        expected: &'static str,
    },
    /// A rollout slice has another shape than the config and layout imply.
    #[error("rollout tensor `{name}` on TP rank {rank} has shape {found:?}; config and layout imply {expected:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// The TP rank.
        rank: usize,
        /// Implied shape.
        expected: Vec<usize>,
        /// Resident shape.
        found: Vec<usize>,
    },
    /// A token id outside the vocabulary.
    #[error("token {token} of sequence {sequence} is outside the vocabulary of {vocab}")]
    Token {
        /// The sequence.
        sequence: usize,
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A call that does not fit the decoder's state.
    #[error("{0}")]
    Usage(String),
    /// A rollout request with a field out of range (refused before it is queued).
    #[error("request{}: `{field}` {problem}", request.map_or(String::new(), |i| format!(" {i}")))]
    Request {
        /// Which request of a call (its index), where known.
        request: Option<usize>,
        /// The field at fault.
        field: &'static str,
        /// What it must be and what it is.
        problem: String,
    },
}

impl DecodeError {
    /// The same error naming request `index` of a call.
    pub fn in_request(self, index: usize) -> Self {
        match self {
            DecodeError::Request { field, problem, .. } => DecodeError::Request {
                request: Some(index),
                field,
                problem,
            },
            other => other,
        }
    }
}

/// Why a Hugging Face checkpoint could not become a Megatron training state.
#[derive(Debug, thiserror::Error)]
pub enum MegatronCheckpointError {
    /// The checkpoint folder could not be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A config field Megatron cannot lay out at these degrees (heads, kv heads or the
    /// intermediate size not dividing by TP, more stages than layers, ...).
    #[error("config field `{field}` cannot be laid out by Megatron at TP = {tp}, PP = {pp}, DP = {dp}: {source}")]
    ConfigField {
        /// The `config.json` field at fault.
        field: &'static str,
        /// Training TP.
        tp: usize,
        /// Training PP.
        pp: usize,
        /// Training DP.
        dp: usize,
        /// The planner's error.
        #[source]
        source: MegatronLayoutError,
    },
    /// Degrees Megatron cannot use whatever the model (zero, ...).
    #[error("Megatron cannot lay out TP = {tp}, PP = {pp}, DP = {dp}: {source}")]
    Degrees {
        /// Training TP.
        tp: usize,
        /// Training PP.
        pp: usize,
        /// Training DP.
        dp: usize,
        /// The planner's error.
        #[source]
        source: MegatronLayoutError,
    },
    /// The checkpoint's tensors do not fit its config (a hand-built [`Checkpoint`](crate::Checkpoint)).
    #[error("checkpoint tensors for the Megatron training state: {0}")]
    Tensors(#[source] MegatronError),
}
