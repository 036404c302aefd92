// `weights = name` selects the view; other `RolloutView` parameters are then plain arguments.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

/// Difference between the policy's first weight and a reference model's.
#[sharded_rollout(weights = policy)]
fn drift(reference: RolloutView<'_, Vec<f32>>, policy: RolloutView<'_, Vec<f32>>) -> f32 {
    policy[0] - reference[0]
}

pub fn main() -> LcResult {
    let mut reference = Lifecycle::new(Copying, vec![1.0]);
    let mut policy = Lifecycle::new(Copying, vec![3.5]);
    let session = reference.rollout()?;
    assert_eq!(drift(&mut policy, session.weights())?, 2.5);
    session.finish()
}
