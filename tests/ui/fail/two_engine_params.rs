// A rollout function takes at most one engine: the second is reported, naming the first.
use lifecycle_core::{sharded_rollout, EngineMut, RolloutView};

struct Kv;

#[sharded_rollout]
fn by_type(w: RolloutView<'_, Vec<f32>>, a: EngineMut<'_, Kv>, b: EngineMut<'_, Kv>) {
    let _ = (w, a, b);
}

#[sharded_rollout]
fn marked_twice(w: RolloutView<'_, Vec<f32>>, #[engine] a: &mut Kv, #[engine] b: &mut Kv) {
    let _ = (w, a, b);
}

fn main() {}
