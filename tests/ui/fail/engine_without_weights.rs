// The engine is borrowed from the rollout session that also yields the weights: a function with
// an engine and no weights view is refused, at the engine.
use lifecycle_core::{sharded_rollout, EngineMut};

struct Kv;

#[sharded_rollout]
fn warm_up(decoder: EngineMut<'_, Kv>, prompts: &[u32]) -> usize {
    let _ = decoder;
    prompts.len()
}

fn main() {}
