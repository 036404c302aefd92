//! DAPO rollouts through the Qwen2 / Llama decoder on a Hugging Face checkpoint: the training
//! state is the checkpoint's weights, the rollout runs [`CpuDecoder`](lifecycle_decoder::CpuDecoder) on the resharded bf16 TP
//! slices, the reward is the same verifiable rule as the toy policy's ([`RewardRule`]: token
//! classes, so its hit rate does not shrink with the vocabulary). The update is the synthetic
//! stand-in ([`synthetic_update`]): there is no backward pass for the decoder here. With LoRA
//! adapters ([`DapoConfig::lora`]) the base is frozen: the switch casts it once, the update and
//! each refresh move the adapters alone, and the decoder applies them unmerged.

use lifecycle_layout::settings::Configure;
use std::path::Path;

use lifecycle_core::MemoryPolicy;
use lifecycle_core::{sharded_rollout, RolloutSession, RolloutView, Switching, TrainSession};
use lifecycle_decoder::{Checkpoint, DecodeError, GroupStream, ModelConfig};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::lora::{adapters, is_adapter, with_adapters, LoraConfig, LoraError};
use lifecycle_layout::RolloutLayout;
use lifecycle_layout::{AdamParams, HostRollout, HostTensor};

use crate::dapo::update::SYNTHETIC_LR;
use crate::dapo::{
    offload_name, reward_line, run_host, synthetic_update, validate, CpuDecoderEngine, DapoBackend,
    DapoConfig, DapoError, DecodeJob, DecoderLayout, GenBatch, GenRequest, Group, RewardRule,
    RunReport, StepReport, UpdateOutcome,
};

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
/// `i mod (W / T)`; each replica serves all its `prompts × group_size` samples as requests with
/// seeds of their own ([`crate::dapo::sample_seed`]: the same samples as the lifecycle's
/// engine gives), replicas on threads of their own ([`CpuDecoderEngine::generate`], with an
/// engine made for the call); the groups carry the samples' log-probabilities.
///
/// `#[sharded_rollout]` turns this into `generate_lm(&mut lifecycle, job)`.
#[sharded_rollout]
pub fn generate_lm(
    weights: RolloutView<'_, HostRollout>,
    job: &LmJob,
) -> Result<Vec<Group>, DecodeError> {
    let mut engine = CpuDecoderEngine::new(
        job.model.clone(),
        DecoderLayout::Unfused(job.layout.clone()),
    );
    let (groups, _, _) = engine.generate(
        weights.get(),
        &DecodeJob {
            prompts: job.prompts.clone(),
            group_size: job.group_size,
            tokens: job.tokens,
            temperature: job.temperature,
            seed: job.seed,
            reward: job.reward,
        },
    )?;
    Ok(groups)
}

/// The decode job of `request` under `config` for a model of `vocab` tokens.
/// One gen batch of `request` through the session's CPU decoder engine, on any backend whose
/// rollout is host tensors (the FSDP and Megatron CPU executors).
pub(crate) fn decoder_batch<B: lifecycle_core::Reshard<Rollout = HostRollout>>(
    session: &mut RolloutSession<'_, B, CpuDecoderEngine>,
    config: &DapoConfig,
    request: &GenRequest,
    vocab: usize,
) -> Result<GenBatch, DapoError> {
    let job = decode_job(config, request, vocab);
    let (weights, mut engine) = session.parts();
    let (groups, setup, generate) = engine.generate(weights.get(), &job)?;
    Ok(GenBatch {
        streamed: None,
        groups,
        setup,
        generate,
    })
}

/// One streamed fill through the session's CPU decoder engine ([`CpuDecoderEngine::fill`]):
/// groups of `config.group_size` samples in `config.prompts_per_batch × group_size` KV slots (a
/// gen batch's room), the stream (made at the first fill, kept across steps for its partial
/// rollouts) sampling on the session's weight version.
pub(crate) fn decoder_fill<B: lifecycle_core::Reshard<Rollout = HostRollout>>(
    session: &mut RolloutSession<'_, B, CpuDecoderEngine>,
    stream: &mut Option<GroupStream>,
    config: &DapoConfig,
    want: usize,
    seed: u64,
    vocab: usize,
) -> Result<GenBatch, DapoError> {
    let leftovers = config
        .stream
        .ok_or_else(|| DapoError::Config("a streamed fill without --sampling stream".into()))?;
    let stream = stream.get_or_insert_with(|| {
        GroupStream::new(config.group_size, leftovers)
            .with_max_groups(config.max_gen_batches * config.prompts_per_batch)
    });
    stream.set_version(session.weights().version())?;
    let job = DecodeJob {
        prompts: Vec::new(),
        group_size: config.group_size,
        tokens: config.tokens,
        temperature: config.temperature,
        seed,
        reward: RewardRule::new(config.reward_modulus, config.reward_quota, vocab),
    };
    let (weights, mut engine) = session.parts();
    let slots = config.prompts_per_batch * config.group_size;
    let f = engine.fill(weights.get(), stream, &job, want, slots)?;
    Ok(GenBatch {
        groups: f.kept,
        setup: f.setup,
        generate: f.generate,
        streamed: Some((f.filled, f.rewards, f.scored)),
    })
}

pub(crate) fn decode_job(config: &DapoConfig, request: &GenRequest, vocab: usize) -> DecodeJob {
    DecodeJob {
        prompts: request.prompts.clone(),
        group_size: config.group_size,
        tokens: config.tokens,
        temperature: config.temperature,
        seed: request.seed,
        reward: RewardRule::new(config.reward_modulus, config.reward_quota, vocab),
    }
}

/// The header line of a checkpoint run: what the model is.
pub(crate) fn checkpoint_line(model: &ModelConfig, path: &Path) -> String {
    format!(
        "checkpoint {} ({:?}, {} params, {} layers, hidden {}, heads {}/{} kv, vocab {}, {} head)",
        path.display(),
        model.architecture,
        model.params(),
        model.model.layers,
        model.model.hidden,
        model.model.heads,
        model.model.query_groups,
        model.model.vocab,
        if model.model.tied_embeddings {
            "tied"
        } else {
            "untied"
        },
    )
}

/// A checkpoint on the host FSDP backend: rollouts by [`CpuDecoderEngine`] on the unfused
/// layout, the synthetic update ([`synthetic_update`]).
#[derive(Debug, Clone)]
pub struct CheckpointDriver {
    config: DapoConfig,
    model: ModelConfig,
    what: String,
    /// The streamed dynamic sampling's state (`--sampling stream`), from its first fill.
    stream: Option<GroupStream>,
}

impl CheckpointDriver {
    /// The driver of `config`'s run on `model` (`what`: how the header names it).
    pub fn new(config: DapoConfig, model: ModelConfig, what: String) -> Self {
        CheckpointDriver {
            config,
            model,
            what,
            stream: None,
        }
    }
}

impl DapoBackend<HostBackend, CpuDecoderEngine> for CheckpointDriver {
    type Error = DapoError;

    fn describe(&self) -> Vec<String> {
        let config = &self.config;
        let lora = lora_config(config).map(|l| {
            let params: usize = adapters(&self.model.model, &l)
                .map(|a| a.iter().map(|a| a.a.numel() + a.b.numel()).sum())
                .unwrap_or(0);
            format!(
                "LoRA: rank {r} on {} (lora_alpha {}, {params} adapter parameters beside {} in \
                 the base), applied unmerged by the decoder; the base frozen (cast into the \
                 rollout once), the update and each refresh moving the adapters alone, the \
                 rollout weights kept resident",
                config.lora_modules,
                2 * config.lora,
                self.model.params(),
                r = config.lora
            )
        });
        let mut lines = vec![
            format!(
                "DAPO on the host backend: W = {}, T = {}, {}, rollouts through the CPU decoder \
                 on {} weights, {} prompts x {} samples per gen batch, {} groups per step, \
                 offload {}",
                config.world,
                config.tp,
                self.what,
                config.rollout_dtype,
                config.prompts_per_batch,
                config.group_size,
                config.batch_groups,
                offload_name(config),
            ),
            format!(
                "update: synthetic (seeded noise in the {}gradient shards, then Adam; no \
                 backward pass for checkpoint models)",
                if config.lora > 0 { "adapters' " } else { "" }
            ),
            reward_line(config, self.model.model.vocab),
        ];
        lines.extend(lora);
        lines
    }

    fn generate(
        &mut self,
        session: &mut RolloutSession<'_, HostBackend, CpuDecoderEngine>,
        request: &GenRequest,
    ) -> Result<GenBatch, DapoError> {
        decoder_batch(session, &self.config, request, self.model.model.vocab)
    }
    fn fill(
        &mut self,
        session: &mut RolloutSession<'_, HostBackend, CpuDecoderEngine>,
        want: usize,
        seed: u64,
    ) -> Result<GenBatch, DapoError> {
        let vocab = self.model.model.vocab;
        decoder_fill(session, &mut self.stream, &self.config, want, seed, vocab)
    }

    fn update(
        &mut self,
        train: &mut TrainSession<'_, HostBackend, CpuDecoderEngine>,
        step: usize,
        kept: &[Group],
    ) -> Result<UpdateOutcome, DapoError> {
        let adam = AdamParams {
            lr: SYNTHETIC_LR,
            ..AdamParams::default()
        };
        // a LoRA model trains its adapters alone
        let lora = self.config.lora > 0;
        let trains = |name: &str| !lora || is_adapter(name);
        synthetic_update(
            train.state_mut(),
            self.config.seed,
            step,
            kept,
            (adam, &trains),
        )?;
        Ok(UpdateOutcome::Synthetic)
    }
}

/// The driver of a checkpoint run on the host FSDP backend (for its header).
pub fn checkpoint_driver(
    config: &DapoConfig,
    checkpoint: &Checkpoint,
    path: &Path,
) -> CheckpointDriver {
    CheckpointDriver::new(
        with_lora_memory(config),
        checkpoint.config.clone(),
        checkpoint_line(&checkpoint.config, path),
    )
}

/// `config` with the memory policy its run keeps: with LoRA adapters ([`DapoConfig::lora`]) the
/// rollout weights stay resident and nothing is offloaded (a refresh then moves the adapters
/// alone), else `config.memory`.
///
/// ```
/// use lifecycle_examples::dapo::DapoConfig;
/// use lifecycle_examples::lm_policy::with_lora_memory;
///
/// let plain = DapoConfig::default();
/// assert_eq!(with_lora_memory(&plain).memory, plain.memory);
/// let lora = with_lora_memory(&DapoConfig { lora: 8, ..plain });
/// assert!(lora.memory.keep_rollout_resident && !lora.memory.offload_params);
/// ```
pub fn with_lora_memory(config: &DapoConfig) -> DapoConfig {
    if config.lora == 0 {
        return *config;
    }
    DapoConfig {
        memory: MemoryPolicy {
            offload_params: false,
            offload_optimizer: false,
            keep_rollout_resident: true,
        },
        ..*config
    }
}

/// The LoRA configuration of [`DapoConfig::lora`] (rank `r` on the linear types of
/// [`DapoConfig::lora_modules`], `lora_alpha` 2r), `None` for 0.
///
/// ```
/// use lifecycle_examples::dapo::DapoConfig;
/// use lifecycle_examples::lm_policy::lora_config;
///
/// assert!(lora_config(&DapoConfig::default()).is_none());
/// let lora = lora_config(&DapoConfig { lora: 8, ..DapoConfig::default() }).unwrap();
/// assert_eq!((lora.rank, lora.scaling()), (8, 2.0));
/// ```
pub fn lora_config(config: &DapoConfig) -> Option<LoraConfig> {
    (config.lora > 0).then(|| {
        LoraConfig::new(
            config.lora,
            2.0 * config.lora as f64,
            config.lora_modules.targets(),
        )
    })
}

/// The adapters of `lora` for `model`, initialised as PEFT does: each `A` uniform in
/// ±1/√(its inputs) from `seed` (kaiming-uniform with a = √5), each `B` zero, so the first
/// rollout is the base model's.
///
/// ```
/// use lifecycle_decoder::ModelConfig;
/// use lifecycle_examples::dapo::DapoConfig;
/// use lifecycle_examples::lm_policy::{initial_adapters, lora_config};
/// use lifecycle_layout::TensorData;
///
/// let model = ModelConfig::from_json_str(
///     r#"{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
///     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
///     "rope_theta": 10000.0}"#,
/// )?;
/// let lora = lora_config(&DapoConfig { lora: 4, ..DapoConfig::default() }).unwrap();
/// let adapters = initial_adapters(&model, &lora, 7)?;
/// assert_eq!(adapters.len(), 2 * 7); // A and B of q, k, v, o, gate, up, down
/// for t in &adapters {
///     let TensorData::F32(v) = &t.data else { unreachable!() };
///     let zero = v.iter().all(|&x| x == 0.0);
///     assert_eq!(zero, t.name.contains("lora_B"), "{}", t.name);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn initial_adapters(
    model: &ModelConfig,
    lora: &LoraConfig,
    seed: u64,
) -> Result<Vec<HostTensor>, LoraError> {
    let mut out = Vec::new();
    for (i, a) in adapters(&model.model, lora)?.into_iter().enumerate() {
        let inputs = a.a.shape.get(1).copied().unwrap_or(1).max(1);
        let bound = 1.0 / (inputs as f32).sqrt();
        let mut rng = crate::rng::SplitMix64::from_keys(&[seed, 0x10fa, i as u64]);
        let n: usize = a.a.shape.iter().product();
        let values = (0..n).map(|_| rng.symmetric(bound)).collect();
        out.push(HostTensor::f32(a.a.name.clone(), a.a.shape.clone(), values));
        let m: usize = a.b.shape.iter().product();
        out.push(HostTensor::f32(
            a.b.name.clone(),
            a.b.shape.clone(),
            vec![0.0; m],
        ));
    }
    Ok(out)
}

/// Runs DAPO on `checkpoint` with `switching`: the same dynamic sampling as [`crate::dapo::run`],
/// rollouts through [`CpuDecoderEngine`], the synthetic update ([`synthetic_update`]).
/// `config.policy` and `config.update` are not used. With [`DapoConfig::lora`], adapters
/// ([`initial_adapters`]) beside the checkpoint's frozen base, the rollout weights kept
/// resident (nothing offloaded: `config.memory` is not used), so each refresh moves the
/// adapters alone.
pub fn run_checkpoint(
    config: &DapoConfig,
    checkpoint: &Checkpoint,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, DapoError> {
    validate(config)?;
    let model = checkpoint.config.clone();
    let base = model
        .rollout_layout_with(config.tp, config.experts)
        .map_err(DecodeError::from)?;
    let lora = lora_config(config);
    let mut tensors = checkpoint.tensors.clone();
    let (layout, decoder) = match &lora {
        None => (base.clone(), DecoderLayout::Unfused(base)),
        Some(l) => {
            tensors.extend(initial_adapters(&model, l, config.seed)?);
            let layout = with_adapters(&base, &model.model, l)?;
            (layout.clone(), DecoderLayout::Lora(layout, l.clone()))
        }
    };
    let state = HostTrainState::from_tensors(config.world, tensors)?;
    let engine = CpuDecoderEngine::new(model.clone(), decoder).with_fp8_compute(config.fp8_compute);
    let run = with_lora_memory(config);
    let mut driver = CheckpointDriver::new(run, model, String::new());
    run_host(
        &run,
        HostBackend::new(layout)
            .with_rollout_dtype(config.rollout_dtype)
            .with_fp8_keep(config.fp8_keep)
            .with_frozen_base(lora.is_some()),
        state,
        engine,
        &mut driver,
        switching,
        on_step,
    )
}
