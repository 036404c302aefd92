//! Pure layout planning for Megatron-Core training layouts. Nothing here touches memory.
//!
//! - [`MegatronLayout`]: TP × PP × DP ranks in Megatron-Core's rank order, per-(stage, TP rank)
//!   parameter buffers with fused QKV and gate/up, vocab-parallel embedding and output layer with
//!   Megatron's vocabulary padding, distributed-optimizer shards.
//! - [`RolloutLayout`]: fused TP rollout tensors of degree `T` dividing W.
//! - [`plan_megatron_to_tp`]: per rollout rank, the element runs read from each training rank,
//!   grouped in buckets under a byte budget.
//!
//! Every inconsistency is a [`MegatronLayoutError`] naming the parameter and the fix.
//!
//! ```
//! use lifecycle_layout::megatron::*;
//! let err = MegatronLayout::new(ModelSpec::tiny(), 3, 1, 1).unwrap_err();
//! assert!(err.to_string().contains("attention heads = 8 is not divisible"));
//! ```

mod error;
mod model;
mod plan;
mod rollout;
pub mod schedule;
mod sources;
mod train;

pub use error::MegatronLayoutError;
pub use model::{hf, ModelSpec};
pub use plan::{plan_megatron_to_tp, BucketConfig, MegatronPlan, RankPlan, Transfer};
pub use rollout::{RolloutKind, RolloutLayout, RolloutTensorSpec, RolloutVocab};
pub use train::{local_kv_heads, MegatronLayout, ParamKind, ParamSlot, RankCoords};
