// The view borrows the session shared, `engine_mut` borrows it mutably: they cannot be held
// together (E0502). `RolloutSession::parts` lends both at once.
use lifecycle_core::Lifecycle;

include!("../copying.rs");
include!("../engine.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Kv::default());
    let mut session = lc.rollout()?;
    let weights = session.weights();
    let mut engine = session.engine_mut();
    engine.cache[0] = weights[0];
    session.finish()
}
