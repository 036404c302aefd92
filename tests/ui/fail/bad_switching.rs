// `switching` is "eager", "lazy" or "inherit", written as a string.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout(switching = "sometimes")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout(switching = eager)]
fn second(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[1]
}

fn main() {}
