//! Verification mode of the host backend: checksums over offloaded buffers and rollout slices
//! detect corruption and name the tensor; non-finite weights are refused before anything moves;
//! a soak of many switch cycles sees no mismatch.

use crate::common;
use lifecycle_layout::settings::Configure;

use half::bf16;
use lifecycle_core::{
    Lifecycle, LifecycleError, MemoryPolicy, Metrics, Mode, PhaseRecorder, Reshard, SwitchContext,
};
use lifecycle_host::{reference_rollout, HostBackend, HostError};

fn lifecycle(verify: bool) -> Lifecycle<HostBackend> {
    let specs = common::specs(2);
    let backend = HostBackend::new(common::layout(2, specs.clone())).with_verification(verify);
    Lifecycle::new(backend, common::state(2, &specs, 8))
}

#[test]
fn a_flipped_bit_in_offloaded_state_is_reported_with_its_tensor() {
    let mut lc = lifecycle(true);
    lc.enter().unwrap();
    // The lifecycle lends no mutable access to offloaded state, so corrupt an offloaded copy and
    // drive the backend's exit on it directly.
    let mut state = lc.peek_state().clone();
    assert!(state
        .inject_offloaded_bit_flip(1, "q", "adam_m", 3, 17)
        .unwrap());
    // a buffer name that names none is an error naming it, as on the GPU backend
    let e = state
        .inject_offloaded_bit_flip(1, "q", "grads", 3, 17)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"adam_m\"") && e.contains("\"grads\""), "{e}");
    let specs = common::specs(2);
    let mut backend = HostBackend::new(common::layout(2, specs)).with_verification(true);
    let mut metrics = Metrics::default();
    let mut ctx = SwitchContext {
        memory: MemoryPolicy::default(),
        rec: PhaseRecorder::new(&mut metrics),
    };
    let err = backend.exit(&mut state, None, &mut ctx).unwrap_err();
    assert!(
        matches!(
            err,
            HostError::Corrupted {
                rank: 1,
                buffer: "adam_m",
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("adam_m of tensor `q` on rank 1 is corrupted"),
        "{text}"
    );
    // everything else came back; the corrupted buffer stayed offloaded
    assert!(state.is_offloaded());
    // and the untouched lifecycle reloads cleanly
    lc.exit().unwrap();
    assert_eq!(lc.mode(), Mode::Train);
}

#[test]
fn without_verification_the_same_flip_goes_unnoticed() {
    let mut lc = lifecycle(false);
    lc.enter().unwrap();
    let mut state = lc.peek_state().clone();
    assert!(state
        .inject_offloaded_bit_flip(0, "embed", "master", 0, 3)
        .unwrap());
    let mut backend = HostBackend::new(common::layout(2, common::specs(2)));
    let mut metrics = Metrics::default();
    let mut ctx = SwitchContext {
        memory: MemoryPolicy::default(),
        rec: PhaseRecorder::new(&mut metrics),
    };
    backend.exit(&mut state, None, &mut ctx).unwrap();
    assert!(!state.is_offloaded());
}

#[test]
fn a_changed_rollout_slice_is_reported_before_release() {
    let specs = common::specs(2);
    let mut state = common::state(2, &specs, 4);
    let mut backend = HostBackend::new(common::layout(2, specs)).with_verification(true);
    let mut metrics = Metrics::default();
    let plan = backend.plan(&state).unwrap();
    let mut rollout = {
        let mut ctx = SwitchContext {
            memory: MemoryPolicy::default(),
            rec: PhaseRecorder::new(&mut metrics),
        };
        backend.enter(&plan, &mut state, &mut ctx).unwrap()
    };
    let t = &mut rollout.ranks[1].tensors[2];
    t.data[0] = bf16::from_bits(t.data[0].to_bits() ^ 1);
    let name = t.name.clone();
    let mut ctx = SwitchContext {
        memory: MemoryPolicy::default(),
        rec: PhaseRecorder::new(&mut metrics),
    };
    let err = backend
        .exit(&mut state, Some(rollout), &mut ctx)
        .unwrap_err();
    assert_eq!(
        err,
        HostError::RolloutCorrupted {
            rank: 1,
            tensor: name.clone()
        }
    );
    assert!(err
        .to_string()
        .contains(&format!("`{name}` on rank 1 changed while resident")));
    assert!(
        !state.is_offloaded(),
        "the training state is reloaded intact"
    );
}

#[test]
fn non_finite_weights_are_refused_before_anything_moves() {
    for (bad, text) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
    ] {
        let mut lc = lifecycle(true);
        lc.train()
            .unwrap()
            .state_mut()
            .for_each_shard_mut(|s| {
                if s.name == "o" && s.rank == 1 {
                    s.master[2] = bad;
                }
            })
            .unwrap();
        let before = lc.peek_state().snapshot();
        let err = lc.rollout().map(|_| ()).unwrap_err();
        assert!(
            matches!(
                err,
                LifecycleError::Plan(HostError::NonFinite {
                    rank: 1,
                    index: 2,
                    ..
                })
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("tensor `o`") && msg.contains(text) && msg.contains("element 2 of rank 1"),
            "{msg}"
        );
        assert_eq!(lc.metrics().bytes().moved() + lc.metrics().bytes().local, 0);
        assert_eq!(lc.peek_state().snapshot(), before);
    }
    // without verification the weights are cast as they are (NaN stays NaN)
    let mut lc = lifecycle(false);
    lc.train()
        .unwrap()
        .state_mut()
        .for_each_shard_mut(|s| s.master.iter_mut().for_each(|w| *w = f32::NAN))
        .unwrap();
    assert!(lc.rollout().unwrap().weights().ranks[0].tensors[0].data[0].is_nan());
}

#[test]
fn soak_of_300_verified_cycles_sees_no_mismatch() {
    let specs = common::specs(2);
    let layout = common::layout(2, specs.clone());
    let mut lc = Lifecycle::new(
        HostBackend::new(layout.clone()).with_verification(true),
        common::state(2, &specs, 12),
    );
    let keep: fn(&lifecycle_host::HostTrainState) -> Vec<Vec<u32>> = |s| {
        s.snapshot()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 4 != 1)
            .map(|(_, v)| v)
            .collect()
    };
    for cycle in 0..300u64 {
        if cycle % 50 == 0 {
            common::perturb(lc.train().unwrap().state_mut(), cycle);
        }
        let before = keep(lc.train().unwrap().state());
        let expected = reference_rollout(lc.peek_state(), &layout).unwrap();
        {
            let s = lc.rollout().unwrap();
            assert_eq!(
                s.weights().first_difference(&expected),
                None,
                "cycle {cycle}"
            );
        }
        let after = keep(lc.train().unwrap().state());
        assert_eq!(before, after, "cycle {cycle}");
    }
    assert_eq!(lc.metrics().enters, 300);
}
