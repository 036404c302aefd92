//! Megatron-Core training layouts to the fused tensor-parallel rollout layout.

#![warn(missing_docs)]

pub mod layout;
mod model;

pub use model::{hf, ModelSpec};
