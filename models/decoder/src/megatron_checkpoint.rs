//! Hugging Face checkpoints as Megatron-Core training states: the config's [`ModelSpec`], the
//! [`MegatronLayout`] at given degrees (errors name the `config.json` field at fault), and the
//! [`MegatronTrainState`] sharded from the checkpoint's tensors.

use std::path::Path;

use lifecycle_layout::megatron::{MegatronLayout, MegatronLayoutError};
pub use lifecycle_layout::megatron::{MegatronParallel, MEGATRON_VOCAB_MULTIPLE};
use lifecycle_layout::HostTensor;
use lifecycle_state::megatron::MegatronTrainState;

use crate::checkpoint::{read_tensors, Checkpoint};
use crate::config::ModelConfig;
use crate::error::{CheckpointError, MegatronCheckpointError};

/// A checkpoint folder loaded straight into a Megatron training state.
#[derive(Debug, Clone)]
pub struct MegatronCheckpoint {
    /// The model config (`config.json`).
    pub config: ModelConfig,
    /// Every rank's shards, optimizer state at zero.
    pub state: MegatronTrainState,
}

/// The `config.json` field a planner error is about, when it is about one.
fn config_field(e: &MegatronLayoutError) -> Option<&'static str> {
    match e {
        MegatronLayoutError::HeadsNotDivisibleByGroups { .. }
        | MegatronLayoutError::TpGroups { .. } => Some("num_key_value_heads"),
        MegatronLayoutError::NotDivisible { what, .. } => match *what {
            "attention heads" => Some("num_attention_heads"),
            "ffn hidden size" => Some("intermediate_size"),
            "moe_intermediate_size" => Some("moe_intermediate_size"),
            _ => None,
        },
        MegatronLayoutError::ExpertsNotDivisible { .. } => Some("num_experts"),
        MegatronLayoutError::PpExceedsLayers { .. } => Some("num_hidden_layers"),
        MegatronLayoutError::TopK { .. } => Some("num_experts_per_tok"),
        MegatronLayoutError::PaddedVocab { .. } => Some("vocab_size"),
        MegatronLayoutError::ZeroSize { what } => match *what {
            "hidden size" => Some("hidden_size"),
            "attention heads" => Some("num_attention_heads"),
            "query groups" => Some("num_key_value_heads"),
            "head dim" => Some("head_dim"),
            "ffn hidden size" => Some("intermediate_size"),
            "vocab size" => Some("vocab_size"),
            "layers" => Some("num_hidden_layers"),
            _ => None,
        },
        _ => None,
    }
}

/// What a [`ModelConfig`] becomes under Megatron-Core: its training layout and training state
/// (the config itself lives in the planning crate; bring this trait into scope for the methods).
pub trait MegatronConfig {
    /// The Megatron-Core training layout of this model at `parallel`, checked by the planner;
    /// an error names the `config.json` field that does not split (e.g. `num_attention_heads`
    /// not divisible by TP, `num_key_value_heads` and TP not dividing one another,
    /// `num_hidden_layers` < PP).
    ///
    /// ```
    /// use lifecycle_decoder::{MegatronConfig, MegatronParallel, ModelConfig};
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 61,
    ///   "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    ///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
    /// let layout = config.megatron_layout(MegatronParallel::new(2, 2, 1))?;
    /// assert_eq!(layout.padded_vocab(), 256); // 61 padded to a multiple of 128 × TP
    /// let err = config.megatron_layout(MegatronParallel::new(1, 3, 1)).unwrap_err();
    /// assert!(err.to_string().starts_with("config field `num_hidden_layers`"), "{err}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn megatron_layout(
        &self,
        parallel: MegatronParallel,
    ) -> Result<MegatronLayout, MegatronCheckpointError>;

    /// Shards full Hugging Face `tensors` of this model into a Megatron training state at
    /// `parallel` ([`MegatronTrainState::from_hf`]: bf16 params rounded from the fp32 values,
    /// zero vocabulary padding, zero grads and Adam moments).
    fn megatron_state(
        &self,
        tensors: Vec<HostTensor>,
        parallel: MegatronParallel,
    ) -> Result<MegatronTrainState, MegatronCheckpointError>;
}

impl MegatronConfig for ModelConfig {
    fn megatron_layout(
        &self,
        parallel: MegatronParallel,
    ) -> Result<MegatronLayout, MegatronCheckpointError> {
        let MegatronParallel { tp, pp, dp, .. } = parallel;
        let spec = self.model_spec(parallel.make_vocab_size_divisible_by);
        MegatronLayout::at(spec, parallel, None).map_err(|source| match config_field(&source) {
            Some(field) => MegatronCheckpointError::ConfigField {
                field,
                tp,
                pp,
                dp,
                source,
            },
            None => MegatronCheckpointError::Degrees { tp, pp, dp, source },
        })
    }

    fn megatron_state(
        &self,
        tensors: Vec<HostTensor>,
        parallel: MegatronParallel,
    ) -> Result<MegatronTrainState, MegatronCheckpointError> {
        let layout = self.megatron_layout(parallel)?;
        MegatronTrainState::from_hf(layout, tensors).map_err(MegatronCheckpointError::Tensors)
    }
}

impl Checkpoint {
    /// This checkpoint as a Megatron training state at `parallel` (the tensors are copied; see
    /// [`MegatronConfig::megatron_state`]).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("lc-doc-meg-{}", std::process::id()));
    /// use lifecycle_decoder::{load_checkpoint, random_tensors, save_checkpoint, ConfigStyle,
    ///     MegatronParallel, ModelConfig};
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 30,
    ///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    ///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
    /// save_checkpoint(&dir, &config, &random_tensors(&config, 3), ConfigStyle::V5)?;
    /// let state = load_checkpoint(&dir)?.megatron_state(MegatronParallel::new(2, 2, 2))?;
    /// assert_eq!(state.world(), 8);
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn megatron_state(
        &self,
        parallel: MegatronParallel,
    ) -> Result<MegatronTrainState, MegatronCheckpointError> {
        self.config.megatron_state(self.tensors.clone(), parallel)
    }
}

/// Loads `dir/config.json` and `dir/model.safetensors` (as [`load_checkpoint`](crate::load_checkpoint) does) into a
/// Megatron training state at `parallel`. The layout is checked before the weights are read, so
/// a config Megatron cannot lay out fails fast, naming the field.
pub fn load_megatron_checkpoint(
    dir: &Path,
    parallel: MegatronParallel,
) -> Result<MegatronCheckpoint, MegatronCheckpointError> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let layout = config.megatron_layout(parallel)?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).map_err(|source| CheckpointError::Io {
        path: path.clone(),
        source,
    })?;
    let tensors = read_tensors(&config, &bytes, &path)?;
    let state =
        MegatronTrainState::from_hf(layout, tensors).map_err(MegatronCheckpointError::Tensors)?;
    Ok(MegatronCheckpoint { config, state })
}
