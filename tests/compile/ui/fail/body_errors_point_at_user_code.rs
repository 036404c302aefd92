// A type error in the body is reported on the user's code, not on generated code.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<f32>>) -> u32 {
    w[0]
}

fn main() {}
