// A rollout function takes exactly one weights view: the second is reported, naming the first.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
fn compare(policy: RolloutView<'_, Vec<f32>>, reference: RolloutView<'_, Vec<f32>>) -> f32 {
    policy[0] - reference[0]
}

#[sharded_rollout]
fn marked_twice(#[weights] a: RolloutView<'_, Vec<f32>>, #[weights] b: RolloutView<'_, Vec<f32>>) {
    let _ = (a, b);
}

fn main() {}
