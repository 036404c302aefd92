//! The verifiable reward of the DAPO loop: token classes.
//!
//! A token's class is `token mod M`; a prompt's target class is the class of its last token; a
//! sample earns 1 if one of its generated tokens is of the target class, else 0. Under a policy
//! that picks tokens uniformly, a token hits with probability `|{t < V : t mod M = c}| / V`, which
//! is `1/M` to within `1/V` for every vocabulary size `V ≥ M`: the rule is as hard on a
//! 151 936-token Qwen2 vocabulary as on the toy policy's 64 tokens (a rule asking for one
//! particular token would hit `V / M` times less often on the large vocabulary).

/// The reward rule: classes modulo [`RewardRule::modulus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewardRule {
    modulus: usize,
}

impl RewardRule {
    /// The rule with `modulus` classes on a vocabulary of `vocab` tokens (the modulus is capped
    /// at the vocabulary size, and is at least 1).
    pub fn new(modulus: usize, vocab: usize) -> Self {
        RewardRule {
            modulus: modulus.min(vocab).max(1),
        }
    }

    /// The number of classes (M).
    pub fn modulus(&self) -> usize {
        self.modulus
    }

    /// The class of `token`.
    pub fn class(&self, token: usize) -> usize {
        token % self.modulus
    }

    /// The target class of a prompt: its last token's class (0 for an empty prompt).
    pub fn target(&self, prompt: &[usize]) -> usize {
        prompt.last().map_or(0, |&t| self.class(t))
    }

    /// 1 if a token of `sample` is of class `target`, else 0.
    pub fn reward(&self, sample: &[usize], target: usize) -> f32 {
        if sample.iter().any(|&t| self.class(t) == target) {
            1.0
        } else {
            0.0
        }
    }

    /// The probability that a token drawn uniformly from a vocabulary of `vocab` is of class
    /// `target` (exact: the class's share of the vocabulary).
    pub fn token_hit_rate(&self, vocab: usize, target: usize) -> f64 {
        if vocab == 0 || target >= self.modulus {
            return 0.0;
        }
        let members = vocab / self.modulus + usize::from(target < vocab % self.modulus);
        members as f64 / vocab as f64
    }

    /// The probability that a sample of `tokens` uniform tokens earns the reward.
    pub fn sample_hit_rate(&self, vocab: usize, target: usize, tokens: usize) -> f64 {
        let miss = 1.0 - self.token_hit_rate(vocab, target);
        1.0 - miss.powi(tokens.min(i32::MAX as usize) as i32)
    }
}
