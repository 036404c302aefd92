//! Code shared by the examples: a toy policy that reads the rollout layout, a DAPO loop on the CPU
//! backend with DAPO rollouts through the Qwen2 / Llama decoder on a checkpoint, and the DAPO loop
//! on GPUs ([`gpu_dapo`]: FSDP training state, GPU decoder rollouts).

pub mod dapo;
pub mod gpu_dapo;
pub mod lm_policy;
pub mod rng;
pub mod toy_policy;
