// A view cannot escape the function that opened its session (E0515).
use lifecycle_core::{Lifecycle, RolloutView};

include!("../copying.rs");

fn leak(lc: &mut Lifecycle<Copying>) -> RolloutView<'_, Vec<f32>> {
    let session = lc.rollout().unwrap();
    session.weights()
}

fn main() {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    println!("{}", leak(&mut lc)[0]);
}
