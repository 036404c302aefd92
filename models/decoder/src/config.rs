//! The model configuration ([`ModelConfig`], read from a Hugging Face `config.json`) lives in the
//! planning crate ([`lifecycle_layout`]), which every planner, decoder and front reads; the
//! decoder adds the check of its inputs against it.

pub use lifecycle_layout::{Architecture, ConfigStyle, ModelConfig};

use crate::error::DecodeError;

/// `token` of sequence `sequence` as an input of a decoder of `config`: an error unless it is
/// inside the vocabulary.
///
/// ```
/// use lifecycle_decoder::{check_token, ModelConfig};
/// let c = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 31,
///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
///   "num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0}"#)?;
/// assert!(check_token(&c, 0, 30).is_ok());
/// assert!(check_token(&c, 2, 31).unwrap_err().to_string().contains("31"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_token(config: &ModelConfig, sequence: usize, token: u32) -> Result<(), DecodeError> {
    if (token as usize) < config.model.vocab {
        Ok(())
    } else {
        Err(DecodeError::Token {
            sequence,
            token,
            vocab: config.model.vocab,
        })
    }
}
