// `switching` is "eager", "lazy" or "inherit", written as a string.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout(switching = "sometimes")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout(switching = eager)]
fn second(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[1]
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let sum: f32 = first(&mut lc)? + second(&mut lc)?;
    println!("{sum}");
    Ok(())
}

include!("../copying.rs");
