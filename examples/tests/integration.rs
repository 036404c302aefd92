//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-examples --test integration dapo_checkpoint` runs one file's tests).

mod dapo_checkpoint;
mod dapo_loop;
mod dapo_megatron;
mod dapo_update;
mod gpu_model;
mod reward_rule;
mod verl_objective;
