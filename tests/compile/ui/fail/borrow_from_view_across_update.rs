// A slice borrowed from the view keeps the lifecycle borrowed too: it cannot cross an update (E0499).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let head: &[f32] = &session.weights().get()[..1];
    lc.train()?.state_mut()[0] = 3.0;
    println!("{head:?}");
    Ok(())
}
