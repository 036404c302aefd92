use lifecycle_layout::DType;

use lifecycle_layout::megatron::MegatronLayoutError;

/// Errors of the Megatron host backend; each names the tensor or argument and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MegatronError {
    /// The layouts are inconsistent (see [`MegatronLayoutError`]).
    #[error(transparent)]
    Layout(#[from] MegatronLayoutError),
    /// A switch option the backend does not have.
    #[error(transparent)]
    Option(#[from] lifecycle_layout::settings::OptionError),
    /// A Hugging Face tensor the model needs was not given.
    #[error("tensor `{name}` is missing: the model description needs it (check the layer count, qkv bias and tied embeddings)")]
    MissingTensor {
        /// The name.
        name: String,
    },
    /// A tensor the model description does not have.
    #[error("tensor `{name}` is not a parameter of the described model: remove it or fix the model description (layers, qkv bias, tied embeddings)")]
    UnexpectedTensor {
        /// The name.
        name: String,
    },
    /// The same name twice.
    #[error("tensor `{name}` is given twice: names must be unique")]
    DuplicateTensor {
        /// The name.
        name: String,
    },
    /// A shape that contradicts the model description.
    #[error("tensor `{name}` has shape {found:?} but the model description gives {expected:?}")]
    ShapeMismatch {
        /// The name.
        name: String,
        /// From the model description.
        expected: Vec<usize>,
        /// Given.
        found: Vec<usize>,
    },
    /// A tensor whose dtype cannot be a trainable weight.
    #[error(
        "tensor `{name}` has dtype {found}: weights must be floating point (f32, bf16 or f16)"
    )]
    DType {
        /// The name.
        name: String,
        /// Its dtype.
        found: DType,
    },
    /// Data length does not match the shape.
    #[error("tensor `{name}` has {found} elements but its shape {shape:?} needs {expected}")]
    ElementCount {
        /// The name.
        name: String,
        /// Its declared shape.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// An operation that needs the training state on the device found it offloaded.
    #[error("{operation} needs the training state on the device, but it is offloaded: leave rollout mode first (`lifecycle.train()`)")]
    Offloaded {
        /// What was attempted.
        operation: &'static str,
    },
    /// A training state whose buffers contradict its own layout (a bug, not a user error).
    #[error("training state is inconsistent with its layout: {what}")]
    Inconsistent {
        /// What was found.
        what: String,
    },
    /// A non-finite parameter where an fp8 rollout quantises it (its block's scale would be
    /// NaN), found before the rollout is handed out.
    #[error("fp8 rollout: `{name}` holds a non-finite value at element {index} of rank {rank}'s slice: fix the parameters or keep the tensor bf16 (--fp8-keep)")]
    NonFinite {
        /// The rollout tensor.
        name: String,
        /// The rollout rank.
        rank: usize,
        /// The element.
        index: usize,
    },
    /// A plan made for another training layout.
    #[error("the plan was made for another training layout than the state's: plan again from this state")]
    PlanMismatch,
    /// Resident rollout weights do not match the plan.
    #[error("resident rollout tensor `{name}` on rank {rank} has {found} elements but the plan needs {expected}: exit and enter again")]
    RolloutMismatch {
        /// The tensor.
        name: String,
        /// The rank.
        rank: usize,
        /// Elements the plan needs.
        expected: usize,
        /// Elements resident.
        found: usize,
    },
}
