// A return type that borrows the view through a hidden lifetime is caught by the borrow checker.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout]
fn iter(w: RolloutView<'_, Vec<f32>>) -> std::slice::Iter<f32> {
    w.get().iter()
}

fn main() {}
