//! Code shared by the examples: a toy policy that reads the rollout layout and a DAPO loop.

pub mod dapo;
pub mod rng;
pub mod toy_policy;
