//! The DAPO loop: lazy spends one switch per training step whatever the number of gen batches,
//! eager one per gen batch, and both see the same weights (identical samples).

use lifecycle_core::{Lifecycle, MemoryPolicy, Switching};
use lifecycle_examples::dapo::{generate, run, DapoConfig, DapoError, GenJob};
use lifecycle_examples::toy_policy::PolicyConfig;
use lifecycle_host::{HostBackend, HostTrainState};

fn small() -> DapoConfig {
    DapoConfig {
        steps: 3,
        world: 2,
        tp: 2,
        prompts_per_batch: 2,
        group_size: 6,
        batch_groups: 4,
        max_gen_batches: 32,
        tokens: 6,
        policy: PolicyConfig {
            vocab: 32,
            hidden: 32,
            ffn: 64,
            layers: 2,
        },
        ..DapoConfig::default()
    }
}

#[test]
fn lazy_costs_one_switch_per_step_and_eager_one_per_gen_batch() {
    let config = small();
    let lazy = run(&config, Switching::Lazy, |_| {}).unwrap();
    let eager = run(&config, Switching::Eager, |_| {}).unwrap();
    assert!(
        lazy.gen_batches() > config.steps,
        "dynamic sampling needed extra gen batches"
    );
    for s in &lazy.steps {
        assert_eq!(
            s.switches, 1,
            "lazy step {}: {} gen batches",
            s.step, s.gen_batches
        );
        assert_eq!(s.exits, 1);
    }
    for s in &eager.steps {
        assert_eq!(s.switches as usize, s.gen_batches);
        assert_eq!(s.exits as usize, s.gen_batches);
    }
    assert_eq!(
        lazy.groups, eager.groups,
        "both policies must sample from the same weights"
    );
    assert!(eager.metrics.bytes().moved() > lazy.metrics.bytes().moved());
}

#[test]
fn samples_follow_the_weights() {
    let config = small();
    let state = HostTrainState::from_tensors(2, config.policy.init(1)).unwrap();
    let backend = HostBackend::new(config.policy.rollout_layout(2).unwrap());
    let mut lc = Lifecycle::new(backend, state);
    let job = GenJob {
        prompts: (0..4).collect(),
        group_size: 4,
        tokens: 8,
        temperature: 1.0,
        seed: 3,
        policy: config.policy,
        tp: 2,
    };
    let first = generate(&mut lc, &job).unwrap();
    let again = generate(&mut lc, &job).unwrap();
    assert_eq!(first, again, "same weights, same seed: same samples");
    assert_eq!(lc.metrics().switches(), 1);
    lc.train()
        .unwrap()
        .state_mut()
        .for_each_shard_mut(|s| s.master.iter_mut().for_each(|w| *w *= -1.0))
        .unwrap();
    let after = generate(&mut lc, &job).unwrap();
    assert_ne!(first, after, "new weights must change the samples");
    assert_eq!(lc.metrics().switches(), 2);
}

#[test]
fn an_unfillable_batch_is_a_clear_error() {
    let mut config = small();
    config.max_gen_batches = 1;
    config.batch_groups = 50;
    let err = run(&config, Switching::Lazy, |_| {}).unwrap_err();
    assert!(matches!(
        err,
        DapoError::BatchNotFilled {
            step: 1,
            gen_batches: 1,
            ..
        }
    ));
    assert!(err.to_string().contains("--max-gen-batches"), "{err}");
}

#[test]
fn bad_settings_are_rejected_before_anything_runs() {
    let mut config = small();
    config.tp = 3;
    let err = run(&config, Switching::Lazy, |_| {}).unwrap_err();
    assert!(
        err.to_string().contains("--tp 3 must divide --world 2"),
        "{err}"
    );
    let mut config = small();
    config.memory = MemoryPolicy {
        keep_rollout_resident: true,
        ..MemoryPolicy::default()
    };
    let err = run(&config, Switching::Lazy, |_| {}).unwrap_err();
    assert!(err.to_string().contains("keep_rollout_resident"), "{err}");
}
