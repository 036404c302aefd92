// A sync free function called three times in a row enters rollout mode once (lazy switching).
use lifecycle_core::{sharded_rollout, Lifecycle, Mode, RolloutView};

include!("../copying.rs");

/// Sum of the weights times `scale`.
#[sharded_rollout]
fn score(weights: RolloutView<'_, Vec<f32>>, scale: f32) -> f32 {
    weights.iter().sum::<f32>() * scale
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    for _ in 0..3 {
        assert_eq!(score(&mut lc, 2.0)?, 6.0);
    }
    assert_eq!(lc.metrics().enters, 1);
    assert_eq!(lc.mode(), Mode::Rollout);
    lc.train()?.state_mut()[0] = 4.0;
    assert_eq!(score(&mut lc, 1.0)?, 6.0);
    assert_eq!(lc.metrics().enters, 2);
    Ok(())
}
