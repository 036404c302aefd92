//! The reward rule's hit rate does not shrink with the vocabulary: the default options fill
//! their batches on the toy policy's 64 tokens and on a Qwen2 vocabulary alike.

use lifecycle_examples::dapo::{DapoConfig, RewardRule};
use lifecycle_examples::rng::SplitMix64;

const VOCABS: [usize; 4] = [64, 96, 1001, 151_936];

fn default_rule(vocab: usize) -> RewardRule {
    let d = DapoConfig::default();
    RewardRule::new(d.reward_modulus, d.reward_quota, vocab)
}

#[test]
fn a_tokens_hit_rate_is_one_over_the_modulus_on_every_vocabulary() {
    for vocab in VOCABS {
        let rule = default_rule(vocab);
        // counted, not derived: every token of the vocabulary
        let members = (0..vocab).filter(|&t| rule.hits(t)).count();
        let rate = rule.token_hit_rate(vocab);
        assert_eq!(rate, members as f64 / vocab as f64, "vocab {vocab}");
        let m = rule.modulus() as f64;
        assert!(
            (rate - 1.0 / m).abs() <= 1.0 / vocab as f64,
            "vocab {vocab}: hit rate {rate}, 1/M = {}",
            1.0 / m
        );
    }
}

#[test]
fn a_samples_hit_rate_is_the_same_on_every_vocabulary() {
    let tokens = DapoConfig::default().tokens;
    let rates: Vec<f64> = VOCABS
        .iter()
        .map(|&v| default_rule(v).sample_hit_rate(v, tokens))
        .collect();
    for (v, r) in VOCABS.iter().zip(&rates) {
        assert!(
            (r - rates[0]).abs() < 0.01,
            "vocab {v}: {r} against {} on 64 tokens",
            rates[0]
        );
    }
    // and it is what uniform sampling gives (Monte Carlo against the binomial tail)
    let mut rng = SplitMix64::new(17);
    for (&vocab, &expected) in VOCABS.iter().zip(&rates) {
        let rule = default_rule(vocab);
        let n = 40_000;
        let hits: f32 = (0..n)
            .map(|_| {
                let sample: Vec<usize> = (0..tokens)
                    .map(|_| (rng.next_u64() % vocab as u64) as usize)
                    .collect();
                rule.reward(&sample)
            })
            .sum();
        let found = f64::from(hits) / n as f64;
        assert!(
            (found - expected).abs() < 0.01,
            "vocab {vocab}: {found} sampled, {expected} expected"
        );
    }
}

#[test]
fn the_default_batch_fills_on_every_vocabulary() {
    // a uniform policy (the worst case for a random checkpoint is close to it): the expected
    // groups with mixed rewards within the gen-batch limit cover the batch several times over
    let d = DapoConfig::default();
    for vocab in VOCABS {
        let p = default_rule(vocab).sample_hit_rate(vocab, d.tokens);
        let g = d.group_size as i32;
        let mixed = 1.0 - p.powi(g) - (1.0 - p).powi(g);
        let expected = mixed * (d.max_gen_batches * d.prompts_per_batch) as f64;
        assert!(
            expected >= 4.0 * d.batch_groups as f64,
            "vocab {vocab}: {expected:.1} mixed groups expected, {} needed",
            d.batch_groups
        );
    }
}

#[test]
fn the_rule_counts_target_class_tokens_against_the_quota() {
    let rule = RewardRule::new(4, 2, 64);
    assert_eq!(rule.reward(&[0, 1, 2, 3]), 0.0);
    assert_eq!(rule.reward(&[0, 1, 8, 3]), 1.0);
    assert_eq!(rule.reward(&[]), 0.0);
    // the modulus is capped at the vocabulary, the quota is at least one token
    let tiny = RewardRule::new(100, 0, 8);
    assert_eq!((tiny.modulus(), tiny.quota()), (8, 1));
    assert_eq!(tiny.reward(&[3, 8]), 1.0);
}
