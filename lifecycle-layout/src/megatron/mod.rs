//! Pure layout planning for Megatron-Core training layouts and the model they describe. Nothing
//! here touches memory.
//!
//! - [`MegatronLayout`]: TP × PP × DP ranks in Megatron-Core's rank order, per-(stage, TP rank)
//!   parameter buffers with fused QKV and gate/up, vocab-parallel embedding and output layer with
//!   Megatron's vocabulary padding, distributed-optimizer shards; for mixture-of-experts models
//!   the router and, per rank, an expert part in Megatron-Core's ETP × EP × EDP × PP expert
//!   layout ([`ExpertParallel`], [`MegatronLayout::new_moe`]).
//! - [`RolloutLayout::fused`](crate::RolloutLayout::fused): the fused TP rollout layout of degree
//!   `T` dividing W ([`crate::RolloutLayout::fused_tensors`]), experts stacked per rank (vLLM's
//!   `w13` / `w2`), split by TP or partitioned ([`crate::RolloutLayout::expert_share`]).
//! - [`plan_megatron_to_tp`]: per rollout rank, the element runs read from each training rank,
//!   grouped in buckets under a byte budget.
//!
//! Layout facts checked against Megatron-LM (read for facts only):
//! - `megatron/core/parallel_state.py`: `RankGenerator` with the default order
//!   `"tp-cp-ep-dp-pp"` builds ranks from prefix products of the sizes in that order, so with
//!   CP = EP = 1 `rank = tp + TP · (dp + DP · pp)`.
//! - `megatron/core/transformer/attention.py` (`SelfAttention.get_query_key_value_tensors`): the
//!   local `linear_qkv` output is viewed as `[groups_per_partition, (heads_per_partition /
//!   groups_per_partition + 2) · head_dim]` and split into `[q heads; k; v]` per group;
//!   `num_query_groups_per_partition = divide(num_query_groups, TP)`. When the groups are fewer
//!   than TP (supported since Megatron-LM #2565, 2025-12), `linear_qkv` stays an ordinary
//!   column-parallel weight, a plain `1/TP` chunk on dim 0 of the group-interleaved tensor, with
//!   no k/v replicas; attention all-gathers the activations and each rank picks its group. So a
//!   rank's chunk may end inside a head ([`qkv_head_row`], [`MegatronLayout::qkv_local_rows`]):
//!   with 4 heads, 1 group, head dim 16 and TP 2 each rank holds 48 rows (`[q0; q1; q2]` and
//!   `[q3; k; v]`). An earlier version of this crate gave each rank its q heads plus a copy of
//!   its group's k and v (`[64, 48]` there); that layout is gone.
//! - `megatron/core/transformer/mlp.py` (`glu`): `linear_fc1`'s local output is
//!   `torch.chunk(x, 2, dim=-1)`, first half gate (activated), second half up, so each TP rank
//!   holds `[its gate rows; its up rows]`.
//! - `megatron/training/tokenizer/tokenizer.py` (`_vocab_size_with_padding`): the vocabulary is
//!   padded up to a multiple of `make_vocab_size_divisible_by × TP`; the vocab-parallel embedding
//!   gives TP rank `t` rows `[t · V/TP, (t+1) · V/TP)` of the padded table.
//!
//! The rollout side follows vLLM's `QKVParallelLinear` (`vllm/model_executor/layers/linear.py`,
//! `weight_loader`): a rank's fused weight is `[q; k; v]` with q at 0, k at `heads_local ·
//! head_dim`, v after k, and when kv heads are fewer than T, rank `t` loads kv head
//! `t / (T / kv_heads)` (the rollout side replicates kv heads; the training side does not).
//!
//! Every inconsistency is a [`MegatronLayoutError`] naming the parameter and the fix.
//!
//! ```
//! use lifecycle_layout::megatron::*;
//! use lifecycle_layout::ModelSpec;
//! let err = MegatronLayout::new(ModelSpec::tiny(), 3, 1, 1).unwrap_err();
//! assert!(err.to_string().contains("attention heads = 8 is not divisible"));
//! ```

mod error;
mod experts;
mod fp8;
mod fp8_one_read;
mod fp8_rollout;
mod parallel;
mod plan;
mod rollout;
pub mod schedule;
mod sources;
mod steps;
mod train;

pub use error::MegatronLayoutError;
pub use experts::{ExpertCoords, ExpertParallel, ExpertPart, ExpertShard};
pub use fp8::{check_fused_fp8, fused_parts, quantised_param};
pub use fp8_one_read::{fp8_one_read, Fp8OneRead};
pub use fp8_rollout::{fp8_rollout, Fp8Rollout, StagedCopy};
pub use parallel::{MegatronParallel, MEGATRON_VOCAB_MULTIPLE};
pub use plan::{plan_megatron_to_tp, BucketConfig, MegatronPlan, RankPlan, Transfer};
pub use rollout::{ExpertShare, RolloutKind, RolloutTensorSpec};
pub use steps::StepShape;
pub use train::{
    local_kv_heads, qkv_head_row, MegatronLayout, OptimizerShard, ParamKind, ParamSlot, QkvHead,
    RankCoords,
};
