//! The GPU executor's error type.

use lifecycle_cuda::CudaError;

use lifecycle_layout::megatron::MegatronLayoutError;
use lifecycle_state::megatron::MegatronError;

/// What the GPU Megatron backend can fail with; each names the argument and the fix.
#[derive(Debug, thiserror::Error)]
pub enum MegatronGpuError {
    /// The layouts are inconsistent (found by the planner before any data moves).
    #[error(transparent)]
    Layout(#[from] MegatronLayoutError),
    /// Host tensors or a host state that cannot become the training state.
    #[error(transparent)]
    Host(#[from] MegatronError),
    /// A GPU, driver, NCCL or allocation failure.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The training state and the rank pool disagree on W or on the ranks this process drives.
    #[error(
        "the training state has W = {state} ranks ({state_local} in this process) but the rank \
         pool has W = {pool} ({pool_local} in this process): build the state with the pool the \
         backend uses, for a layout with TP × PP × DP = {pool}"
    )]
    WorldMismatch {
        /// W of the state.
        state: usize,
        /// Ranks of the state held by this process.
        state_local: usize,
        /// W of the pool.
        pool: usize,
        /// Ranks of the pool driven by this process.
        pool_local: usize,
    },
    /// The training state is not on the device where the operation needs it.
    #[error("{operation} needs the training state on the device, but it is offloaded: leave rollout mode first (`lifecycle.train()`)")]
    Offloaded {
        /// What was attempted.
        operation: &'static str,
    },
    /// A plan made for another training layout or another backend.
    #[error("the plan was made for another training layout or rollout layout than this backend and state use: plan again")]
    PlanMismatch,
    /// Resident rollout weights that do not match the plan.
    #[error("the resident rollout weights hold {found} elements per rank on {found_ranks} ranks, the plan needs {expected} on {expected_ranks}: exit and enter again")]
    RolloutMismatch {
        /// Elements per rank the plan needs.
        expected: usize,
        /// Ranks the plan needs in this process.
        expected_ranks: usize,
        /// Elements per rank resident.
        found: usize,
        /// Ranks resident.
        found_ranks: usize,
    },
    /// Invalid settings.
    #[error("invalid setting: {0}")]
    Config(String),
    /// An operation that needs every rank in this process (one process driving all GPUs).
    #[error("{operation} needs every rank in this process (W = {world}, this process drives {local}): run it in the single-process mode, or read each rank's part in its own process")]
    NotAllLocal {
        /// What was attempted.
        operation: &'static str,
        /// W.
        world: usize,
        /// Ranks of this process.
        local: usize,
    },
}
