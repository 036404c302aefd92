//! The reference token pick: the distribution a request draws from at one step ([`kept`]), the
//! draw ([`pick`]) and the log-probabilities reported beside the token, in f64 on the host. The
//! GPU decoder's pick kernel follows the same rules in f32 (the CPU decoder uses this one).
//!
//! The rules, in order, for logits `x` and a request's [`SamplingParams`]:
//! 1. `z = (x - max x) / T`; the full distribution is `softmax(z)`, and a token's
//!    [`Picked::logprob`] is `z[t] - ln Σ exp(z)` (at `T = 0`, of `x` itself).
//! 2. top-k: the tokens whose logit is at least the k-th largest (ties with it kept).
//! 3. top-p: of those, sorted by logit (descending; lower index first on ties), the first whose
//!    running mass `Σ exp(z) / Σ_kept exp(z)` reaches `top_p`, and every token whose logit is
//!    at least its logit.
//! 4. The draw: with `u` in [0, 1) and the kept tokens in index order, the first whose running
//!    weight `Σ exp(z)` exceeds `u · Σ_kept exp(z)` (the argmax where rounding leaves none).

use crate::rollout::request::SamplingParams;

/// A picked token and its log-probabilities (see [`Sample`](crate::Sample)'s fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picked {
    /// The token.
    pub token: u32,
    /// `log_softmax(logits / T)[token]` (of the logits at T = 0).
    pub logprob: f32,
    /// `log_softmax(logits)[token]`.
    pub raw_logprob: f32,
    /// The token's log-probability in the truncated, renormalised distribution (0 when
    /// greedy).
    pub truncated_logprob: f32,
}

/// Index of the largest value, the lowest on ties.
fn argmax(x: &[f32]) -> usize {
    crate::sampling::argmax(x)
}

/// `ln Σ exp(v)` of values whose largest is `top`.
fn log_sum_exp(v: impl Iterator<Item = f64>, top: f64) -> f64 {
    top + v.map(|a| (a - top).exp()).sum::<f64>().ln()
}

/// The tokens a non-greedy request may draw at one step and their renormalised probabilities,
/// in index order (rules 1–3 of [the module](self)).
///
/// ```
/// use lifecycle_decoder::{kept, SamplingParams};
/// let logits = [2.0, 1.0, 0.0, 3.0];
/// let top2 = kept(&logits, &SamplingParams::new(1).with_temperature(1.0).with_top_k(2));
/// assert_eq!(top2.iter().map(|k| k.0).collect::<Vec<_>>(), vec![0, 3]);
/// let total: f64 = top2.iter().map(|k| k.1).sum();
/// assert!((total - 1.0).abs() < 1e-12);
/// ```
pub fn kept(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let weights = kept_weights(logits, params);
    let total: f64 = weights.iter().map(|w| w.1).sum();
    weights.into_iter().map(|(t, w)| (t, w / total)).collect()
}

/// `(token, exp(z))` of the kept tokens, in index order.
fn kept_weights(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let t = f64::from(params.temperature.max(f32::MIN_POSITIVE));
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w = |x: f32| ((f64::from(x) - top) / t).exp();
    let vocab = logits.len();
    let k = params.top_k.map_or(vocab, |k| (k as usize).min(vocab));
    let mut floor = f32::NEG_INFINITY;
    if k < vocab || params.top_p < 1.0 {
        let mut order: Vec<usize> = (0..vocab).collect();
        // descending by logit, lower index first on ties
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if k < vocab {
            floor = logits[order[k - 1]];
        }
        if params.top_p < 1.0 {
            let cands: Vec<usize> = order
                .into_iter()
                .take_while(|&i| logits[i] >= floor)
                .collect();
            let mass: f64 = cands.iter().map(|&i| w(logits[i])).sum();
            let mut run = 0.0;
            for &i in &cands {
                run += w(logits[i]) / mass;
                if run >= f64::from(params.top_p) {
                    floor = floor.max(logits[i]);
                    break;
                }
            }
        }
    }
    (0..vocab)
        .filter(|&i| logits[i] >= floor)
        .map(|i| (i as u32, w(logits[i])))
        .collect()
}

/// The token of one step for a request sampling as `params` says, drawn with `uniform` (in
/// [0, 1): the request's next draw; unused when greedy), and its log-probabilities (the rules
/// of [the module](self)).
///
/// ```
/// use lifecycle_decoder::{pick, SamplingParams};
/// let logits = [0.0, 3.0, 1.0];
/// let greedy = pick(&logits, &SamplingParams::new(1), 0.5);
/// assert_eq!(greedy.token, 1);
/// assert_eq!(greedy.truncated_logprob, 0.0);
/// // top-k 1 at any temperature is the argmax too, drawn with probability 1
/// let top1 = pick(&logits, &SamplingParams::new(1).with_temperature(0.7).with_top_k(1), 0.99);
/// assert_eq!((top1.token, top1.truncated_logprob), (1, 0.0));
/// assert!(top1.logprob < 0.0 && top1.raw_logprob < top1.logprob);
/// ```
pub fn pick(logits: &[f32], params: &SamplingParams, uniform: f32) -> Picked {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let raw_lse = log_sum_exp(logits.iter().map(|&x| f64::from(x)), top);
    if params.greedy() {
        let token = argmax(logits);
        let lp = (f64::from(logits[token]) - raw_lse) as f32;
        return Picked {
            token: token as u32,
            logprob: lp,
            raw_logprob: lp,
            truncated_logprob: 0.0,
        };
    }
    let t = f64::from(params.temperature);
    let z = |x: f32| (f64::from(x) - top) / t;
    let lse = log_sum_exp(logits.iter().map(|&x| z(x)), 0.0);
    let weights = kept_weights(logits, params);
    let total: f64 = weights.iter().map(|w| w.1).sum();
    let target = f64::from(uniform) * total;
    let mut run = 0.0;
    let token = weights
        .iter()
        .find(|(_, w)| {
            run += w;
            run > target
        })
        .map_or(argmax(logits), |&(t, _)| t as usize);
    let x = logits[token];
    Picked {
        token: token as u32,
        logprob: (z(x) - lse) as f32,
        raw_logprob: (f64::from(x) - raw_lse) as f32,
        truncated_logprob: (z(x) - total.ln()) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hot(t: f32) -> SamplingParams {
        SamplingParams::new(1).with_temperature(t)
    }

    #[test]
    fn without_truncation_every_token_is_kept_with_its_softmax_mass() {
        let logits = [1.0f32, 2.0, 3.0];
        let k = kept(&logits, &hot(1.0));
        let e: Vec<f64> = logits.iter().map(|&x| f64::from(x - 3.0).exp()).collect();
        let s: f64 = e.iter().sum();
        for (i, (t, p)) in k.iter().enumerate() {
            assert_eq!(*t as usize, i);
            assert!((p - e[i] / s).abs() < 1e-15);
        }
    }

    #[test]
    fn top_k_keeps_ties_with_the_last_kept_token() {
        let logits = [5.0f32, 1.0, 3.0, 3.0, 0.0];
        let k: Vec<u32> = kept(&logits, &hot(1.0).with_top_k(2))
            .iter()
            .map(|k| k.0)
            .collect();
        assert_eq!(k, vec![0, 2, 3]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        // probabilities 0.5, 0.25, 0.125, 0.125 (logits ln 4, ln 2, 0, 0)
        let logits = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
        let ids = |p: f32| -> Vec<u32> {
            kept(&logits, &hot(1.0).with_top_p(p))
                .iter()
                .map(|k| k.0)
                .collect()
        };
        assert_eq!(ids(0.5), vec![0]);
        assert_eq!(ids(0.6), vec![0, 1]);
        // reaching into the tie keeps both tied tokens
        assert_eq!(ids(0.8), vec![0, 1, 2, 3]);
        assert_eq!(ids(1.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn the_draw_walks_the_kept_tokens_in_index_order() {
        let logits = [0.0f32, 0.0, 0.0, 0.0];
        for (u, want) in [(0.0, 0), (0.24, 0), (0.26, 1), (0.74, 2), (0.99, 3)] {
            assert_eq!(pick(&logits, &hot(1.0), u).token, want, "u = {u}");
        }
        // top-k 2 of four tied tokens keeps all four (ties), so the draw is the same
        assert_eq!(pick(&logits, &hot(1.0).with_top_k(2), 0.99).token, 3);
    }

    #[test]
    fn log_probs_are_of_the_full_distribution_at_the_temperature() {
        let logits = [1.0f32, 2.0, 4.0];
        let p = pick(&logits, &hot(0.5).with_top_k(1), 0.3);
        assert_eq!(p.token, 2);
        let z: Vec<f64> = logits.iter().map(|&x| f64::from(x - 4.0) / 0.5).collect();
        let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
        assert!((f64::from(p.logprob) - (z[2] - lse)).abs() < 1e-6);
        let raw = logits
            .iter()
            .map(|&x| f64::from(x - 4.0).exp())
            .sum::<f64>()
            .ln();
        assert!((f64::from(p.raw_logprob) + raw).abs() < 1e-6);
        assert_eq!(p.truncated_logprob, 0.0);
    }
}
