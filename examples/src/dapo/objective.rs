//! The DAPO objective of the update: group advantages and the per-token clipped objective with
//! its derivative with respect to the new log-probability, in two variants ([`Objective`]), and
//! verl's truncated importance sampling between the rollout's and the trainer's log-probabilities
//! ([`tis_weight`], [`Mismatch`]).
//!
//! With `r` a group's rewards, `ε` [`UpdateConfig::adv_eps`], `d = logp − old_logp` a token's
//! log-ratio and `A` its sequence's advantage, the per-token loss is `ℓ` and the loss of a
//! mini-batch is the token mean `L = (1/N) Σ_tokens ℓ` over its `N` completion tokens
//! ([`super::update::surrogate`]). The objective this module returns is `−ℓ` (its `value`) and
//! `−∂ℓ/∂logp` (its `dlogp`).
//!
//! **[`Objective::Verl`]** (the default), as verl computes it in `compute_grpo_outcome_advantage`
//! and in the "vanilla" policy loss (`compute_policy_loss_vanilla` / `compute_policy_loss`,
//! `loss_agg_mode = "token-mean"`):
//!
//! - `A_i = (r_i − mean(r)) / (std(r) + ε)` with the sample standard deviation (Bessel's
//!   correction, `n − 1`, as `torch.std`); a group of one sample has mean 0 and std 1 there, so
//!   `A = r / (1 + ε)`; a group of equal rewards has `A = 0`.
//! - `ρ = exp(clamp(d, −20, 20))` ([`LOG_RATIO_CLAMP`]).
//! - `ℓ₁ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))`; for `A < 0` the dual clip
//!   `ℓ = min(ℓ₁, −A·c)` with `c` [`UpdateConfig::clip_ratio_c`] (3), else `ℓ = ℓ₁`.
//! - `∂ℓ/∂logp = −A·ρ` where the unclipped term `−A·ρ` is the one `ℓ` takes and `|d| ≤ 20`;
//!   0 where the ratio clip binds, where the dual clip binds (`ℓ = −A·c` does not depend on
//!   `logp`) and where the log-ratio clamp binds (`|d| > 20`).
//!
//! **[`Objective::Population`]**, the loop's first objective:
//!
//! - `A_i = (r_i − mean(r)) / (std(r) + ε)` with the population standard deviation (`n`); a group
//!   of one sample has `A = 0`.
//! - `ρ = exp(d)`, `ℓ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))`: clip-higher, no dual clip,
//!   no log-ratio clamp; `∂ℓ/∂logp = −A·ρ` where the unclipped term is taken, else 0.
//!
//! **Truncated importance sampling** (TIS, [`UpdateConfig::tis_cap`] `= Some(C)`, `C = 2` by
//! default; either objective), as verl's `compute_policy_loss_vanilla` applies it after the dual
//! clip and before the aggregation when it is given `rollout_log_probs`: with `rollout_logp` the
//! log-probability the rollout engine sampled the token with (its weights, its numerics) and
//! `old_logp` the trainer's recomputation of it,
//!
//! - `w = min(exp(old_logp − rollout_logp), C)` ([`tis_weight`]; no lower bound, no clamp of the
//!   exponent: `w` is `C` wherever the exponential overflows);
//! - `ℓ_TIS = w·ℓ` and `∂ℓ_TIS/∂logp = w·∂ℓ/∂logp`: neither `old_logp` nor `rollout_logp`
//!   depends on `logp`, so `w` carries no gradient; the token mean divides by the same `N`.
//!
//! The weight corrects for the rollout sampling from a slightly different distribution than the
//! trainer's `π_old` (bf16 or fp8 rollout weights, other kernels); [`Mismatch`] measures that
//! difference.
//!
//! Ties: where both terms of a `max` / `min` are equal and depend on `logp` differently, torch's
//! autograd splits the gradient between them; this module gives the whole gradient to the
//! unclipped term, and the dual clip binds only where `−A·c` is strictly below `ℓ₁`. Inside the
//! clip range the two terms and their gradients agree, so only a ratio of exactly `c` (dual clip)
//! tells the two conventions apart.

use std::fmt;

use super::update::UpdateConfig;

/// The cap `C` of verl's truncated importance sampling in [`UpdateConfig::default`] (verl's
/// `tis_imp_ratio_cap` in its DAPO recipes).
pub const DEFAULT_TIS_CAP: f32 = 2.0;

/// verl's clamp of the log-ratio `logp − old_logp` before the exponential (`±20`): beyond it the
/// ratio is constant and its gradient is zero.
pub const LOG_RATIO_CLAMP: f32 = 20.0;

/// Which DAPO objective the update computes (see the module docs for the formulas).
///
/// ```
/// use lifecycle_examples::dapo::update::{group_advantages, Objective, UpdateConfig};
///
/// assert_eq!(UpdateConfig::default().objective, Objective::Verl);
/// // verl divides by the sample std (n − 1), the population variant by the population std (n)
/// let verl = group_advantages(&[1.0, 0.0], 0.0, Objective::Verl);
/// let population = group_advantages(&[1.0, 0.0], 0.0, Objective::Population);
/// assert!((verl[0] - 0.5f32.sqrt()).abs() < 1e-6 && (population[0] - 1.0).abs() < 1e-6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Objective {
    /// verl's GRPO advantages (sample std, a one-sample group has mean 0 and std 1) and its
    /// vanilla token-mean policy loss: clip-higher, the dual clip at
    /// [`UpdateConfig::clip_ratio_c`] for negative advantages, the log-ratio clamped to ±20.
    #[default]
    Verl,
    /// The population std of the group's rewards, clip-higher, no dual clip, no log-ratio clamp
    /// (the loop's objective before it followed verl).
    Population,
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Objective::Verl => "verl",
            Objective::Population => "population",
        })
    }
}

impl Objective {
    /// What the report says of the objective under `config`, e.g. "verl's objective (token-mean
    /// clipped loss, ε_low 0.2 / ε_high 0.28, dual-clip 3, log-ratio clamp ±20, advantages over
    /// the sample std), truncated importance sampling capped at 2".
    pub fn summary(self, config: &UpdateConfig) -> String {
        let tis = match config.tis_cap {
            Some(cap) => format!(
                "truncated importance sampling min(exp(old − rollout log-prob), {cap}) per token"
            ),
            None => "no truncated importance sampling".to_string(),
        };
        let objective = match self {
            Objective::Verl => format!(
                "verl's objective (token-mean clipped loss, ε_low {} / ε_high {}, dual-clip {}, \
                 log-ratio clamp ±{LOG_RATIO_CLAMP}, advantages over the sample std)",
                config.clip_low, config.clip_high, config.clip_ratio_c
            ),
            Objective::Population => format!(
                "population objective (token-mean clipped loss, ε_low {} / ε_high {}, no \
                 dual-clip, advantages over the population std)",
                config.clip_low, config.clip_high
            ),
        };
        format!("{objective}, {tis}")
    }
}

/// Group-normalised advantages `(r − mean) / (std + eps)` of one group's rewards, in sample
/// order: the sample std (`n − 1`) and mean 0 / std 1 for a one-sample group under
/// [`Objective::Verl`]; the population std (`n`) under [`Objective::Population`]. Equal rewards
/// give zeros under both.
///
/// ```
/// use lifecycle_examples::dapo::update::{group_advantages, Objective};
///
/// // a group of one sample: verl takes mean 0 and std 1
/// let a = group_advantages(&[0.75], 1e-6, Objective::Verl);
/// assert!((a[0] - 0.75).abs() < 1e-6);
/// assert_eq!(group_advantages(&[0.75], 1e-6, Objective::Population), [0.0]);
/// ```
pub fn group_advantages(rewards: &[f32], eps: f32, objective: Objective) -> Vec<f32> {
    match objective {
        Objective::Verl => verl_advantages(rewards, eps),
        Objective::Population => population_advantages(rewards, eps),
    }
}

/// verl's advantages, computed in f64 (verl's `compute_grpo_outcome_advantage`: `torch.mean`
/// and `torch.std`, Bessel-corrected, per group; mean 0 and std 1 for a group of one).
fn verl_advantages(rewards: &[f32], eps: f32) -> Vec<f32> {
    let n = rewards.len();
    let (mean, std) = match n {
        0 => return Vec::new(),
        1 => (0.0, 1.0),
        _ => {
            let mean = rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / n as f64;
            let ss = rewards
                .iter()
                .map(|&r| (f64::from(r) - mean).powi(2))
                .sum::<f64>();
            (mean, (ss / (n - 1) as f64).sqrt())
        }
    };
    let denom = std + f64::from(eps);
    rewards
        .iter()
        .map(|&r| ((f64::from(r) - mean) / denom) as f32)
        .collect()
}

/// The population-std advantages, in f32 (the loop's first computation, unchanged).
fn population_advantages(rewards: &[f32], eps: f32) -> Vec<f32> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let n = rewards.len() as f32;
    let mean = rewards.iter().sum::<f32>() / n;
    let var = rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f32>() / n;
    let std = var.sqrt();
    rewards.iter().map(|r| (r - mean) / (std + eps)).collect()
}

/// One token's objective `−ℓ` (the negated per-token loss of the module docs) and its
/// derivative.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenObjective {
    /// The objective `−ℓ`.
    pub value: f32,
    /// Its derivative with respect to `logp`: `A·ρ` where the unclipped term is taken (and,
    /// under [`Objective::Verl`], the log-ratio is within ±20), else 0.
    pub dlogp: f32,
    /// Whether a clip removed the gradient: the ratio clip, or under [`Objective::Verl`] the
    /// dual clip or the log-ratio clamp.
    pub clipped: bool,
    /// The ratio `ρ` the objective used (under [`Objective::Verl`] that of the clamped
    /// log-ratio).
    pub ratio: f32,
    /// The truncated importance weight `w` that `value` and `dlogp` were multiplied by
    /// ([`TokenObjective::weighted`]); 1 without TIS.
    pub weight: f32,
}

impl TokenObjective {
    /// The same objective under truncated importance sampling: `value` and `dlogp` multiplied
    /// by `weight` (a [`tis_weight`], which carries no gradient); `ratio` and `clipped` are the
    /// objective's own (verl counts its clip fractions before the weight).
    ///
    /// ```
    /// use lifecycle_examples::dapo::update::{tis_weight, token_objective, UpdateConfig};
    ///
    /// let c = UpdateConfig::default();
    /// // the rollout gave the token log-prob −1.5, the trainer −1.0: w = min(e^0.5, 2)
    /// let w = tis_weight(-1.0, -1.5, 2.0);
    /// let t = token_objective(-0.9, -1.0, 0.5, &c).weighted(w);
    /// let plain = token_objective(-0.9, -1.0, 0.5, &c);
    /// assert_eq!((t.value, t.dlogp, t.weight), (plain.value * w, plain.dlogp * w, w));
    /// ```
    pub fn weighted(self, weight: f32) -> TokenObjective {
        TokenObjective {
            value: self.value * weight,
            dlogp: self.dlogp * weight,
            weight: self.weight * weight,
            ..self
        }
    }
}

/// verl's token-level truncated importance weight `min(exp(old_logp − rollout_logp), cap)`:
/// `old_logp` the trainer's log-probability of a sampled token, `rollout_logp` the rollout
/// engine's (see the module docs). As `torch.clamp(·, max=cap)`: a NaN stays NaN, and an
/// exponential that overflows is `cap`.
///
/// ```
/// use lifecycle_examples::dapo::update::tis_weight;
///
/// assert_eq!(tis_weight(-2.0, -2.0, 2.0), 1.0); // the rollout agrees with the trainer
/// assert!((tis_weight(-2.5, -2.0, 2.0) - (-0.5f32).exp()).abs() < 1e-7); // below 1: kept
/// assert_eq!(tis_weight(-1.0, -3.0, 2.0), 2.0); // e² > 2: capped
/// assert_eq!(tis_weight(0.0, -200.0, 2.0), 2.0); // e^200 overflows f32: capped
/// ```
pub fn tis_weight(old_logp: f32, rollout_logp: f32, cap: f32) -> f32 {
    let w = (old_logp - rollout_logp).exp();
    // `w > cap` is false for NaN: a NaN passes through, as torch.clamp lets it
    if w > cap {
        cap
    } else {
        w
    }
}

/// How far the rollout's log-probabilities of the sampled tokens are from the trainer's:
/// with `r = old_logp − rollout_logp` per token (the log of the truncated importance weight
/// before the cap), the mean `|r|` and the k3 estimate `mean(exp(r) − 1 − r)` of
/// `KL(π_rollout ‖ π_trainer)` (unbiased for tokens drawn by the rollout, and never negative).
/// Computed in f64.
///
/// ```
/// use lifecycle_examples::dapo::update::Mismatch;
///
/// let trainer = vec![vec![-1.0f32, -2.0], vec![-0.5]];
/// let rollout = vec![vec![-1.0f32, -2.5], vec![-0.25]];
/// let m = Mismatch::measure(&trainer, &rollout).expect("equal shapes");
/// assert_eq!(m.tokens, 3);
/// assert!((m.mean_abs - 0.25).abs() < 1e-12);
/// let k3 = ((0.5f64.exp() - 1.5) + ((-0.25f64).exp() - 0.75)) / 3.0;
/// assert!((m.k3 - k3).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mismatch {
    /// Tokens measured.
    pub tokens: usize,
    /// Mean `|old_logp − rollout_logp|`.
    pub mean_abs: f64,
    /// Largest `|old_logp − rollout_logp|`.
    pub max_abs: f64,
    /// `mean(exp(r) − 1 − r)`, `r = old_logp − rollout_logp`: the k3 estimate of
    /// `KL(π_rollout ‖ π_trainer)`.
    pub k3: f64,
}

impl Mismatch {
    /// The mismatch of the trainer's log-probabilities `old_logp` and the rollout's
    /// `rollout_logp`, sequence by sequence and token by token; `None` where their shapes differ
    /// (a sequence of one has fewer tokens than its counterpart) or there is no token.
    pub fn measure(old_logp: &[Vec<f32>], rollout_logp: &[Vec<f32>]) -> Option<Mismatch> {
        if old_logp.len() != rollout_logp.len()
            || old_logp
                .iter()
                .zip(rollout_logp)
                .any(|(a, b)| a.len() != b.len())
        {
            return None;
        }
        let (mut tokens, mut abs, mut max_abs, mut k3) = (0usize, 0.0f64, 0.0f64, 0.0f64);
        for (&old, &rollout) in old_logp.iter().flatten().zip(rollout_logp.iter().flatten()) {
            let r = f64::from(old) - f64::from(rollout);
            tokens += 1;
            abs += r.abs();
            max_abs = max_abs.max(r.abs());
            // exp(r) − 1 − r without the cancellation of exp(r) − 1 for small r
            k3 += r.exp_m1() - r;
        }
        (tokens > 0).then(|| Mismatch {
            tokens,
            mean_abs: abs / tokens as f64,
            max_abs,
            k3: k3 / tokens as f64,
        })
    }

    /// The mismatch of several parts (token-weighted means); `None` for none.
    pub fn combine(parts: impl IntoIterator<Item = Mismatch>) -> Option<Mismatch> {
        let mut all: Option<Mismatch> = None;
        for p in parts {
            all = Some(match all {
                None => p,
                Some(a) => {
                    let n = a.tokens + p.tokens;
                    let mean = |x: f64, y: f64| {
                        (x * a.tokens as f64 + y * p.tokens as f64) / n.max(1) as f64
                    };
                    Mismatch {
                        tokens: n,
                        mean_abs: mean(a.mean_abs, p.mean_abs),
                        max_abs: a.max_abs.max(p.max_abs),
                        k3: mean(a.k3, p.k3),
                    }
                }
            });
        }
        all
    }
}

/// The objective of one token with log-probabilities `logp` (new policy) and `old_logp` (the
/// sampling policy) and its sequence's `advantage`, under `config`'s [`Objective`] and clip
/// settings (see the module docs).
///
/// ```
/// use lifecycle_examples::dapo::update::{token_objective, UpdateConfig};
///
/// // verl's dual clip: a negative advantage with a ratio above 3 costs 3·|A| and no gradient
/// let t = token_objective(2.0, 0.0, -0.5, &UpdateConfig::default());
/// assert_eq!((t.value, t.dlogp), (-1.5, 0.0));
/// ```
pub fn token_objective(
    logp: f32,
    old_logp: f32,
    advantage: f32,
    config: &UpdateConfig,
) -> TokenObjective {
    let (lo, hi) = (1.0 - config.clip_low, 1.0 + config.clip_high);
    match config.objective {
        Objective::Population => {
            let ratio = (logp - old_logp).exp();
            clipped_objective(ratio, advantage, lo, hi, true)
        }
        Objective::Verl => {
            let d = logp - old_logp;
            // torch.clamp passes the gradient on the closed interval
            let inside = (-LOG_RATIO_CLAMP..=LOG_RATIO_CLAMP).contains(&d);
            let ratio = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp();
            let t = clipped_objective(ratio, advantage, lo, hi, inside);
            // −min(ℓ₁, −A·c) = max(−ℓ₁, A·c), for A < 0 only
            let floor = advantage * config.clip_ratio_c;
            if advantage < 0.0 && floor > t.value {
                TokenObjective {
                    value: floor,
                    dlogp: 0.0,
                    clipped: true,
                    ratio,
                    weight: 1.0,
                }
            } else {
                t
            }
        }
    }
}

/// `−max(−A·ρ, −A·clip(ρ, lo, hi)) = min(A·ρ, A·clip(ρ, lo, hi))` and its derivative, `A·ρ`
/// where the unclipped term is the minimum and `grad` (the ratio depends on `logp` here), else 0.
fn clipped_objective(ratio: f32, advantage: f32, lo: f32, hi: f32, grad: bool) -> TokenObjective {
    let unclipped = ratio * advantage;
    let clipped = ratio.clamp(lo, hi) * advantage;
    if unclipped <= clipped {
        TokenObjective {
            value: unclipped,
            dlogp: if grad { unclipped } else { 0.0 },
            clipped: !grad,
            ratio,
            weight: 1.0,
        }
    } else {
        TokenObjective {
            value: clipped,
            dlogp: 0.0,
            clipped: true,
            ratio,
            weight: 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(objective: Objective) -> UpdateConfig {
        UpdateConfig {
            objective,
            ..UpdateConfig::default()
        }
    }

    #[test]
    fn verl_divides_by_the_bessel_corrected_std() {
        // [1, 0, 0]: mean 1/3, Σ(r − mean)² = 2/3; sample std √(1/3), population std √(2/9)
        let a = group_advantages(&[1.0, 0.0, 0.0], 0.0, Objective::Verl);
        let (dev, sample_std) = (2.0f64 / 3.0, (1.0f64 / 3.0).sqrt());
        assert!((f64::from(a[0]) - dev / sample_std).abs() < 1e-6, "{a:?}");
        assert!(
            (f64::from(a[1]) + (1.0 / 3.0) / sample_std).abs() < 1e-6,
            "{a:?}"
        );
        let p = group_advantages(&[1.0, 0.0, 0.0], 0.0, Objective::Population);
        assert!(
            (f64::from(p[0]) - dev / (2.0f64 / 9.0).sqrt()).abs() < 1e-6,
            "{p:?}"
        );
        // ε is added to the std: [1, 0] has sample std √½
        let a = group_advantages(&[1.0, 0.0], 0.5, Objective::Verl);
        assert!(
            (f64::from(a[0]) - 0.5 / (0.5f64.sqrt() + 0.5)).abs() < 1e-6,
            "{a:?}"
        );
        // equal rewards and one sample
        assert_eq!(group_advantages(&[0.5; 4], 1e-6, Objective::Verl), [0.0; 4]);
        let one = group_advantages(&[0.75], 1e-6, Objective::Verl);
        assert!(
            (f64::from(one[0]) - 0.75 / (1.0 + 1e-6)).abs() < 1e-7,
            "{one:?}"
        );
        assert_eq!(
            group_advantages(&[0.75], 1e-6, Objective::Population),
            [0.0]
        );
        assert!(group_advantages(&[], 1e-6, Objective::Verl).is_empty());
    }

    #[test]
    fn the_dual_clip_binds_for_a_negative_advantage_and_a_large_ratio() {
        let c = config(Objective::Verl);
        assert_eq!(c.clip_ratio_c, 3.0);
        // ρ = e² ≈ 7.39 > 3, A = −0.8: ℓ = min(0.8·ρ, 3·0.8) = 2.4, no gradient
        let t = token_objective(-1.0, -3.0, -0.8, &c);
        assert!((t.value + 3.0 * 0.8).abs() < 1e-6, "{t:?}");
        assert!(t.dlogp == 0.0 && t.clipped, "{t:?}");
        // without the dual clip the loss is A·ρ with its gradient
        let p = token_objective(-1.0, -3.0, -0.8, &config(Objective::Population));
        let rho = 2.0f32.exp();
        assert!((p.value + 0.8 * rho).abs() < 1e-5 && (p.dlogp + 0.8 * rho).abs() < 1e-5);
        // below c the dual clip does not bind: ρ = e ≈ 2.72 (above 1 + ε_high, which does not
        // clip a negative advantage)
        let t = token_objective(1.0, 0.0, -0.8, &c);
        let rho = 1.0f32.exp();
        assert!(!t.clipped && (t.value + 0.8 * rho).abs() < 1e-6, "{t:?}");
        assert!((t.dlogp + 0.8 * rho).abs() < 1e-6, "{t:?}");
        // a positive advantage is never dual-clipped: clip-higher at 1.28
        let t = token_objective(2.0, 0.0, 0.8, &c);
        assert!(t.clipped && t.dlogp == 0.0 && (t.value - 0.8 * 1.28).abs() < 1e-6);
    }

    #[test]
    fn verl_clamps_the_log_ratio_at_twenty() {
        let c = config(Objective::Verl);
        // d = −25, A > 0: the unclipped term is the minimum, ρ = e^−20 (not e^−25), and the
        // clamp removes the gradient
        let t = token_objective(-26.0, -1.0, 0.5, &c);
        assert_eq!(t.ratio, (-20.0f32).exp());
        assert!((t.value - 0.5 * (-20.0f32).exp()).abs() < 1e-12, "{t:?}");
        assert!(t.dlogp == 0.0 && t.clipped, "{t:?}");
        // the population variant neither clamps nor removes the gradient
        let p = token_objective(-26.0, -1.0, 0.5, &config(Objective::Population));
        assert_eq!(p.ratio, (-25.0f32).exp());
        assert!(p.dlogp > 0.0 && !p.clipped, "{p:?}");
        // d = 30: ρ = e^20; A < 0 meets the dual clip, A > 0 clip-higher
        let t = token_objective(0.0, -30.0, -1.0, &c);
        assert_eq!((t.ratio, t.value, t.dlogp), (20.0f32.exp(), -3.0, 0.0));
        let t = token_objective(0.0, -30.0, 1.0, &c);
        assert!((t.value - 1.28).abs() < 1e-6 && t.dlogp == 0.0);
        // inside ±20 the gradient flows: d = −19.5, A > 0
        let t = token_objective(-20.5, -1.0, 0.5, &c);
        assert!(!t.clipped && t.dlogp == t.value && t.value > 0.0, "{t:?}");
        // the closed interval: d = −20 exactly still has its gradient
        let t = token_objective(-21.0, -1.0, 0.5, &c);
        assert!(!t.clipped && t.dlogp > 0.0, "{t:?}");
    }

    #[test]
    fn tis_weights_each_branch_without_touching_the_clips() {
        let c = config(Objective::Verl);
        // below 1, between 1 and the cap, truncated at it
        for (old, rollout, w) in [
            (-2.0f32, -1.5f32, (-0.5f32).exp()),
            (-1.5, -2.0, 0.5f32.exp()),
            (-1.0, -3.0, 2.0),
        ] {
            assert_eq!(tis_weight(old, rollout, 2.0), w);
            for (logp, adv) in [(-0.9f32, 0.5f32), (old + 2.0, -0.8), (old + 2.0, 0.8)] {
                let t = token_objective(logp, old, adv, &c);
                let weighted = t.weighted(tis_weight(old, rollout, 2.0));
                assert_eq!(weighted.value, t.value * w);
                assert_eq!(weighted.dlogp, t.dlogp * w);
                assert_eq!((weighted.ratio, weighted.clipped), (t.ratio, t.clipped));
                assert_eq!((t.weight, weighted.weight), (1.0, w));
            }
        }
        // as torch.clamp(max=): NaN stays NaN, +inf is capped
        assert!(tis_weight(f32::NAN, -1.0, 2.0).is_nan());
        assert_eq!(tis_weight(0.0, f32::NEG_INFINITY, 2.0), 2.0);
        assert_eq!(tis_weight(f32::NEG_INFINITY, -1.0, 2.0), 0.0);
    }

    #[test]
    fn the_mismatch_of_parts_is_the_mismatch_of_the_whole() {
        let old = vec![vec![-1.0f32, -2.0, -0.5], vec![-3.0]];
        let rollout = vec![vec![-1.25f32, -1.0, -0.5], vec![-2.0]];
        let whole = Mismatch::measure(&old, &rollout).unwrap();
        let parts = Mismatch::combine([
            Mismatch::measure(&old[..1], &rollout[..1]).unwrap(),
            Mismatch::measure(&old[1..], &rollout[1..]).unwrap(),
        ])
        .unwrap();
        assert_eq!(whole.tokens, 4);
        assert!((whole.mean_abs - parts.mean_abs).abs() < 1e-12);
        assert!((whole.k3 - parts.k3).abs() < 1e-12);
        assert_eq!((whole.max_abs, parts.max_abs), (1.0, 1.0));
        // k3 ≥ 0, 0 only where the two agree
        assert!(whole.k3 > 0.0);
        assert_eq!(Mismatch::measure(&old, &old).unwrap().k3, 0.0);
        // shapes that differ measure nothing
        assert_eq!(Mismatch::measure(&old, &rollout[..1]), None);
        assert_eq!(Mismatch::measure(&old, &[vec![0.0; 3], vec![]]), None);
        assert_eq!(Mismatch::combine([]), None);
    }

    #[test]
    fn both_objectives_agree_inside_the_clip_range() {
        for (logp, adv) in [(0.1f32, 1.5f32), (-0.15, -0.7), (0.0, 0.0), (0.2, -2.0)] {
            let v = token_objective(logp, 0.0, adv, &config(Objective::Verl));
            let p = token_objective(logp, 0.0, adv, &config(Objective::Population));
            assert_eq!(v, p, "logp {logp}, A {adv}");
            assert!(!v.clipped && v.dlogp == v.value);
        }
    }
}
