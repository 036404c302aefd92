//! The CPU executor of Megatron-Core training layouts (planned by `lifecycle_layout::megatron`).
//!
//! - [`MegatronTrainState`] / [`MegatronHostBackend`]: ranks as threads, real offload accounting,
//!   implementing [`Reshard`](lifecycle_core::Reshard); the rollout is a
//!   [`HostRollout`](lifecycle_layout::HostRollout) with one tensor per fused rollout tensor per rank.
//! - [`reference_rollout`]: the independent reference (rebuild full Hugging Face tensors, slice
//!   them) every Megatron executor is checked against bit for bit; [`fuse_unfused_rollout`] fuses
//!   the FSDP executors' unfused rollout for cross-layout checks.

mod backend;
mod reference;
mod unfused;

pub use backend::MegatronHostBackend;
pub use lifecycle_state::megatron::{MegatronError, MegatronTrainState, RankTrain, Resident};
pub use reference::{rebuild_hf_tensors, reference_rollout, FullTensor};
pub use unfused::{fuse_unfused_rollout, unfused_rollout_specs};
