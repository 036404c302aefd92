//! A Qwen2 / Llama decoder that reads the rollout tensor-parallel layout of the host backend
//! directly, and Hugging Face checkpoints (`config.json` + `model.safetensors`).
//!
//! - [`ModelConfig`]: both `config.json` spellings (transformers 4.x `rope_theta`/`torch_dtype`,
//!   5.x `rope_parameters`/`dtype`), the tensors a config implies, and
//!   [`ModelConfig::rollout_layout`], which picks every split for a TP degree `T` (vocabulary
//!   replicated when it does not divide by `T`, kv heads replicated when there are fewer than `T`).
//! - [`load_checkpoint`] / [`save_checkpoint`]: safetensors ⇄ [`lifecycle_layout::HostTensor`].
//! - [`Decoder`]: batched prefill, decode steps with a KV cache, greedy or temperature sampling;
//!   [`CpuDecoder`] is the CPU reference (bf16 weights, f32 accumulation). A GPU implementation is
//!   meant to sit behind the same trait.
//!
//! - Megatron: [`ModelConfig::model_spec`] / [`MegatronConfig::megatron_layout`] map a config to
//!   `lifecycle_megatron`'s model description and training layout (errors name the `config.json`
//!   field Megatron cannot split), [`Checkpoint::megatron_state`] and [`load_megatron_checkpoint`]
//!   build a [`lifecycle_state::megatron::MegatronTrainState`] from a checkpoint at any TP × PP × DP, and
//!   [`CpuDecoder::new_fused`] rolls out from the Megatron backend's fused rollout weights
//!   (`[q; k; v]`, `[gate; up]`, padded vocabulary) with the same logits as from the unfused ones.
//!   This crate depends on `lifecycle-megatron`, not the other way round: the backend stays free of
//!   file formats (`config.json`, safetensors) and knows only its own `ModelSpec`.
//!
//! The CPU decoder is checked against Hugging Face `transformers` on the tiny checkpoints under
//! `fixtures/` (see `fixtures/make_fixtures.py` and `tests/oracle.rs`).

#![warn(missing_docs)]

mod adapters;
mod checkpoint;
mod config;
mod cpu;
mod decoder;
mod error;
mod fused_weights;
mod heads;
mod math;
mod megatron_checkpoint;
pub mod rollout;
mod sampling;
mod spec_check;
mod weights;

pub use adapters::check_adapters;
pub use checkpoint::{load_checkpoint, random_tensors, read_tensors, save_checkpoint, Checkpoint};
pub use config::{check_token, Architecture, ConfigStyle, ModelConfig};
pub use cpu::{CpuDecoder, DEFAULT_SLOTS};
pub use decoder::{Decoder, PrefillLogits};
pub use error::{CheckpointError, DecodeError, MegatronCheckpointError};
pub use heads::{head_shares, layout_heads, HeadShare};
pub use lifecycle_layout::KvDtype;
pub use math::{dot, route_top_k};
pub use megatron_checkpoint::{
    load_megatron_checkpoint, MegatronCheckpoint, MegatronConfig, MegatronParallel,
    MEGATRON_VOCAB_MULTIPLE,
};
pub use rollout::groups::{Filled, GroupStream, Leftovers};
pub use rollout::pages::{KvPages, KvPaging};
pub use rollout::pick::{kept, pick, Picked};
pub use rollout::request::{FinishReason, Request, Sample, SamplingParams};
pub use rollout::scheduler::{PickArgs, Scheduler, SlotDecoder};
pub use sampling::{argmax, sample_token, Sampling, SplitMix64};
pub use spec_check::rollout_spec;
