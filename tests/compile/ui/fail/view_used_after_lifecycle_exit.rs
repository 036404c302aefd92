// A view cannot be used after `Lifecycle::exit` released the weights (E0499).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let weights = session.weights();
    lc.exit()?;
    println!("{}", weights[0]);
    Ok(())
}
