//! The DAPO loop: lazy spends one switch per training step whatever the number of gen batches,
//! eager one per gen batch, and both see the same weights (identical samples and learning
//! curves); the policy learns the reward rule.

use lifecycle_core::{Lifecycle, MemoryPolicy, Switching};
use lifecycle_examples::dapo::{
    generate, run, DapoConfig, DapoError, GenJob, RewardRule, UpdateConfig, UpdateOutcome,
};
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
        reward_quota: 2,
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
    let bits = |c: Vec<f32>| c.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(lazy.curve()),
        bits(eager.curve()),
        "identical learning curves"
    );
    for (a, b) in lazy.steps.iter().zip(&eager.steps) {
        assert_eq!(a.update, b.update, "identical updates at step {}", a.step);
        assert!(matches!(a.update, UpdateOutcome::Dapo(_)));
    }
    assert!(eager.metrics.bytes().moved() > lazy.metrics.bytes().moved());
}

#[test]
fn the_toy_policy_learns_the_reward_rule() {
    let config = DapoConfig {
        steps: 10,
        update: UpdateConfig {
            lr: 3e-4,
            ..UpdateConfig::default()
        },
        ..small()
    };
    let report = run(&config, Switching::Lazy, |_| {}).unwrap();
    let (early, late) = report.quarters();
    eprintln!("learning curve {:?}", report.curve());
    assert!(
        late > early + 0.25,
        "mean reward {early:.3} -> {late:.3}: {:?}",
        report.curve()
    );
    for s in &report.steps {
        let UpdateOutcome::Dapo(pg) = &s.update else {
            panic!("step {}: {:?}", s.step, s.update);
        };
        assert_eq!(
            pg.tokens,
            config.batch_groups * config.group_size * config.tokens
        );
        assert!(pg.loss.is_finite() && pg.grad_norm > 0.0, "{pg:?}");
    }
}

/// The rollout's log-probabilities reach the update: the toy policy samples from its bf16
/// rollout copy and the update recomputes them from the fp32 masters, so they differ by the
/// rounding of the weights, which the update measures, and TIS (on by default) weighs each
/// token by min(exp(old − rollout), 2), close to 1 here; with TIS off the update is another,
/// and the mismatch is measured the same.
#[test]
fn the_update_measures_the_rollout_trainer_mismatch_and_applies_tis() {
    let config = DapoConfig {
        steps: 2,
        ..small()
    };
    let report = run(&config, Switching::Lazy, |_| {}).unwrap();
    for g in &report.groups {
        assert_eq!(g.logprobs.len(), g.samples.len());
        for (lp, s) in g.logprobs.iter().zip(&g.samples) {
            assert_eq!(lp.len(), s.len());
            assert!(lp.iter().all(|&x| x.is_finite() && x <= 0.0), "{lp:?}");
        }
    }
    let off = DapoConfig {
        update: UpdateConfig {
            tis_cap: None,
            ..config.update
        },
        ..config
    };
    let without = run(&off, Switching::Lazy, |_| {}).unwrap();
    // the first step's samples are those of the same initial weights
    assert_eq!(report.groups[0], without.groups[0]);
    for (s, t) in report.steps.iter().zip(&without.steps) {
        let (UpdateOutcome::Dapo(on), UpdateOutcome::Dapo(off)) = (&s.update, &t.update) else {
            panic!("step {}: {:?}", s.step, s.update);
        };
        let m = on
            .mismatch
            .expect("the toy rollout reports log-probabilities");
        eprintln!("step {}: {m:?}, {:?}", s.step, on.tis);
        assert_eq!(m.tokens, on.tokens);
        // bf16 weights against fp32: a small, non-zero mismatch
        assert!(m.mean_abs > 0.0 && m.mean_abs < 0.05, "{m:?}");
        assert!(m.k3 >= 0.0 && m.k3 < 1e-2, "{m:?}");
        let tis = on.tis.expect("TIS is on by default");
        assert_eq!(tis.cap, 2.0);
        assert!((tis.mean_weight - 1.0).abs() < 0.05, "{tis:?}");
        assert!(off.tis.is_none() && off.mismatch.is_some());
        if s.step == 1 {
            // the same samples and old log-probs: TIS changes the loss, not the mismatch
            assert_eq!(off.mismatch, on.mismatch);
            assert_ne!(off.loss, on.loss);
        }
        assert!(
            s.rollout_logprob.is_some_and(|lp| lp < 0.0),
            "{:?}",
            s.rollout_logprob
        );
    }
}

#[test]
fn the_default_run_is_set_up_to_learn() {
    // the settings the example runs by default: the update is DAPO with clip-higher
    let d = DapoConfig::default();
    assert_eq!((d.update.clip_low, d.update.clip_high), (0.2, 0.28));
    assert!(
        d.update.minibatches >= 2,
        "ratios other than 1 need a second mini-batch"
    );
    let rule = RewardRule::new(d.reward_modulus, d.reward_quota, d.policy.vocab);
    let p = rule.sample_hit_rate(d.policy.vocab, d.tokens);
    assert!(
        (0.05..0.5).contains(&p),
        "a uniform policy scores {p}: room to learn"
    );
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
        reward: RewardRule::new(4, 2, config.policy.vocab),
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
fn a_step_whose_gen_batches_run_out_trains_on_the_groups_gathered() {
    let mut config = small();
    config.max_gen_batches = 1;
    config.batch_groups = 50;
    config.steps = 2;
    let report = run(&config, Switching::Lazy, |_| {}).unwrap();
    assert_eq!(report.steps.len(), 2, "the run reaches its end");
    for s in &report.steps {
        assert_eq!(s.gen_batches, 1, "step {}", s.step);
        assert_eq!(s.short_of, Some(50), "step {}", s.step);
        assert!(
            s.kept > 0 && s.kept < 50,
            "step {}: kept {}",
            s.step,
            s.kept
        );
    }
    let line = report.short_steps().unwrap();
    assert!(line.contains("--max-gen-batches"), "{line}");
    assert!(
        line.contains(&format!("step 1 ({} of 50 groups)", report.steps[0].kept)),
        "{line}"
    );
    // a full batch says nothing
    let full = run(&small(), Switching::Lazy, |_| {}).unwrap();
    assert!(full.steps.iter().all(|s| s.short_of.is_none()));
    assert_eq!(full.short_steps(), None);
}

#[test]
fn a_step_without_any_mixed_group_is_a_clear_error() {
    // one class: every token is of the target class, every reward 1, every group uniform
    let mut config = small();
    config.max_gen_batches = 2;
    config.reward_modulus = 1;
    let err = run(&config, Switching::Lazy, |_| {}).unwrap_err();
    assert!(matches!(
        err,
        DapoError::BatchNotFilled {
            step: 1,
            kept: 0,
            gen_batches: 2,
            ..
        }
    ));
    let text = err.to_string();
    assert!(
        text.contains("--max-gen-batches") && text.contains("nothing to train on"),
        "{text}"
    );
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
