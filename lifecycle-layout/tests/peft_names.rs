//! PEFT's own LoRA keys and shapes (fixtures/peft_names.json, written by `peft` through
//! fixtures/make_peft_fixture.py) read by `lora::check_adapter_state` against the adapters our
//! layout puts on the same model: every key parsed back to its base, every shape the one our
//! split rules start from, and PEFT's scaling ours.

use lifecycle_layout::lora::{check_adapter_state, LoraConfig, LoraTarget};
use lifecycle_layout::ModelSpec;
use serde_json::Value;

fn usize_of(v: &Value, key: &str) -> usize {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("fixture field {key}")) as usize
}

fn tensors(v: &Value) -> Vec<(String, Vec<usize>)> {
    v.as_array()
        .expect("a list of [name, shape]")
        .iter()
        .map(|e| {
            let name = e[0].as_str().expect("name").to_string();
            let shape = e[1]
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect();
            (name, shape)
        })
        .collect()
}

#[test]
fn peft_keys_and_shapes_are_the_adapters_of_our_layout() {
    let text = include_str!("fixtures/peft_names.json");
    let fixture: Value = serde_json::from_str(text).expect("peft_names.json parses");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let c = &case["config"];
        let model = ModelSpec {
            hidden: usize_of(c, "hidden_size"),
            heads: usize_of(c, "num_attention_heads"),
            query_groups: usize_of(c, "num_key_value_heads"),
            head_dim: usize_of(c, "head_dim"),
            ffn: usize_of(c, "intermediate_size"),
            vocab: usize_of(c, "vocab_size"),
            layers: usize_of(c, "num_hidden_layers"),
            qkv_bias: true,
            tied_embeddings: false,
            qk_norm: false,
            moe: None,
            ..ModelSpec::tiny()
        };
        let targets: Vec<LoraTarget> = case["target_modules"]
            .as_array()
            .expect("targets")
            .iter()
            .map(|t| LoraTarget::from_module(t.as_str().expect("module")).expect("a target"))
            .collect();
        let lora = LoraConfig::new(
            usize_of(case, "r"),
            case["lora_alpha"].as_f64().expect("alpha"),
            targets.clone(),
        )
        .with_rslora(case["use_rslora"].as_bool().expect("rslora"));
        let name = case["name"].as_str().unwrap_or("?");
        for key in ["state_dict", "named_parameters"] {
            let given = tensors(&case[key]);
            let adapters = check_adapter_state(&model, &lora, &given)
                .unwrap_or_else(|e| panic!("{name} {key}: {e}"));
            assert_eq!(adapters.len(), targets.len() * model.layers, "{name} {key}");
            assert_eq!(given.len(), 2 * adapters.len(), "{name} {key}");
        }
        if let Some(s) = case["scaling"].as_f64() {
            assert!(
                (lora.scaling() - s).abs() < 1e-12,
                "{name}: {} vs {s}",
                lora.scaling()
            );
        }
    }
}
