//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-host --test integration fp8_switch` runs one file's tests).

#[path = "common/megatron.rs"]
mod common;
mod fp8_switch;
mod fsdp_plan_sim;
mod lora_frozen_base;
mod megatron_bad_layouts;
mod megatron_core_qkv;
mod megatron_executor_matrix;
mod megatron_fp8_one_read_sim;
mod megatron_fsdp_agreement;
mod megatron_optimizer_reset;
mod megatron_random_layouts;
mod megatron_schedule_sim;
