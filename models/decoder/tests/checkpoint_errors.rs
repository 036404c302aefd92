//! Config parsing in both spellings and checkpoint errors: each names the tensor, field or file,
//! and a truncated or corrupt file is an error, never a panic.

use std::path::PathBuf;

use lifecycle_decoder::{
    load_checkpoint, random_tensors, save_checkpoint, CheckpointError, ConfigStyle, ModelConfig,
};
use lifecycle_layout::HostTensor;

const V4: &str = r#"{"model_type": "qwen2", "vocab_size": 40, "hidden_size": 16,
  "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
  "rms_norm_eps": 1e-5, "tie_word_embeddings": false}"#;

const V5: &str = r#"{"model_type": "qwen2", "vocab_size": 40, "hidden_size": 16,
  "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
  "dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": false}"#;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lc-decoder-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn small() -> ModelConfig {
    ModelConfig::from_json_str(V5).unwrap()
}

fn write(tag: &str, tensors: &[HostTensor]) -> PathBuf {
    let dir = temp_dir(tag);
    save_checkpoint(&dir, &small(), tensors, ConfigStyle::V5).unwrap();
    dir
}

#[test]
fn both_config_styles_parse_to_the_same_config() {
    let a = ModelConfig::from_json_str(V4).unwrap();
    let b = ModelConfig::from_json_str(V5).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!(a.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(
        (a.model.head_dim, a.model.query_groups, a.model.qkv_bias),
        (4, 2, true)
    );
    // and the writer round-trips through both
    for style in [ConfigStyle::V4, ConfigStyle::V5] {
        assert_eq!(ModelConfig::from_json_str(&a.to_json(style)).unwrap(), a);
    }
    // Llama: biases only with attention_bias
    let llama = V4.replace("qwen2", "llama");
    assert!(!ModelConfig::from_json_str(&llama).unwrap().model.qkv_bias);
}

#[test]
fn bad_config_fields_are_named() {
    let cases = [
        (
            V5.replace("\"hidden_size\": 16,", ""),
            "config field `hidden_size`: missing",
        ),
        (
            V5.replace("\"hidden_size\": 16", "\"hidden_size\": \"big\""),
            "config field `hidden_size`: must be a positive integer, found \"big\"",
        ),
        (
            V5.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
            "config field `num_key_value_heads`: 3 does not divide num_attention_heads 4",
        ),
        (
            V4.replace("\"rope_theta\": 500000.0,", ""),
            "config field `rope_theta`: missing",
        ),
        (
            V5.replace("\"default\"", "\"yarn\""),
            "config field `rope_parameters`: rope_type \"yarn\" is not supported",
        ),
        (
            V5.replace("qwen2", "gpt2"),
            "config field `model_type`: \"gpt2\" is not supported",
        ),
        (
            V5.replace(
                "\"tie_word_embeddings\": false",
                "\"tie_word_embeddings\": 0",
            ),
            "config field `tie_word_embeddings`: must be true or false",
        ),
        (
            V4.replace("\"rope_theta\": 500000.0", "\"rope_theta\": -1"),
            "config field `rope_theta`: must be a positive number",
        ),
    ];
    for (json, want) in cases {
        let err = ModelConfig::from_json_str(&json).unwrap_err().to_string();
        assert!(err.contains(want), "got: {err}\nwant: {want}");
    }
    let err = ModelConfig::from_json_str("{not json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a valid model config"), "{err}");
}

#[test]
fn a_config_file_that_is_missing_or_broken_names_the_file() {
    let dir = temp_dir("badcfg");
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "[1, 2").unwrap();
    let err = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        err.contains("config.json: not a valid model config"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_tensor_is_named() {
    let mut tensors = random_tensors(&small(), 1);
    tensors.retain(|t| t.name != "model.layers.1.self_attn.k_proj.bias");
    let dir = write("missing", &tensors);
    let err = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        err.starts_with("tensor `model.layers.1.self_attn.k_proj.bias` is missing from"),
        "{err}"
    );
    // an untied config without lm_head says why it is needed
    let mut tensors = random_tensors(&small(), 1);
    tensors.retain(|t| t.name != "lm_head.weight");
    let dir2 = write("nohead", &tensors);
    let err = load_checkpoint(&dir2).unwrap_err().to_string();
    assert!(
        err.contains("`lm_head.weight` is missing") && err.contains("tie_word_embeddings is false"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&dir2).ok();
}

#[test]
fn mis_shaped_tensor_is_named() {
    let mut tensors = random_tensors(&small(), 1);
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "model.layers.0.mlp.up_proj.weight")
        .unwrap();
    *t = HostTensor::f32(t.name.clone(), [16, 24], vec![0.0; 16 * 24]);
    let dir = write("shape", &tensors);
    let err = load_checkpoint(&dir).unwrap_err().to_string();
    assert_eq!(
        err,
        "tensor `model.layers.0.mlp.up_proj.weight` has shape [16, 24] but the config implies [24, 16]"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn integer_weights_are_rejected_by_name() {
    let mut tensors = random_tensors(&small(), 1);
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "model.norm.weight")
        .unwrap();
    t.data = lifecycle_layout::TensorData::I32(vec![1; 16]);
    let dir = write("dtype", &tensors);
    let err = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tensor `model.norm.weight` has dtype I32"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn truncated_or_corrupt_safetensors_is_an_error_not_a_panic() {
    let dir = write("trunc", &random_tensors(&small(), 1));
    let path = dir.join("model.safetensors");
    let full = std::fs::read(&path).unwrap();
    for keep in [0, 4, 8, 20, full.len() / 2, full.len() - 1] {
        std::fs::write(&path, &full[..keep]).unwrap();
        let err = load_checkpoint(&dir).unwrap_err().to_string();
        assert!(
            err.contains("not a valid safetensors file"),
            "{keep} bytes: {err}"
        );
        assert!(err.contains("truncated or corrupt"), "{err}");
    }
    // a header length pointing past the end, garbage header bytes
    let mut bad = full.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    assert!(load_checkpoint(&dir).is_err());
    let mut bad = full.clone();
    bad[8..16].copy_from_slice(b"\xff\xfe{[]}\x00\x01");
    std::fs::write(&path, &bad).unwrap();
    assert!(load_checkpoint(&dir).is_err());
    std::fs::write(&path, &full).unwrap();
    assert_eq!(
        load_checkpoint(&dir).unwrap().tensors,
        random_tensors(&small(), 1)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tied_checkpoints_need_no_head_and_ignore_a_stale_one() {
    let mut config = small();
    config.model.tied_embeddings = true;
    let mut tensors = random_tensors(&config, 2);
    assert!(tensors.iter().all(|t| t.name != "lm_head.weight"));
    tensors.push(HostTensor::f32("lm_head.weight", [40, 16], vec![0.0; 640]));
    let dir = temp_dir("tied");
    save_checkpoint(&dir, &config, &tensors, ConfigStyle::V4).unwrap();
    let ckpt = load_checkpoint(&dir).unwrap();
    assert!(ckpt.config.model.tied_embeddings);
    assert!(ckpt.tensors.iter().all(|t| t.name != "lm_head.weight"));
    std::fs::remove_dir_all(&dir).ok();
}
