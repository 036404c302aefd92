//! The CPU decoder with LoRA adapters applied unmerged (`CpuDecoder::new_lora`): against the
//! merged model, at every tensor-parallel degree, and the adapters a decoder is given checked
//! by name.
//!
//! The weights are chosen so that merging is exact in bf16: base matrices on a grid of 1/64
//! (|w| ≤ 1/2), adapters on a grid of 1/8 with r = 2 and scaling 1, so every entry of
//! `W + s·B·A` is a multiple of 1/64 below 1 in magnitude. The merged and unmerged decoders
//! then read the same numbers and differ only in the order of their f32 sums.

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{random_tensors, CpuDecoder, Decoder, ModelConfig, PrefillLogits};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::fp8::RolloutDtype;
use lifecycle_layout::lora::{adapters, with_adapters, LoraConfig, LoraTarget};
use lifecycle_layout::settings::Configure;
use lifecycle_layout::{HostTensor, RolloutLayout, TensorData};

fn config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "rope_theta": 10000.0}"#,
    )
    .unwrap()
}

/// A value of the grid of `1/den` with |k| ≤ `max`, from `seed`'s stream.
fn grid(seed: &mut u64, max: i64, den: f32) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let k = ((*seed >> 33) % (2 * max as u64 + 1)) as i64 - max;
    k as f32 / den
}

fn values(t: &HostTensor) -> &[f32] {
    match &t.data {
        TensorData::F32(v) => v,
        _ => panic!("f32 tensors"),
    }
}

/// The base tensors (linear weights on the 1/64 grid), the adapters of `lora` (on the 1/8
/// grid), and the merged tensors `W + s·B·A`.
fn model(lora: &LoraConfig) -> (Vec<HostTensor>, Vec<HostTensor>, Vec<HostTensor>) {
    let c = config();
    let mut seed = 11u64;
    let linear = |name: &str| {
        LoraTarget::ALL
            .iter()
            .any(|t| name.contains(&format!(".{}.weight", t.module())))
    };
    let base: Vec<HostTensor> = random_tensors(&c, 3)
        .into_iter()
        .map(|t| {
            if linear(&t.name) {
                let n = t.shape.iter().product();
                let data = (0..n).map(|_| grid(&mut seed, 32, 64.0)).collect();
                HostTensor::f32(t.name, t.shape, data)
            } else {
                t
            }
        })
        .collect();
    let specs = adapters(&c.model, lora).unwrap();
    let mut adapter_tensors = Vec::new();
    let mut merged = base.clone();
    for a in &specs {
        let (r, inp) = (a.a.shape[0], a.a.shape[1]);
        let out = a.b.shape[0];
        let av: Vec<f32> = (0..r * inp).map(|_| grid(&mut seed, 2, 8.0)).collect();
        let bv: Vec<f32> = (0..out * r).map(|_| grid(&mut seed, 2, 8.0)).collect();
        let s = lora.scaling() as f32;
        let w = merged.iter_mut().find(|t| t.name == a.base).unwrap();
        let mut wv = values(w).to_vec();
        for o in 0..out {
            for i in 0..inp {
                let delta: f32 = (0..r).map(|k| bv[o * r + k] * av[k * inp + i]).sum();
                wv[o * inp + i] += s * delta;
            }
        }
        *w = HostTensor::f32(w.name.clone(), w.shape.clone(), wv);
        adapter_tensors.push(HostTensor::f32(a.a.name.clone(), a.a.shape.clone(), av));
        adapter_tensors.push(HostTensor::f32(a.b.name.clone(), a.b.shape.clone(), bv));
    }
    (base, adapter_tensors, merged)
}

/// Every prompt position's logits of a decoder over the rollout of `tensors` in `layout`.
fn logits(
    layout: &RolloutLayout,
    tensors: Vec<HostTensor>,
    lora: Option<&LoraConfig>,
) -> Result<Vec<f32>, String> {
    logits_in(layout, tensors, lora, RolloutDtype::Bf16)
}

/// [`logits`] of a rollout in `dtype`.
fn logits_in(
    layout: &RolloutLayout,
    tensors: Vec<HostTensor>,
    lora: Option<&LoraConfig>,
    dtype: RolloutDtype,
) -> Result<Vec<f32>, String> {
    let c = config();
    let state = HostTrainState::from_tensors(layout.tp(), tensors).map_err(|e| e.to_string())?;
    let backend = HostBackend::new(layout.clone()).with_rollout_dtype(dtype);
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout().map_err(|e| e.to_string())?;
    let weights = session.weights();
    for t in weights.ranks.iter().flat_map(|r| &r.tensors) {
        if t.name.contains(".lora_") && t.fp8.is_some() {
            return Err(format!("adapter `{}` was quantised", t.name));
        }
    }
    let group: Vec<_> = weights.ranks.iter().collect();
    let mut d = match lora {
        Some(l) => CpuDecoder::new_lora(&c, layout, &group, l),
        None => CpuDecoder::new(&c, layout, &group),
    }
    .map_err(|e| e.to_string())?;
    let out = d
        .prefill(&[vec![1, 5, 9, 2, 33, 60, 7]], PrefillLogits::All)
        .map_err(|e| e.to_string())?;
    Ok(out.concat())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn unmerged_adapters_give_the_merged_model_at_every_degree() {
    let lora = LoraConfig::new(2, 2.0, LoraTarget::ALL.to_vec());
    assert_eq!(lora.scaling(), 1.0);
    let (base, adapter_tensors, merged) = model(&lora);
    let c = config();
    let merged_logits = logits(&c.rollout_layout(1).unwrap(), merged, None).unwrap();
    let base_logits = logits(&c.rollout_layout(1).unwrap(), base.clone(), None).unwrap();
    let scale = merged_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // the adapters matter: without them the logits move well beyond the tolerance
    assert!(max_diff(&base_logits, &merged_logits) > 1e-2 * scale);
    for t in [1, 2, 4] {
        let layout = with_adapters(&c.rollout_layout(t).unwrap(), &c.model, &lora).unwrap();
        let mut all = base.clone();
        all.extend(adapter_tensors.iter().cloned());
        let got = logits(&layout, all, Some(&lora)).unwrap();
        let err = max_diff(&got, &merged_logits);
        println!("T = {t}: unmerged vs merged max |Δ logit| {err:.2e} (logits to {scale:.2})");
        assert!(
            err <= 1e-5 * scale.max(1.0),
            "T = {t}: unmerged vs merged max |Δ logit| {err} (logits to {scale})"
        );
    }
}

#[test]
fn adapters_a_decoder_is_not_told_of_or_that_disagree_are_refused() {
    let lora = LoraConfig::new(2, 2.0, vec![LoraTarget::Q, LoraTarget::Down]);
    let (base, adapter_tensors, _) = model(&lora);
    let c = config();
    let layout = with_adapters(&c.rollout_layout(2).unwrap(), &c.model, &lora).unwrap();
    let mut all = base;
    all.extend(adapter_tensors);
    // no configuration: its scaling is unknown
    let e = logits(&layout, all.clone(), None).unwrap_err();
    assert!(e.contains("LoRA adapters") && e.contains("new_lora"), "{e}");
    // a configuration of another rank
    let other = LoraConfig::new(4, 2.0, lora.targets.clone());
    let e = logits(&layout, all.clone(), Some(&other)).unwrap_err();
    assert!(e.contains("r = 2") && e.contains("q_proj"), "{e}");
    // one that targets a module the rollout holds no adapter for
    let more = LoraConfig::new(2, 2.0, vec![LoraTarget::Q, LoraTarget::V, LoraTarget::Down]);
    let e = logits(&layout, all.clone(), Some(&more)).unwrap_err();
    assert!(e.contains("v_proj.lora_A"), "{e}");
    // one that does not target an adapter the rollout holds
    let fewer = LoraConfig::new(2, 2.0, vec![LoraTarget::Q]);
    let e = logits(&layout, all, Some(&fewer)).unwrap_err();
    assert!(
        e.contains("down_proj") && e.contains("does not target"),
        "{e}"
    );
}

/// An fp8 rollout quantises the base and keeps the adapters bf16, which the decoder applies:
/// the logits move from the fp8 base's by what the adapters add.
#[test]
fn an_fp8_base_keeps_its_adapters_bf16() {
    let lora = LoraConfig::new(2, 2.0, LoraTarget::ALL.to_vec());
    let (base, adapter_tensors, _) = model(&lora);
    let c = config();
    let fp8 = RolloutDtype::Fp8;
    // T = 1: this model's matrices are smaller than a 128 × 128 block, which a slice may not cut
    let plain = logits_in(&c.rollout_layout(1).unwrap(), base.clone(), None, fp8).unwrap();
    let layout = with_adapters(&c.rollout_layout(1).unwrap(), &c.model, &lora).unwrap();
    let mut all = base;
    all.extend(adapter_tensors);
    let adapted = logits_in(&layout, all, Some(&lora), fp8).unwrap();
    let scale = plain.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(max_diff(&adapted, &plain) > 1e-2 * scale);
}
