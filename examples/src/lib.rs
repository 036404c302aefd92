//! Code shared by the examples: a toy policy that reads the rollout layout and trains on full f32
//! tensors ([`toy_policy`]: forward and backward), a DAPO loop on the CPU backend ([`dapo`]: the
//! policy-gradient update, the reward rule) with rollouts through the Qwen2 / Llama decoder on a
//! checkpoint ([`lm_policy`]), and the DAPO loop on GPUs ([`gpu_dapo`]: FSDP training state, GPU
//! decoder rollouts), and [`gpu_model`]: a model, the FSDP backend and its lifecycle built in one
//! call for the GPU decoder.

pub mod dapo;
pub mod gpu_dapo;
pub mod gpu_model;
pub mod lm_policy;
pub mod prediction;
pub mod rng;
pub mod toy_policy;
