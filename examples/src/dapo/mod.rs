//! A DAPO training loop on the host backend: dynamic sampling calls the rollout several times per
//! training step with no weight change in between, then the update changes every weight.
//!
//! On the toy policy ([`run`]) the update is DAPO's policy-gradient step ([`update`]: verl's
//! objective by default ([`objective`]: token-mean clipped loss with clip-higher and the dual
//! clip, group-normalised advantages), gradients by backpropagation, Adam on the FSDP shards),
//! and the policy learns the reward rule ([`reward`]). On a checkpoint ([`crate::lm_policy`])
//! the update is a synthetic stand-in ([`update::synthetic_update`]).

pub mod driver;
pub mod engines;
pub mod megatron;
pub mod objective;
pub mod reward;
pub mod update;

use std::time::Duration;

use lifecycle_core::{
    sharded_rollout, Lifecycle, LifecycleConfig, LifecycleError, LinkBytes, MemoryPolicy, Metrics,
    Reshard, RolloutEngine, RolloutSession, RolloutView, Switching, Trace, TrainSession,
};
use lifecycle_decoder::Leftovers;
use lifecycle_host::megatron::MegatronError;
use lifecycle_host::{HostBackend, HostError, HostTrainState};
use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use lifecycle_layout::lora::LoraTarget;
use lifecycle_layout::{ExpertPlacement, HostRollout};

use crate::rng::SplitMix64;
use crate::toy_policy::{ForwardError, PolicyConfig, TpGroup};

pub use driver::{
    run_steps, BatchNotFilled, BatchReport, DapoBackend, GenBatch, LoopEvent, LoopSettings,
    StreamUnsupported,
};
pub use engines::{CpuDecoderEngine, DecodeJob, DecoderLayout, ToyEngine};
pub use objective::Objective;
pub use reward::RewardRule;
pub use update::{dapo_update, synthetic_update, PgStats, UpdateConfig, UpdateOutcome};

/// The training layout of a host run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostTrain {
    /// FSDP shards ([`HostBackend`]): the toy policy, or a checkpoint.
    Fsdp,
    /// Megatron-Core TP × PP × DP (`lifecycle_host::megatron::MegatronHostBackend`, DP = W /
    /// (TP × PP)) with its fused rollout read by the CPU decoder: a checkpoint or a small
    /// random Qwen2 model ([`megatron`]).
    Megatron {
        /// Training tensor-parallel degree.
        tp: usize,
        /// Pipeline stages.
        pp: usize,
        /// Expert-parallel degree of a mixture-of-experts model (1 for dense models).
        ep: usize,
        /// Expert tensor-parallel degree (Megatron's default: TP).
        etp: usize,
    },
}

/// Settings of a DAPO run.
#[derive(Debug, Clone, Copy)]
pub struct DapoConfig {
    /// Training steps.
    pub steps: usize,
    /// Ranks (W).
    pub world: usize,
    /// Rollout tensor-parallel degree (T, dividing W).
    pub tp: usize,
    /// Prompts per rollout call (gen batch).
    pub prompts_per_batch: usize,
    /// Samples per prompt (group size).
    pub group_size: usize,
    /// Groups with mixed rewards a training batch needs.
    pub batch_groups: usize,
    /// Most gen batches per step before giving up.
    pub max_gen_batches: usize,
    /// Tokens generated per sample.
    pub tokens: usize,
    /// Sampling temperature.
    pub temperature: f32,
    /// Seed of weights, prompts and sampling.
    pub seed: u64,
    /// Classes of the reward rule ([`RewardRule`]; capped at the vocabulary size).
    pub reward_modulus: usize,
    /// Target-class tokens a sample needs for reward 1 ([`RewardRule::quota`]).
    pub reward_quota: usize,
    /// The policy-gradient update (toy policy).
    pub update: UpdateConfig,
    /// Policy sizes.
    pub policy: PolicyConfig,
    /// What to offload during rollout.
    pub memory: MemoryPolicy,
    /// Record a timeline of every switch ([`RunReport::trace`]).
    pub trace: bool,
    /// The training layout.
    pub train: HostTrain,
    /// Experts of a mixture-of-experts checkpoint in the rollout layout.
    pub experts: ExpertPlacement,
    /// The rollout weights' dtype: fp8 quantises the matrices in the switch (a decoder model
    /// in the FSDP layout: `--checkpoint`).
    pub rollout_dtype: RolloutDtype,
    /// Matrices an fp8 rollout keeps bf16 beyond the published exemptions.
    pub fp8_keep: Fp8Keep,
    /// How the CPU decoder computes with fp8 weights: weight-only, or W8A8 (activations
    /// quantised per token in 1 × 128 groups as well).
    pub fp8_compute: Fp8Compute,
    /// DAPO's dynamic sampling streamed through the CPU decoder's KV slots, the requests in
    /// flight once a step's groups are kept aborted or carried as partial rollouts
    /// ([`DapoBackend::fill`]); `None`: whole gen batches (`--checkpoint` runs only).
    pub stream: Option<Leftovers>,
    /// LoRA adapters of this rank on the linear types [`DapoConfig::lora_modules`] names, of
    /// a checkpoint model (FSDP layout, [`crate::lm_policy::run_checkpoint`]); 0: none. The base
    /// is frozen: cast into the rollout once, the update moving the adapters alone, each
    /// refresh moving them alone.
    pub lora: usize,
    /// Which linear types the LoRA adapters adapt.
    pub lora_modules: LoraModules,
}

/// The linear types LoRA adapters adapt ([`DapoConfig::lora_modules`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraModules {
    /// All seven: q / k / v / o and gate / up / down.
    #[default]
    All,
    /// The attention's q / k / v / o (a mixture-of-experts model's experts take no adapters).
    Attention,
}

impl LoraModules {
    /// The targets, in a layer's order.
    ///
    /// ```
    /// use lifecycle_examples::dapo::LoraModules;
    /// assert_eq!(LoraModules::All.targets().len(), 7);
    /// assert_eq!(LoraModules::Attention.targets().len(), 4);
    /// ```
    pub fn targets(self) -> Vec<LoraTarget> {
        match self {
            LoraModules::All => LoraTarget::ALL.to_vec(),
            LoraModules::Attention => LoraTarget::ALL[..4].to_vec(),
        }
    }
}

impl std::fmt::Display for LoraModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LoraModules::All => "all seven linear types",
            LoraModules::Attention => "the attention's q / k / v / o",
        })
    }
}

impl Default for DapoConfig {
    fn default() -> Self {
        DapoConfig {
            steps: 16,
            world: 2,
            tp: 2,
            prompts_per_batch: 4,
            group_size: 8,
            batch_groups: 8,
            max_gen_batches: 32,
            tokens: 8,
            temperature: 1.0,
            seed: 2026,
            reward_modulus: 4,
            reward_quota: 4,
            update: UpdateConfig::default(),
            policy: PolicyConfig {
                vocab: 64,
                hidden: 256,
                ffn: 1024,
                layers: 2,
            },
            memory: MemoryPolicy::default(),
            trace: false,
            train: HostTrain::Fsdp,
            experts: ExpertPlacement::TensorParallel,
            rollout_dtype: RolloutDtype::Bf16,
            fp8_keep: Fp8Keep::default(),
            fp8_compute: Fp8Compute::W8A8,
            stream: None,
            lora: 0,
            lora_modules: LoraModules::All,
        }
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum DapoError {
    /// A lifecycle operation failed.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError<HostError>),
    /// The host backend rejected the model or an update.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A lifecycle operation of the Megatron host backend failed (boxed: the error is large).
    #[error(transparent)]
    MegatronLifecycle(Box<LifecycleError<MegatronError>>),
    /// The Megatron host backend rejected the model, a layout or an update.
    #[error(transparent)]
    Megatron(#[from] MegatronError),
    /// The checkpoint does not fit the Megatron layout.
    #[error(transparent)]
    MegatronCheckpoint(#[from] lifecycle_decoder::MegatronCheckpointError),
    /// Dynamic sampling found no group with mixed rewards within `--max-gen-batches` (a step
    /// with some trains on those, [`StepReport::short_of`]).
    #[error(
        "step {step}: {kept} of {needed} groups with mixed rewards after {gen_batches} gen batches \
         (the limit, --max-gen-batches), nothing to train on (the samples' mean reward is \
         {mean_reward:.3}, and near 0 or 1 almost every group is uniform): raise the limit, or \
         raise the group size so fewer groups have uniform rewards"
    )]
    BatchNotFilled {
        /// The step.
        step: usize,
        /// Groups kept.
        kept: usize,
        /// Groups needed.
        needed: usize,
        /// Gen batches run.
        gen_batches: usize,
        /// Mean reward of every sample generated in the step.
        mean_reward: f32,
    },
    /// Inconsistent settings.
    #[error("invalid setting: {0}")]
    Config(String),
    /// The checkpoint could not be loaded.
    #[error(transparent)]
    Checkpoint(#[from] lifecycle_decoder::CheckpointError),
    /// The decoder rejected the model, its layout or a token.
    #[error(transparent)]
    Decode(#[from] lifecycle_decoder::DecodeError),
    /// The training forward pass rejected a batch.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// The LoRA adapters do not fit the model.
    #[error(transparent)]
    Lora(#[from] lifecycle_layout::lora::LoraError),
}

impl From<StreamUnsupported> for DapoError {
    fn from(e: StreamUnsupported) -> Self {
        DapoError::Config(format!("--sampling stream: {}", e.why))
    }
}

impl From<LifecycleError<MegatronError>> for DapoError {
    fn from(e: LifecycleError<MegatronError>) -> Self {
        DapoError::MegatronLifecycle(Box::new(e))
    }
}

impl From<BatchNotFilled> for DapoError {
    fn from(b: BatchNotFilled) -> Self {
        DapoError::BatchNotFilled {
            step: b.step,
            kept: b.kept,
            needed: b.needed,
            gen_batches: b.gen_batches,
            mean_reward: b.mean_reward,
        }
    }
}

/// The samples of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// Prompt id.
    pub prompt: u64,
    /// Generated tokens of each sample.
    pub samples: Vec<Vec<usize>>,
    /// Reward of each sample.
    pub rewards: Vec<f32>,
    /// The rollout's log-probability of each generated token of each sample (shaped like
    /// `samples`): `log_softmax(logits / T)` of the rollout weights at the sampling temperature,
    /// before any top-k / top-p truncation, what the update's truncated importance sampling
    /// weighs against the trainer's ([`update::tis_weight`]); empty where the rollout reported
    /// none.
    pub logprobs: Vec<Vec<f32>>,
}

impl Group {
    /// Whether every sample got the same reward (no learning signal: DAPO drops the group).
    pub fn uniform(&self) -> bool {
        self.rewards.windows(2).all(|w| w[0] == w[1])
    }
}

/// One rollout call's work.
#[derive(Debug, Clone)]
pub struct GenJob {
    /// Prompt ids.
    pub prompts: Vec<u64>,
    /// Samples per prompt.
    pub group_size: usize,
    /// Tokens per sample.
    pub tokens: usize,
    /// Temperature.
    pub temperature: f32,
    /// Sampling seed (mixed with prompt and sample index).
    pub seed: u64,
    /// The reward rule (built for the vocabulary by [`RewardRule::new`]).
    pub reward: RewardRule,
    /// Policy sizes.
    pub policy: PolicyConfig,
    /// Rollout tensor-parallel degree.
    pub tp: usize,
}

/// The tokens of prompt `id` (four, each below `vocab`).
pub fn prompt(id: u64, vocab: usize) -> Vec<usize> {
    let v = vocab.max(1) as u64;
    (0..4)
        .map(|k| ((id * 31 + k * 7 + 3) % v) as usize)
        .collect()
}

/// The group of prompt `id`: its samples, rewarded by `rule`, with the rollout's log-probability
/// of each of their tokens ([`Group::logprobs`]; empty for none).
pub fn rewarded_group(
    id: u64,
    rule: RewardRule,
    samples: Vec<Vec<usize>>,
    logprobs: Vec<Vec<f32>>,
) -> Group {
    let rewards = samples.iter().map(|s| rule.reward(s)).collect();
    Group {
        prompt: id,
        samples,
        rewards,
        logprobs,
    }
}

/// The sampling seed of sample `sample` of prompt `prompt` in a gen batch of seed `seed`: every
/// sample draws from a generator of its own (`SplitMix64::from_keys(&[seed, prompt, sample])`'s
/// first word as its request's [`SamplingParams::seed`](lifecycle_decoder::SamplingParams)), so
/// its tokens depend on its prompt, its index and the weights only, never on the replica or the
/// batch it is decoded in. Every decoder rollout (the CPU and GPU engines, a decoder built per
/// call; under lazy and eager alike) takes its seeds from here; the toy policy draws from
/// `SplitMix64::from_keys(&[seed, prompt, sample])` itself.
pub fn sample_seed(seed: u64, prompt: u64, sample: usize) -> u64 {
    SplitMix64::from_keys(&[seed, prompt, sample as u64]).next_u64()
}

/// Rolls out one gen batch: `group_size` samples per prompt, prompts spread over the `W / T`
/// data-parallel replicas of the rollout layout (one thread each).
///
/// `#[sharded_rollout]` turns this into `generate(&mut lifecycle, job)`, which enters rollout mode
/// only when the resident weights are missing or stale.
#[sharded_rollout]
pub fn generate(weights: RolloutView<'_, HostRollout>, job: &GenJob) -> Vec<Group> {
    sample_gen_batch(weights.get(), job)
}

/// The body of [`generate`] on resident weights (what [`ToyEngine`] runs).
pub(crate) fn sample_gen_batch(weights: &HostRollout, job: &GenJob) -> Vec<Group> {
    let replicas = weights.ranks.len() / job.tp;
    let groups: Vec<TpGroup<'_>> = (0..replicas)
        .map(|d| {
            TpGroup::new(
                weights.ranks[d * job.tp..(d + 1) * job.tp].iter().collect(),
                job.policy,
            )
        })
        .collect();
    // Every (prompt, sample) pair is one sequence; prompt i runs on replica i mod replicas, and the
    // sequences are spread over the machine's cores (all threads read the same resident weights).
    let work: Vec<(usize, u64, usize)> = job
        .prompts
        .iter()
        .enumerate()
        .flat_map(|(i, &id)| (0..job.group_size).map(move |s| (i % replicas, id, s)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(work.len())
        .max(1);
    // (prompt id, sample index, (tokens, their log-probabilities))
    type Done = (u64, usize, (Vec<usize>, Vec<f32>));
    let mut done: Vec<Done> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (work, groups) = (&work, &groups);
                scope.spawn(move || {
                    work.iter()
                        .skip(t)
                        .step_by(threads)
                        .map(|&(replica, id, s)| {
                            let tokens = prompt(id, job.policy.vocab);
                            let mut rng = SplitMix64::from_keys(&[job.seed, id, s as u64]);
                            (
                                id,
                                s,
                                groups[replica].sample_with_logprobs(
                                    &tokens,
                                    job.tokens,
                                    job.temperature,
                                    &mut rng,
                                ),
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_by_key(|&(id, s, _)| (id, s));
    job.prompts
        .iter()
        .map(|&id| {
            let (samples, logprobs): (Vec<Vec<usize>>, Vec<Vec<f32>>) = done
                .iter()
                .filter(|(p, _, _)| *p == id)
                .map(|(_, _, (tokens, logprobs))| (tokens.clone(), logprobs.clone()))
                .unzip();
            rewarded_group(id, job.reward, samples, logprobs)
        })
        .collect()
}

/// What one training step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// 1-based step number.
    pub step: usize,
    /// Rollout calls (gen batches) the step needed.
    pub gen_batches: usize,
    /// Groups generated.
    pub groups: usize,
    /// Groups with mixed rewards kept for training.
    pub kept: usize,
    /// `Some(needed)` when the step's gen batches ran out (`--max-gen-batches`) with fewer than
    /// the `needed` groups and it trained on the `kept` ones; `None` for a full batch.
    pub short_of: Option<usize>,
    /// Mean reward of every sample generated in the step (the learning curve: the policy's
    /// success rate on fresh prompts, before dynamic sampling filters groups).
    pub mean_reward: f32,
    /// Mean reward of the kept groups.
    pub kept_reward: f32,
    /// Mean rollout log-probability per generated token of the kept groups
    /// ([`Group::logprobs`]); `None` where the rollout reported none.
    pub rollout_logprob: Option<f64>,
    /// Switches into rollout mode during the step.
    pub switches: u64,
    /// Exits during the step.
    pub exits: u64,
    /// Bytes moved by switches during the step.
    pub bytes: LinkBytes,
    /// Time in rollout calls, switches included.
    pub rollout_time: Duration,
    /// Time in switch phases (enter + exit).
    pub switch_time: Duration,
    /// Time of the update phase: `lc.train()` (the exit under lazy) and the update.
    pub update_time: Duration,
    /// The update alone (gradients and optimizer step), without the exit.
    pub update_apply: Duration,
    /// Generation alone, over the step's gen batches.
    pub generate: Duration,
    /// Per-call engine setup, over the step's gen batches.
    pub setup: Duration,
    /// Switch time of each gen batch's rollout call.
    pub batch_switch: Vec<Duration>,
    /// What the update did.
    pub update: UpdateOutcome,
    /// The streamed fill's cost (`--sampling stream`): samples finished and their mean length
    /// against the kept ones', requests aborted, carried and dropped as stale.
    pub streamed: Option<lifecycle_decoder::Filled>,
}

/// What a whole run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The switching policy.
    pub switching: Switching,
    /// Per step.
    pub steps: Vec<StepReport>,
    /// Lifecycle metrics of the whole run.
    pub metrics: Metrics,
    /// Wall time of the run.
    pub total_time: Duration,
    /// Every group generated, in order (to compare runs sample for sample).
    pub groups: Vec<Group>,
    /// The switch timeline (empty unless [`DapoConfig::trace`]).
    pub trace: Trace,
}

impl RunReport {
    /// The steps that trained on fewer groups than a full batch because their gen batches ran
    /// out (`--max-gen-batches`), as one line for a report; `None` when every batch was full.
    ///
    /// ```
    /// # use lifecycle_examples::dapo::RunReport;
    /// # fn show(report: &RunReport) {
    /// if let Some(line) = report.short_steps() {
    ///     println!("{line}");
    /// }
    /// # }
    /// ```
    pub fn short_steps(&self) -> Option<String> {
        let short: Vec<String> = self
            .steps
            .iter()
            .filter_map(|s| {
                s.short_of
                    .map(|n| format!("step {} ({} of {n} groups)", s.step, s.kept))
            })
            .collect();
        (!short.is_empty()).then(|| {
            format!(
                "trained on the groups gathered when the gen batches ran out (--max-gen-batches): \
                 {}",
                short.join(", ")
            )
        })
    }

    /// Gen batches over all steps.
    pub fn gen_batches(&self) -> usize {
        self.steps.iter().map(|s| s.gen_batches).sum()
    }

    /// Time in rollout calls over all steps, switches included.
    pub fn rollout_time(&self) -> Duration {
        self.steps.iter().map(|s| s.rollout_time).sum()
    }

    /// The learning curve: [`StepReport::mean_reward`] per step.
    pub fn curve(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.mean_reward).collect()
    }

    /// Mean of the learning curve over its first and its last quarter of steps (at least one
    /// step each).
    pub fn quarters(&self) -> (f32, f32) {
        let curve = self.curve();
        let q = (curve.len() / 4).max(1).min(curve.len());
        let mean = |s: &[f32]| s.iter().sum::<f32>() / s.len().max(1) as f32;
        (mean(&curve[..q]), mean(&curve[curve.len() - q..]))
    }
}

/// Checks settings before anything is built.
pub fn validate(config: &DapoConfig) -> Result<(), DapoError> {
    let c = config;
    let checks = [
        (c.steps == 0, "--steps must be at least 1".to_string()),
        (c.world == 0, "--world must be at least 1".to_string()),
        (
            c.tp == 0 || !c.world.is_multiple_of(c.tp),
            format!("--tp {} must divide --world {}", c.tp, c.world),
        ),
        (
            match c.train {
                HostTrain::Fsdp => false,
                HostTrain::Megatron { tp, pp, .. } => {
                    tp == 0 || pp == 0 || !c.world.is_multiple_of(tp * pp)
                }
            },
            match c.train {
                HostTrain::Fsdp => String::new(),
                HostTrain::Megatron { tp, pp, .. } => format!(
                    "--train-tp {tp} x --pp {pp} must divide --world {} (DP = W / (TP x PP))",
                    c.world
                ),
            },
        ),
        (
            c.group_size < 2,
            "--group-size must be at least 2 (DAPO compares rewards within a group)".to_string(),
        ),
        (
            c.prompts_per_batch == 0,
            "--prompts-per-batch must be at least 1".to_string(),
        ),
        (
            c.batch_groups == 0,
            "--batch-groups must be at least 1".to_string(),
        ),
        (
            c.max_gen_batches == 0,
            "--max-gen-batches must be at least 1".to_string(),
        ),
        (c.tokens == 0, "--tokens must be at least 1".to_string()),
        (
            c.reward_modulus == 0,
            "the reward modulus must be at least 1".to_string(),
        ),
        (
            c.reward_quota == 0 || c.reward_quota > c.tokens,
            format!(
                "the reward quota must be between 1 and --tokens ({}), found {}",
                c.tokens, c.reward_quota
            ),
        ),
        (
            c.update.minibatches == 0,
            "the update needs at least one mini-batch".to_string(),
        ),
        (
            !(c.update.lr.is_finite() && c.update.lr > 0.0),
            format!(
                "the learning rate must be a finite number > 0, found {}",
                c.update.lr
            ),
        ),
        (
            !(c.update.clip_low >= 0.0 && c.update.clip_low < 1.0 && c.update.clip_high >= 0.0),
            format!(
                "the clip range needs 0 ≤ ε_low < 1 and ε_high ≥ 0, found {} and {}",
                c.update.clip_low, c.update.clip_high
            ),
        ),
        (
            c.update.clip_ratio_c.is_nan() || c.update.clip_ratio_c <= 1.0,
            format!(
                "the dual clip's c (clip_ratio_c) must be > 1, as verl asserts, found {}",
                c.update.clip_ratio_c
            ),
        ),
        (
            c.update
                .tis_cap
                .is_some_and(|cap| !(cap.is_finite() && cap > 0.0)),
            format!(
                "the cap of truncated importance sampling (--tis-cap) must be a finite number > 0 \
                 (0 on the command line turns TIS off), found {}",
                c.update.tis_cap.unwrap_or(f32::NAN)
            ),
        ),
        (
            !(c.temperature.is_finite() && c.temperature >= 0.0),
            format!(
                "--temperature must be a finite number ≥ 0, found {}",
                c.temperature
            ),
        ),
    ];
    match checks.into_iter().find(|(bad, _)| *bad) {
        Some((_, msg)) => Err(DapoError::Config(msg)),
        None => Ok(()),
    }
}

/// One gen batch the loop asks the rollout for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    /// 1-based training step.
    pub step: usize,
    /// Gen batches already run in this step (0 for the first).
    pub batch: usize,
    /// Prompt ids of the batch.
    pub prompts: Vec<u64>,
    /// Sampling seed of the step.
    pub seed: u64,
}

/// The loop settings of `config`.
pub fn loop_settings(config: &DapoConfig) -> LoopSettings {
    LoopSettings {
        steps: config.steps,
        prompts_per_batch: config.prompts_per_batch,
        batch_groups: config.batch_groups,
        max_gen_batches: config.max_gen_batches,
        seed: config.seed,
        streamed: config.stream.is_some(),
    }
}

/// Builds the lifecycle of a host run (`config`'s memory policy and trace, `engine` attached)
/// and runs the DAPO loop on it with `driver`, calling `on_step` after each step.
pub fn run_host<B, E, D>(
    config: &DapoConfig,
    backend: B,
    state: B::TrainState,
    engine: E,
    driver: &mut D,
    switching: Switching,
    mut on_step: impl FnMut(&StepReport),
) -> Result<RunReport, DapoError>
where
    B: Reshard,
    E: RolloutEngine<B::Rollout>,
    D: DapoBackend<B, E, Error = DapoError>,
    DapoError: From<LifecycleError<B::Error>>,
{
    validate(config)?;
    let lc_config = LifecycleConfig {
        switching,
        memory: config.memory,
    };
    let mut lc = Lifecycle::with_config(backend, state, lc_config)?.with_engine(engine);
    if config.trace {
        lc.enable_trace();
    }
    run_steps(&mut lc, driver, &loop_settings(config), |e| {
        if let LoopEvent::Step(s) = e {
            on_step(s)
        }
    })
}

/// The toy policy on the host FSDP backend: rollouts by [`ToyEngine`], the update
/// [`dapo_update`].
#[derive(Debug, Clone)]
pub struct ToyDriver {
    config: DapoConfig,
}

impl ToyDriver {
    /// The driver of `config`'s toy-policy run.
    pub fn new(config: DapoConfig) -> Self {
        ToyDriver { config }
    }

    fn rule(&self) -> RewardRule {
        let c = &self.config;
        RewardRule::new(c.reward_modulus, c.reward_quota, c.policy.vocab)
    }
}

/// The report's "DAPO on the host backend" line and its offload setting.
pub(crate) fn offload_name(config: &DapoConfig) -> &'static str {
    let m = config.memory;
    match (m.offload_params, m.offload_optimizer) {
        (false, false) if m.keep_rollout_resident => "off (the rollout weights kept resident)",
        (false, false) => "off",
        (true, false) => "master",
        (false, true) => "Adam",
        (true, true) => "master + Adam",
    }
}

/// The report's reward line.
pub fn reward_line(config: &DapoConfig, vocab: usize) -> String {
    let rule = RewardRule::new(config.reward_modulus, config.reward_quota, vocab);
    format!(
        "reward: 1 if at least {} of the {} generated tokens t have t mod {} == 0 (a uniform \
         policy scores {:.3})",
        rule.quota(),
        config.tokens,
        rule.modulus(),
        rule.sample_hit_rate(vocab, config.tokens)
    )
}

impl DapoBackend<HostBackend, ToyEngine> for ToyDriver {
    type Error = DapoError;

    fn describe(&self) -> Vec<String> {
        let config = &self.config;
        let u = &config.update;
        vec![
            format!(
                "DAPO on the host backend: W = {}, T = {}, policy {} params ({} layers, hidden {}, ffn {}, vocab {}), \
                 {} prompts x {} samples per gen batch, {} groups per step, offload {}",
                config.world,
                config.tp,
                config.policy.params(),
                config.policy.layers,
                config.policy.hidden,
                config.policy.ffn,
                config.policy.vocab,
                config.prompts_per_batch,
                config.group_size,
                config.batch_groups,
                offload_name(config),
            ),
            format!(
                "update: DAPO, {}, {} mini-batches per step, Adam lr {:e}; gradients by \
                 backpropagation",
                u.objective.summary(u),
                u.minibatches,
                u.lr
            ),
            reward_line(config, config.policy.vocab),
        ]
    }

    fn generate(
        &mut self,
        session: &mut RolloutSession<'_, HostBackend, ToyEngine>,
        request: &GenRequest,
    ) -> Result<GenBatch, DapoError> {
        let c = &self.config;
        let job = GenJob {
            prompts: request.prompts.clone(),
            group_size: c.group_size,
            tokens: c.tokens,
            temperature: c.temperature,
            seed: request.seed,
            reward: self.rule(),
            policy: c.policy,
            tp: c.tp,
        };
        let (weights, mut engine) = session.parts();
        let t = std::time::Instant::now();
        let groups = engine.generate(weights, &job);
        Ok(GenBatch {
            streamed: None,
            groups,
            setup: Duration::ZERO,
            generate: t.elapsed(),
        })
    }

    fn update(
        &mut self,
        train: &mut TrainSession<'_, HostBackend, ToyEngine>,
        _step: usize,
        kept: &[Group],
    ) -> Result<UpdateOutcome, DapoError> {
        let c = &self.config;
        dapo_update(train.state_mut(), c.policy, kept, &c.update, c.temperature)
            .map(UpdateOutcome::Dapo)
    }
}

/// Runs DAPO on the toy policy with `switching`, calling `on_step` after each step: the update is
/// [`dapo_update`].
pub fn run(
    config: &DapoConfig,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, DapoError> {
    validate(config)?;
    if config.train != HostTrain::Fsdp {
        return Err(DapoError::Config(
            "the toy policy trains in the FSDP layout only (--train megatron needs a decoder \
             model: a --checkpoint or the built-in small Qwen2 model)"
                .to_string(),
        ));
    }
    if config.rollout_dtype != RolloutDtype::Bf16 {
        return Err(DapoError::Config(
            "the toy policy rolls out in bf16 only: --rollout-dtype fp8 needs a decoder model \
             (--checkpoint)"
                .to_string(),
        ));
    }
    if config.lora > 0 {
        return Err(DapoError::Config(
            "LoRA adapters (--lora) adapt a decoder model's linear layers: pass --checkpoint DIR \
             (the toy policy has none)"
                .to_string(),
        ));
    }
    let state = HostTrainState::from_tensors(config.world, config.policy.init(config.seed))?;
    let layout = config.policy.rollout_layout(config.tp)?;
    let mut driver = ToyDriver::new(*config);
    run_host(
        config,
        HostBackend::new(layout),
        state,
        ToyEngine,
        &mut driver,
        switching,
        on_step,
    )
}
