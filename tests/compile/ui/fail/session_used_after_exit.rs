// `RolloutSession::exit` consumes the session: it cannot be used afterwards (E0382).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    session.exit()?;
    println!("{}", session.weights()[0]);
    Ok(())
}
