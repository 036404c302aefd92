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
//!    The rollout's own log-probabilities of the same tokens ([`Group::logprobs`]) differ from
//!    them by that rounding: [`PgStats::mismatch`] measures it ([`Mismatch`]), and truncated
//!    importance sampling ([`UpdateConfig::tis_cap`], on by default) weights each token's loss
//!    by `w = min(exp(old_logp − rollout_logp), C)`.
//! 3. The kept groups are split into [`UpdateConfig::minibatches`] mini-batches, one Adam step
//!    each: from the second one on the policy has moved, the ratios
//!    `ρ = exp(clamp(log π − log π_old, −20, 20))` differ from 1 and the clips apply.
//! 4. **Loss** (token level, verl's vanilla policy loss with `loss_agg_mode = "token-mean"`):
//!    `L = (1/N) Σ_tokens ℓ` with `ℓ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))`, and for
//!    `A < 0` the dual clip `ℓ = min(ℓ, −A·c)` (`c` = [`UpdateConfig::clip_ratio_c`]), then
//!    under TIS `ℓ = w·ℓ`; `N` the number of completion tokens of the mini-batch.
//! 5. **Gradients**: `∂L/∂log π` per token ([`surrogate`]; zero where a clip or the log-ratio
//!    clamp binds, times `w` under TIS), backpropagated through the toy policy
//!    ([`Params::backward`]) in f32 on full tensors, written into every rank's FSDP gradient
//!    shard, then [`HostTrainState::adam_step`].
//!
//! Determinism: each group is one lockstep forward / backward pass on one thread; the groups'
//! gradients are summed in group order, whatever the number of threads or their timing.

use lifecycle_host::{HostError, HostTrainState};
use lifecycle_layout::AdamParams;

pub use super::objective::{
    group_advantages, tis_weight, token_objective, Mismatch, Objective, TokenObjective,
    DEFAULT_TIS_CAP, LOG_RATIO_CLAMP,
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
    /// Truncated importance sampling: `Some(C)` multiplies each token's loss and gradient by
    /// `min(exp(old_logp − rollout_logp), C)` ([`tis_weight`]; verl's `tis_imp_ratio_cap`, > 0
    /// and finite), `None` leaves them as they are. On ([`DEFAULT_TIS_CAP`]) by default; the
    /// groups must then carry the rollout's log-probabilities ([`Group::logprobs`]).
    pub tis_cap: Option<f32>,
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
            tis_cap: Some(DEFAULT_TIS_CAP),
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
    /// The rollout's log-probabilities against the trainer's (`old_logp`, recomputed from the
    /// master weights before the first Adam step) over every token of the kept groups; `None`
    /// where the groups carry no rollout log-probabilities.
    pub mismatch: Option<Mismatch>,
    /// What truncated importance sampling did; `None` with TIS off.
    pub tis: Option<TisStats>,
}

/// What truncated importance sampling did in one update: the weights
/// `min(exp(old_logp − rollout_logp), C)` of every token of the kept groups (the same in every
/// mini-batch: both log-probabilities are fixed for the step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TisStats {
    /// The cap `C`.
    pub cap: f32,
    /// Mean weight.
    pub mean_weight: f64,
    /// Share of tokens whose weight the cap truncated (`exp(old_logp − rollout_logp) > C`).
    pub capped_fraction: f64,
}

impl TisStats {
    /// The weights of every token of `old_logp` against `rollout_logp` (sequences of equal
    /// lengths) under cap `cap`; `None` for no token.
    pub fn measure(old_logp: &[Vec<f32>], rollout_logp: &[Vec<f32>], cap: f32) -> Option<Self> {
        let (mut n, mut sum, mut capped) = (0usize, 0.0f64, 0usize);
        for (old, rollout) in old_logp.iter().zip(rollout_logp) {
            for (&o, &r) in old.iter().zip(rollout) {
                let w = tis_weight(o, r, cap);
                n += 1;
                sum += f64::from(w);
                capped += usize::from((o - r).exp() > cap);
            }
        }
        (n > 0).then(|| TisStats {
            cap,
            mean_weight: sum / n as f64,
            capped_fraction: capped as f64 / n as f64,
        })
    }
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
/// `logp` (new policy) and `old_logp` (the trainer's, of the sampling policy), one advantage per
/// sequence, normalised by `norm_tokens` (the token count of the whole mini-batch these
/// sequences belong to: verl's token mean).
///
/// With `rollout_logp` (the rollout engine's log-probabilities of the same tokens, shaped like
/// `logp`) and [`UpdateConfig::tis_cap`] `Some(C)`, each token's loss and derivative are
/// multiplied by its truncated importance weight ([`tis_weight`]); with either missing they are
/// not. A token without a rollout log-probability (a shorter row) gets weight 1:
/// [`dapo_update`] checks the shapes before it gets here.
///
/// ```
/// use lifecycle_examples::dapo::update::{surrogate, tis_weight, UpdateConfig};
///
/// let (logp, old) = (vec![vec![-1.0f32, -2.0]], vec![vec![-1.0f32, -2.0]]);
/// let rollout = vec![vec![-1.5f32, -1.0]]; // weights min(e^0.5, 2) and e^−1
/// let c = UpdateConfig::default(); // TIS capped at 2
/// let plain = surrogate(&logp, &old, None, &[1.0], &c, 2);
/// let tis = surrogate(&logp, &old, Some(&rollout), &[1.0], &c, 2);
/// let w = [tis_weight(-1.0, -1.5, 2.0), tis_weight(-2.0, -1.0, 2.0)];
/// assert_eq!(tis.dlogp[0], [plain.dlogp[0][0] * w[0], plain.dlogp[0][1] * w[1]]);
/// ```
pub fn surrogate(
    logp: &[Vec<f32>],
    old_logp: &[Vec<f32>],
    rollout_logp: Option<&[Vec<f32>]>,
    advantages: &[f32],
    config: &UpdateConfig,
    norm_tokens: usize,
) -> Surrogate {
    let scale = 1.0 / norm_tokens.max(1) as f32;
    let tis = config.tis_cap.zip(rollout_logp);
    let mut total = 0.0f64;
    let (mut clipped, mut max_dev) = (0, 0.0f32);
    let dlogp = logp
        .iter()
        .zip(old_logp)
        .zip(advantages)
        .enumerate()
        .map(|(k, ((new, old), &adv))| {
            new.iter()
                .zip(old)
                .enumerate()
                .map(|(j, (&lp, &olp))| {
                    let mut t = token_objective(lp, olp, adv, config);
                    if let Some((cap, rollout)) = tis
                        && let Some(&rlp) = rollout.get(k).and_then(|r| r.get(j))
                    {
                        t = t.weighted(tis_weight(olp, rlp, cap));
                    }
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

/// Checks that `group`'s rollout log-probabilities ([`Group::logprobs`]) are one per token of
/// every sample, or absent; whether they are present.
fn has_rollout_logprobs(group: &Group, tis_cap: Option<f32>) -> Result<bool, DapoError> {
    if group.logprobs.is_empty() {
        return match tis_cap {
            None => Ok(false),
            Some(cap) => Err(DapoError::Config(format!(
                "truncated importance sampling is on (cap {cap}) but the group of prompt {} \
                 carries no rollout log-probabilities: roll out with an engine that reports \
                 them, or turn TIS off (--tis-cap 0, UpdateConfig::tis_cap = None)",
                group.prompt
            ))),
        };
    }
    if group.logprobs.len() != group.samples.len() {
        return Err(DapoError::Config(format!(
            "the group of prompt {} has rollout log-probabilities for {} samples but has {} \
             samples (one row per sample expected)",
            group.prompt,
            group.logprobs.len(),
            group.samples.len()
        )));
    }
    for (i, (lp, s)) in group.logprobs.iter().zip(&group.samples).enumerate() {
        if lp.len() != s.len() {
            return Err(DapoError::Config(format!(
                "sample {i} of the group of prompt {} has {} rollout log-probabilities for {} \
                 tokens (one per token expected)",
                group.prompt,
                lp.len(),
                s.len()
            )));
        }
    }
    Ok(true)
}

/// The DAPO update of the toy policy on the kept groups (see the module docs). `temperature` is
/// the sampling temperature (log-probabilities are those of `softmax(logits / temperature)`).
///
/// Under truncated importance sampling ([`UpdateConfig::tis_cap`]) every group must carry the
/// rollout's log-probabilities ([`Group::logprobs`], one per token); where they are there, the
/// stats measure them against the trainer's ([`PgStats::mismatch`]) whether TIS is on or not.
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
    if let Some(cap) = config.tis_cap
        && !(cap.is_finite() && cap > 0.0)
    {
        return Err(DapoError::Config(format!(
            "the cap of truncated importance sampling (tis_cap, --tis-cap) must be a finite \
                 number > 0, found {cap}"
        )));
    }
    let mut with_rollout = Vec::with_capacity(groups.len());
    for g in groups {
        with_rollout.push(has_rollout_logprobs(g, config.tis_cap)?);
    }
    let all_rollout = with_rollout.iter().all(|&x| x);
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
    // the rollout against the trainer, over every token of the groups that carry both
    let mismatch = Mismatch::combine(
        groups
            .iter()
            .zip(&old)
            .zip(&with_rollout)
            .filter(|&(_, &has)| has)
            .filter_map(|((g, o), _)| Mismatch::measure(o.logprobs(), &g.logprobs)),
    );
    let tis = match config.tis_cap {
        Some(cap) if all_rollout => {
            let olds: Vec<Vec<f32>> = old.iter().flat_map(|o| o.logprobs().to_vec()).collect();
            let rollouts: Vec<Vec<f32>> = groups.iter().flat_map(|g| g.logprobs.clone()).collect();
            TisStats::measure(&olds, &rollouts, cap)
        }
        _ => None,
    };
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
            let rollout = with_rollout[g].then_some(groups[g].logprobs.as_slice());
            let s = surrogate(
                fwd.logprobs(),
                old[g].logprobs(),
                rollout,
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
        mismatch,
        tis,
    })
}

/// Adam's learning rate in [`synthetic_update`]: large enough that the bf16 rollout copy of every
/// weight changes too.
pub const SYNTHETIC_LR: f32 = 1e-2;

/// The stand-in update for models without a backward pass here (checkpoints): seeded noise
/// scaled by the batch's mean absolute advantage in the gradient shard of every tensor `trains`
/// names (every tensor, or a LoRA model's adapters), zero in the others, then a real Adam step
/// (see [`SYNTHETIC_LR`]) that changes every trained master weight and leaves the others bit for
/// bit. Not a learned update.
pub fn synthetic_update(
    state: &mut HostTrainState,
    seed: u64,
    step: usize,
    groups: &[Group],
    (adam, trains): (AdamParams, &dyn Fn(&str) -> bool),
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
        if !trains(s.name) {
            // no gradient: Adam leaves the weight bit for bit (its moments stay zero)
            s.grad.fill(0.0);
            return;
        }
        let mut rng = SplitMix64::from_keys(&[seed, step as u64, s.tensor as u64, s.rank as u64]);
        for g in s.grad.iter_mut() {
            *g = rng.symmetric(1.0) * (0.5 + signal);
        }
    })?;
    state.adam_step(adam)?;
    Ok(())
}
