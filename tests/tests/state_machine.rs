//! Property tests of the lifecycle state machine on the host backend: random sequences of
//! rollout / train / update / enter / exit calls under every switching and memory policy.
//!
//! Checked after every step against a model of the lifecycle:
//! - lazy: switches = rollouts that found no resident weights of the current version
//!   (so, with no explicit exits, the number of version changes between rollouts);
//! - eager: switches = rollout calls;
//! - every rollout sees weights equal to weights built directly from the current training state.

use crate::common;

use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Mode, Switching};
use lifecycle_host::{reference_rollout, HostBackend};
use proptest::prelude::*;

#[derive(Debug, Clone, Copy)]
enum Op {
    Rollout,
    ReadTrain,
    Update,
    Enter,
    Exit,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Rollout),
        1 => Just(Op::ReadTrain),
        2 => Just(Op::Update),
        1 => Just(Op::Enter),
        1 => Just(Op::Exit),
    ]
}

fn policy() -> impl Strategy<Value = LifecycleConfig> {
    (any::<bool>(), 0..3u8).prop_map(|(eager, memory)| LifecycleConfig {
        switching: if eager {
            Switching::Eager
        } else {
            Switching::Lazy
        },
        memory: match memory {
            0 => MemoryPolicy::default(),
            1 => MemoryPolicy::resident(),
            _ => MemoryPolicy {
                keep_rollout_resident: true,
                ..MemoryPolicy::resident()
            },
        },
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn switches_follow_versions_and_weights_are_never_stale(
        ops in prop::collection::vec(op(), 1..40),
        config in policy(),
        world in prop::sample::select(vec![1usize, 2, 4]),
        tp_pick in 0usize..3,
    ) {
        let tps: Vec<usize> = (1..=world).filter(|t| world % t == 0).collect();
        let tp = tps[tp_pick % tps.len()];
        let specs = common::specs(tp);
        let layout = common::layout(tp, specs.clone());
        let mut lc = Lifecycle::with_config(
            HostBackend::new(layout.clone()),
            common::state(world, &specs, 42),
            config,
        ).unwrap();

        // model: the version the resident rollout weights were built from, if any
        let mut resident: Option<u64> = None;
        let mut version = 0u64;
        let mut switches = 0u64;
        let mut rollouts = 0u64;
        let keep = config.memory.keep_rollout_resident;

        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Rollout => {
                    if resident != Some(version) {
                        switches += 1;
                    }
                    resident = Some(version);
                    rollouts += 1;
                    let expected = reference_rollout(lc.peek_state(), &layout).unwrap();
                    let session = lc.rollout().unwrap();
                    prop_assert_eq!(session.version(), version);
                    prop_assert_eq!(session.weights().first_difference(&expected), None);
                    session.finish().unwrap();
                    if config.switching == Switching::Eager {
                        resident = None;
                        prop_assert_eq!(lc.mode(), Mode::Train);
                    } else {
                        prop_assert_eq!(lc.mode(), Mode::Rollout);
                    }
                }
                Op::ReadTrain => {
                    let _ = lc.train().unwrap().state().world();
                    if !keep {
                        resident = None;
                    }
                }
                Op::Update => {
                    common::perturb(lc.train().unwrap().state_mut(), step as u64);
                    version += 1;
                    if !keep {
                        resident = None;
                    }
                }
                Op::Enter => {
                    if resident != Some(version) {
                        switches += 1;
                    }
                    resident = Some(version);
                    lc.enter().unwrap();
                    prop_assert!(lc.rollout_is_current());
                }
                Op::Exit => {
                    lc.exit().unwrap();
                    resident = None;
                    prop_assert_eq!(lc.mode(), Mode::Train);
                }
            }
            prop_assert_eq!(lc.version(), version);
            prop_assert_eq!(lc.metrics().switches(), switches, "after {:?} (step {})", op, step);
        }
        if config.switching == Switching::Eager {
            let explicit_enters = ops.iter().filter(|o| matches!(o, Op::Enter)).count() as u64;
            prop_assert!(lc.metrics().switches() >= rollouts);
            prop_assert!(lc.metrics().switches() <= rollouts + explicit_enters);
        }
    }

    #[test]
    fn lazy_switches_equal_version_changes_between_rollouts(
        ops in prop::collection::vec(prop_oneof![3 => Just(Op::Rollout), 1 => Just(Op::Update)], 1..40),
        eager in any::<bool>(),
    ) {
        let specs = common::specs(2);
        let config = LifecycleConfig {
            switching: if eager { Switching::Eager } else { Switching::Lazy },
            memory: MemoryPolicy::default(),
        };
        let mut lc = Lifecycle::with_config(
            HostBackend::new(common::layout(2, specs.clone())),
            common::state(2, &specs, 9),
            config,
        ).unwrap();
        let mut last_rollout_version: Option<u64> = None;
        let mut version_changes = 0u64;
        let mut rollouts = 0u64;
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Rollout => {
                    if last_rollout_version != Some(lc.version()) {
                        version_changes += 1;
                    }
                    last_rollout_version = Some(lc.version());
                    rollouts += 1;
                    lc.rollout().unwrap().finish().unwrap();
                }
                Op::Update => {
                    common::perturb(lc.train().unwrap().state_mut(), step as u64);
                }
                _ => unreachable!("only rollouts and updates are generated"),
            }
        }
        let expected = if eager { rollouts } else { version_changes };
        prop_assert_eq!(lc.metrics().switches(), expected);
        prop_assert_eq!(lc.metrics().rollout_calls, rollouts);
    }
}
