//! Bad layouts and inputs are plan-time errors naming the parameter and the fix.

use crate::common;

use lifecycle_core::Lifecycle;
use lifecycle_host::megatron::{MegatronError, MegatronHostBackend, MegatronTrainState};
use lifecycle_layout::megatron::{
    plan_megatron_to_tp, BucketConfig, MegatronLayout, MegatronLayoutError,
};
use lifecycle_layout::HostTensor;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{RolloutLayout, RolloutVocab};

fn layout_err(model: ModelSpec, tp: usize, pp: usize, dp: usize) -> String {
    MegatronLayout::new(model, tp, pp, dp)
        .unwrap_err()
        .to_string()
}

fn plan_err(model: ModelSpec, tp: usize, pp: usize, dp: usize, rollout: RolloutLayout) -> String {
    let train = MegatronLayout::new(model, tp, pp, dp).unwrap();
    plan_megatron_to_tp(&train, &rollout, BucketConfig::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn heads_not_divisible_by_groups() {
    let mut m = common::model(3, false);
    m.heads = 8;
    let e = layout_err(m, 1, 1, 1);
    assert!(
        e.contains("attention heads = 8 is not divisible by query groups"),
        "{e}"
    );
    assert!(e.contains("pick query groups dividing 8"), "{e}");
}

#[test]
fn tp_and_groups_must_divide_one_another() {
    let mut m = common::model(3, false);
    m.heads = 12;
    m.ffn = 24;
    let e = layout_err(m, 2, 1, 1);
    assert!(
        e.contains("training TP tensor-parallel degree 2 and query groups = 3"),
        "{e}"
    );
    assert!(e.contains("choose a degree among 1, 3, 6, 12"), "{e}");
    let e = plan_err(
        m,
        1,
        1,
        2,
        RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(1)),
    );
    assert!(
        e.contains("rollout T tensor-parallel degree 2 and query groups = 3"),
        "{e}"
    );
}

#[test]
fn heads_and_ffn_must_split_tp_ways() {
    let m = common::model(2, false);
    let e = layout_err(m, 16, 1, 1);
    assert!(
        e.contains("attention heads = 8 is not divisible by the training TP"),
        "{e}"
    );
    assert!(e.contains("`self_attention.linear_qkv.weight`"), "{e}");
    let mut m = common::model(8, false);
    m.ffn = 12;
    let e = layout_err(m, 8, 1, 1);
    assert!(e.contains("ffn hidden size = 12"), "{e}");
    assert!(e.contains("`mlp.linear_fc1.weight`"), "{e}");
}

#[test]
fn rollout_degree_must_divide_world() {
    let e = plan_err(
        common::model(2, false),
        2,
        1,
        2,
        RolloutLayout::fused(8, RolloutVocab::PadToMultipleOf(1)),
    );
    assert!(
        e.contains("T = 8 does not divide the world size W = 4"),
        "{e}"
    );
    assert!(e.contains("(1, 2, 4)"), "{e}");
}

#[test]
fn more_stages_than_layers() {
    let e = layout_err(common::model(2, false), 1, 8, 1);
    assert!(e.contains("PP = 8 exceeds the 4 transformer layers"), "{e}");
    assert!(e.contains("use PP ≤ 4"), "{e}");
}

#[test]
fn world_must_be_tp_pp_dp() {
    let e = MegatronLayout::from_world(common::model(2, false), 6, 4, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("world size W = 6 is not TP × PP × DP"), "{e}");
    assert!(MegatronLayout::from_world(common::model(2, false), 8, 4, 1).is_ok());
}

#[test]
fn padded_vocab_must_be_consistent() {
    let m = common::model(2, false);
    let e = MegatronLayout::with_padded_vocab(m, 2, 1, 1, 36)
        .unwrap_err()
        .to_string();
    assert!(e.contains("padded vocab size 36"), "{e}");
    assert!(e.contains("use 40"), "{e}");
    let e = MegatronLayout::with_padded_vocab(m, 4, 1, 1, 42)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of TP = 4"), "{e}");
    assert!(MegatronLayout::with_padded_vocab(m, 2, 1, 1, 38).is_ok());
}

#[test]
fn unpadded_rollout_vocab_must_split() {
    let e = plan_err(
        common::model(2, false),
        2,
        1,
        1,
        RolloutLayout::fused(2, RolloutVocab::Unpadded),
    );
    assert!(
        e.contains("vocab size 37 of `model.embed_tokens.weight`"),
        "{e}"
    );
    assert!(e.contains("RolloutVocab::PadToMultipleOf"), "{e}");
}

#[test]
fn zero_sizes() {
    let mut m = common::model(2, false);
    m.hidden = 0;
    assert_eq!(
        layout_err(m, 1, 1, 1),
        "hidden size must be at least 1, found 0"
    );
    let e = layout_err(common::model(2, false), 1, 0, 1);
    assert!(
        e.contains("pipeline-parallel degree PP must be at least 1"),
        "{e}"
    );
    let e = plan_err(
        common::model(2, false),
        1,
        1,
        1,
        RolloutLayout::fused(0, RolloutVocab::Unpadded),
    );
    assert!(
        e.contains("rollout tensor-parallel degree T must be at least 1"),
        "{e}"
    );
    let e = MegatronHostBackend::new(RolloutLayout::fused(1, RolloutVocab::Unpadded))
        .with_config(BucketConfig { bucket_bytes: 1 })
        .unwrap_err();
    assert_eq!(
        e,
        MegatronError::Layout(MegatronLayoutError::BucketTooSmall { bytes: 1 })
    );
}

#[test]
fn bad_checkpoint_tensors_name_the_tensor() {
    let m = common::model(2, false);
    let layout = MegatronLayout::new(m, 1, 1, 1).unwrap();
    let mut tensors = common::hf_tensors(&m, 1);
    tensors.retain(|t| t.name != "model.layers.2.mlp.up_proj.weight");
    let e = MegatronTrainState::from_hf(layout.clone(), tensors).unwrap_err();
    assert!(e
        .to_string()
        .contains("`model.layers.2.mlp.up_proj.weight` is missing"));

    let mut tensors = common::hf_tensors(&m, 1);
    tensors[1] = HostTensor::f32("model.layers.0.input_layernorm.weight", [9], vec![0.0; 9]);
    let e = MegatronTrainState::from_hf(layout.clone(), tensors).unwrap_err();
    assert!(
        e.to_string()
            .contains("has shape [9] but the model description gives [8]"),
        "{e}"
    );

    let mut tensors = common::hf_tensors(&m, 1);
    tensors.push(HostTensor::f32("model.layers.9.extra", [1], vec![0.0]));
    let e = MegatronTrainState::from_hf(layout, tensors).unwrap_err();
    assert!(
        e.to_string()
            .contains("`model.layers.9.extra` is not a parameter"),
        "{e}"
    );
}

/// A 2-layer model's state at TP = 2 (W = 2).
fn two_rank_state() -> MegatronTrainState {
    let m = common::model(2, false);
    MegatronTrainState::from_hf(
        MegatronLayout::new(m, 2, 1, 1).unwrap(),
        common::hf_tensors(&m, 1),
    )
    .unwrap()
}

#[test]
fn plan_errors_surface_through_the_lifecycle_before_anything_moves() {
    let state = two_rank_state();
    let before = state.snapshot();
    let backend =
        MegatronHostBackend::new(RolloutLayout::fused(4, RolloutVocab::PadToMultipleOf(1)));
    let mut lc = Lifecycle::new(backend, state);
    let e = lc.rollout().unwrap_err().to_string();
    assert!(
        e.contains("T = 4 does not divide the world size W = 2"),
        "{e}"
    );
    assert_eq!(lc.peek_state().snapshot(), before);
}

/// Verification is an option every backend takes and the Megatron host backend does not have:
/// refused by name at plan, before anything moves; the shared options otherwise switch.
#[test]
fn an_option_the_backend_lacks_is_refused_before_anything_moves() {
    use lifecycle_layout::settings::Configure;
    let state = two_rank_state();
    let before = state.snapshot();
    let rollout = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(1));
    let backend = MegatronHostBackend::new(rollout.clone()).with_verification(true);
    let mut lc = Lifecycle::new(backend, state.clone());
    let e = lc.rollout().unwrap_err().to_string();
    assert!(
        e.contains("verification") && e.contains("Megatron host backend"),
        "{e}"
    );
    assert_eq!(lc.peek_state().snapshot(), before);
    // offload overlap changes nothing on the host: taken
    let backend = MegatronHostBackend::new(rollout).with_offload_overlap(true);
    assert!(backend.offload_overlap());
    let mut lc = Lifecycle::new(backend, state);
    assert!(lc.rollout().is_ok());
}

/// Mixture-of-experts models in the Megatron expert layouts: bad expert degrees, a rollout
/// degree the expert placement cannot split, expert parallelism for a dense model, and
/// missing, extra or mis-shaped expert tensors and routers are errors naming the degree, the
/// config field or the tensor, before any rank is built.
#[test]
fn expert_layouts_and_expert_tensors_are_checked_by_name() {
    use lifecycle_layout::ExpertPlacement;
    let m = common::moe_model(false); // 4 experts of 12, layers 1-3 MoE
    let moe_err = |tp, pp, dp, ep, etp| {
        MegatronLayout::new_moe(m, tp, pp, dp, ep, etp)
            .unwrap_err()
            .to_string()
    };
    let e = moe_err(1, 1, 6, 3, 1);
    assert!(
        e.contains("num_experts = 4 is not divisible by the expert-parallel degree EP = 3"),
        "{e}"
    );
    let e = moe_err(1, 1, 4, 1, 8);
    assert!(e.contains("ETP × EP × PP = 8 × 1 × 1"), "{e}");
    let e = moe_err(1, 1, 8, 1, 8);
    assert!(e.contains("moe_intermediate_size = 12"), "{e}");
    let e = MegatronLayout::new_moe(common::model(2, false), 1, 1, 2, 2, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("EP = 2 needs a mixture-of-experts model"), "{e}");
    // T = 8 partitions neither 4 experts nor 12 rows of every expert
    let train = MegatronLayout::new_moe(m, 1, 1, 8, 4, 1).unwrap();
    for (placement, field) in [
        (ExpertPlacement::Partitioned, "num_experts = 4"),
        (
            ExpertPlacement::TensorParallel,
            "moe_intermediate_size = 12",
        ),
    ] {
        let rollout = RolloutLayout::fused(8, RolloutVocab::PadToMultipleOf(1))
            .with_expert_placement(placement);
        let e = plan_megatron_to_tp(&train, &rollout, BucketConfig::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(field) && e.contains("T = 8") && e.contains("ExpertPlacement::"),
            "{e}"
        );
    }
    // expert tensors: missing, one past num_experts, a router of the wrong shape
    let layout = MegatronLayout::new_moe(m, 1, 1, 2, 2, 1).unwrap();
    let full = common::hf_tensors(&m, 3);
    let missing: Vec<HostTensor> = full
        .iter()
        .filter(|t| t.name != "model.layers.2.mlp.experts.3.down_proj.weight")
        .cloned()
        .collect();
    match MegatronTrainState::from_hf(layout.clone(), missing) {
        Err(MegatronError::MissingTensor { name }) => {
            assert_eq!(name, "model.layers.2.mlp.experts.3.down_proj.weight")
        }
        other => panic!("{other:?}"),
    }
    let mut extra = full.clone();
    extra.push(HostTensor::f32(
        "model.layers.1.mlp.experts.4.up_proj.weight",
        vec![12, 8],
        vec![0.0; 96],
    ));
    let e = MegatronTrainState::from_hf(layout.clone(), extra)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.1.mlp.experts.4.up_proj.weight"),
        "{e}"
    );
    let bad_router: Vec<HostTensor> = full
        .iter()
        .map(|t| {
            if t.name == "model.layers.1.mlp.gate.weight" {
                HostTensor::f32(t.name.clone(), vec![5, 8], vec![0.0; 40])
            } else {
                t.clone()
            }
        })
        .collect();
    match MegatronTrainState::from_hf(layout, bad_router) {
        Err(MegatronError::ShapeMismatch {
            name,
            expected,
            found,
        }) => {
            assert_eq!(name, "model.layers.1.mlp.gate.weight");
            assert_eq!((expected, found), (vec![4, 8], vec![5, 8]));
        }
        other => panic!("{other:?}"),
    }
}
