//! Shared helpers of the integration tests: a small model with awkward shapes.
#![allow(dead_code)]

use lifecycle_host::HostTrainState;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

/// Deterministic pseudo-random values (splitmix64), with a spread of magnitudes so bf16 rounding
/// is exercised.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * (1 << (z % 7)) as f32
        })
        .collect()
}

/// Specs of a tiny decoder-like model for rollout degree `tp`: split dims are multiples of `tp`
/// but (for most `W`) not of `W`, and one tensor has fewer rows than some `W`.
pub fn specs(tp: usize) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", [10 * tp, 6], Parallel::Column),
        TensorSpec::new("q", [3 * tp, 7], Parallel::Column),
        TensorSpec::new("q.bias", [3 * tp], Parallel::Column),
        TensorSpec::new("o", [7, 5 * tp], Parallel::Row),
        TensorSpec::new("norm", [7], Parallel::Replicated),
        TensorSpec::new("tiny", [2, 3], Parallel::Replicated),
        TensorSpec::new("conv", [tp, 3, 2], Parallel::Column),
    ]
}

/// A training state of `world` ranks for `specs`, filled from `seed`.
pub fn state(world: usize, specs: &[TensorSpec], seed: u64) -> HostTrainState {
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            HostTensor::f32(
                s.name.clone(),
                s.shape.clone(),
                values(seed + i as u64, s.numel()),
            )
        })
        .collect();
    HostTrainState::from_tensors(world, tensors).expect("valid test model")
}

/// The rollout layout of `specs` at degree `tp`.
pub fn layout(tp: usize, specs: Vec<TensorSpec>) -> RolloutLayout {
    RolloutLayout::new(tp, specs).expect("valid test layout")
}

/// Changes every master weight (a stand-in for an optimizer step).
pub fn perturb(state: &mut HostTrainState, step: u64) {
    state
        .for_each_shard_mut(|s| {
            for (i, w) in s.master.iter_mut().enumerate() {
                *w += 0.01 * ((i as u64 + step) % 5) as f32 + 0.001;
            }
        })
        .expect("state on device");
}
