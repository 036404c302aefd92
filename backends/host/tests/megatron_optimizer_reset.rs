//! `MegatronTrainState::reset_optimizer`: a fresh Adam on the current weights.

use crate::common::{hf_tensors, model};
use lifecycle_host::megatron::MegatronTrainState;
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::AdamParams;

fn stepped(state: &mut MegatronTrainState, seed: u64) {
    let grads = hf_tensors(&model(2, false), seed);
    state.set_grads_from_hf(grads).unwrap();
    state.adam_step(AdamParams::default()).unwrap();
}

#[test]
fn a_reset_optimizer_forgets_the_moments() {
    let m = model(2, false);
    let layout = MegatronLayout::new(m, 2, 1, 2).unwrap();
    // Two steps, then a reset: moments and step count are a fresh optimizer's, and the next
    // step differs from one that kept the moments.
    let mut a = MegatronTrainState::from_hf(layout, hf_tensors(&m, 7)).unwrap();
    stepped(&mut a, 1);
    stepped(&mut a, 2);
    assert_eq!(a.adam_steps(), 2);
    let mut b = a.clone();
    a.reset_optimizer().unwrap();
    assert_eq!(a.adam_steps(), 0);
    for r in 0..a.world() {
        let rank = a.rank(r).unwrap();
        assert!(rank.adam_m.values().iter().all(|&x| x == 0.0));
        assert!(rank.adam_v.values().iter().all(|&x| x == 0.0));
    }
    stepped(&mut a, 3);
    stepped(&mut b, 3);
    // Without the reset the moments carry history: the weights differ.
    assert_ne!(a.snapshot(), b.snapshot(), "the reset changed nothing");
}
