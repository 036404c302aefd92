// The view is borrowed for one call only: a named lifetime on it is rejected.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
fn first<'a>(w: RolloutView<'a, Vec<f32>>) -> f32 {
    w[0]
}

fn main() {}
