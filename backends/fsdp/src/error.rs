//! The FSDP backend's error type.

use lifecycle_cuda::CudaError;
use lifecycle_layout::LayoutError;
use lifecycle_state::HostError;

/// What the FSDP backend can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// The layouts do not fit together (found by the planner before any data moves).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A GPU, driver, NCCL or allocation failure.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The host backend's state could not be read.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The training state and the rank pool disagree on W.
    #[error(
        "the training state is sharded over W = {state} ranks but the rank pool has {pool}: build \
         the state with the same pool the backend uses"
    )]
    WorldMismatch {
        /// W of the state.
        state: usize,
        /// Ranks of the pool.
        pool: usize,
    },
    /// A host tensor cannot become a training tensor.
    #[error("tensor `{name}`: {problem}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What is wrong and what to do.
        problem: String,
    },
    /// The training state is not on the device where the operation needs it.
    #[error("{operation} needs the training state on the device, but it is offloaded: exit rollout mode first")]
    Offloaded {
        /// What was attempted.
        operation: &'static str,
    },
    /// A buffer an in-place update needs is not on the device (rollout mode offloads master
    /// weights and Adam moments and frees the gradients).
    #[error(
        "{operation} needs the {buffer} of rank {rank} on the device, but it is {found}: leave \
         rollout mode first (Lifecycle::train exits, reloads the training state and reallocates \
         the gradients)"
    )]
    NotResident {
        /// What was attempted.
        operation: &'static str,
        /// The buffer: `fp32 master weights`, `Adam m`, `Adam v` or `gradients`.
        buffer: &'static str,
        /// The first rank found without it.
        rank: usize,
        /// Where it is instead.
        found: &'static str,
    },
    /// An Adam hyper-parameter out of its range.
    #[error("Adam parameter {name} = {value} is invalid: it must be {expected}")]
    AdamParam {
        /// The parameter (`lr`, `beta1`, `beta2` or `eps`).
        name: &'static str,
        /// The value given.
        value: f32,
        /// The valid range.
        expected: &'static str,
    },
    /// The resident rollout weights do not match the plan.
    #[error("the resident rollout weights ({found} elements per rank) do not match the plan ({expected})")]
    RolloutMismatch {
        /// Elements the plan expects.
        expected: u64,
        /// Elements found.
        found: u64,
    },
    /// Invalid settings.
    #[error("invalid setting: {0}")]
    Config(String),
    /// A master weight is NaN or infinite (found by the switch's casts and quantisations, or
    /// by verification mode's scan).
    #[error(
        "tensor `{tensor}` has a non-finite master weight ({value}) at element {index} of rank \
         {rank}'s shard: fix the update that produced it (no switch rolls out non-finite \
         weights)"
    )]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// The rank holding the shard.
        rank: usize,
        /// Element index within the rank's (padded) shard.
        index: u64,
        /// The value.
        value: f32,
    },
    /// Verification mode: an offloaded buffer came back different.
    #[error(
        "offloaded {buffer} of tensor `{tensor}` on rank {rank} is corrupted (hash {found:#018x} \
         after reload, {expected:#018x} before offload): it stays offloaded; restore the \
         training state from a checkpoint"
    )]
    Corrupted {
        /// The rank.
        rank: usize,
        /// The tensor.
        tensor: String,
        /// `master`, `adam_m` or `adam_v`.
        buffer: &'static str,
        /// Hash before offload (of the first mismatching chunk).
        expected: u64,
        /// Hash after reload.
        found: u64,
    },
    /// Verification mode: a rollout tensor changed while resident.
    #[error(
        "rollout tensor `{tensor}` on rank {rank} changed while resident (hash mismatch): \
         something wrote into the rollout weights; the training state is reloaded intact"
    )]
    RolloutCorrupted {
        /// The rank.
        rank: usize,
        /// The tensor.
        tensor: String,
    },
}
