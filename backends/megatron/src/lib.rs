//! Megatron-Core training layouts to the fused tensor-parallel rollout layout, on NVIDIA GPUs.
//!
//! The layouts, the planner and the per-rank schedule are pure and live in
//! `lifecycle_layout::megatron`; the CPU executor is `lifecycle_host::megatron`. This crate is the
//! GPU executor: [`MegatronGpuBackend`] implements
//! [`Reshard`](lifecycle_core::Reshard) over a [`ThreadRankPool`](lifecycle_cuda::ThreadRankPool)
//! (one thread and one NCCL communicator per GPU), running the same [`MegatronPlan`] as the CPU
//! executor (`lifecycle_host::megatron::MegatronHostBackend`), bit for bit.
//!
//! - **Training state** ([`MegatronGpuState`]): per rank the bf16 parameters of its (stage, TP
//!   rank) in one contiguous device buffer and fp32 grads of the same length, plus its DP shard of
//!   the fp32 main params and Adam m, v (Megatron's distributed optimizer). Built from host tensors
//!   ([`MegatronGpuBackend::state_from_hf`]), from the CPU backend's state
//!   ([`MegatronGpuBackend::state_from_host`]), or on the devices for benchmarks
//!   ([`MegatronGpuBackend::synthetic_state`]); [`MegatronGpuBackend::download_state`] gives it
//!   back as a [`MegatronTrainState`](lifecycle_state::megatron::MegatronTrainState).
//!   Or a caller's ([`LentMegatronState`]): each parameter of a rank's stage lent by address
//!   (Megatron-Core's parameters where its DDP buffers keep them), read in place by the same
//!   [`Reshard`](lifecycle_core::Reshard) impl ([`MegatronGpuBackend::lending`]; the backend is
//!   generic over [`MegatronBuffers`]).
//! - **Schedule** (`lifecycle_layout::megatron::schedule`, pure): each rank copies the runs of its fused slices it holds
//!   itself. With peer copies ([`Transport`], the default where every rank lives in this process
//!   and the GPUs have peer access), each owner writes the runs its peers need straight into
//!   their rollout buffers: runs of 1 MiB and more by its copy engines (2-D copies for strided
//!   runs), smaller ones by one tile-kernel launch per peer; no slots, packing or NCCL. With NCCL
//!   (one process per GPU), each rank receives the others' runs from their owners step by step
//!   (step `k` = bucket `k` of every destination), all messages of a step in one NCCL group: large runs as their own
//!   messages, straight from the owner's parameter buffer and into the rollout buffer where they
//!   are contiguous; small runs (and strided sides) packed into a send slot and unpacked from a
//!   receive slot. Only the bytes of the fused slices move (`[q; k; v]`, `[gate; up]`,
//!   vocabulary padding removed); bf16 to bf16, no cast. Large local runs go through the
//!   driver's device-to-device copy, the rest through one tile-kernel launch. Each rank's
//!   schedule becomes steps ([`RankSchedule::rank_steps`](lifecycle_layout::megatron::schedule::RankSchedule::rank_steps))
//!   that the engine's step runner ([`lifecycle_cuda::run_program`]) issues, the same runner as
//!   FSDP's.
//! - **Streams**: local copies on the auxiliary stream (they never wait for the network), packs
//!   and unpacks (or peer tiles) on the compute stream, NCCL (or peer copies) on its own stream, offload and reload on the copy
//!   stream; `in_flight` slots let step `k`'s network work overlap packing `k + 1` and unpacking
//!   `k - 1`. One launch of the tile copy kernel moves a whole list of runs.
//! - **Offload** ([`MemoryPolicy`](lifecycle_core::MemoryPolicy), as the CPU executor):
//!   `offload_params` moves the bf16 parameters and the fp32 main params, `offload_optimizer`
//!   Adam m and v, to pinned host memory from a [`PinnedPool`] kept between switches; grads are
//!   freed at every switch and come back as zeros. Exit releases the rollout and reloads.
//! - **Tracing** (off by default; `Lifecycle::enable_trace`): every piece of device work is a
//!   span measured by CUDA events on the stream that ran it
//!   ([`StreamTimeline`](lifecycle_cuda::StreamTimeline)), read once the streams are
//!   synchronised: zeroing and local copies (`aux`), packs and unpacks or peer tiles
//!   (`compute`), each step's grouped send/receive (`nccl`, received bytes) or the peer copies
//!   to each destination (`peer`, sent bytes), offload and reload copies (`copy`), with
//!   bytes and link, on one track per rank and stream next to the host's phase spans. When
//!   tracing is off no event is created.
//! - **Errors**: [`MegatronGpuError`]; layout errors come from `plan`, before anything moves;
//!   out-of-memory is a typed error, and a failed enter leaves the training state as it was.
//!
//! On a machine with NVIDIA GPUs (2 for the W = 2 cases; `export NCCL_NVLS_ENABLE=0` where
//! NVLink multicast must stay off):
//!
//! ```text
//! cargo test --release -p lifecycle-megatron --test gpu -- --ignored --test-threads=1
//! cargo run --release -p lifecycle-bench --bin megatron_bench     # Qwen2.5-7B shapes, W = 2
//! ```
//!
//! [`MegatronPlan`]: lifecycle_layout::megatron::MegatronPlan

#![warn(missing_docs)]

mod backend;
mod buffers;
mod build;
mod config;
mod download;
mod error;
mod fp8;
mod lent;
mod reshard;
mod state;
mod transfer;

pub use backend::{MegatronGpuBackend, MegatronGpuPlan};
pub use buffers::MegatronBuffers;
pub use config::GpuConfig;
pub use error::MegatronGpuError;
pub use lent::{LentMegatronBackend, LentMegatronParts, LentMegatronState};
pub use lifecycle_cuda::Transport;
pub use lifecycle_cuda::{PinnedPool, DEFAULT_CHUNK_BYTES};
pub use state::{GpuRank, MegatronGpuState};
