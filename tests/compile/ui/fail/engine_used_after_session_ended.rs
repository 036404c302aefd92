// The engine cannot be used after its session ended: `finish` (and `exit`) consume the session
// while the engine still borrows it (E0505).
use lifecycle_core::Lifecycle;

include!("../copying.rs");
include!("../engine.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Kv::default());
    let mut session = lc.rollout()?;
    let (_, mut engine) = session.parts();
    session.finish()?;
    engine.touch();
    Ok(())
}
