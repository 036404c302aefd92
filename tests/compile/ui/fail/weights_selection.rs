// `weights = name` must name a parameter, and the selected parameter must be a `RolloutView<'_, W>`.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout(weights = policy)]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout]
fn second(#[weights] w: &Vec<f32>) -> f32 {
    w[1]
}

#[sharded_rollout]
fn third(w: &RolloutView<'_, Vec<f32>>) -> f32 {
    w[2]
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0, 3.0]);
    let sum: f32 = first(&mut lc)? + second(&mut lc)? + third(&mut lc)?;
    println!("{sum}");
    Ok(())
}

include!("../copying.rs");
