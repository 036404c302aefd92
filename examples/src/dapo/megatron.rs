//! DAPO on the host Megatron backend ([`MegatronHostBackend`]: Megatron-Core's TP × PP × DP
//! training layout, ranks as threads) with its fused rollout (`[q; k; v]`, `[gate; up]`) read
//! in place by the CPU decoder ([`CpuDecoderEngine`] on [`DecoderLayout::Fused`]).
//!
//! The model is a checkpoint or, without one, a small random Qwen2 model
//! ([`SMALL_MEGATRON_CONFIG`]). The update is a synthetic stand-in, as for every decoder model
//! here (no backward pass): seeded noise as full Hugging Face-named gradients, scaled by the
//! batch's mean absolute advantage, set on every rank ([`MegatronTrainState::set_grads_from_hf`]),
//! then Megatron's distributed-optimizer Adam step ([`MegatronTrainState::adam_step`]).

use lifecycle_layout::settings::Configure;
use std::path::Path;

use lifecycle_core::{RolloutSession, Switching, TrainSession};
use lifecycle_decoder::{
    random_tensors, Checkpoint, CheckpointError, DecodeError, GroupStream, MegatronConfig,
    MegatronParallel, ModelConfig,
};
use lifecycle_host::megatron::{MegatronHostBackend, MegatronTrainState};
use lifecycle_layout::{AdamParams, HostTensor};
use lifecycle_layout::{ExpertPlacement, RolloutLayout as FusedLayout, RolloutVocab};

use super::update::SYNTHETIC_LR;
use super::{
    offload_name, reward_line, run_host, validate, CpuDecoderEngine, DapoBackend, DapoConfig,
    DapoError, DecoderLayout, GenBatch, GenRequest, Group, HostTrain, RunReport, StepReport,
    UpdateOutcome,
};
use crate::lm_policy::{checkpoint_line, decoder_batch};
use crate::rng::SplitMix64;

/// The model of `--train megatron` without `--checkpoint`: a small Qwen2 config (vocab 256,
/// hidden 64, 2 layers, 4 heads / 2 kv heads), random weights ([`random_tensors`]).
pub const SMALL_MEGATRON_CONFIG: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 256
}"#;

/// The fused rollout layout at degree `t` for `model` (vocabulary unpadded when `t` divides it,
/// padded to a multiple of 64 otherwise, as `lifecycle-plan` assumes), its experts (if any)
/// placed by `experts`.
pub fn fused_layout(model: &ModelConfig, t: usize, experts: ExpertPlacement) -> FusedLayout {
    let vocab = if t > 0 && model.model.vocab.is_multiple_of(t) {
        RolloutVocab::Unpadded
    } else {
        RolloutVocab::PadToMultipleOf(64)
    };
    FusedLayout::fused(t, vocab).with_expert_placement(experts)
}

/// The Megatron degrees of `config` (`HostTrain::Megatron`; TP = PP = EP = 1 otherwise).
pub fn parallel(config: &DapoConfig) -> MegatronParallel {
    let (tp, pp, ep, etp) = match config.train {
        HostTrain::Megatron { tp, pp, ep, etp } => (tp, pp, ep, etp),
        HostTrain::Fsdp => (1, 1, 1, 1),
    };
    MegatronParallel::new(tp, pp, config.world / (tp * pp).max(1)).with_experts(ep, etp)
}

/// The model and initial weights of a Megatron run: the checkpoint's, or the small random model's.
pub fn model_and_tensors(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
) -> Result<(ModelConfig, Vec<HostTensor>), DapoError> {
    Ok(match checkpoint {
        Some(c) => (c.config.clone(), c.tensors.clone()),
        None => {
            let model =
                ModelConfig::from_json_str(SMALL_MEGATRON_CONFIG).map_err(CheckpointError::from)?;
            let tensors = random_tensors(&model, config.seed);
            (model, tensors)
        }
    })
}

/// Megatron training layout on the host, fused rollout through the CPU decoder.
#[derive(Debug, Clone)]
pub struct MegatronDriver {
    config: DapoConfig,
    model: ModelConfig,
    what: String,
    /// The streamed dynamic sampling's state (`--sampling stream`), from its first fill.
    stream: Option<GroupStream>,
}

impl MegatronDriver {
    /// The driver of `config`'s run on `model` (`what`: how the header names it).
    pub fn new(config: DapoConfig, model: ModelConfig, what: String) -> Self {
        MegatronDriver {
            config,
            model,
            what,
            stream: None,
        }
    }

    /// The driver of a run on `checkpoint` (at `path`), or on the small random model.
    pub fn for_run(
        config: &DapoConfig,
        checkpoint: Option<(&Checkpoint, &Path)>,
    ) -> Result<Self, DapoError> {
        let (model, what) = match checkpoint {
            Some((c, path)) => (c.config.clone(), checkpoint_line(&c.config, path)),
            None => {
                let m = ModelConfig::from_json_str(SMALL_MEGATRON_CONFIG)
                    .map_err(CheckpointError::from)?;
                let what = format!(
                    "small random Qwen2 model ({} params, {} layers, hidden {}, heads {}/{} kv, \
                     vocab {})",
                    m.params(),
                    m.model.layers,
                    m.model.hidden,
                    m.model.heads,
                    m.model.query_groups,
                    m.model.vocab
                );
                (m, what)
            }
        };
        Ok(MegatronDriver::new(*config, model, what))
    }
}

/// Seeded full-size gradients of `model`, scaled by the kept groups' mean absolute advantage
/// and by `scale`.
pub fn synthetic_hf_grads(
    model: &ModelConfig,
    seed: u64,
    step: usize,
    groups: &[Group],
    scale: f32,
) -> Vec<HostTensor> {
    let signal = groups
        .iter()
        .map(|g| {
            let mean = g.rewards.iter().sum::<f32>() / g.rewards.len().max(1) as f32;
            g.rewards.iter().map(|r| (r - mean).abs()).sum::<f32>() / g.rewards.len().max(1) as f32
        })
        .sum::<f32>()
        / groups.len().max(1) as f32;
    model
        .tensor_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let mut rng = SplitMix64::from_keys(&[seed, step as u64, i as u64]);
            let n = shape.iter().product();
            let data = (0..n)
                .map(|_| rng.symmetric(1.0) * (0.5 + signal) * scale)
                .collect();
            HostTensor::f32(name, shape, data)
        })
        .collect()
}

impl DapoBackend<MegatronHostBackend, CpuDecoderEngine> for MegatronDriver {
    type Error = DapoError;

    fn describe(&self) -> Vec<String> {
        let c = &self.config;
        let p = parallel(c);
        let experts = match self.model.model.moe {
            Some(_) => format!(
                ", experts EP {} x ETP {} -> {}",
                p.ep,
                p.etp,
                c.experts.name()
            ),
            None => String::new(),
        };
        vec![
            format!(
                "DAPO on the host backend, Megatron training layout: W = {} (TP {} x PP {} x DP \
                 {}{experts}) -> fused rollout T = {}, {}, rollouts through the CPU decoder \
                 reading the fused layout, {} prompts x {} samples per gen batch, {} groups per \
                 step, offload {}",
                c.world,
                p.tp,
                p.pp,
                p.dp,
                c.tp,
                self.what,
                c.prompts_per_batch,
                c.group_size,
                c.batch_groups,
                offload_name(c),
            ),
            format!(
                "update: synthetic (seeded noise as full gradients on every rank, then Megatron's \
                 distributed-optimizer Adam step, lr {SYNTHETIC_LR:e}; no backward pass for \
                 decoder models)"
            ),
            reward_line(c, self.model.model.vocab),
        ]
    }

    fn generate(
        &mut self,
        session: &mut RolloutSession<'_, MegatronHostBackend, CpuDecoderEngine>,
        request: &GenRequest,
    ) -> Result<GenBatch, DapoError> {
        decoder_batch(session, &self.config, request, self.model.model.vocab)
    }
    fn fill(
        &mut self,
        session: &mut RolloutSession<'_, MegatronHostBackend, CpuDecoderEngine>,
        want: usize,
        seed: u64,
    ) -> Result<GenBatch, DapoError> {
        let vocab = self.model.model.vocab;
        crate::lm_policy::decoder_fill(session, &mut self.stream, &self.config, want, seed, vocab)
    }

    fn update(
        &mut self,
        train: &mut TrainSession<'_, MegatronHostBackend, CpuDecoderEngine>,
        step: usize,
        kept: &[Group],
    ) -> Result<UpdateOutcome, DapoError> {
        let grads = synthetic_hf_grads(&self.model, self.config.seed, step, kept, 1.0);
        let state: &mut MegatronTrainState = train.state_mut();
        state.set_grads_from_hf(grads)?;
        state.adam_step(AdamParams {
            lr: SYNTHETIC_LR,
            ..AdamParams::default()
        })?;
        Ok(UpdateOutcome::Synthetic)
    }
}

/// Runs DAPO with the Megatron training layout (`config.train`) on `checkpoint` or the small
/// random model, under `switching`.
pub fn run_megatron(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, DapoError> {
    validate(config)?;
    if config.lora > 0 {
        return Err(DapoError::Config(
            "LoRA adapters (--lora) run in the FSDP training layout (--train fsdp), whose \
             backend keeps a frozen base"
                .to_string(),
        ));
    }
    let (model, tensors) = model_and_tensors(config, checkpoint)?;
    let state = model.megatron_state(tensors, parallel(config))?;
    let layout = fused_layout(&model, config.tp, config.experts);
    // the decoder's own checks of the degree (heads, ffn, experts, vocabulary) before anything
    // moves
    model
        .rollout_layout_with(config.tp, config.experts)
        .map_err(DecodeError::from)?;
    let engine = CpuDecoderEngine::new(model.clone(), DecoderLayout::Fused(layout.clone()))
        .with_fp8_compute(config.fp8_compute);
    let mut driver = MegatronDriver::new(*config, model, String::new());
    run_host(
        config,
        MegatronHostBackend::new(layout)
            .with_rollout_dtype(config.rollout_dtype)
            .with_fp8_keep(config.fp8_keep),
        state,
        engine,
        &mut driver,
        switching,
        on_step,
    )
}
