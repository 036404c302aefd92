//! The CPU reference backend of `lifecycle-core`.
//!
//! Ranks are threads of one process and collectives are shared-memory copies. The training layout
//! is FSDP2's dim-0 sharding of fp32 master weights, grads and Adam moments; the rollout layout is
//! bf16 tensor parallel of degree `T` dividing `W` (see [`lifecycle_layout`]). Offload
//! really copies buffers into separate host allocations and frees the originals, and every rank
//! keeps a [`MemoryMeter`] of its "device" memory. The GPU backends are checked against this one
//! bit for bit.

#![warn(missing_docs)]

mod backend;
mod cast;
mod checksum;
mod error;
mod rollout;
mod state;

pub use backend::{per_rank, HostBackend};
pub use cast::cast_f32_to_bf16;
pub use checksum::{checksum_bf16, checksum_f32};
pub use error::HostError;
pub use rollout::{reference_rollout, HostRollout, RankRollout, RolloutTensor};
pub use state::{HostTrainState, MemoryMeter, ShardMut};
