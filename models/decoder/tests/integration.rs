//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-decoder --test integration checkpoint_errors` runs one file's tests).

mod checkpoint_errors;
mod common;
mod continuous;
mod decoder_layouts;
mod fp8_rollout;
mod lora;
mod megatron_checkpoint;
mod megatron_rollout;
mod oracle;
mod sampling_reference;
mod scheduler_props;
