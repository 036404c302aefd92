use lifecycle_core::layout::{DType, LayoutError};

/// Errors of the host backend; each names the tensor or argument and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HostError {
    /// The layouts are inconsistent (see [`LayoutError`]).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A tensor whose dtype cannot be a trainable weight.
    #[error("tensor `{name}` has dtype {found}: master weights must be floating point (f32, bf16 or f16)")]
    DType {
        /// The tensor.
        name: String,
        /// Its dtype.
        found: DType,
    },
    /// Data length does not match the shape.
    #[error("tensor `{name}` has {found} elements but its shape {shape:?} needs {expected}")]
    ElementCount {
        /// The tensor.
        name: String,
        /// Its declared shape.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// A name that is not in the training state.
    #[error("no tensor named `{name}` in the training state")]
    UnknownTensor {
        /// The name asked for.
        name: String,
    },
    /// An operation that needs the training state on the device found it offloaded.
    #[error("{operation} needs the training state on the device, but it is offloaded: leave rollout mode first (`lifecycle.train()`)")]
    Offloaded {
        /// What was attempted.
        operation: &'static str,
    },
    /// Resident rollout weights do not match the plan (refresh with another layout).
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
