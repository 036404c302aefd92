// A rollout function takes at most one engine: the second is reported, naming the first.
use lifecycle_core::{sharded_rollout, EngineMut, Lifecycle, RolloutView};

// `Kv`: the engine of ../engine.rs, included below.

#[sharded_rollout]
fn by_type(w: RolloutView<'_, Vec<f32>>, a: EngineMut<'_, Kv>, b: EngineMut<'_, Kv>) {
    let _ = (w, a, b);
}

#[sharded_rollout]
fn marked_twice(w: RolloutView<'_, Vec<f32>>, #[engine] a: &mut Kv, #[engine] b: &mut Kv) {
    let _ = (w, a, b);
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]).with_engine(Kv::default());
    by_type(&mut lc)?;
    marked_twice(&mut lc)?;
    Ok(())
}

include!("../copying.rs");
include!("../engine.rs");
