//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-layout --test integration fp8_oracle` runs one file's tests).

mod fp8_oracle;
mod megatron_plan_7b_shape;
mod peft_names;
