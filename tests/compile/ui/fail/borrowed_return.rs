// A rollout function cannot return borrows of the weights: they would outlive the session.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout]
fn first(w: RolloutView<'_, Vec<f32>>) -> &f32 {
    w.get().first().unwrap()
}

#[sharded_rollout]
fn view(w: RolloutView<'_, Vec<f32>>) -> Option<RolloutView<'_, Vec<f32>>> {
    Some(w)
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let x: f32 = *first(&mut lc)?;
    let v: Option<RolloutView<'_, Vec<f32>>> = view(&mut lc)?;
    println!("{x} {}", v.is_some());
    Ok(())
}

include!("../copying.rs");
