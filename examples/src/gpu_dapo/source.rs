//! The model of a run and where its initial weights come from: a checkpoint, or random weights
//! made on the GPUs (Qwen2.5-7B shapes or a small config).

use lifecycle_decoder::{load_checkpoint, CheckpointError, ModelConfig};
use lifecycle_fsdp::{FsdpBackend, FsdpTrainState};
use lifecycle_layout::HostTensor;

use super::{DapoGpuError, Options, SyntheticModel};

/// The Qwen2.5-7B config (the model of `lifecycle_layout::ModelSpec::qwen2_5_7b(28)`).
pub(crate) const QWEN2_5_7B_CONFIG: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 152064
}"#;

/// The small Qwen2-style config of `--synthetic small` (the default model).
pub(crate) const SMALL_CONFIG: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 4096
}"#;

/// Where the initial weights come from; a policy after the first starts again from them, put
/// back in place.
pub(crate) enum Source {
    /// Random weights made on the GPUs ([`FsdpBackend::synthetic_state`]).
    Synthetic {
        shapes: Vec<(String, Vec<usize>)>,
        seed: u64,
        scale: f32,
    },
    /// Checkpoint weights (fp32, kept in host memory to restore them).
    Host { tensors: Vec<HostTensor> },
}

/// The model of a run: its config, its initial weights, and a description for the output.
pub(crate) struct Model {
    pub(crate) config: ModelConfig,
    pub(crate) source: Source,
    pub(crate) what: String,
}

impl Model {
    /// Reads the checkpoint of `--checkpoint`, or makes the config of `--synthetic` (default:
    /// small). No GPU work.
    pub(crate) fn from_options(a: &Options) -> Result<Model, DapoGpuError> {
        let (seed, scale) = (a.run.seed, a.gpu.scale);
        match (&a.run.checkpoint, a.gpu.synthetic) {
            (Some(dir), _) => {
                let ckpt = load_checkpoint(dir)?;
                let tensors = ckpt
                    .tensors
                    .into_iter()
                    .map(|t| {
                        let data = t.data.to_f32().ok_or_else(|| {
                            DapoGpuError::Usage(format!(
                                "checkpoint tensor {} is not floating point ({})",
                                t.name,
                                t.data.dtype()
                            ))
                        })?;
                        Ok(HostTensor::f32(t.name, t.shape, data))
                    })
                    .collect::<Result<Vec<_>, DapoGpuError>>()?;
                Ok(Model {
                    config: ckpt.config,
                    source: Source::Host { tensors },
                    what: format!("checkpoint {}", dir.display()),
                })
            }
            (None, Some(SyntheticModel::Qwen7b)) => {
                let config =
                    ModelConfig::from_json_str(QWEN2_5_7B_CONFIG).map_err(CheckpointError::from)?;
                let shapes = config.tensor_shapes();
                Ok(Model {
                    config,
                    source: Source::Synthetic {
                        shapes,
                        seed,
                        scale,
                    },
                    what: "synthetic Qwen2.5-7B shapes, random weights".to_string(),
                })
            }
            (None, Some(SyntheticModel::Small) | None) => {
                let config =
                    ModelConfig::from_json_str(SMALL_CONFIG).map_err(CheckpointError::from)?;
                Ok(Model {
                    source: Source::Synthetic {
                        shapes: config.tensor_shapes(),
                        seed,
                        scale,
                    },
                    config,
                    what: "small synthetic Qwen2 config, random weights".to_string(),
                })
            }
        }
    }
}

impl Source {
    /// The training state of the initial weights, with a fresh optimizer (m, v, grads zero).
    pub(crate) fn initial(&self, backend: &FsdpBackend) -> Result<FsdpTrainState, DapoGpuError> {
        let mut state = match self {
            Source::Synthetic {
                shapes,
                seed,
                scale,
            } => backend.synthetic_state(shapes, *seed, *scale)?,
            Source::Host { tensors } => backend.state_from_tensors(tensors.clone())?,
        };
        backend.reset_optimizer(&mut state)?;
        Ok(state)
    }

    /// Puts the initial weights and a fresh optimizer back into `state`, in place.
    pub(crate) fn reset(
        &self,
        backend: &FsdpBackend,
        state: &mut FsdpTrainState,
    ) -> Result<(), DapoGpuError> {
        match self {
            Source::Synthetic { seed, scale, .. } => {
                backend.fill_synthetic_master(state, *seed, *scale)?
            }
            Source::Host { tensors } => backend.upload_master(state, tensors)?,
        }
        backend.reset_optimizer(state)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seven_b_config_is_the_shared_model_description() {
        let config = ModelConfig::from_json_str(QWEN2_5_7B_CONFIG).unwrap();
        assert_eq!(
            config.tensor_shapes(),
            lifecycle_layout::ModelSpec::qwen2_5_7b(28).hf_tensors()
        );
        assert_eq!(config.params(), 7_615_616_512);
        assert!(config.rollout_layout(2).is_ok());
        let small = ModelConfig::from_json_str(SMALL_CONFIG).unwrap();
        assert!(small.rollout_layout(1).is_ok() && small.rollout_layout(2).is_ok());
    }
}
