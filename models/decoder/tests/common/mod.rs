//! The decoder tests' fixtures: where they are and how their JSON references read.

#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The fixtures folder of this crate.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A JSON file of the fixtures, by its path under the folder.
pub fn json(path: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(path)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `fixtures/references.json` (Qwen2 / Llama, made by make_fixtures.py).
pub fn references() -> Value {
    json("references.json")
}

/// `fixtures/moe/moe_references.json` (Qwen3 / Qwen3-MoE, made by make_moe_fixtures.py).
pub fn moe_references() -> Value {
    json("moe/moe_references.json")
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
