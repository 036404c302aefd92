//! The same Hugging Face model built for the FSDP host backend (unfused rollout, fused here
//! afterwards) and for this backend (fused rollout) gives bit-identical rollout weights, before
//! and after one optimizer step with the same gradients.

#[path = "common/megatron.rs"]
mod common;

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
