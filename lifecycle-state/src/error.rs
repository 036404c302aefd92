use lifecycle_layout::{DType, LayoutError};

/// Errors of the host backend; each names the tensor or argument and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HostError {
    /// The layouts are inconsistent (see [`LayoutError`]).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A training buffer named by a string that names none.
    #[error("{0}")]
    Buffer(String),
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
    /// A LoRA setting that does not fit the model (a whole tensor named as trained beside the
    /// adapters that the model lacks, or that is an adapter), named.
    #[error(transparent)]
    Lora(Box<lifecycle_layout::lora::LoraError>),
    /// A frozen tensor (a LoRA model's base, `with_frozen_base`) written since enter cast it.
    #[error("tensor `{name}` is frozen (with_frozen_base) but its master on rank {rank} changed since enter: its rollout form would be stale; write only the trained tensors (the adapters and those named with with_trained), or leave rollout mode and enter again")]
    FrozenWritten {
        /// The tensor.
        name: String,
        /// The rank whose shard changed.
        rank: usize,
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
    /// Verification mode: a master weight is NaN or infinite.
    #[error("tensor `{tensor}` has a non-finite master weight ({value}) at element {index} of rank {rank}'s shard: fix the update that produced it (verification mode refuses to switch non-finite weights)")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// The rank holding the shard.
        rank: usize,
        /// Element index within the shard.
        index: usize,
        /// The value.
        value: f32,
    },
    /// Verification mode: an offloaded buffer changed while it was in host memory.
    #[error("offloaded {buffer} of tensor `{tensor}` on rank {rank} is corrupted (checksum {found:#018x}, expected {expected:#018x}): it stays offloaded; restore the training state from a checkpoint")]
    Corrupted {
        /// The rank.
        rank: usize,
        /// The tensor.
        tensor: String,
        /// `master`, `adam_m` or `adam_v`.
        buffer: &'static str,
        /// Checksum at offload.
        expected: u64,
        /// Checksum at reload.
        found: u64,
    },
    /// Verification mode: a rollout slice changed while resident.
    #[error("rollout tensor `{tensor}` on rank {rank} changed while resident (checksum mismatch): something wrote into the rollout weights; the training state is reloaded intact")]
    RolloutCorrupted {
        /// The rank.
        rank: usize,
        /// The tensor.
        tensor: String,
    },
}

impl From<lifecycle_layout::lora::LoraError> for HostError {
    fn from(e: lifecycle_layout::lora::LoraError) -> Self {
        HostError::Lora(Box::new(e))
    }
}
