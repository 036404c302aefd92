//! The DAPO update of the toy policy: its gradients against finite differences of the loss, the
//! shards they are written to, and one update moving the policy the way the advantages say.

use lifecycle_examples::dapo::update::{
    dapo_update, group_advantages, surrogate, token_objective, write_grads, Objective, UpdateConfig,
};
use lifecycle_examples::dapo::{prompt, Group};
use lifecycle_examples::rng::SplitMix64;
use lifecycle_examples::toy_policy::{Params, PolicyConfig, Sequence};
use lifecycle_host::HostTrainState;

const TINY: PolicyConfig = PolicyConfig {
    vocab: 8,
    hidden: 8,
    ffn: 12,
    layers: 2,
};

/// The tiny policy's initial weights with random norm gains (init sets them to one, which would
/// hide a gain-gradient error that only shows for gains ≠ 1).
fn tiny_params(seed: u64) -> Params {
    let mut params = Params::from_tensors(TINY, &TINY.init(seed)).unwrap();
    let mut rng = SplitMix64::new(seed ^ 0x5eed);
    for (spec, t) in TINY.specs().iter().zip(params.tensors_mut()) {
        if spec.shape.len() == 1 {
            t.iter_mut().for_each(|g| *g = 1.0 + rng.symmetric(0.5));
        }
    }
    params
}

struct Case {
    prompts: Vec<Vec<usize>>,
    completions: Vec<Vec<usize>>,
    advantages: Vec<f32>,
    /// log π_old − log π at the starting weights, per token: ratios spread over both sides of
    /// the clip range.
    offsets: Vec<Vec<f32>>,
    /// log π_old − log π_rollout per token: truncated importance weights below 1, between 1
    /// and the cap, and above it.
    rollout_offsets: Vec<Vec<f32>>,
    temperature: f32,
}

fn case(temperature: f32) -> Case {
    let mut rng = SplitMix64::new(11);
    let completions: Vec<Vec<usize>> = (0..4)
        .map(|_| (0..5).map(|_| (rng.next_u64() % 8) as usize).collect())
        .collect();
    let steps = [-0.6f32, -0.1, 0.05, 0.4, 0.9, -0.3];
    let offsets = (0..4)
        .map(|i| (0..5).map(|j| steps[(i * 5 + j) % steps.len()]).collect())
        .collect();
    let tis = [0.3f32, -0.4, 1.2, 0.0, -1.5, 0.6, 2.5];
    let rollout_offsets = (0..4)
        .map(|i| (0..5).map(|j| tis[(i * 5 + j) % tis.len()]).collect())
        .collect();
    Case {
        prompts: vec![vec![1, 5, 2], vec![7, 0, 3], vec![1, 5, 2], vec![4, 4, 6]],
        completions,
        advantages: vec![1.2, -0.8, 0.5, -1.5],
        offsets,
        rollout_offsets,
        temperature,
    }
}

impl Case {
    fn seqs(&self) -> Vec<Sequence<'_>> {
        self.prompts
            .iter()
            .zip(&self.completions)
            .map(|(p, c)| Sequence {
                prompt: p,
                completion: c,
            })
            .collect()
    }

    fn tokens(&self) -> usize {
        self.completions.iter().map(Vec::len).sum()
    }

    /// Old log-probabilities: the starting weights' plus the offsets.
    fn old(&self, start: &Params) -> Vec<Vec<f32>> {
        let fwd = start.forward(&self.seqs(), self.temperature).unwrap();
        fwd.logprobs()
            .iter()
            .zip(&self.offsets)
            .map(|(lp, off)| lp.iter().zip(off).map(|(a, b)| a + b).collect())
            .collect()
    }

    /// The rollout's log-probabilities: the old ones minus the rollout offsets.
    fn rollout(&self, old: &[Vec<f32>]) -> Vec<Vec<f32>> {
        old.iter()
            .zip(&self.rollout_offsets)
            .map(|(lp, off)| lp.iter().zip(off).map(|(a, b)| a - b).collect())
            .collect()
    }

    /// The loss under the default settings: verl's objective with truncated importance sampling.
    fn loss(&self, params: &Params, old: &[Vec<f32>]) -> f64 {
        let fwd = params.forward(&self.seqs(), self.temperature).unwrap();
        surrogate(
            fwd.logprobs(),
            old,
            Some(&self.rollout(old)),
            &self.advantages,
            &UpdateConfig::default(),
            self.tokens(),
        )
        .loss
    }
}

/// Largest `|analytic − numeric| / (abs + rel · max(|analytic|, |numeric|))` over every element;
/// ≤ 1 means they agree.
fn worst(analytic: &Params, numeric: &Params, abs: f32, rel: f32) -> (f32, String) {
    let mut worst = (0.0f32, String::new());
    for ((spec, a), n) in TINY
        .specs()
        .iter()
        .zip(analytic.tensors())
        .zip(numeric.tensors())
    {
        for (i, (&x, &y)) in a.iter().zip(n).enumerate() {
            let e = (x - y).abs() / (abs + rel * x.abs().max(y.abs()));
            if e > worst.0 {
                worst = (e, format!("{}[{i}]: analytic {x}, numeric {y}", spec.name));
            }
        }
    }
    worst
}

fn check_gradient(temperature: f32) {
    let start = tiny_params(3);
    let c = case(temperature);
    let old = c.old(&start);
    let fwd = start.forward(&c.seqs(), c.temperature).unwrap();
    let rollout = c.rollout(&old);
    let s = surrogate(
        fwd.logprobs(),
        &old,
        Some(&rollout),
        &c.advantages,
        &UpdateConfig::default(),
        c.tokens(),
    );
    // the weights differ from 1 and the cap binds on some tokens: TIS is in the gradient
    let plain = surrogate(
        fwd.logprobs(),
        &old,
        None,
        &c.advantages,
        &UpdateConfig::default(),
        c.tokens(),
    );
    assert!((s.loss - plain.loss).abs() > 1e-3 * plain.loss.abs());
    // both branches of the clipped objective are exercised
    assert!(
        s.clipped > 0 && s.clipped < c.tokens(),
        "{} of {} tokens clipped",
        s.clipped,
        c.tokens()
    );
    let mut analytic = Params::zeros(TINY);
    start.backward(&fwd, &s.dlogp, &mut analytic);

    let eps = 2.5e-4f32;
    let mut numeric = Params::zeros(TINY);
    let mut probe = start.clone();
    for t in 0..TINY.specs().len() {
        for i in 0..start.tensors()[t].len() {
            let w = start.tensors()[t][i];
            probe.tensors_mut()[t][i] = w + eps;
            let up = c.loss(&probe, &old);
            probe.tensors_mut()[t][i] = w - eps;
            let down = c.loss(&probe, &old);
            probe.tensors_mut()[t][i] = w;
            numeric.tensors_mut()[t][i] = ((up - down) / (2.0 * f64::from(eps))) as f32;
        }
    }
    // every tensor gets a gradient (a backward pass that skips a path would leave zeros)
    for (spec, g) in TINY.specs().iter().zip(numeric.tensors()) {
        let nonzero = g.iter().filter(|x| x.abs() > 1e-3).count();
        assert!(
            nonzero * 4 >= g.len() || spec.name.contains("embed"),
            "{}: only {nonzero} of {} numeric gradients are non-zero",
            spec.name,
            g.len()
        );
    }
    let (e, at) = worst(&analytic, &numeric, 2e-3, 2e-2);
    assert!(e <= 1.0, "gradient mismatch ({e:.2} × tolerance) at {at}");
    // the tolerance is tight enough to see a 10 % error in one tensor
    let mut wrong = analytic.clone();
    wrong.tensors_mut()[2].iter_mut().for_each(|g| *g *= 1.1);
    assert!(
        worst(&wrong, &numeric, 2e-3, 2e-2).0 > 1.0,
        "a 10 % error would pass"
    );
}

#[test]
fn backward_matches_finite_differences_of_the_dapo_loss() {
    check_gradient(1.0);
}

#[test]
fn backward_matches_finite_differences_at_a_temperature() {
    check_gradient(0.7);
}

#[test]
fn the_clipped_objective_follows_clip_higher() {
    // ratios between 0.5 and 1.5: the dual clip (at 3) and the log-ratio clamp (±20) stay out,
    // and both objectives are the clipped objective with clip-higher
    for objective in [Objective::Verl, Objective::Population] {
        let c = UpdateConfig {
            objective,
            ..UpdateConfig::default()
        };
        assert_eq!((c.clip_low, c.clip_high), (0.2, 0.28));
        // inside the range: r·A and its gradient r·A
        let t = token_objective(0.1f32.ln(), 0.1f32.ln(), 2.0, &c);
        assert!((t.value - 2.0).abs() < 1e-6 && (t.dlogp - 2.0).abs() < 1e-6 && !t.clipped);
        // A > 0: clipped above 1 + ε_high = 1.28, not at 1.2
        let r = |x: f32| x.ln();
        let t = token_objective(r(1.25), 0.0, 1.0, &c);
        assert!(!t.clipped && (t.value - 1.25).abs() < 1e-5);
        let t = token_objective(r(1.5), 0.0, 1.0, &c);
        assert!(t.clipped && t.dlogp == 0.0 && (t.value - 1.28).abs() < 1e-5);
        // A > 0 and r < 1 − ε_low: the unclipped term is the minimum, the gradient flows
        let t = token_objective(r(0.5), 0.0, 1.0, &c);
        assert!(!t.clipped && (t.dlogp - 0.5).abs() < 1e-5);
        // A < 0: clipped below 1 − ε_low = 0.8, not above
        let t = token_objective(r(0.7), 0.0, -1.0, &c);
        assert!(t.clipped && t.dlogp == 0.0 && (t.value + 0.8).abs() < 1e-5);
        let t = token_objective(r(1.5), 0.0, -1.0, &c);
        assert!(!t.clipped && (t.dlogp + 1.5).abs() < 1e-5);
    }
}

#[test]
fn advantages_are_normalised_per_group() {
    // verl: zero mean and unit sample variance (n − 1); population: unit population variance
    for (objective, dof) in [(Objective::Verl, 3.0), (Objective::Population, 4.0)] {
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], 1e-6, objective);
        let e = 0.5 * f32::sqrt(dof);
        for (x, e) in a.iter().zip([e, -e, -e, e]) {
            assert!((x - e).abs() < 1e-4, "{objective}: {a:?}");
        }
        let a = group_advantages(&[1.0, 0.0, 0.0, 0.0], 1e-6, objective);
        assert!((a.iter().sum::<f32>()).abs() < 1e-5, "zero mean: {a:?}");
        let var = a.iter().map(|x| x * x).sum::<f32>() / dof;
        assert!(
            (var - 1.0).abs() < 1e-4,
            "{objective}: unit variance: {a:?}"
        );
        assert!(group_advantages(&[1.0; 5], 1e-6, objective)
            .iter()
            .all(|&x| x == 0.0));
    }
}

#[test]
fn gradients_land_in_the_fsdp_shards_by_rows() {
    // W = 3: 8 rows split 3 / 3 / 2, 1-D gains split too
    let mut state = HostTrainState::from_tensors(3, TINY.init(5)).unwrap();
    let mut grads = Params::zeros(TINY);
    let mut k = 0.0;
    for t in grads.tensors_mut() {
        for g in t.iter_mut() {
            *g = k;
            k += 1.0;
        }
    }
    write_grads(&mut state, &grads).unwrap();
    let mut gathered: Vec<Vec<f32>> = TINY.specs().iter().map(|s| vec![-1.0; s.numel()]).collect();
    let mut shards = 0;
    state
        .for_each_shard_mut(|s| {
            let cols: usize = s.shape.iter().skip(1).product();
            gathered[s.tensor][s.rows.start * cols..s.rows.end * cols].copy_from_slice(s.grad);
            shards += 1;
        })
        .unwrap();
    assert_eq!(shards, 3 * TINY.specs().len());
    assert_eq!(gathered.as_slice(), grads.tensors());
    // a state of another policy is refused with the tensor's name
    let other = PolicyConfig { vocab: 16, ..TINY };
    let mut state = HostTrainState::from_tensors(2, other.init(5)).unwrap();
    let err = write_grads(&mut state, &grads).unwrap_err().to_string();
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
}

#[test]
fn one_update_moves_the_policy_along_the_advantages() {
    let policy = PolicyConfig {
        vocab: 16,
        hidden: 16,
        ffn: 32,
        layers: 2,
    };
    let mut rng = SplitMix64::new(9);
    let mut groups: Vec<Group> = (0..4u64)
        .map(|id| Group {
            prompt: id,
            samples: (0..4)
                .map(|_| (0..6).map(|_| (rng.next_u64() % 16) as usize).collect())
                .collect(),
            rewards: vec![1.0, 0.0, 0.0, 1.0],
            logprobs: Vec::new(),
        })
        .collect();
    let bare = groups.clone();
    // the rollout's log-probabilities: the initial policy's, off by ±0.05
    let params = Params::from_tensors(policy, &policy.init(4)).unwrap();
    for g in &mut groups {
        let p = prompt(g.prompt, policy.vocab);
        let seqs: Vec<Sequence<'_>> = g
            .samples
            .iter()
            .map(|s| Sequence {
                prompt: &p,
                completion: s,
            })
            .collect();
        let fwd = params.forward(&seqs, 1.0).unwrap();
        g.logprobs = fwd
            .logprobs()
            .iter()
            .enumerate()
            .map(|(i, lp)| {
                lp.iter()
                    .map(|&x| x + if i % 2 == 0 { 0.05 } else { -0.05 })
                    .collect()
            })
            .collect();
    }
    // Σ_groups Σ_samples A · Σ_tokens log π: the first-order objective an update must raise
    let objective = |state: &HostTrainState| -> f64 {
        let params = Params::from_state(policy, state).unwrap();
        groups
            .iter()
            .map(|g| {
                let p = prompt(g.prompt, policy.vocab);
                let seqs: Vec<Sequence<'_>> = g
                    .samples
                    .iter()
                    .map(|s| Sequence {
                        prompt: &p,
                        completion: s,
                    })
                    .collect();
                let fwd = params.forward(&seqs, 1.0).unwrap();
                group_advantages(&g.rewards, 1e-6, Objective::Verl)
                    .iter()
                    .zip(fwd.logprobs())
                    .map(|(a, lp)| f64::from(*a) * lp.iter().map(|&x| f64::from(x)).sum::<f64>())
                    .sum::<f64>()
            })
            .sum()
    };
    let mut state = HostTrainState::from_tensors(2, policy.init(4)).unwrap();
    let before = objective(&state);
    let config = UpdateConfig {
        lr: 1e-3,
        minibatches: 2,
        ..UpdateConfig::default()
    };
    // TIS is on by default: groups without the rollout's log-probabilities are refused by name
    let err = dapo_update(&mut state, policy, &bare, &config, 1.0).unwrap_err();
    assert!(
        err.to_string().contains("rollout log-probabilities")
            && err.to_string().contains("--tis-cap 0"),
        "{err}"
    );
    let stats = dapo_update(&mut state, policy, &groups, &config, 1.0).unwrap();
    let after = objective(&state);
    let m = stats.mismatch.expect("the groups carry rollout log-probs");
    assert_eq!(m.tokens, 4 * 4 * 6);
    assert!((m.mean_abs - 0.05).abs() < 1e-6, "{m:?}");
    let k3 = ((0.05f64.exp() - 1.05) + ((-0.05f64).exp() - 0.95)) / 2.0;
    assert!((m.k3 - k3).abs() < 1e-7, "{m:?}");
    let tis = stats.tis.expect("TIS is on");
    assert!((tis.mean_weight - (0.05f64.cosh())).abs() < 1e-6, "{tis:?}");
    assert_eq!(tis.capped_fraction, 0.0);
    assert!(
        after > before + 1e-3,
        "objective {before} -> {after} ({stats:?})"
    );
    assert_eq!((stats.minibatches, stats.tokens), (2, 4 * 4 * 6));
    assert!(
        stats.max_ratio_deviation > 0.0,
        "the second mini-batch saw the moved policy"
    );
    // the same update again gives the same weights bit for bit
    let mut again = HostTrainState::from_tensors(2, policy.init(4)).unwrap();
    dapo_update(&mut again, policy, &groups, &config, 1.0).unwrap();
    assert_eq!(state.snapshot(), again.snapshot());
}

#[test]
fn the_training_forward_computes_the_rollout_forward() {
    use half::bf16;
    use lifecycle_core::Lifecycle;
    use lifecycle_examples::toy_policy::TpGroup;
    use lifecycle_host::HostBackend;
    use lifecycle_layout::HostTensor;

    let policy = PolicyConfig {
        vocab: 16,
        hidden: 24,
        ffn: 32,
        layers: 2,
    };
    // masters already on the bf16 grid: the two forwards then differ only in summation order
    let tensors: Vec<HostTensor> = policy
        .init(8)
        .into_iter()
        .map(|t| {
            let data = t.data.to_f32().unwrap();
            let rounded = data.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            HostTensor::f32(t.name, t.shape, rounded)
        })
        .collect();
    let params = Params::from_tensors(policy, &tensors).unwrap();
    let state = HostTrainState::from_tensors(2, tensors).unwrap();
    let layout = policy.rollout_layout(2).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group = TpGroup::new(weights.ranks.iter().collect(), policy);
    let p = prompt(3, policy.vocab);
    let completions: Vec<Vec<usize>> = vec![vec![1, 9, 4, 4, 15], vec![0, 2, 7, 11, 3]];
    for temperature in [1.0, 0.6] {
        let seqs: Vec<Sequence<'_>> = completions
            .iter()
            .map(|c| Sequence {
                prompt: &p,
                completion: c,
            })
            .collect();
        let fwd = params.forward(&seqs, temperature).unwrap();
        for (c, train) in completions.iter().zip(fwd.logprobs()) {
            let rollout = group.score(&p, c, temperature);
            for (a, b) in train.iter().zip(&rollout) {
                assert!((a - b).abs() < 1e-4, "{train:?} vs {rollout:?}");
            }
        }
    }
    drop(group);
    session.finish().unwrap();
}
