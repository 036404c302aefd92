// Unknown attribute arguments are rejected, listing the known ones.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout(policy = "lazy")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

fn main() {}
