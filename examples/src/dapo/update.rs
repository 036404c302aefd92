//! The training update between rollouts: DAPO's policy-gradient step for the toy policy, and a
//! synthetic stand-in for models this crate has no backward pass for (checkpoints).
//!
//! The DAPO step, per training step (the formulas of both objectives, [`Objective::Verl`] by
//! default and [`Objective::Population`], are in [`super::objective`]):
//!
//! 1. **Advantages**, per group: `A_i = (r_i − mean(r)) / (std(r) + ε)`, under verl's objective
//!    with the sample standard deviation (`n − 1`, as verl's `compute_grpo_outcome_advantage`);
//!    groups with uniform rewards were already dropped by dynamic sampling.
//! 2. **Old log-probabilities** are recomputed from the fp32 master weights before the first
//!    update (the weights the rollout's bf16 copy was cast from), so the first mini-batch has
//!    ratios of exactly 1 and the bf16 rounding of the rollout weights stays out of the ratio.
//! 3. The kept groups are split into [`UpdateConfig::minibatches`] mini-batches, one Adam step
//!    each: from the second one on the policy has moved, the ratios
//!    `ρ = exp(clamp(log π − log π_old, −20, 20))` differ from 1 and the clips apply.
//! 4. **Loss** (token level, verl's vanilla policy loss with `loss_agg_mode = "token-mean"`):
//!    `L = (1/N) Σ_tokens ℓ` with `ℓ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))`, and for
//!    `A < 0` the dual clip `ℓ = min(ℓ, −A·c)` (`c` = [`UpdateConfig::clip_ratio_c`]), `N` the
//!    number of completion tokens of the mini-batch.
//! 5. **Gradients**: `∂L/∂log π` per token ([`surrogate`]; zero where a clip or the log-ratio
//!    clamp binds), backpropagated through the toy policy ([`Params::backward`]) in f32 on full
//!    tensors, written into every rank's FSDP gradient shard, then [`HostTrainState::adam_step`].
//!
//! Determinism: each group is one lockstep forward / backward pass on one thread; the groups'
//! gradients are summed in group order, whatever the number of threads or their timing.

use lifecycle_host::{HostError, HostTrainState};
use lifecycle_layout::AdamParams;

pub use super::objective::{
    group_advantages, token_objective, Objective, TokenObjective, LOG_RATIO_CLAMP,
};
use super::{prompt, DapoError, Group};
use crate::rng::SplitMix64;
use crate::toy_policy::{Forward, Params, PolicyConfig, Sequence};

/// Settings of the DAPO update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateConfig {
    /// Adam learning rate.
    pub lr: f32,
    /// The objective: verl's (the default) or the population-std variant ([`Objective`]).
    pub objective: Objective,
    /// ε_low: a negative-advantage token stops pushing its probability down once its ratio is
    /// below `1 − ε_low`.
    pub clip_low: f32,
    /// ε_high (clip-higher): a positive-advantage token stops pushing its probability up once
    /// its ratio is above `1 + ε_high`.
    pub clip_high: f32,
    /// `c` of the dual clip ([`Objective::Verl`] only, verl's `clip_ratio_c`, > 1): a
    /// negative-advantage token's loss is at most `c·|A|`, and has no gradient there.
    pub clip_ratio_c: f32,
    /// Mini-batches per training step (one Adam step each); at most the number of kept groups.
    pub minibatches: usize,
    /// ε of the advantage normalisation.
    pub adv_eps: f32,
}

impl Default for UpdateConfig {
    fn default() -> Self {
        UpdateConfig {
            lr: 1e-5,
            objective: Objective::Verl,
            clip_low: 0.2,
            clip_high: 0.28,
            clip_ratio_c: 3.0,
            minibatches: 4,
            adv_eps: 1e-6,
        }
    }
}

impl UpdateConfig {
    /// The Adam settings of one step.
    pub fn adam(&self) -> AdamParams {
        AdamParams {
            lr: self.lr,
            ..AdamParams::default()
        }
    }
}

/// What the update of one step did.
#[derive(Debug, Clone, PartialEq)]
pub enum UpdateOutcome {
    /// A DAPO policy-gradient step.
    Dapo(PgStats),
    /// Seeded noise in the gradient shards, then a real Adam step (no backward pass exists for
    /// the model).
    Synthetic,
}

/// Figures of one DAPO update.
#[derive(Debug, Clone, PartialEq)]
pub struct PgStats {
    /// Mini-batches (Adam steps).
    pub minibatches: usize,
    /// Completion tokens in the loss (all mini-batches).
    pub tokens: usize,
    /// Token-level loss, mean over mini-batches.
    pub loss: f32,
    /// Share of tokens whose gradient a clip removed (all mini-batches): the ratio clip, and
    /// under [`Objective::Verl`] the dual clip or the log-ratio clamp.
    pub clip_fraction: f32,
    /// Largest `|ρ − 1|` over every token of every mini-batch (`ρ` the ratio the loss used).
    pub max_ratio_deviation: f32,
    /// Gradient norm, mean over mini-batches.
    pub grad_norm: f32,
}

/// The token-level loss of some sequences and its derivative per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Surrogate {
    /// `(1/N) Σ ℓ` over these sequences' tokens (`ℓ = −`[`TokenObjective::value`]).
    pub loss: f64,
    /// `∂loss / ∂logp` per sequence and token.
    pub dlogp: Vec<Vec<f32>>,
    /// Tokens whose gradient a clip removed ([`TokenObjective::clipped`]).
    pub clipped: usize,
    /// Largest `|ρ − 1|`.
    pub max_ratio_deviation: f32,
}

/// DAPO's token-level loss under `config`'s [`Objective`] over sequences with log-probabilities
/// `logp` (new policy) and `old_logp` (the sampling policy), one advantage per sequence,
/// normalised by `norm_tokens` (the token count of the whole mini-batch these sequences belong
/// to: verl's token mean).
pub fn surrogate(
    logp: &[Vec<f32>],
    old_logp: &[Vec<f32>],
    advantages: &[f32],
    config: &UpdateConfig,
    norm_tokens: usize,
) -> Surrogate {
    let scale = 1.0 / norm_tokens.max(1) as f32;
    let mut total = 0.0f64;
    let (mut clipped, mut max_dev) = (0, 0.0f32);
    let dlogp = logp
        .iter()
        .zip(old_logp)
        .zip(advantages)
        .map(|((new, old), &adv)| {
            new.iter()
                .zip(old)
                .map(|(&lp, &olp)| {
                    let t = token_objective(lp, olp, adv, config);
                    total += f64::from(t.value);
                    clipped += usize::from(t.clipped);
                    max_dev = max_dev.max((t.ratio - 1.0).abs());
                    -t.dlogp * scale
                })
                .collect()
        })
        .collect();
    Surrogate {
        loss: -total * f64::from(scale),
        dlogp,
        clipped,
        max_ratio_deviation: max_dev,
    }
}

/// Maps `f` over `items` on the machine's cores; the results are in `items` order and each
/// depends on its item only (no shared accumulation), so the output does not depend on the
/// number of threads or their timing.
pub fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let mut out: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                scope.spawn(move || {
                    items
                        .iter()
                        .enumerate()
                        .skip(t)
                        .step_by(threads)
                        .map(|(i, x)| (i, f(x)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}

/// Writes full gradient tensors into every rank's FSDP gradient shard: rank `r`'s shard of a
/// tensor is the row range [`lifecycle_host::ShardMut::rows`] of the full row-major tensor.
/// Every tensor of the state must be one of the policy's, with the same shape.
pub fn write_grads(state: &mut HostTrainState, grads: &Params) -> Result<(), DapoError> {
    let specs = grads.config().specs();
    let mut index = Vec::new();
    for (name, shape) in state.layout().tensors() {
        let Some(i) = specs.iter().position(|s| &s.name == name) else {
            return Err(HostError::UnknownTensor { name: name.clone() }.into());
        };
        if &specs[i].shape != shape {
            return Err(DapoError::Config(format!(
                "tensor `{name}` has shape {shape:?} in the training state but {:?} in the \
                 policy",
                specs[i].shape
            )));
        }
        index.push(i);
    }
    let mut bad = None;
    state.for_each_shard_mut(|s| {
        let cols: usize = s.shape.iter().skip(1).product();
        let full = index.get(s.tensor).and_then(|&i| grads.tensors().get(i));
        match full.and_then(|f| f.get(s.rows.start * cols..s.rows.end * cols)) {
            Some(src) if src.len() == s.grad.len() => s.grad.copy_from_slice(src),
            _ => bad = Some((s.name.to_string(), s.rank)),
        }
    })?;
    match bad {
        None => Ok(()),
        Some((name, rank)) => Err(DapoError::Config(format!(
            "rank {rank}'s gradient shard of `{name}` does not match the tensor's rows"
        ))),
    }
}

/// One group's sequences, in sample order.
fn sequences<'a>(prompt_tokens: &'a [usize], group: &'a Group) -> Vec<Sequence<'a>> {
    group
        .samples
        .iter()
        .map(|s| Sequence {
            prompt: prompt_tokens,
            completion: s,
        })
        .collect()
}

/// The DAPO update of the toy policy on the kept groups (see the module docs). `temperature` is
/// the sampling temperature (log-probabilities are those of `softmax(logits / temperature)`).
pub fn dapo_update(
    state: &mut HostTrainState,
    policy: PolicyConfig,
    groups: &[Group],
    config: &UpdateConfig,
    temperature: f32,
) -> Result<PgStats, DapoError> {
    if groups.is_empty() {
        return Err(DapoError::Config(
            "the update needs at least one kept group".to_string(),
        ));
    }
    let prompts: Vec<Vec<usize>> = groups
        .iter()
        .map(|g| prompt(g.prompt, policy.vocab))
        .collect();
    let advantages: Vec<Vec<f32>> = groups
        .iter()
        .map(|g| group_advantages(&g.rewards, config.adv_eps, config.objective))
        .collect();
    let forward = |params: &Params, chunk: &[usize]| -> Result<Vec<Forward>, DapoError> {
        par_map(chunk, |&g| {
            params.forward(&sequences(&prompts[g], &groups[g]), temperature)
        })
        .into_iter()
        .map(|r| r.map_err(DapoError::from))
        .collect()
    };
    let all: Vec<usize> = (0..groups.len()).collect();
    let mut params = Params::from_state(policy, state)?;
    // π_old: the masters before the first Adam step of this training step
    let old = forward(&params, &all)?;
    let minibatches = config.minibatches.clamp(1, groups.len());
    let (mut loss, mut grad_norm, mut clipped, mut tokens, mut max_dev) =
        (0.0f64, 0.0f64, 0, 0, 0.0f32);
    for k in 0..minibatches {
        // near-equal contiguous parts
        let mb = &all[k * groups.len() / minibatches..(k + 1) * groups.len() / minibatches];
        if k > 0 {
            params = Params::from_state(policy, state)?;
        }
        let fresh = if k == 0 {
            Vec::new()
        } else {
            forward(&params, mb)?
        };
        let fwds: Vec<&Forward> = if k == 0 {
            mb.iter().map(|&g| &old[g]).collect()
        } else {
            fresh.iter().collect()
        };
        let mb_tokens: usize = mb
            .iter()
            .flat_map(|&g| &groups[g].samples)
            .map(Vec::len)
            .sum();
        let work: Vec<(usize, &Forward)> = mb.iter().copied().zip(fwds).collect();
        let parts = par_map(&work, |&(g, fwd)| {
            let s = surrogate(
                fwd.logprobs(),
                old[g].logprobs(),
                &advantages[g],
                config,
                mb_tokens,
            );
            let mut grads = Params::zeros(policy);
            params.backward(fwd, &s.dlogp, &mut grads);
            (grads, s)
        });
        // summed in group order: deterministic
        let mut grads = Params::zeros(policy);
        for (g, s) in &parts {
            grads.add_assign(g);
            loss += s.loss;
            clipped += s.clipped;
            max_dev = max_dev.max(s.max_ratio_deviation);
        }
        tokens += mb_tokens;
        grad_norm += f64::from(grads.norm());
        write_grads(state, &grads)?;
        state.adam_step(config.adam())?;
    }
    Ok(PgStats {
        minibatches,
        tokens,
        loss: (loss / minibatches as f64) as f32,
        clip_fraction: clipped as f32 / tokens.max(1) as f32,
        max_ratio_deviation: max_dev,
        grad_norm: (grad_norm / minibatches as f64) as f32,
    })
}

/// Adam's learning rate in [`synthetic_update`]: large enough that the bf16 rollout copy of every
/// weight changes too.
pub const SYNTHETIC_LR: f32 = 1e-2;

/// The stand-in update for models without a backward pass here (checkpoints): seeded noise
/// scaled by the batch's mean absolute advantage in every gradient shard, then a real Adam step
/// (see [`SYNTHETIC_LR`]) that changes every master weight. Not a learned update.
pub fn synthetic_update(
    state: &mut HostTrainState,
    seed: u64,
    step: usize,
    groups: &[Group],
    adam: AdamParams,
) -> Result<(), DapoError> {
    let signal = groups
        .iter()
        .map(|g| {
            let mean = g.rewards.iter().sum::<f32>() / g.rewards.len().max(1) as f32;
            g.rewards.iter().map(|r| (r - mean).abs()).sum::<f32>() / g.rewards.len().max(1) as f32
        })
        .sum::<f32>()
        / groups.len().max(1) as f32;
    state.for_each_shard_mut(|s| {
        let mut rng = SplitMix64::from_keys(&[seed, step as u64, s.tensor as u64, s.rank as u64]);
        for g in s.grad.iter_mut() {
            *g = rng.symmetric(1.0) * (0.5 + signal);
        }
    })?;
    state.adam_step(adam)?;
    Ok(())
}
