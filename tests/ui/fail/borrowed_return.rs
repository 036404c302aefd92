// A rollout function cannot return borrows of the weights: they would outlive the session.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<f32>>) -> &f32 {
    w.get().first().unwrap()
}

#[sharded_rollout]
fn view(w: RolloutView<'_, Vec<f32>>) -> Option<RolloutView<'_, Vec<f32>>> {
    Some(w)
}

fn main() {}
