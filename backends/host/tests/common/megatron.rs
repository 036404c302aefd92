//! Shared helpers of the Megatron CPU and GPU executor tests (the GPU tests include this file):
//! a tiny model shape and deterministic full tensors.
#![allow(dead_code)]

use lifecycle_layout::settings::Configure;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{LayerSet, ModelSpec, MoeSpec};

/// Deterministic values in about [-2, 2) with varied low mantissa bits (so bf16 rounding
/// matters), from a splitmix64 stream.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// A tiny model: 8 heads in `groups` groups, 4 layers, vocab 37 (not a multiple of the padding).
pub fn model(groups: usize, tied: bool) -> ModelSpec {
    ModelSpec {
        hidden: 8,
        heads: 8,
        query_groups: groups,
        // 4 rows per head: at TP 8 with one group a rank's 1/8 of the fused linear_qkv (40
        // rows) ends inside a head, as Megatron-Core's plain chunks do
        head_dim: 4,
        ffn: 16,
        vocab: 37,
        layers: 4,
        qkv_bias: true,
        tied_embeddings: tied,
        make_vocab_size_divisible_by: 4,
        // Qwen3's per-head q/k norms in the two-group models
        qk_norm: groups == 2,
        moe: None,
    }
}

/// A tiny mixture-of-experts model (Qwen3-MoE): [`model`] with two query groups, its layers
/// 1–3 holding 4 experts of intermediate size 12 (top-2) and layer 0 a dense MLP; the tied one
/// also has a shared expert of intermediate size 8 (Qwen2-MoE style).
pub fn moe_model(tied: bool) -> ModelSpec {
    ModelSpec {
        qkv_bias: false,
        moe: Some(MoeSpec {
            experts: 4,
            top_k: 2,
            ffn: 12,
            norm_topk_prob: true,
            sparse_step: 1,
            dense_layers: LayerSet::from_layers(&[0]).unwrap_or(LayerSet::EMPTY),
            shared_ffn: if tied { 8 } else { 0 },
        }),
        ..model(2, tied)
    }
}

/// Every Hugging Face tensor of `model` with distinct deterministic values.
pub fn hf_tensors(model: &ModelSpec, seed: u64) -> Vec<HostTensor> {
    model
        .hf_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            HostTensor::f32(name, shape, values(seed * 1000 + i as u64, n))
        })
        .collect()
}

/// A dense model whose fused parts keep whole 128-row blocks at T ∈ {1, 2} (the fp8 tests): 4
/// heads of 128 in 2 groups, ffn 512, an odd vocabulary.
pub fn fp8_dense() -> ModelSpec {
    ModelSpec {
        hidden: 256,
        heads: 4,
        query_groups: 2,
        head_dim: 128,
        ffn: 512,
        vocab: 301,
        layers: 2,
        qkv_bias: true,
        tied_embeddings: false,
        make_vocab_size_divisible_by: 4,
        qk_norm: false,
        moe: None,
    }
}

/// [`fp8_dense`] with 4 experts of 256 (top-2) in layer 1 and a shared expert of 256, Qwen3 q/k
/// norms.
pub fn fp8_moe() -> ModelSpec {
    ModelSpec {
        qkv_bias: false,
        qk_norm: true,
        moe: Some(MoeSpec {
            experts: 4,
            top_k: 2,
            ffn: 256,
            norm_topk_prob: true,
            sparse_step: 1,
            dense_layers: LayerSet::from_layers(&[0]).unwrap_or(LayerSet::EMPTY),
            shared_ffn: 256,
        }),
        ..fp8_dense()
    }
}

/// The CPU executor's fp8 rollout of `state` (`MegatronHostBackend` with fp8, `keep` kept bf16).
pub fn host_fp8(
    state: &lifecycle_host::megatron::MegatronTrainState,
    rollout: &lifecycle_layout::RolloutLayout,
    keep: lifecycle_layout::fp8::Fp8Keep,
) -> lifecycle_layout::HostRollout {
    let backend = lifecycle_host::megatron::MegatronHostBackend::new(rollout.clone())
        .with_rollout_dtype(lifecycle_layout::fp8::RolloutDtype::Fp8)
        .with_fp8_keep(keep);
    let mut lc = lifecycle_core::Lifecycle::new(backend, state.clone());
    let session = lc.rollout().expect("the CPU executor's fp8 rollout");

    session.weights().get().clone()
}
