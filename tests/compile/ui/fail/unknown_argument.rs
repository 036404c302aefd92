// Unknown attribute arguments are rejected, listing the known ones.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout(policy = "lazy")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    println!("{}", first(&mut lc)?);
    first_enter(&mut lc)?;
    first_exit(&mut lc)?;
    Ok(())
}

include!("../copying.rs");
