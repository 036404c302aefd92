// The engine borrowed from a session cannot be used across a training update: the update needs
// `lc` mutably (E0499), so the KV cache can never serve the new weights without a new wake.
use lifecycle_core::Lifecycle;

include!("../copying.rs");
include!("../engine.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Kv::default());
    let mut session = lc.rollout()?;
    let (_weights, mut engine) = session.parts();
    lc.train()?.state_mut()[0] = 3.0;
    engine.touch();
    Ok(())
}
