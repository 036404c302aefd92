// The generated function returns a `Result` that must be used: a failed switch cannot go unnoticed.
#![deny(unused_must_use)]
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

fn main() {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    first(&mut lc);
    let _: LcResult = lc.exit();
}
