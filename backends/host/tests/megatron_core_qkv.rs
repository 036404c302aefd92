//! The Megatron-Core layout of `linear_qkv` when TP exceeds the query groups (Megatron-LM #2565):
//! a plain 1/TP chunk of the group-interleaved tensor, no k/v replicas, checked value by value
//! against the Hugging Face q, k, v tensors (not through the crate's own row function).

use lifecycle_host::megatron::MegatronTrainState;
use lifecycle_layout::megatron::{MegatronLayout, ParamKind};
use lifecycle_layout::{hf, HostTensor, ModelSpec};

#[test]
fn four_heads_one_group_tp2_is_two_chunks_of_48_rows() {
    let model = ModelSpec {
        hidden: 48,
        heads: 4,
        query_groups: 1,
        head_dim: 16,
        ffn: 32,
        vocab: 64,
        layers: 1,
        qkv_bias: false,
        tied_embeddings: true,
        make_vocab_size_divisible_by: 4,
        qk_norm: false,
        moe: None,
    };
    let h = model.hidden;
    // every row of q, k and v carries its own value, exact in bf16: row r of q → r, k → 128 + r,
    // v → 192 + r (each column the same)
    let tensors: Vec<HostTensor> = model
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let base = if name.ends_with(hf::Q) {
                Some(0.0)
            } else if name.ends_with(hf::K) {
                Some(128.0)
            } else if name.ends_with(hf::V) {
                Some(192.0)
            } else {
                None
            };
            let data = (0..n)
                .map(|i| base.map_or(0.5, |b| b + (i / h) as f32))
                .collect();
            HostTensor::f32(name, shape, data)
        })
        .collect();
    let layout = MegatronLayout::new(model, 2, 1, 1).unwrap();
    assert_eq!(layout.qkv_local_rows(), 48);
    let slot = layout.slot(0, ParamKind::Qkv, Some(0)).unwrap().clone();
    assert_eq!(
        slot.shape,
        vec![48, 48],
        "Megatron-Core's [48, 48] per rank"
    );
    let state = MegatronTrainState::from_hf(layout, tensors).unwrap();
    let rows = |rank: usize| -> Vec<f32> {
        let p = state.params_anywhere(rank).unwrap();
        (0..48).map(|r| p[slot.offset + r * h].to_f32()).collect()
    };
    // rank 0: q heads 0, 1, 2 (q rows 0..48)
    let want0: Vec<f32> = (0..48).map(|r| r as f32).collect();
    // rank 1: q head 3 (q rows 48..64), then k (16 rows), then v (16 rows)
    let want1: Vec<f32> = (48..64)
        .map(|r| r as f32)
        .chain((0..16).map(|r| 128.0 + r as f32))
        .chain((0..16).map(|r| 192.0 + r as f32))
        .collect();
    assert_eq!(rows(0), want0);
    assert_eq!(rows(1), want1);
    // a TP that does not divide the fused rows is refused, naming linear_qkv
    let odd = ModelSpec {
        head_dim: 3,
        ..model
    };
    let err = MegatronLayout::new(odd, 4, 1, 1).unwrap_err().to_string();
    assert!(err.contains("linear_qkv"), "{err}");
}
