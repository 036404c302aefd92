// A rollout function needs a `RolloutView<'_, W>` parameter (or one marked #[weights]).
use lifecycle_core::sharded_rollout;

#[sharded_rollout]
fn first(weights: &Vec<f32>, scale: f32) -> f32 {
    weights[0] * scale
}

fn main() {}
