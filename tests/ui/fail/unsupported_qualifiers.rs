// `const fn`, `unsafe fn` and `extern` functions cannot be rollout functions.
#![allow(improper_ctypes_definitions)]
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
const fn constant(_w: RolloutView<'_, Vec<f32>>) -> f32 {
    0.0
}

#[sharded_rollout]
unsafe fn dangerous(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout]
extern "C" fn foreign(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

fn main() {}
