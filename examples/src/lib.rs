//! Code shared by the examples: a toy policy that reads the rollout layout, a DAPO loop, and DAPO
//! rollouts through the Qwen2 / Llama decoder on a checkpoint.

pub mod dapo;
pub mod lm_policy;
pub mod rng;
pub mod toy_policy;
