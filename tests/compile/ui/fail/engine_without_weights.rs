// The engine is borrowed from the rollout session that also yields the weights: a function with
// an engine and no weights view is refused, at the engine.
use lifecycle_core::{sharded_rollout, EngineMut, Lifecycle};

// `Kv`: the engine of ../engine.rs, included below.

#[sharded_rollout]
fn warm_up(decoder: EngineMut<'_, Kv>, prompts: &[u32]) -> usize {
    let _ = decoder;
    prompts.len()
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]).with_engine(Kv::default());
    let n: usize = warm_up(&mut lc, &[1, 2])?;
    println!("{n}");
    Ok(())
}

include!("../copying.rs");
include!("../engine.rs");
