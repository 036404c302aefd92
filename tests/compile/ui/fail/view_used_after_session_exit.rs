// A view cannot outlive its session: exiting moves the session while the view borrows it (E0505).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let weights = session.weights();
    session.exit()?;
    println!("{}", weights[0]);
    Ok(())
}
