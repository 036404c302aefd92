//! Megatron-Core training layouts to the fused tensor-parallel rollout layout.
//!
//! - `lifecycle_layout::megatron` (pure, no memory touched): the Megatron training layout (TP × PP × DP in
//!   Megatron-Core's rank order, fused `linear_qkv` per query group, fused `linear_fc1` =
//!   `[gate; up]`, vocab-parallel embedding and output layer with Megatron's padding, pipeline
//!   stages, distributed-optimizer shards), the fused rollout layout of degree `T`, and the
//!   planner that says which element runs each rollout rank reads from which training rank.
//! - [`MegatronTrainState`] / [`MegatronHostBackend`]: the CPU executor implementing
//!   [`Reshard`](lifecycle_core::Reshard), ranks as threads, real offload accounting; the rollout
//!   is a [`lifecycle_host::HostRollout`] with one tensor per fused rollout tensor per rank.
//! - [`gpu`]: the executor on NVIDIA GPUs ([`gpu::MegatronGpuBackend`]), the same plan run with
//!   NCCL send/receive steps, bit-identical to the CPU executor.
//! - [`reference_rollout`]: the independent reference (rebuild full Hugging Face tensors, slice
//!   them) the executor is checked against bit for bit; [`fuse_unfused_rollout`] fuses the FSDP
//!   backends' unfused rollout for cross-backend checks.
//!
//! Layout facts checked against Megatron-LM (read for facts only):
//! - `megatron/core/parallel_state.py`: `RankGenerator` with the default order
//!   `"tp-cp-ep-dp-pp"` builds ranks from prefix products of the sizes in that order, so with
//!   CP = EP = 1 `rank = tp + TP · (dp + DP · pp)`.
//! - `megatron/core/transformer/attention.py` (`SelfAttention.get_query_key_value_tensors`): the
//!   local `linear_qkv` output is viewed as `[groups_per_partition, (heads_per_partition /
//!   groups_per_partition + 2) · head_dim]` and split into `[q heads; k; v]` per group;
//!   `num_query_groups_per_partition = divide(num_query_groups, TP)`. Megatron-Core itself thus
//!   requires TP | groups; the case groups | TP (groups < TP) is this crate's extension, as RL
//!   stacks lay it out: each TP rank holds one group — its `heads / TP` q heads and a replica of
//!   the group's k and v heads (ranks `g · TP/groups .. (g+1) · TP/groups` share group `g`).
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
//! `t / (T / kv_heads)` — the same replication rule as the training side above.

#![warn(missing_docs)]

mod backend;
mod error;
pub mod gpu;
mod reference;
mod shard;
mod state;
mod unfused;

pub use backend::MegatronHostBackend;
pub use error::MegatronError;
pub use reference::{rebuild_hf_tensors, reference_rollout, FullTensor};
pub use state::MegatronTrainState;
pub use unfused::{fuse_unfused_rollout, unfused_rollout_specs};
