//! What the GPU test files share: where the oracle fixtures are and how their JSON reads.

#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;

use lifecycle_decoder::{Decoder, ModelConfig, PrefillLogits, Sampling};
use serde_json::Value;

/// The fixtures: `LIFECYCLE_DECODER_FIXTURES`, or next to this crate, or relative to the current
/// folder (a test binary copied to another machine runs from the repository root).
pub fn fixtures() -> PathBuf {
    if let Ok(p) = std::env::var("LIFECYCLE_DECODER_FIXTURES") {
        return PathBuf::from(p);
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../decoder/fixtures");
    if here.join("references.json").is_file() {
        return here;
    }
    PathBuf::from("models/decoder/fixtures")
}

/// `references.json` of the fixtures: transformers' logits and greedy tokens per model.
pub fn references() -> Result<Value, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(fixtures().join("references.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// A list of numbers, or of rows of numbers, flattened to f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|x| match x {
            Value::Array(row) => row.iter().map(|y| y.as_f64().unwrap() as f32).collect(),
            other => vec![other.as_f64().unwrap() as f32],
        })
        .collect()
}

/// A list of token ids.
pub fn tokens(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits rows and greedy tokens of one decoder.
pub type Outputs = (Vec<Vec<f32>>, Vec<Vec<u32>>);

/// Every path of the fp8 products: prefill logits of every position of `long` and of `short`
/// (more than 8 tokens: the dequantised GEMMs), two decode steps of 2 sequences (the e4m3
/// kernel), and 6 greedy tokens.
pub fn run<D: Decoder>(
    dec: &mut D,
    long: &[Vec<u32>],
    short: &[Vec<u32>],
) -> Result<Outputs, Box<dyn std::error::Error>>
where
    D::Error: 'static,
{
    let mut logits = dec.prefill(long, PrefillLogits::All)?;
    logits.extend(dec.decode_step(&[8, 77])?);
    logits.extend(dec.decode_step(&[3, 1])?);
    logits.extend(dec.prefill(short, PrefillLogits::All)?);
    let tokens = dec.generate(short, &Sampling::greedy(6))?;
    Ok((logits, tokens))
}

/// The prompts of [`run`]: a long one (40 tokens) with a short one, and two of 10 and 6.
pub fn prompts() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let long = vec![
        (0..40).map(|i| (i * 37 + 11) % 300).collect(),
        vec![5, 6, 7],
    ];
    let short = vec![
        vec![3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
        vec![27, 18, 28, 18, 28, 4],
    ];
    (long, short)
}

/// A dense Qwen2 of 256 wide with q / k / v biases, 128-wide heads and an untied head, two
/// layers.
pub fn qwen2_256() -> Result<ModelConfig, Box<dyn std::error::Error>> {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 300, "hidden_size": 256,
            "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 10000.0,
            "tie_word_embeddings": false}"#,
    )
    .map_err(Into::into)
}

/// The host executor's fp8 rollout of `tensors` (W = 1) in `layout`: the CPU decoders' weights.
pub fn host_fp8(
    layout: &lifecycle_layout::RolloutLayout,
    tensors: &[lifecycle_layout::HostTensor],
) -> Result<lifecycle_core::Lifecycle<lifecycle_host::HostBackend>, Box<dyn std::error::Error>> {
    use lifecycle_layout::settings::Configure;
    let host = lifecycle_host::HostTrainState::from_tensors(1, tensors.to_vec())?;
    let backend = lifecycle_host::HostBackend::new(layout.clone())
        .with_rollout_dtype(lifecycle_layout::fp8::RolloutDtype::Fp8);
    Ok(lifecycle_core::Lifecycle::new(backend, host))
}
