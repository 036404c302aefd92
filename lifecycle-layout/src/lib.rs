//! Pure planning for weight switches: which bytes of which training shard land where in the
//! rollout layout, and the step plans the CPU and GPU executors run.
//!
//! This crate links no GPU library; everything here is computed and tested on the CPU.
//!
//! - The root: the FSDP2 → tensor-parallel planner ([`plan_fsdp_to_tp`]) and the types every
//!   layout shares ([`TensorSpec`], [`DType`], [`Parallel`], [`Region2d`], [`HostTensor`],
//!   [`AdamParams`]).
//! - [`fsdp`]: the FSDP executors' flat shard buffers and their per-bucket cast / send / receive
//!   steps.
//! - [`ModelSpec`]: the one model description (shapes, heads, vocabulary padding, tied head) that
//!   planners, executors, decoders and `lifecycle-plan` share, with its Hugging Face names ([`hf`]).
//! - [`megatron`]: Megatron-Core training layouts, the fused rollout layout, their planner and the
//!   per-rank schedule.
//! - [`fp8`]: block-scaled float8 e4m3 (128 × 128 blocks, fp32 `scale_inv`), the format of the
//!   published fp8 checkpoints, checked bit for bit against PyTorch.
//! - [`lora`]: LoRA adapters in the rollout layout: their shapes, splits, PEFT names and checks.
//! - [`settings`]: the options every switch backend holds and their builders, written once.
//! - [`steps`]: the step plans both layouts produce and every executor runs (copies, network
//!   steps, staging slots), compiled into stream programs.
//!
//! Nothing here touches memory: the planner turns tensor descriptions into a [`ReshardPlan`] that
//! the host and GPU executors run. Every inconsistency is a [`LayoutError`] naming the tensor and
//! the fix.
//!
//! - Training layout ([`FsdpLayout`]): every tensor split on dim 0 across `W` ranks by PyTorch
//!   FSDP2's rule: rank `r` holds rows `[r·c, min((r+1)·c, n))` with `c = ⌈n / W⌉`.
//! - Rollout layout ([`RolloutLayout`], one type for both formats): tensor parallel of degree
//!   `T` dividing `W`; rank `r` is TP rank `r mod T`. Unfused ([`RolloutLayout::new`], what the
//!   FSDP planner produces): [`Parallel::Column`] tensors split on dim 0, [`Parallel::Row`]
//!   tensors on dim 1, [`Parallel::Replicated`] tensors whole on every rank. Fused
//!   ([`RolloutLayout::fused`], what the Megatron planner produces): `[q; k; v]` and
//!   `[gate; up]` per rank, the vocabulary sized by a [`RolloutVocab`].
//!
//! ```
//! use lifecycle_layout::{FsdpLayout, Parallel, RolloutLayout, TensorSpec, plan_fsdp_to_tp};
//! let specs = vec![
//!     TensorSpec::new("up", [6, 4], Parallel::Column),
//!     TensorSpec::new("down", [4, 6], Parallel::Row),
//!     TensorSpec::new("norm", [4], Parallel::Replicated),
//! ];
//! let train = FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
//! let rollout = RolloutLayout::new(2, specs)?;
//! let plan = plan_fsdp_to_tp(&train, &rollout)?;
//! // With W = T = 2, a column-parallel slice is the rank's own shard: nothing crosses a link.
//! let up = &plan.ranks[0].tensors[0];
//! assert!(up.pieces.iter().all(|p| p.src_rank == 0));
//! # Ok::<(), lifecycle_layout::LayoutError>(())
//! ```

#![warn(missing_docs)]

// `spec` first: rustdoc lists a type's inherent methods in the order of the modules that define
// them, so `RolloutLayout`'s page opens with its own (`new`, `tp`, `tensors`, ...) before the
// Megatron and mixture-of-experts ones of `megatron::rollout`.
mod spec;

mod adam;
mod entry;
mod error;
pub mod fp8;
pub mod fsdp;
mod hf_config;
mod host_rollout;
mod kv;
pub mod lora;
pub mod megatron;
mod model;
mod plan;
mod region;
pub mod settings;
pub mod steps;
mod tensor;
pub mod vllm;

pub use adam::AdamParams;
pub use entry::RolloutEntry;
pub use error::{ConfigError, LayoutError};
pub use hf_config::{Architecture, ConfigStyle, ModelConfig};
pub use host_rollout::{HostRollout, RankRollout, RolloutTensor};
pub use kv::KvDtype;
pub use model::{hf, LayerSet, ModelSpec, MoeSpec};
pub use plan::{plan_fsdp_to_tp, Piece, RankPlan, ReshardPlan, TensorPlan};
pub use region::Region2d;
pub use spec::{
    fsdp_rows, tp_range, DType, ExpertPlacement, FsdpLayout, Parallel, RolloutFormat,
    RolloutLayout, RolloutVocab, TensorSpec,
};
pub use tensor::{HostTensor, TensorData};
