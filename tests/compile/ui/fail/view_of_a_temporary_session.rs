// A view borrows its session: taken from a session that is not kept in a variable, it dies with
// the statement (E0716). Bind the session first.
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let weights = lc.rollout()?.weights();
    println!("{}", weights[0]);
    Ok(())
}
