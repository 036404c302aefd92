// A view cannot be held across a call of a #[sharded_rollout] function: it takes `&mut lc` (E0499).
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let weights = session.weights();
    let x = first(&mut lc)?;
    println!("{} {}", weights[1], x);
    Ok(())
}
