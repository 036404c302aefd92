// A rollout function that takes an engine runs only on a lifecycle with that engine attached
// (E0308): a lifecycle without one is refused at the call.
use lifecycle_core::{sharded_rollout, EngineMut, Lifecycle, RolloutView};

include!("../copying.rs");
include!("../engine.rs");

#[sharded_rollout]
fn decode(weights: RolloutView<'_, Vec<f32>>, mut kv: EngineMut<'_, Kv>) -> f32 {
    weights[0] + kv.touch()
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    decode(&mut lc)?;
    Ok(())
}
