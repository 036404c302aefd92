// The lifecycle's backend must produce the view's weights type (`Reshard<Rollout = W>`).
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<i32>>) -> i32 {
    w[0]
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let _ = first(&mut lc)?;
    Ok(())
}
