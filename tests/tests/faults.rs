//! Transactional switches on the host backend: every phase × {error, panic} × {start, end of the
//! phase}, under the offloading and the keep-resident memory policies. After each failure the
//! master weights and optimizer state are bit-identical to before, the lifecycle is in the state
//! its error names, and the next calls work and see correct weights.

use crate::common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use lifecycle_core::{
    AfterFailure, Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, LifecycleConfig,
    LifecycleError, MemoryPolicy, Mode, Operation, Phase, RoomRequest, Switching,
};
use lifecycle_host::{reference_rollout, HostBackend, HostTrainState};

type Lc = Lifecycle<FaultInjector<HostBackend>>;

/// Master weights and Adam moments, bit for bit (grads are freed by every switch by design).
fn preserved(state: &HostTrainState) -> Vec<Vec<u32>> {
    state
        .snapshot()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 1)
        .map(|(_, v)| v)
        .collect()
}

fn setup(
    memory: MemoryPolicy,
) -> (
    Lc,
    lifecycle_core::FaultHandle,
    lifecycle_layout::RolloutLayout,
) {
    let specs = common::specs(2);
    let layout = common::layout(2, specs.clone());
    let mut state = common::state(2, &specs, 21);
    state
        .for_each_shard_mut(|s| {
            s.grad
                .iter_mut()
                .enumerate()
                .for_each(|(i, g)| *g = (i % 5) as f32 - 2.0)
        })
        .unwrap();
    state.adam_step(Default::default()).unwrap();
    let (backend, faults) = FaultInjector::new(HostBackend::new(layout.clone()));
    let config = LifecycleConfig {
        switching: Switching::Lazy,
        memory,
    };
    (
        Lifecycle::with_config(backend, state, config).unwrap(),
        faults,
        layout,
    )
}

fn check_rollout_works(lc: &mut Lc, layout: &lifecycle_layout::RolloutLayout) {
    let expected = reference_rollout(lc.peek_state(), layout).unwrap();
    let session = lc
        .rollout()
        .expect("the lifecycle is usable after the failure");
    assert_eq!(session.weights().first_difference(&expected), None);
}

/// The policies the matrix runs: the explicit default (master + Adam offloaded), and the three
/// that offload by need decides (nothing, kept resident; the optimizer state; both), each taken
/// from `MemoryPolicy::by_need` for a rollout that fits, one that needs the optimizer state out
/// and one that needs both.
fn policies() -> Vec<(&'static str, MemoryPolicy)> {
    const GB: u64 = 1 << 30;
    let fits = RoomRequest {
        free: 10 * GB,
        rollout: 2 * GB,
        engine: GB,
        margin: GB,
        optimizer: 4 * GB,
        params: 2 * GB,
        ..RoomRequest::default()
    };
    let by_need = |engine: u64| {
        MemoryPolicy::by_need(&RoomRequest { engine, ..fits })
            .expect("the request fits")
            .policy
    };
    let resident = by_need(GB);
    let optimizer = by_need(9 * GB);
    let both = by_need(12 * GB);
    assert!(resident.keep_rollout_resident && !resident.offload_optimizer);
    assert!(optimizer.offload_optimizer && !optimizer.offload_params);
    assert!(both.offload_optimizer && both.offload_params);
    vec![
        ("offload", MemoryPolicy::default()),
        ("by need: keep resident", resident),
        ("by need: optimizer out", optimizer),
        ("by need: master + optimizer out", both),
    ]
}

const KINDS: [FaultKind; 2] = [FaultKind::Error, FaultKind::Panic];
const ATS: [FaultAt; 2] = [FaultAt::Start, FaultAt::End];

#[test]
fn failures_while_entering_restore_the_training_state() {
    for (name, memory) in policies() {
        for phase in [Phase::Plan, Phase::Transfer, Phase::Offload] {
            for kind in KINDS {
                for at in ATS {
                    let what = format!("{name}: {kind:?} at {at:?} of {phase}");
                    let (mut lc, faults, layout) = setup(memory);
                    let before = preserved(lc.peek_state());
                    faults.inject(Fault::new(phase, at, kind));
                    let err = lc.rollout().map(|_| ()).expect_err(&what);
                    assert_eq!(faults.pending(), 0, "{what}: the fault fired");
                    match (&err, phase, kind) {
                        (LifecycleError::Plan(_), Phase::Plan, FaultKind::Error) => {}
                        (
                            LifecycleError::Panicked {
                                during: Operation::Plan,
                                ..
                            },
                            Phase::Plan,
                            FaultKind::Panic,
                        ) => {}
                        (
                            LifecycleError::Enter {
                                after: AfterFailure::Restored,
                                ..
                            },
                            _,
                            FaultKind::Error,
                        ) => {}
                        (
                            LifecycleError::Panicked {
                                during: Operation::Enter,
                                after: AfterFailure::Restored,
                                ..
                            },
                            _,
                            FaultKind::Panic,
                        ) => {}
                        _ => panic!("{what}: unexpected error {err}"),
                    }
                    assert!(err.to_string().contains("injected fault"), "{what}: {err}");
                    assert_eq!(lc.mode(), Mode::Train, "{what}");
                    assert!(
                        !lc.peek_state().is_offloaded(),
                        "{what}: nothing left offloaded"
                    );
                    assert_eq!(preserved(lc.peek_state()), before, "{what}: state changed");
                    check_rollout_works(&mut lc, &layout);
                    assert_eq!(preserved(lc.train().unwrap().state()), before, "{what}");
                }
            }
        }
    }
}

#[test]
fn failures_while_refreshing_release_the_stale_weights() {
    let memory = MemoryPolicy {
        keep_rollout_resident: true,
        ..MemoryPolicy::resident()
    };
    for kind in KINDS {
        for at in ATS {
            let what = format!("{kind:?} at {at:?} of a refresh's transfer");
            let (mut lc, faults, layout) = setup(memory);
            lc.enter().unwrap();
            common::perturb(lc.train().unwrap().state_mut(), 1);
            let before = preserved(lc.peek_state());
            faults.inject(Fault::new(Phase::Transfer, at, kind));
            let err = lc.rollout().map(|_| ()).expect_err(&what);
            assert!(
                matches!(
                    err,
                    LifecycleError::Refresh {
                        after: AfterFailure::Restored,
                        ..
                    } | LifecycleError::Panicked {
                        during: Operation::Refresh,
                        after: AfterFailure::Restored,
                        ..
                    }
                ),
                "{what}: {err}"
            );
            assert!(!lc.rollout_is_current());
            assert_eq!(preserved(lc.peek_state()), before, "{what}");
            check_rollout_works(&mut lc, &layout);
            assert_eq!(
                lc.metrics().enters,
                2,
                "{what}: the half-refreshed weights were replaced"
            );
        }
    }
}

#[test]
fn failures_while_exiting_fault_the_lifecycle_until_a_retry_brings_the_state_back() {
    for (name, memory) in policies() {
        for phase in [Phase::Release, Phase::Reload] {
            if phase == Phase::Release && memory.keep_rollout_resident {
                continue; // nothing is released when training starts under this policy
            }
            for kind in KINDS {
                for at in ATS {
                    let what = format!("{name}: {kind:?} at {at:?} of {phase}");
                    let (mut lc, faults, layout) = setup(memory);
                    let before = preserved(lc.peek_state());
                    lc.enter().unwrap();
                    faults.inject(Fault::new(phase, at, kind));
                    let err = lc.train().map(|_| ()).expect_err(&what);
                    assert!(
                        matches!(
                            err,
                            LifecycleError::Exit { .. }
                                | LifecycleError::Panicked {
                                    during: Operation::Exit,
                                    after: AfterFailure::Faulted { .. },
                                    ..
                                }
                        ),
                        "{what}: {err}"
                    );
                    assert!(
                        err.to_string().contains("retries"),
                        "{what}: the error says how to recover: {err}"
                    );
                    assert_eq!(lc.mode(), Mode::Faulted, "{what}");
                    // the retry brings the state back, bit for bit
                    let state = preserved(lc.train().expect("the retry succeeds").state());
                    assert_eq!(state, before, "{what}");
                    assert_eq!(lc.mode(), Mode::Train);
                    check_rollout_works(&mut lc, &layout);
                }
            }
        }
    }
}

#[test]
fn a_failing_retry_keeps_the_lifecycle_faulted_and_a_later_one_recovers() {
    let (mut lc, faults, layout) = setup(MemoryPolicy::default());
    let before = preserved(lc.peek_state());
    lc.enter().unwrap();
    for _ in 0..3 {
        faults.inject(Fault::new(Phase::Reload, FaultAt::Start, FaultKind::Error));
    }
    assert!(lc.train().is_err());
    assert!(lc.exit().is_err(), "second attempt fails too");
    assert!(lc.rollout().is_err(), "third attempt fails too");
    assert_eq!(lc.mode(), Mode::Faulted);
    assert_eq!(faults.fired().len(), 3);
    assert_eq!(preserved(lc.train().unwrap().state()), before);
    check_rollout_works(&mut lc, &layout);
}

#[lifecycle_core::sharded_rollout]
fn body(
    weights: lifecycle_core::RolloutView<'_, lifecycle_layout::HostRollout>,
    fail: u8,
) -> Result<usize, String> {
    match fail {
        1 => Err("the rollout body failed".into()),
        2 => panic!("the rollout body panicked"),
        _ => Ok(weights.ranks.len()),
    }
}

#[test]
fn a_failing_rollout_body_leaves_a_usable_lifecycle() {
    for switching in [Switching::Lazy, Switching::Eager] {
        let (mut lc, _faults, layout) = setup(MemoryPolicy::default());
        lc.set_switching(switching);
        let before = preserved(lc.peek_state());
        // an error of the body is the body's result; the switch itself succeeded
        assert_eq!(
            body(&mut lc, 1).unwrap(),
            Err("the rollout body failed".to_string())
        );
        let caught = catch_unwind(AssertUnwindSafe(|| body(&mut lc, 2)));
        assert!(caught.is_err(), "the panic reaches the caller");
        // weights were only read: lazy keeps them resident and current; eager exits next
        match switching {
            Switching::Lazy => assert!(lc.rollout_is_current()),
            Switching::Eager => {}
        }
        assert_eq!(body(&mut lc, 0).unwrap(), Ok(2));
        check_rollout_works(&mut lc, &layout);
        assert_eq!(
            preserved(lc.train().unwrap().state()),
            before,
            "{switching:?}"
        );
    }
}

#[test]
fn skip_counts_occurrences_across_calls() {
    let (mut lc, faults, _layout) = setup(MemoryPolicy::default());
    faults.inject(Fault {
        skip: 2,
        ..Fault::new(Phase::Offload, FaultAt::End, FaultKind::Error)
    });
    for _ in 0..2 {
        lc.enter().unwrap();
        lc.exit().unwrap();
    }
    assert_eq!(faults.pending(), 1);
    assert!(lc.enter().is_err(), "the third offload fails");
    assert_eq!(faults.fired().len(), 1);
}
