// `weights = name` must name a parameter, and the selected parameter must be a `RolloutView<'_, W>`.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout(weights = policy)]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout]
fn second(#[weights] w: &Vec<f32>) -> f32 {
    w[1]
}

#[sharded_rollout]
fn third(w: &RolloutView<'_, Vec<f32>>) -> f32 {
    w[2]
}

fn main() {}
