//! FSDP training layout → tensor-parallel bf16 rollout layout on NVIDIA GPUs.
//!
//! [`FsdpBackend`] implements the core [`Reshard`](lifecycle_core::Reshard) trait over a
//! [`ThreadRankPool`](lifecycle_cuda::ThreadRankPool) (one thread and one NCCL communicator per
//! GPU):
//!
//! - **Training state** ([`FsdpTrainState`]): per rank, flat fp32 buffers of FSDP2 dim-0 shards
//!   (uneven shards padded to `⌈rows / W⌉` rows) for master weights, grads, Adam m and v.
//! - **Plan** ([`FsdpPlan`]): the core planner's pieces ([`plan_fsdp_to_tp`](lifecycle_layout::plan_fsdp_to_tp),
//!   every validation there) cut into buckets under a byte budget. Each rank casts fp32 → bf16 at
//!   the source; pieces it keeps are cast straight into its rollout buffer, pieces a peer needs are
//!   sent from its own rollout buffer when the peer needs the same slice (T = 1: the all-gather
//!   goes straight into the rollout buffers, no staging) or from a staging slot otherwise (row-
//!   parallel slices), and received straight into the peer's rollout buffer.
//! - **Transport** ([`FsdpBackend::with_transport`]): with every rank in one process and peer
//!   access between the GPUs (the default [`Transport::Auto`](lifecycle_cuda::Transport)), each
//!   sender's copy engines write every piece straight into its place in the receiver's rollout
//!   buffer (peer copies: ~390 GB/s per GPU on 2×H200, no SMs, no NCCL); with one process per
//!   GPU, grouped NCCL sends / receives (or all-gathers).
//! - **Execution**: each rank's buckets become steps
//!   ([`FsdpPlan::rank_steps`](lifecycle_layout::fsdp::FsdpPlan::rank_steps)) that the engine's
//!   step runner ([`lifecycle_cuda::run_program`]) issues, the same runner as Megatron's.
//! - **Overlap**: local casts on an auxiliary stream, staged casts and unpacks on the compute
//!   stream, peer copies or NCCL on their own stream; bucket `k + 1`'s casts overlap bucket `k`'s
//!   transfers;
//!   offload copies (master, Adam m, v → pinned host, in 1 GiB pieces) run on a fourth stream
//!   during the transfer; grads are freed, not copied.
//! - **Exit**: rollout buffers released, offloaded state reloaded on the copy stream, grads
//!   reallocated as zeros.
//! - **Memory**: freed device memory stays mapped in each GPU's stream-ordered pool (as PyTorch's
//!   caching allocator keeps it), so the next phase reuses it without remapping;
//!   [`FsdpBackend::trim_device_memory`] hands it back to the driver. Peak extra device memory
//!   during a transfer is at most `in_flight × bucket_bytes` of staging (none at T = 1).
//! - **Modes** ([`GatherMode`]): grouped send/receive (default, any T), in-place all-gathers
//!   straight into the rollout buffers (T = 1, fastest there), packed one-message-per-peer
//!   buckets (T > 1, an experiment that measured slower).
//!
//! - **In-place updates** (module `update`): seeded synthetic gradients
//!   ([`FsdpBackend::fill_synthetic_grads`], host twin [`synthetic_grad_value`]) and an Adam step
//!   ([`FsdpBackend::adam_step`]) applied on the device to the resident master, m, v shards,
//!   bit-identical to the host backend's `adam_step`; no reallocation, pinned host buffers kept.
//! - **Reliability**: every wait on NCCL work has the pool's deadline
//!   ([`lifecycle_cuda::CollectiveSettings`]): a peer rank that stalls or dies ends the switch in
//!   [`lifecycle_cuda::CudaError::CollectiveTimeout`] with the training state restored on the
//!   devices (`AfterFailure::Restored`); the pool then refuses collectives until it is rebuilt.
//! - **Verification** ([`with_verification`](lifecycle_layout::settings::Configure::with_verification)): device hashes of every offloaded
//!   buffer and of the rollout weights, and a non-finite scan of the master weights.
//!
//! [`FsdpBackend::download_rollout`] returns a [`HostRollout`](lifecycle_layout::HostRollout) for bit
//! comparison with the host backend; [`FsdpBackend::download_state`] returns the training buffers.

#![warn(missing_docs)]

mod backend;
mod buffers;
mod build;
mod checks;
mod download;
mod error;
mod hooks;
mod lent;

mod reshard;
mod state;
mod transfer;
mod update;
mod update_kernels;
mod verify;

pub use backend::{FsdpBackend, DEFAULT_OFFLOAD_CHUNK_BYTES};
pub use buffers::FsdpBuffers;
pub use error::FsdpError;
pub use lent::{LentFsdpBackend, LentFsdpState, LentMaster, LentParts};
pub use lifecycle_layout::fsdp::{BucketConfig, FsdpPlan, GatherMode};
pub use state::{FsdpTrainState, RankDump, RankTrain};
pub use update::{check_adam_params, synthetic_grad_value};
pub use update_kernels::UPDATE_KERNEL_SRC;
