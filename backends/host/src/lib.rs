//! The CPU executors: the reference every GPU executor is checked against, bit for bit.
//!
//! Ranks are threads of one process and collectives are shared-memory copies. The training layout
//! is FSDP2's dim-0 sharding of fp32 master weights, grads and Adam moments; the rollout layout is
//! bf16 tensor parallel of degree `T` dividing `W` (see [`lifecycle_layout`]). Offload
//! really copies buffers into separate host allocations and frees the originals, and every rank
//! keeps a [`MemoryMeter`] of its "device" memory. The GPU backends are checked against this one
//! bit for bit.
//!
//! [`megatron`] is the CPU executor of Megatron-Core training layouts (TP × PP × DP, fused QKV and
//! gate/up, padded vocabulary, distributed optimizer).
//!
//! [`fp8`] makes fp8 rollout weights (block-scaled e4m3) from the FSDP masters as a switch would:
//! each block's amax agreed between the ranks holding its rows, every piece quantised by its
//! source; checked against quantising the full tensors. ([`HostBackend`] with
//! `RolloutDtype::Fp8` runs it as a switch; the GPU FSDP backend quantises the same way on the
//! device, bit for bit.)
//!
//! The training states they switch live below them, in `lifecycle-state` (re-exported here).

#![warn(missing_docs)]

mod backend;
pub mod fp8;
pub mod megatron;
mod rollout;
pub mod steps;

pub use backend::{per_rank, HostBackend};
pub use lifecycle_state::{
    cast_f32_to_bf16, checksum_bf16, checksum_f32, checksum_tensor, HostError, HostTrainState,
    MemoryMeter, ShardMut,
};
pub use rollout::reference_rollout;
