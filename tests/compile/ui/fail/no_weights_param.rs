// A rollout function needs a `RolloutView<'_, W>` parameter (or one marked #[weights]).
use lifecycle_core::{sharded_rollout, Lifecycle};

#[sharded_rollout]
fn first(weights: &Vec<f32>, scale: f32) -> f32 {
    weights[0] * scale
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let x: f32 = first(&mut lc, 2.0)?;
    println!("{x}");
    Ok(())
}

include!("../copying.rs");
