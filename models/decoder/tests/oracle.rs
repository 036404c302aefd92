//! The CPU decoder against Hugging Face `transformers` (fixtures/make_fixtures.py: Qwen2 / Llama;
//! fixtures/make_moe_fixtures.py: Qwen3 and Qwen3-MoE, with the experts split by TP and
//! partitioned over the ranks) at T ∈ {1, 2}, W = T, through the host backend's real switch into
//! the rollout layout; and the MoE checkpoint and config errors.
//!
//! Tolerance: the checkpoints hold f32 weights; the rollout layout holds them rounded to bf16
//! (round to nearest even), and the references were computed by transformers in f32 *with the
//! same bf16-rounded weights*. So the decoder and the oracle use identical weights and differ
//! only in f32 summation order and `exp`/`sin`/`cos` rounding: logits must agree to
//! `1e-4 + 1e-4 · max|logit|` (measured: below 1e-5). (Against the unrounded f32 weights the logits move by up to the
//! `max_logit_change_f32_vs_bf16_weights` the fixture records, 6e-3 to 5e-2 here, which is what a
//! bf16-weight tolerance would have to absorb.) Greedy tokens must be equal.

use std::path::PathBuf;

use crate::common::{fixtures, floats, moe_references, references, tokens};

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{
    load_checkpoint, save_checkpoint, ConfigStyle, CpuDecoder, Decoder, MegatronConfig,
    PrefillLogits, Sampling,
};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::{hf, ExpertPlacement, HostTensor, Parallel, TensorData};

const MODELS: [&str; 3] = ["gqa_untied", "tied_vocab61", "kv1_headdim16"];

/// The Qwen3 / Qwen3-MoE fixtures (fixtures/moe, made by fixtures/make_moe_fixtures.py with
/// transformers 5.17): Qwen3 dense, a per-expert sharded MoE, and a MoE with a dense layer as
/// `save_pretrained` writes it. The same tolerance holds: their references were computed in f32
/// with the bf16-rounded weights, and every router margin (the gap between the k-th and
/// (k+1)-th routing probability) is at least 4e-4, far above the rounding, so the decoder must
/// pick the same experts.
const MOE_MODELS: [&str; 4] = [
    "qwen3_dense",
    "moe_e4_untied_v61",
    "moe_e6_tied_dense0",
    "qwen2moe_shared_e4",
];

fn moe_fixtures() -> PathBuf {
    fixtures().join("moe")
}

/// The largest |a − b| of `got` against `want`, and the largest |want| (the tolerances' scale).
fn distance(what: &str, got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    (err, scale)
}

/// Largest |a − b| after checking it is within tolerance.
fn compare(what: &str, got: &[f32], want: &[f32]) -> f32 {
    let (err, scale) = distance(what, got, want);
    let tol = 1e-4 + 1e-4 * scale;
    assert!(err <= tol, "{what}: max |error| {err} > tolerance {tol}");
    err
}

#[test]
fn cpu_decoder_matches_transformers_at_t1_and_t2() {
    let refs = references();
    let mut worst = 0.0f32;
    for name in MODELS {
        let model = &refs["models"][name];
        let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
        let cases = model["cases"].as_array().unwrap();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        for tp in [1, 2] {
            let layout = ckpt.config.rollout_layout(tp).unwrap();
            let state = HostTrainState::from_tensors(tp, ckpt.tensors.clone()).unwrap();
            let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
            let session = lc.rollout().unwrap();
            let weights = session.weights();
            let group: Vec<_> = weights.ranks.iter().collect();
            let mut dec = CpuDecoder::new(&ckpt.config, &layout, &group).unwrap();

            // batched prefill, logits of every position
            let prefill = dec.prefill(&prompts, PrefillLogits::All).unwrap();
            for (i, c) in cases.iter().enumerate() {
                let what = format!("{name} T={tp} prompt {i} prefill");
                worst = worst.max(compare(&what, &prefill[i], &floats(&c["prefill_logits"])));
            }
            // decode steps fed with the reference greedy tokens (batched, KV cache)
            let greedy: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["greedy_tokens"])).collect();
            let steps = greedy[0].len();
            for k in 0..steps {
                let feed: Vec<u32> = greedy.iter().map(|g| g[k]).collect();
                let logits = dec.decode_step(&feed).unwrap();
                for (i, c) in cases.iter().enumerate() {
                    let what = format!("{name} T={tp} prompt {i} decode step {k}");
                    let want = floats(&c["decode_logits"][k]);
                    worst = worst.max(compare(&what, &logits[i], &want));
                }
            }
            // free-running greedy generation
            let out = dec.generate(&prompts, &Sampling::greedy(steps)).unwrap();
            assert_eq!(out, greedy, "{name} T={tp}: greedy tokens");
        }
    }
    println!("max |logit error| over all models, T = 1 and 2: {worst:e}");
}

#[test]
fn fixture_configs_cover_both_styles_and_the_hard_cases() {
    use lifecycle_layout::Parallel;
    let gqa = load_checkpoint(&fixtures().join("gqa_untied"))
        .unwrap()
        .config;
    let tied = load_checkpoint(&fixtures().join("tied_vocab61"))
        .unwrap()
        .config;
    let kv1 = load_checkpoint(&fixtures().join("kv1_headdim16"))
        .unwrap()
        .config;
    let raw = |n: &str| std::fs::read_to_string(fixtures().join(n).join("config.json")).unwrap();
    assert!(
        raw("gqa_untied").contains("rope_parameters") && raw("gqa_untied").contains("\"dtype\"")
    );
    assert!(
        raw("tied_vocab61").contains("torch_dtype")
            && !raw("tied_vocab61").contains("rope_parameters")
    );
    assert_eq!(
        (
            gqa.rope_theta,
            gqa.model.tied_embeddings,
            gqa.model.query_groups
        ),
        (10000.0, false, 2)
    );
    assert_eq!(
        (
            tied.rope_theta,
            tied.model.tied_embeddings,
            tied.model.vocab
        ),
        (1e6, true, 61)
    );
    assert_eq!(
        (kv1.model.head_dim, kv1.model.query_groups, kv1.model.hidden),
        (16, 1, 48)
    );
    assert_eq!(tied.dtype.as_deref(), Some("float32"));
    let split = |c: &lifecycle_decoder::ModelConfig, name: &str| {
        let layout = c.rollout_layout(2).unwrap();
        layout
            .tensors()
            .iter()
            .find(|t| t.name == name)
            .unwrap()
            .parallel
    };
    assert_eq!(
        split(&tied, "model.embed_tokens.weight"),
        Parallel::Replicated
    );
    assert_eq!(split(&gqa, "lm_head.weight"), Parallel::Column);
    assert_eq!(
        split(&kv1, "model.layers.0.self_attn.k_proj.weight"),
        Parallel::Replicated
    );
    assert_eq!(
        split(&gqa, "model.layers.0.self_attn.k_proj.weight"),
        Parallel::Column
    );
}

#[test]
fn cpu_decoder_matches_transformers_on_qwen3_and_qwen3_moe() {
    let refs = moe_references();
    let mut worst = 0.0f32;
    let mut runs = 0;
    for name in MOE_MODELS {
        let model = &refs["models"][name];
        let ckpt = load_checkpoint(&moe_fixtures().join(name)).unwrap();
        let cases = model["cases"].as_array().unwrap();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        let placements: &[ExpertPlacement] = if ckpt.config.model.moe.is_some() {
            &[
                ExpertPlacement::TensorParallel,
                ExpertPlacement::Partitioned,
            ]
        } else {
            &[ExpertPlacement::TensorParallel]
        };
        for tp in [1, 2] {
            for &placement in placements {
                let what = |s: String| format!("{name} T={tp} experts={}: {s}", placement.name());
                let layout = ckpt.config.rollout_layout_with(tp, placement).unwrap();
                let state = HostTrainState::from_tensors(tp, ckpt.tensors.clone()).unwrap();
                let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
                let session = lc.rollout().unwrap();
                let weights = session.weights();
                if placement == ExpertPlacement::Partitioned && tp == 2 {
                    // each rank received its own experts and none of the others
                    let e = ckpt.config.model.moe.unwrap().experts;
                    let l = (0..ckpt.config.model.layers)
                        .find(|&l| ckpt.config.model_spec(128).moe_layer(l))
                        .unwrap();
                    for (rank, r) in weights.ranks.iter().enumerate() {
                        for x in 0..e {
                            let held = r.tensor(&hf::expert(l, x, hf::EXPERT_UP)).is_some();
                            assert_eq!(
                                held,
                                x / (e / 2) == rank,
                                "{}",
                                what(format!("expert {x}"))
                            );
                        }
                    }
                }
                let group: Vec<_> = weights.ranks.iter().collect();
                let mut dec = CpuDecoder::new(&ckpt.config, &layout, &group).unwrap();
                let prefill = dec.prefill(&prompts, PrefillLogits::All).unwrap();
                for (i, c) in cases.iter().enumerate() {
                    let w = what(format!("prompt {i} prefill"));
                    worst = worst.max(compare(&w, &prefill[i], &floats(&c["prefill_logits"])));
                }
                let greedy: Vec<Vec<u32>> =
                    cases.iter().map(|c| tokens(&c["greedy_tokens"])).collect();
                let steps = greedy[0].len();
                for k in 0..steps {
                    let feed: Vec<u32> = greedy.iter().map(|g| g[k]).collect();
                    let logits = dec.decode_step(&feed).unwrap();
                    for (i, c) in cases.iter().enumerate() {
                        let w = what(format!("prompt {i} decode step {k}"));
                        let want = floats(&c["decode_logits"][k]);
                        worst = worst.max(compare(&w, &logits[i], &want));
                    }
                }
                let out = dec.generate(&prompts, &Sampling::greedy(steps)).unwrap();
                assert_eq!(out, greedy, "{}", what("greedy tokens".into()));
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 2 + 4 + 4 + 4);
    println!("max |logit error| over Qwen3 / Qwen3-MoE, T = 1 and 2, both placements: {worst:e}");
}

#[test]
fn fixtures_cover_sharded_per_expert_and_dense_layers() {
    let e4 = load_checkpoint(&moe_fixtures().join("moe_e4_untied_v61")).unwrap();
    let e6 = load_checkpoint(&moe_fixtures().join("moe_e6_tied_dense0")).unwrap();
    let dense = load_checkpoint(&moe_fixtures().join("qwen3_dense")).unwrap();
    for dir in ["moe_e4_untied_v61", "moe_e6_tied_dense0", "qwen3_dense"] {
        assert!(moe_fixtures()
            .join(dir)
            .join("model.safetensors.index.json")
            .exists());
    }
    let m4 = e4.config.model.moe.unwrap();
    assert_eq!(
        (m4.experts, m4.top_k, m4.ffn, m4.norm_topk_prob),
        (4, 2, 24, true)
    );
    let m6 = e6.config.model.moe.unwrap();
    // transformers 5.17 writes the expert count as num_local_experts
    assert_eq!((m6.experts, m6.norm_topk_prob), (6, false));
    assert_eq!(m6.dense_layers.layers(), vec![0]);
    let spec = e6.config.model_spec(128);
    assert!(!spec.moe_layer(0) && spec.moe_layer(1) && spec.moe_layer(2));
    assert!(dense.config.model.qk_norm && dense.config.model.moe.is_none());
    assert_eq!(
        (dense.config.model.head_dim, dense.config.model.hidden),
        (16, 32)
    );
    assert!(e6.config.model.tied_embeddings && !e4.config.model.tied_embeddings);
}

/// The per-expert tensors of `tensors` stacked as transformers 5 holds them in memory.
fn stacked(tensors: &[HostTensor], layers: usize, experts: usize) -> Vec<HostTensor> {
    let f32s = |t: &HostTensor| match &t.data {
        TensorData::F32(v) => v.clone(),
        other => panic!("{} is {other:?}", t.name),
    };
    let find = |n: &str| tensors.iter().find(|t| t.name == n);
    let mut out: Vec<HostTensor> = tensors
        .iter()
        .filter(|t| hf::parse_expert(&t.name).is_none())
        .cloned()
        .collect();
    for l in 0..layers {
        let Some(g0) = find(&hf::expert(l, 0, hf::EXPERT_GATE)) else {
            continue;
        };
        let (f, h) = (g0.shape[0], g0.shape[1]);
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for e in 0..experts {
            gate_up.extend(f32s(find(&hf::expert(l, e, hf::EXPERT_GATE)).unwrap()));
            gate_up.extend(f32s(find(&hf::expert(l, e, hf::EXPERT_UP)).unwrap()));
            down.extend(f32s(find(&hf::expert(l, e, hf::EXPERT_DOWN)).unwrap()));
        }
        let name = |s: &str| format!("model.layers.{l}.mlp.experts.{s}");
        out.push(HostTensor::f32(
            name("gate_up_proj"),
            vec![experts, 2 * f, h],
            gate_up,
        ));
        out.push(HostTensor::f32(
            name("down_proj"),
            vec![experts, h, f],
            down,
        ));
    }
    out
}

#[test]
fn stacked_expert_checkpoints_load_to_the_same_tensors() {
    let dir = std::env::temp_dir().join(format!("lc-moe-stacked-{}", std::process::id()));
    for name in ["moe_e4_untied_v61", "moe_e6_tied_dense0"] {
        let ckpt = load_checkpoint(&moe_fixtures().join(name)).unwrap();
        let moe = ckpt.config.model.moe.unwrap();
        let tensors = stacked(&ckpt.tensors, ckpt.config.model.layers, moe.experts);
        save_checkpoint(&dir, &ckpt.config, &tensors, ConfigStyle::V5).unwrap();
        let back = load_checkpoint(&dir).unwrap();
        assert_eq!(back.tensors, ckpt.tensors, "{name}");
        // a stack of the wrong shape is named in the error
        let mut bad = tensors.clone();
        let i = bad
            .iter()
            .position(|t| t.name.ends_with("experts.down_proj"))
            .unwrap();
        bad[i].shape[0] -= 1;
        bad[i].data = TensorData::F32(vec![0.0; bad[i].shape.iter().product()]);
        save_checkpoint(&dir, &ckpt.config, &bad, ConfigStyle::V5).unwrap();
        let err = load_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("experts.down_proj"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn moe_configs_and_layouts_refuse_bad_input_with_the_field_named() {
    use lifecycle_decoder::ModelConfig;
    let base = r#""model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_theta": 10000.0, "moe_intermediate_size": 6"#;
    let cfg = |extra: &str| ModelConfig::from_json_str(&format!("{{{base}, {extra}}}"));
    let err = |extra: &str| cfg(extra).unwrap_err().to_string();
    // top-k larger than the expert count
    let e = err(r#""num_experts": 4, "num_experts_per_tok": 5"#);
    assert!(e.contains("num_experts_per_tok") && e.contains("5"), "{e}");
    // no expert count at all
    assert!(err(r#""num_experts_per_tok": 2"#).contains("num_experts"));
    // two spellings that disagree
    let e = err(r#""num_experts": 4, "num_local_experts": 6, "num_experts_per_tok": 2"#);
    assert!(e.contains("num_local_experts"), "{e}");
    // a dense layer past what the set holds, and a malformed list
    let e = err(r#""num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [300]"#);
    assert!(e.contains("mlp_only_layers"), "{e}");
    let e = err(r#""num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": "0""#);
    assert!(e.contains("mlp_only_layers"), "{e}");
    // a shared expert in a qwen3_moe config is named (Qwen2-MoE has them); a qwen2_moe config
    // without its size is named; a shared expert that T does not split is named
    let e =
        err(r#""num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 8"#);
    assert!(
        e.contains("shared_expert_intermediate_size") && e.contains("qwen2_moe"),
        "{e}"
    );
    let qwen2 = |extra: &str| {
        let text = format!("{{{base}, {extra}}}").replace("qwen3_moe", "qwen2_moe");
        ModelConfig::from_json_str(&text)
    };
    let e = qwen2(r#""num_experts": 4, "num_experts_per_tok": 2"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shared_expert_intermediate_size"), "{e}");
    let c = qwen2(
        r#""num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 9"#,
    )
    .unwrap();
    assert!(c.model.qkv_bias && c.model.moe.is_some_and(|m| m.shared_ffn == 9));
    let back = ModelConfig::from_json_str(&c.to_json(lifecycle_decoder::ConfigStyle::V5)).unwrap();
    assert_eq!(
        back,
        lifecycle_decoder::ModelConfig {
            dtype: back.dtype.clone(),
            ..c.clone()
        }
    );
    let e = c.rollout_layout(2).unwrap_err().to_string();
    assert!(e.contains("shared_expert_intermediate_size 9"), "{e}");
    // an expert count that T does not divide (expert parallelism) and an expert size that T does
    // not divide (TP inside every expert), each naming its field
    let c = cfg(r#""num_experts": 6, "num_experts_per_tok": 2"#).unwrap();
    let e = c
        .rollout_layout_with(4, ExpertPlacement::Partitioned)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_experts 6"), "{e}");
    let e = c
        .rollout_layout_with(4, ExpertPlacement::TensorParallel)
        .unwrap_err()
        .to_string();
    assert!(e.contains("moe_intermediate_size 6"), "{e}");
    // the router is replicated, the experts owned, in the EP layout
    let ep = c
        .rollout_layout_with(2, ExpertPlacement::Partitioned)
        .unwrap();
    let split = |n: &str| ep.tensors().iter().find(|t| t.name == n).unwrap().parallel;
    assert_eq!(
        split("model.layers.1.mlp.gate.weight"),
        Parallel::Replicated
    );
    assert_eq!(
        split("model.layers.1.mlp.experts.5.down_proj.weight"),
        Parallel::Owned { rank: 1 }
    );
    // the Megatron expert layout: an expert-parallel degree the 6 experts do not split is
    // named with the config field
    let e = c
        .megatron_layout(lifecycle_decoder::MegatronParallel::new(1, 1, 4).with_experts(4, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_experts") && e.contains("EP = 4"), "{e}");
}

#[test]
fn missing_and_misshaped_expert_tensors_are_named() {
    let ckpt = load_checkpoint(&moe_fixtures().join("moe_e4_untied_v61")).unwrap();
    let dir = std::env::temp_dir().join(format!("lc-moe-missing-{}", std::process::id()));
    let gone = hf::expert(1, 3, hf::EXPERT_DOWN);
    let fewer: Vec<_> = ckpt
        .tensors
        .iter()
        .filter(|t| t.name != gone)
        .cloned()
        .collect();
    save_checkpoint(&dir, &ckpt.config, &fewer, ConfigStyle::V5).unwrap();
    let e = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(e.contains(&gone) && e.contains("gate_up_proj"), "{e}");
    // an expert more than num_experts says
    let mut extra = ckpt.tensors.clone();
    let mut fifth = extra
        .iter()
        .find(|t| t.name == hf::expert(0, 0, hf::EXPERT_UP))
        .unwrap()
        .clone();
    fifth.name = hf::expert(0, 4, hf::EXPERT_UP);
    extra.push(fifth);
    save_checkpoint(&dir, &ckpt.config, &extra, ConfigStyle::V5).unwrap();
    let e = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        e.contains("experts.4.up_proj") && e.contains("num_experts = 4"),
        "{e}"
    );
    let mut router_bad = ckpt.tensors.clone();
    let r = router_bad
        .iter_mut()
        .find(|t| t.name == hf::layer(0, hf::ROUTER))
        .unwrap();
    r.shape = vec![3, 32];
    r.data = TensorData::F32(vec![0.0; 96]);
    save_checkpoint(&dir, &ckpt.config, &router_bad, ConfigStyle::V5).unwrap();
    let e = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        e.contains("mlp.gate.weight") && e.contains("[4, 32]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs `f` on a CPU decoder of every fixture model (T = 1, its bf16 rollout through the host
/// backend), with the model's name, reference cases and prompts.
fn for_each_model(f: impl Fn(&str, &[serde_json::Value], &[Vec<u32>], &mut CpuDecoder<'_>)) {
    let refs = references();
    for name in MODELS {
        let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
        let cases = refs["models"][name]["cases"].as_array().unwrap();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        let layout = ckpt.config.rollout_layout(1).unwrap();
        let state = HostTrainState::from_tensors(1, ckpt.tensors.clone()).unwrap();
        let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
        let session = lc.rollout().unwrap();
        let weights = session.weights();
        let group: Vec<_> = weights.ranks.iter().collect();
        let mut dec = CpuDecoder::new(&ckpt.config, &layout, &group).unwrap();
        f(name, cases, &prompts, &mut dec);
    }
}

/// A bf16 KV cache (`CpuDecoder::set_kv_dtype`): every fixture model's prefill logits move off
/// the transformers references (computed with an f32 cache) by the rounding of K and V, which
/// is not zero but stays below `1e-2 + 1e-2 · max|logit|`; f32 (the default) stays within the
/// module's tolerance on the same decoder after switching back.
#[test]
fn a_bf16_kv_cache_moves_the_logits_by_its_rounding_only() {
    use lifecycle_decoder::KvDtype;
    for_each_model(|name, cases, prompts, dec| {
        assert_eq!(dec.kv_dtype(), KvDtype::F32);
        dec.set_kv_dtype(KvDtype::Bf16).unwrap();
        let prefill = dec.prefill(prompts, PrefillLogits::All).unwrap();
        let mut moved = 0.0f32;
        for (i, c) in cases.iter().enumerate() {
            let (err, scale) = distance(name, &prefill[i], &floats(&c["prefill_logits"]));
            let tol = 1e-2 + 1e-2 * scale;
            assert!(
                err <= tol,
                "{name} prompt {i}: bf16 KV moved a logit by {err} > {tol}"
            );
            moved = moved.max(err);
        }
        assert!(
            moved > 1e-6,
            "{name}: a bf16 cache left every logit unchanged"
        );
        dec.set_kv_dtype(KvDtype::F32).unwrap();
        let prefill = dec.prefill(prompts, PrefillLogits::All).unwrap();
        for (i, c) in cases.iter().enumerate() {
            compare(
                &format!("{name} prompt {i} (f32 again)"),
                &prefill[i],
                &floats(&c["prefill_logits"]),
            );
        }
        println!("{name}: a bf16 KV cache moved the prefill logits by at most {moved:.3e}");
    });
}

#[test]
fn an_fp8_kv_cache_moves_the_logits_by_its_rounding_only() {
    use lifecycle_decoder::KvDtype;
    for_each_model(|name, cases, prompts, dec| {
        let mut moved = [0.0f32; 2];
        for (slot, kv) in [KvDtype::Bf16, KvDtype::Fp8].into_iter().enumerate() {
            dec.set_kv_dtype(kv).unwrap();
            let prefill = dec.prefill(prompts, PrefillLogits::All).unwrap();
            for (i, c) in cases.iter().enumerate() {
                let (err, scale) = distance(name, &prefill[i], &floats(&c["prefill_logits"]));
                // e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value
                let tol = 1e-1 + 1e-1 * scale;
                assert!(
                    err.is_finite() && err <= tol,
                    "{name} prompt {i}: {kv} KV moved a logit by {err} > {tol}"
                );
                moved[slot] = moved[slot].max(err);
            }
        }
        // e4m3 keeps 4 mantissa bits fewer than bf16: its rounding moves the logits about 16
        // times as far (11-17 times on these models)
        let ratio = moved[1] / moved[0].max(1e-12);
        assert!(
            (4.0..=64.0).contains(&ratio),
            "{name}: an fp8 cache moved the logits by {} against bf16's {} ({ratio:.1}x)",
            moved[1],
            moved[0]
        );
        println!(
            "{name}: an fp8 KV cache moved the prefill logits by at most {:.3e} (bf16: {:.3e})",
            moved[1], moved[0]
        );
    });
}
