//! What the GPU test files share: where the oracle fixtures are and how their JSON reads.

#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;

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
