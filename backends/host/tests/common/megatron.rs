//! Shared helpers of the Megatron CPU and GPU executor tests (the GPU tests include this file):
//! a tiny model shape and deterministic full tensors.
#![allow(dead_code)]

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
