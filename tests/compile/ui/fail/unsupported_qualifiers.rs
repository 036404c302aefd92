// `const fn`, `unsafe fn` and `extern` functions cannot be rollout functions.
#![allow(improper_ctypes_definitions)]
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout]
const fn constant(_w: RolloutView<'_, Vec<f32>>) -> f32 {
    0.0
}

#[sharded_rollout]
unsafe fn dangerous(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

#[sharded_rollout]
extern "C" fn foreign(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let sum: f32 = constant(&mut lc)? + dangerous(&mut lc)? + foreign(&mut lc)?;
    println!("{sum}");
    Ok(())
}

include!("../copying.rs");
