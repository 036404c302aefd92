// An attribute argument given twice is rejected, pointing at both.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout(switching = "eager", switching = "lazy")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

fn main() {}
