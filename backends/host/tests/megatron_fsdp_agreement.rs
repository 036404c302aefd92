//! The same Hugging Face model built for the FSDP host backend (unfused rollout, fused here
//! afterwards) and for this backend (fused rollout) gives bit-identical rollout weights, before
//! and after one optimizer step with the same gradients.

use crate::common;
use lifecycle_layout::settings::Configure;

use std::collections::HashMap;

use lifecycle_core::Lifecycle;
use lifecycle_host::megatron::{
    fuse_unfused_rollout, unfused_rollout_specs, MegatronHostBackend, MegatronTrainState,
};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::HostRollout;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::RolloutLayout as CoreRolloutLayout;
use lifecycle_layout::{AdamParams, HostTensor};
use lifecycle_layout::{RolloutLayout, RolloutVocab};

fn rollout_of<B>(lc: &mut Lifecycle<B>) -> HostRollout
where
    B: lifecycle_core::Reshard<Rollout = HostRollout>,
{
    let session = lc.rollout().unwrap();
    let w = session.weights().get().clone();
    session.finish().unwrap();
    w
}

fn fsdp_set_grads(state: &mut HostTrainState, grads: &[HostTensor]) {
    let full: HashMap<&str, Vec<f32>> = grads
        .iter()
        .map(|g| (g.name.as_str(), g.data.to_f32().unwrap()))
        .collect();
    state
        .for_each_shard_mut(|s| {
            let cols: usize = s.shape.iter().skip(1).product();
            let src = &full[s.name];
            s.grad
                .copy_from_slice(&src[s.rows.start * cols..s.rows.end * cols]);
        })
        .unwrap();
}

fn check(model: ModelSpec, tp: usize, pp: usize, dp: usize, t: usize) {
    let case = format!(
        "groups {} tied {} TP {tp} PP {pp} DP {dp} T {t}",
        model.query_groups, model.tied_embeddings
    );
    let world = tp * pp * dp;
    let tensors = common::hf_tensors(&model, 3);
    let grads = common::hf_tensors(&model, 5);

    let fsdp_state = HostTrainState::from_tensors(world, tensors.clone()).unwrap();
    let fsdp_layout = CoreRolloutLayout::new(t, unfused_rollout_specs(&model, t)).unwrap();
    let mut fsdp = Lifecycle::new(HostBackend::new(fsdp_layout), fsdp_state);

    let layout = MegatronLayout::new(model, tp, pp, dp).unwrap();
    let state = MegatronTrainState::from_hf(layout, tensors).unwrap();
    let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded);
    let mut meg = Lifecycle::new(MegatronHostBackend::new(rollout), state);

    for step in 0..2 {
        let fused = fuse_unfused_rollout(&model, &rollout_of(&mut fsdp), t).unwrap();
        let ours = rollout_of(&mut meg);
        if let Some((rank, name)) = ours.first_difference(&fused) {
            panic!("{case} step {step}: rank {rank} `{name}` differs from the FSDP backend's");
        }
        if step == 0 {
            {
                let mut train = fsdp.train().unwrap();
                fsdp_set_grads(train.state_mut(), &grads);
                train.state_mut().adam_step(AdamParams::default()).unwrap();
            }
            let mut train = meg.train().unwrap();
            train.state_mut().set_grads_from_hf(grads.clone()).unwrap();
            train.state_mut().adam_step(AdamParams::default()).unwrap();
        }
    }
}

#[test]
fn fsdp_and_megatron_rollouts_agree() {
    for groups in [1, 2, 8] {
        for tied in [false, true] {
            let mut model = common::model(groups, tied);
            model.vocab = 40; // the FSDP rollout keeps the vocabulary unpadded: T must divide it
            for (tp, pp, dp, t) in [
                (2, 2, 1, 4),
                (1, 2, 2, 2),
                (4, 1, 2, 8),
                (2, 1, 1, 1),
                (8, 1, 1, 8),
                (1, 4, 2, 8),
                (2, 4, 1, 2),
            ] {
                check(model, tp, pp, dp, t);
            }
        }
    }
}

/// A dense model whose fused parts keep whole 128-row fp8 blocks at T ∈ {1, 2, 4}: 4 heads of
/// 128 in 2 groups, ffn 512.
fn blocky(qkv_bias: bool) -> ModelSpec {
    ModelSpec {
        hidden: 256,
        heads: 4,
        query_groups: 2,
        head_dim: 128,
        ffn: 512,
        vocab: 64,
        layers: 2,
        qkv_bias,
        tied_embeddings: false,
        make_vocab_size_divisible_by: 4,
        qk_norm: false,
        moe: None,
    }
}

/// `tensors` rounded to bf16 (the values a Megatron state's bf16 parameters hold exactly).
fn bf16_exact(tensors: Vec<HostTensor>) -> Vec<HostTensor> {
    tensors.into_iter().map(HostTensor::bf16_rounded).collect()
}

/// fp8 rollouts: the FSDP host backend's (quantised from the fp32 masters, then fused here) and
/// this backend's (fused, quantised in its own block grid from the bf16 parameters) are
/// bit-identical on bf16-exact weights, e4m3 bytes and block scales alike, kv heads split or
/// replicated; a fused tensor whose parts would share a block is refused by name.
#[test]
fn fsdp_and_megatron_fp8_rollouts_agree() {
    use lifecycle_layout::fp8::RolloutDtype;
    for qkv_bias in [false, true] {
        let model = blocky(qkv_bias);
        for (tp, pp, dp, t) in [(2, 1, 1, 2), (1, 2, 1, 1), (2, 2, 1, 4), (1, 1, 2, 2)] {
            let case = format!("bias {qkv_bias} TP {tp} PP {pp} DP {dp} T {t}");
            let tensors = bf16_exact(common::hf_tensors(&model, 7));
            let world = tp * pp * dp;
            let fsdp_state = HostTrainState::from_tensors(world, tensors.clone()).unwrap();
            let fsdp_layout = CoreRolloutLayout::new(t, unfused_rollout_specs(&model, t)).unwrap();
            let mut fsdp = Lifecycle::new(
                HostBackend::new(fsdp_layout).with_rollout_dtype(RolloutDtype::Fp8),
                fsdp_state,
            );
            let layout = MegatronLayout::new(model, tp, pp, dp).unwrap();
            let state = MegatronTrainState::from_hf(layout, tensors).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded);
            let mut meg = Lifecycle::new(
                MegatronHostBackend::new(rollout).with_rollout_dtype(RolloutDtype::Fp8),
                state,
            );
            let fused = fuse_unfused_rollout(&model, &rollout_of(&mut fsdp), t).unwrap();
            let ours = rollout_of(&mut meg);
            let quantised = ours.ranks[0].tensors.iter().filter(|x| x.fp8.is_some());
            assert_eq!(
                quantised.count(),
                4 * model.layers,
                "{case}: qkv, o, gate_up, down"
            );
            if let Some((rank, name)) = ours.first_difference(&fused) {
                panic!("{case}: rank {rank} `{name}` differs from the FSDP backend's fp8 rollout");
            }
            // the next rollout (enter again), and one refreshed in place with the weights kept
            // resident: fp8 again, the same bytes
            meg.train().unwrap();
            let again = rollout_of(&mut meg);
            assert_eq!(
                again.first_difference(&ours),
                None,
                "{case}: the next rollout"
            );
            let resident = lifecycle_core::LifecycleConfig {
                memory: lifecycle_core::MemoryPolicy {
                    keep_rollout_resident: true,
                    ..lifecycle_core::MemoryPolicy::resident()
                },
                ..Default::default()
            };
            let layout = MegatronLayout::new(model, tp, pp, dp).unwrap();
            let tensors = bf16_exact(common::hf_tensors(&model, 7));
            let state = MegatronTrainState::from_hf(layout, tensors).unwrap();
            let backend = MegatronHostBackend::new(RolloutLayout::fused(t, RolloutVocab::Unpadded))
                .with_rollout_dtype(RolloutDtype::Fp8);
            let mut kept = Lifecycle::with_config(backend, state, resident).unwrap();
            rollout_of(&mut kept);
            let _ = kept.train().unwrap().state_mut(); // stale: the next rollout refreshes
            let refreshed = rollout_of(&mut kept);
            assert_eq!(kept.metrics().refreshes, 1, "{case}");
            assert_eq!(
                refreshed.first_difference(&ours),
                None,
                "{case}: refreshed in place"
            );
        }
    }
    // head_dim 64: k of 64 rows per rank at T = 2 would share a block with v
    let model = ModelSpec {
        head_dim: 64,
        ..blocky(false)
    };
    let layout = MegatronLayout::new(model, 2, 1, 1).unwrap();
    let state = MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 7)).unwrap();
    let backend = MegatronHostBackend::new(RolloutLayout::fused(2, RolloutVocab::Unpadded))
        .with_rollout_dtype(RolloutDtype::Fp8);
    let mut lc = Lifecycle::new(backend, state);
    let err = lc.rollout().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("qkv_proj") && err.contains("128-row"), "{err}");
    // a non-finite parameter where a block is quantised: refused by name, the state trains on
    let model = blocky(false);
    let mut tensors = bf16_exact(common::hf_tensors(&model, 7));
    let down = tensors
        .iter_mut()
        .find(|t| t.name == "model.layers.1.mlp.down_proj.weight")
        .unwrap();
    let mut v = down.data.to_f32().unwrap();
    v[5] = f32::NAN;
    *down = HostTensor::f32(down.name.clone(), down.shape.clone(), v);
    let layout = MegatronLayout::new(model, 1, 1, 1).unwrap();
    let state = MegatronTrainState::from_hf(layout, tensors).unwrap();
    let backend = MegatronHostBackend::new(RolloutLayout::fused(1, RolloutVocab::Unpadded))
        .with_rollout_dtype(RolloutDtype::Fp8);
    let mut lc = Lifecycle::new(backend, state);
    let err = lc.rollout().map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("down_proj") && err.contains("non-finite"),
        "{err}"
    );
    assert_eq!(lc.mode(), lifecycle_core::Mode::Train);
    lc.train().unwrap();
}
