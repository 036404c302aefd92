//! DAPO rollouts through the Qwen2 / Llama decoder on a Hugging Face checkpoint: the training
//! state is the checkpoint's weights, the rollout runs [`CpuDecoder`] on the resharded bf16 TP
//! slices, the reward is the same verifiable rule as the toy policy's ([`RewardRule`]: token
//! classes, so its hit rate does not shrink with the vocabulary). The update is the synthetic
//! stand-in ([`synthetic_update`]): there is no backward pass for the decoder here.

use lifecycle_core::{sharded_rollout, RolloutView, Switching};
use lifecycle_decoder::{Checkpoint, CpuDecoder, DecodeError, Decoder, ModelConfig, Sampling};
use lifecycle_host::HostTrainState;
use lifecycle_layout::RolloutLayout;
use lifecycle_layout::{AdamParams, HostRollout};

use crate::dapo::update::SYNTHETIC_LR;
use crate::dapo::{
    prompt, rewarded_group, run_loop, synthetic_update, validate, DapoConfig, DapoError, Group,
    RewardRule, RunReport, StepReport, UpdateOutcome,
};
use crate::rng::SplitMix64;

/// Generated sequences of one replica: prompt id and tokens.
type Samples = Vec<(u64, Vec<u32>)>;

/// One rollout call's work on a checkpoint model.
#[derive(Debug, Clone)]
pub struct LmJob {
    /// Prompt ids.
    pub prompts: Vec<u64>,
    /// Samples per prompt.
    pub group_size: usize,
    /// Tokens generated per sample.
    pub tokens: usize,
    /// Temperature.
    pub temperature: f32,
    /// Sampling seed.
    pub seed: u64,
    /// The reward rule (built for the model's vocabulary by [`RewardRule::new`]).
    pub reward: RewardRule,
    /// The model.
    pub model: ModelConfig,
    /// The rollout layout the weights are in.
    pub layout: RolloutLayout,
}

/// Rolls out one gen batch through the decoder: prompt `i` goes to data-parallel replica
/// `i mod (W / T)`; each replica decodes all its `prompts × group_size` sequences as one batch
/// (batched prefill, then decode steps with the KV cache), replicas on threads of their own.
///
/// `#[sharded_rollout]` turns this into `generate_lm(&mut lifecycle, job)`.
#[sharded_rollout]
pub fn generate_lm(
    weights: RolloutView<'_, HostRollout>,
    job: &LmJob,
) -> Result<Vec<Group>, DecodeError> {
    let tp = job.layout.tp();
    let replicas = weights.ranks.len() / tp;
    let vocab = job.model.vocab_size;
    let per_replica: Vec<Result<Samples, DecodeError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..replicas)
            .map(|d| {
                let group: Vec<_> = weights.ranks[d * tp..(d + 1) * tp].iter().collect();
                scope.spawn(move || {
                    let mut decoder = CpuDecoder::new(&job.model, &job.layout, &group)?;
                    let ids: Vec<u64> = job
                        .prompts
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| i % replicas == d)
                        .flat_map(|(_, &id)| std::iter::repeat_n(id, job.group_size))
                        .collect();
                    let prompts: Vec<Vec<u32>> = ids
                        .iter()
                        .map(|&id| prompt(id, vocab).iter().map(|&t| t as u32).collect())
                        .collect();
                    let sampling = Sampling {
                        temperature: job.temperature,
                        max_new_tokens: job.tokens,
                        seed: SplitMix64::from_keys(&[job.seed, d as u64]).next_u64(),
                        stop_token: None,
                    };
                    let out = decoder.generate(&prompts, &sampling)?;
                    Ok(ids.into_iter().zip(out).collect())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut samples: Samples = Vec::new();
    for r in per_replica {
        samples.extend(r?);
    }
    Ok(job
        .prompts
        .iter()
        .map(|&id| {
            let samples: Vec<Vec<usize>> = samples
                .iter()
                .filter(|(p, _)| *p == id)
                .map(|(_, t)| t.iter().map(|&x| x as usize).collect())
                .collect();
            rewarded_group(id, job.reward, samples)
        })
        .collect::<Vec<Group>>())
}

/// Runs DAPO on `checkpoint` with `switching`: the same dynamic sampling as [`crate::dapo::run`],
/// rollouts through [`generate_lm`], the synthetic update ([`synthetic_update`]).
/// `config.policy` and `config.update` are not used.
pub fn run_checkpoint(
    config: &DapoConfig,
    checkpoint: &Checkpoint,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, DapoError> {
    validate(config)?;
    let model = checkpoint.config.clone();
    let layout = model.rollout_layout(config.tp)?;
    let state = HostTrainState::from_tensors(config.world, checkpoint.tensors.clone())?;
    run_loop(
        config,
        state,
        layout.clone(),
        switching,
        on_step,
        |lc, req| {
            let job = LmJob {
                prompts: req.prompts.clone(),
                group_size: config.group_size,
                tokens: config.tokens,
                temperature: config.temperature,
                seed: req.seed,
                reward: RewardRule::new(
                    config.reward_modulus,
                    config.reward_quota,
                    model.vocab_size,
                ),
                model: model.clone(),
                layout: layout.clone(),
            };
            Ok(generate_lm(lc, &job)??)
        },
        |state, step, kept| {
            let adam = AdamParams {
                lr: SYNTHETIC_LR,
                ..AdamParams::default()
            };
            synthetic_update(state, config.seed, step, kept, adam)?;
            Ok(UpdateOutcome::Synthetic)
        },
    )
}
