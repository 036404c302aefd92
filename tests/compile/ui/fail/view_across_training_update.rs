// A rollout view cannot be used across a training update: the update needs `lc` mutably (E0499).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let weights = session.weights();
    lc.train()?.state_mut()[0] = 3.0;
    println!("{}", weights[0]);
    Ok(())
}
