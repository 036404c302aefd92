// A view cannot move into `std::thread::spawn`: the thread may outlive the session (E0597).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let session = lc.rollout()?;
    let weights = session.weights();
    let handle = std::thread::spawn(move || weights[0]);
    println!("{}", handle.join().unwrap());
    Ok(())
}
