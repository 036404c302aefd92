// A view cannot be stored where it would outlive its session, such as a struct that must be
// `'static` (E0597): keep owned data there, in a `VersionedCache` looked up with the view of each
// call.
use lifecycle_core::{Lifecycle, RolloutView};

include!("../copying.rs");

struct Scorer {
    weights: Option<RolloutView<'static, Vec<f32>>>,
}

fn main() -> LcResult {
    let mut scorer = Scorer { weights: None };
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    scorer.weights = Some(session.weights());
    session.finish()?;
    println!("{}", scorer.weights.is_some());
    Ok(())
}
