//! Hugging Face checkpoints as Megatron training states: the config → `ModelSpec` mapping, the
//! state holding exactly the checkpoint's (bf16-rounded) tensors at every TP × PP × DP of the
//! matrix, and configs Megatron cannot lay out failing with the `config.json` field named.

use std::path::{Path, PathBuf};

use half::bf16;
use lifecycle_decoder::{
    load_checkpoint, load_megatron_checkpoint, save_checkpoint, Checkpoint, ConfigStyle,
    MegatronCheckpointError, MegatronConfig, MegatronParallel, ModelConfig,
};
use lifecycle_host::megatron::rebuild_hf_tensors;

const MODELS: [&str; 3] = ["gqa_untied", "tied_vocab61", "kv1_headdim16"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn config(json: &str) -> ModelConfig {
    ModelConfig::from_json_str(json).unwrap()
}

#[test]
fn configs_map_to_megatron_specs_field_by_field() {
    let load = |n: &str| load_checkpoint(&fixtures().join(n)).unwrap().config;
    let spec = |c: &ModelConfig| {
        let s = c.model_spec(128);
        (
            s.hidden,
            s.heads,
            s.query_groups,
            s.head_dim,
            s.ffn,
            s.vocab,
            s.layers,
            s.qkv_bias,
            s.tied_embeddings,
            s.make_vocab_size_divisible_by,
        )
    };
    assert_eq!(
        spec(&load("gqa_untied")),
        (32, 4, 2, 8, 64, 96, 2, true, false, 128)
    );
    assert_eq!(
        spec(&load("tied_vocab61")),
        (32, 4, 2, 8, 64, 61, 2, true, true, 128)
    );
    // head_dim given explicitly: q rows (4 · 16) differ from the hidden size 48
    assert_eq!(
        spec(&load("kv1_headdim16")),
        (48, 4, 1, 16, 80, 128, 2, true, true, 128)
    );
    let llama = |bias: bool| {
        config(&format!(
            r#"{{"model_type": "llama", "vocab_size": 50, "hidden_size": 24,
            "intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 6,
            "rope_theta": 10000.0, "attention_bias": {bias}}}"#
        ))
    };
    // no num_key_value_heads: multi-head attention, one query group per head
    assert_eq!(
        spec(&llama(false)),
        (24, 6, 6, 4, 40, 50, 3, false, false, 128)
    );
    assert!(llama(true).model_spec(8).qkv_bias);
    // the Megatron model has exactly the checkpoint's tensors, with the same shapes
    for c in [
        load("gqa_untied"),
        load("tied_vocab61"),
        load("kv1_headdim16"),
        llama(true),
        llama(false),
    ] {
        let mut ours = c.tensor_shapes();
        let mut theirs = c.model_spec(128).hf_tensors();
        ours.sort();
        theirs.sort();
        assert_eq!(ours, theirs);
    }
}

#[test]
fn megatron_states_hold_the_checkpoint_at_every_layout() {
    for name in MODELS {
        let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
        // what the bf16 parameters must hold: every tensor rounded to nearest even
        let want: Vec<(String, Vec<u16>)> = ckpt
            .tensors
            .iter()
            .map(|t| {
                let v = t.data.to_f32().unwrap();
                (
                    t.name.clone(),
                    v.iter().map(|x| bf16::from_f32(*x).to_bits()).collect(),
                )
            })
            .collect();
        for tp in [1, 2, 4] {
            for pp in [1, 2] {
                for dp in [1, 2] {
                    let parallel = MegatronParallel::new(tp, pp, dp);
                    let state = ckpt.megatron_state(parallel).unwrap();
                    let layout = state.layout();
                    assert_eq!(
                        (layout.tp(), layout.pp(), layout.dp(), state.world()),
                        (tp, pp, dp, tp * pp * dp)
                    );
                    // Megatron pads the vocabulary to a multiple of 128 · TP
                    let multiple = 128 * tp;
                    assert_eq!(
                        layout.padded_vocab(),
                        ckpt.config.model.vocab.div_ceil(multiple) * multiple
                    );
                    let full = rebuild_hf_tensors(&state).unwrap();
                    let mut got: Vec<(String, Vec<u16>)> = full
                        .into_iter()
                        .map(|t| (t.name, t.data.iter().map(|x| x.to_bits()).collect()))
                        .collect();
                    got.sort();
                    let mut want = want.clone();
                    want.sort();
                    assert!(got == want, "{name} TP={tp} PP={pp} DP={dp}");
                }
            }
        }
    }
}

#[test]
fn a_checkpoint_folder_loads_into_a_megatron_state() {
    let dir = fixtures().join("kv1_headdim16");
    let parallel = MegatronParallel {
        make_vocab_size_divisible_by: 8,
        ..MegatronParallel::new(4, 2, 1)
    };
    let loaded = load_megatron_checkpoint(&dir, parallel).unwrap();
    let ckpt = load_checkpoint(&dir).unwrap();
    assert_eq!(loaded.config, ckpt.config);
    assert_eq!(loaded.state.layout().padded_vocab(), 128);
    assert!(loaded.state.snapshot() == ckpt.megatron_state(parallel).unwrap().snapshot());
}

#[test]
fn configs_megatron_cannot_lay_out_name_the_field() {
    let gqa = load_checkpoint(&fixtures().join("gqa_untied"))
        .unwrap()
        .config;
    let field_of = |c: &ModelConfig, p: MegatronParallel| {
        let err = c.megatron_layout(p).unwrap_err();
        let msg = err.to_string();
        match err {
            MegatronCheckpointError::ConfigField { field, .. } => (field, msg),
            other => panic!("expected a config-field error, got {other:?}"),
        }
    };
    // 4 heads at TP 3
    let (field, msg) = field_of(&gqa, MegatronParallel::new(3, 1, 1));
    assert_eq!(field, "num_attention_heads");
    assert!(
        msg.starts_with(
            "config field `num_attention_heads` cannot be laid out by Megatron at TP = 3, PP = 1, DP = 1: attention heads = 4 is not divisible"
        ),
        "{msg}"
    );
    // 3 kv heads at TP 2: neither divides the other
    let c = config(
        r#"{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 24,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 3, "rope_theta": 10000.0}"#,
    );
    let (field, msg) = field_of(&c, MegatronParallel::new(2, 1, 1));
    assert_eq!(field, "num_key_value_heads", "{msg}");
    assert!(
        msg.contains("query groups = 3 do not divide one another"),
        "{msg}"
    );
    // intermediate size 60 at TP 8
    let c = config(
        r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 60, "num_hidden_layers": 2, "num_attention_heads": 8,
        "rope_theta": 10000.0}"#,
    );
    let (field, msg) = field_of(&c, MegatronParallel::new(8, 1, 1));
    assert_eq!(field, "intermediate_size", "{msg}");
    assert!(msg.contains("ffn hidden size = 60"), "{msg}");
    // more stages than layers
    let (field, msg) = field_of(&gqa, MegatronParallel::new(1, 3, 1));
    assert_eq!(field, "num_hidden_layers", "{msg}");
    assert!(
        msg.contains("PP = 3 exceeds the 2 transformer layers"),
        "{msg}"
    );
    // degrees that are wrong whatever the model
    let err = gqa
        .megatron_layout(MegatronParallel::new(0, 1, 1))
        .unwrap_err();
    assert!(
        matches!(err, MegatronCheckpointError::Degrees { tp: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("must be at least 1"), "{err}");
    let err = gqa
        .megatron_layout(MegatronParallel {
            make_vocab_size_divisible_by: 0,
            ..MegatronParallel::new(1, 1, 1)
        })
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("make_vocab_size_divisible_by must be at least 1"),
        "{err}"
    );
}

#[test]
fn folder_and_tensor_errors_are_clear() {
    let tmp = std::env::temp_dir().join(format!("lc-megatron-ckpt-{}", std::process::id()));
    // no folder at all: the config file is named
    let err = load_megatron_checkpoint(&tmp.join("absent"), MegatronParallel::new(1, 1, 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    // a config Megatron cannot lay out fails before the weights are read (there are none)
    let gqa = load_checkpoint(&fixtures().join("gqa_untied")).unwrap();
    let only_config = tmp.join("only_config");
    std::fs::create_dir_all(&only_config).unwrap();
    std::fs::write(
        only_config.join("config.json"),
        gqa.config.to_json(ConfigStyle::V5),
    )
    .unwrap();
    let err = load_megatron_checkpoint(&only_config, MegatronParallel::new(3, 1, 1)).unwrap_err();
    assert!(
        matches!(
            err,
            MegatronCheckpointError::ConfigField {
                field: "num_attention_heads",
                ..
            }
        ),
        "{err:?}"
    );
    // with a good layout the missing weights file is the error, naming it
    let err = load_megatron_checkpoint(&only_config, MegatronParallel::new(2, 1, 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    // a checkpoint file missing a tensor the config needs
    let broken = tmp.join("broken");
    let tensors: Vec<_> = gqa
        .tensors
        .iter()
        .filter(|t| t.name != "lm_head.weight")
        .cloned()
        .collect();
    save_checkpoint(&broken, &gqa.config, &tensors, ConfigStyle::V4).unwrap();
    let err = load_megatron_checkpoint(&broken, MegatronParallel::new(2, 1, 1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`lm_head.weight` is missing") && err.contains("tie_word_embeddings is false"),
        "{err}"
    );
    // a hand-built checkpoint whose tensors do not fit its config
    let hand = Checkpoint {
        config: gqa.config.clone(),
        tensors: tensors.clone(),
    };
    let err = hand
        .megatron_state(MegatronParallel::new(2, 2, 1))
        .unwrap_err();
    assert!(
        matches!(err, MegatronCheckpointError::Tensors(_)),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("`lm_head.weight` is missing"),
        "{err}"
    );
    std::fs::remove_dir_all(&tmp).ok();
}
