//! The model shapes the benchmarks run, built from their `config.json` text.

use lifecycle_layout::{ConfigError, ModelConfig};

/// The Qwen2.5-7B shape (hidden 3584, 28 heads / 4 kv, ffn 18944, vocabulary 152064, untied
/// embeddings) at `layers` decoder layers.
///
/// ```
/// let c = lifecycle_bench::models::qwen25_7b(4)?;
/// assert_eq!((c.model.layers, c.model.hidden), (4, 3584));
/// # Ok::<(), lifecycle_layout::ConfigError>(())
/// ```
pub fn qwen25_7b(layers: usize) -> Result<ModelConfig, ConfigError> {
    ModelConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": {layers},
            "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false}}"#
    ))
}
