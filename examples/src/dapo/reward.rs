//! The verifiable reward of the DAPO loop: token classes.
//!
//! A token's class is `token mod M`; a sample earns 1 if at least `quota` of its generated tokens
//! are of class 0, else 0. Under a policy that picks tokens uniformly a token is of class 0 with
//! probability `⌈V / M⌉ / V`, which is `1/M` to within `1/V` for every vocabulary size `V ≥ M`:
//! the rule is as hard on a 151 936-token Qwen2 vocabulary as on the toy policy's 64 tokens (a
//! rule asking for one particular token would hit `V / M` times less often on the large one).
//!
//! The target class is the same for every prompt; the prompt sets the context the policy starts
//! from. (A target that changes with the prompt is more than the toy policy learns in a
//! one-minute run: it settles on one class for every prompt and the other prompts' groups stop
//! having mixed rewards.)

/// The reward rule: at least [`RewardRule::quota`] generated tokens of class 0 modulo
/// [`RewardRule::modulus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewardRule {
    modulus: usize,
    quota: usize,
}

impl RewardRule {
    /// The rule with `modulus` classes on a vocabulary of `vocab` tokens (the modulus is capped
    /// at the vocabulary size and is at least 1) and a quota of at least 1 token.
    pub fn new(modulus: usize, quota: usize, vocab: usize) -> Self {
        RewardRule {
            modulus: modulus.min(vocab).max(1),
            quota: quota.max(1),
        }
    }

    /// The number of classes (M).
    pub fn modulus(&self) -> usize {
        self.modulus
    }

    /// Tokens of the target class a sample needs.
    pub fn quota(&self) -> usize {
        self.quota
    }

    /// Whether `token` is of the target class (class 0).
    pub fn hits(&self, token: usize) -> bool {
        token.is_multiple_of(self.modulus)
    }

    /// 1 if at least [`RewardRule::quota`] tokens of `sample` are of the target class, else 0.
    pub fn reward(&self, sample: &[usize]) -> f32 {
        if sample.iter().filter(|&&t| self.hits(t)).count() >= self.quota {
            1.0
        } else {
            0.0
        }
    }

    /// The probability that a token drawn uniformly from a vocabulary of `vocab` is of the target
    /// class (exact: the class's share of the vocabulary).
    pub fn token_hit_rate(&self, vocab: usize) -> f64 {
        if vocab == 0 {
            return 0.0;
        }
        vocab.div_ceil(self.modulus) as f64 / vocab as f64
    }

    /// The probability that a sample of `tokens` uniform tokens earns the reward (the binomial
    /// tail at the quota).
    pub fn sample_hit_rate(&self, vocab: usize, tokens: usize) -> f64 {
        let p = self.token_hit_rate(vocab);
        let mut total = 0.0;
        let mut choose = 1.0f64; // C(tokens, k)
        for k in 0..=tokens {
            if k >= self.quota {
                total += choose * p.powi(k as i32) * (1.0 - p).powi((tokens - k) as i32);
            }
            choose = choose * (tokens - k) as f64 / (k + 1) as f64;
        }
        total
    }
}
