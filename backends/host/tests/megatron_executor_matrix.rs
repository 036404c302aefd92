//! The host executor against the independent reference over the layout matrix:
//! TP ∈ {1, 2, 4, 8}, PP ∈ {1, 2, 4}, DP ∈ {1, 2} (W ≤ 16), T ∈ {1, 2, 4, 8} dividing W,
//! query groups ∈ {1, 2, 8}, tied and untied embeddings, vocab 37 (not a multiple of the
//! padding); and for a mixture-of-experts model (with and without a shared expert) EP × ETP × TP × PP × DP × T with the experts split by TP
//! or partitioned on the rollout side.

use crate::common;

use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Phase, Switching};
use lifecycle_host::megatron::{
    rebuild_hf_tensors, reference_rollout, MegatronHostBackend, MegatronTrainState,
};
use lifecycle_layout::megatron::{plan_megatron_to_tp, BucketConfig, MegatronLayout};
use lifecycle_layout::HostRollout;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{AdamParams, HostTensor};
use lifecycle_layout::{ExpertPlacement, RolloutLayout, RolloutVocab};

fn assert_same(case: &str, got: &HostRollout, want: &HostRollout) {
    if let Some((rank, name)) = got.first_difference(want) {
        panic!("{case}: rank {rank} tensor `{name}` differs from the reference");
    }
}

fn grads(model: &ModelSpec, seed: u64) -> Vec<HostTensor> {
    common::hf_tensors(model, seed)
}

/// Enter, compare; train (one Adam step), re-enter or refresh, compare; exit; check memory.
fn run_case(model: ModelSpec, tp: usize, pp: usize, dp: usize, t: usize, case_no: usize) {
    let layout = MegatronLayout::new(model, tp, pp, dp).unwrap();
    let case = format!(
        "groups {} tied {} TP {tp} PP {pp} DP {dp} T {t}",
        model.query_groups, model.tied_embeddings
    );
    run_layout(layout, t, ExpertPlacement::TensorParallel, case, case_no);
}

/// [`run_case`] on a given training layout and rollout degree and expert placement.
fn run_layout(
    layout: MegatronLayout,
    t: usize,
    placement: ExpertPlacement,
    case: String,
    case_no: usize,
) {
    let model = *layout.model();
    let inputs = common::hf_tensors(&model, 7);
    let state = MegatronTrainState::from_hf(layout, inputs.clone()).unwrap();
    // Round trip: sharding then rebuilding gives the inputs rounded to bf16.
    let rebuilt = rebuild_hf_tensors(&state).unwrap();
    assert_eq!(rebuilt.len(), inputs.len());
    for (r, i) in rebuilt.iter().zip(&inputs) {
        let want: Vec<u16> = i
            .data
            .to_f32()
            .unwrap()
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let got: Vec<u16> = r.data.iter().map(|x| x.to_bits()).collect();
        assert!(
            r.name == i.name && r.shape == i.shape && got == want,
            "round trip of `{}`",
            i.name
        );
    }
    let start_mem: Vec<u64> = (0..state.world())
        .map(|r| state.memory(r).unwrap().current)
        .collect();
    // Vary the rollout vocabulary, the bucket budget and the memory policy across cases.
    let vocab = RolloutVocab::PadToMultipleOf([1, 4, 3][case_no % 3]);
    let rollout = RolloutLayout::fused(t, vocab).with_expert_placement(placement);
    let budget = [64, 1 << 20, 6][case_no % 3];
    let backend = MegatronHostBackend::new(rollout.clone())
        .with_config(BucketConfig {
            bucket_bytes: budget,
        })
        .unwrap();
    let memory = if case_no.is_multiple_of(2) {
        MemoryPolicy::default()
    } else {
        MemoryPolicy {
            offload_params: false,
            offload_optimizer: false,
            keep_rollout_resident: true,
        }
    };
    let config = LifecycleConfig {
        switching: Switching::Lazy,
        memory,
    };
    let case = format!("{case} vocab {vocab:?} budget {budget}");
    let mut lc = Lifecycle::with_config(backend, state, config).unwrap();
    let rollout_now = |lc: &mut Lifecycle<MegatronHostBackend>| -> HostRollout {
        let session = lc.rollout().unwrap();
        let got = session.weights().get().clone();
        session.finish().unwrap();
        got
    };
    let got = rollout_now(&mut lc);
    let want = reference_rollout(lc.peek_state(), &rollout).unwrap();
    assert_same(&case, &got, &want);
    // Metrics: the bytes the plan says, staging within the bucket budget.
    let plan = plan_megatron_to_tp(
        lc.peek_state().layout(),
        &rollout,
        BucketConfig {
            bucket_bytes: budget,
        },
    )
    .unwrap();
    let transfer = *lc.metrics().phase(Phase::Transfer);
    assert_eq!(
        transfer.bytes.device_to_device,
        plan.remote_bytes(),
        "{case}"
    );
    assert_eq!(transfer.bytes.local, plan.local_bytes(), "{case}");
    assert!(transfer.peak_extra_bytes <= budget, "{case}");
    let offloaded = lc.metrics().phase(Phase::Offload).bytes.device_to_host;
    assert_eq!(offloaded > 0, memory.offload_params, "{case}");

    // One optimizer step changes every weight; the next rollout must follow it.
    {
        let mut train = lc.train().unwrap();
        let state = train.state_mut();
        state.set_grads_from_hf(grads(&model, 11)).unwrap();
        state.adam_step(AdamParams::default()).unwrap();
    }
    let got2 = rollout_now(&mut lc);
    let want2 = reference_rollout(lc.peek_state(), &rollout).unwrap();
    assert_same(&format!("{case} after a step"), &got2, &want2);
    assert!(
        got2.first_difference(&got).is_some(),
        "{case}: the step changed nothing"
    );
    let metrics = lc.metrics().clone();
    assert_eq!(metrics.switches(), 2, "{case}");
    if memory.keep_rollout_resident {
        assert_eq!(metrics.refreshes, 1, "{case}");
    }
    lc.exit().unwrap();
    let state = lc.peek_state();
    for (r, &m) in start_mem.iter().enumerate() {
        assert_eq!(
            state.memory(r).unwrap().current,
            m,
            "{case}: rank {r} memory"
        );
    }
    assert!(!state.is_offloaded());
}

#[test]
fn executor_matches_reference_over_the_matrix() {
    let mut case_no = 0;
    for tp in [1, 2, 4, 8] {
        for pp in [1, 2, 4] {
            for dp in [1, 2] {
                let world = tp * pp * dp;
                if world > 16 {
                    continue;
                }
                for t in [1, 2, 4, 8].into_iter().filter(|t| world % t == 0) {
                    for groups in [1, 2, 8] {
                        for tied in [false, true] {
                            run_case(common::model(groups, tied), tp, pp, dp, t, case_no);
                            case_no += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(case_no > 300, "{case_no} cases");
}

#[test]
fn executor_matches_reference_over_the_expert_grid() {
    let mut case_no = 0;
    for tp in [1usize, 2, 4] {
        for pp in [1, 2] {
            for dp in [1, 2, 4] {
                let world = tp * pp * dp;
                if world > 16 {
                    continue;
                }
                for (ep, etp) in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)] {
                    if !world.is_multiple_of(ep * etp * pp) {
                        continue;
                    }
                    for t in [1, 2, 4, 8].into_iter().filter(|t| world % t == 0) {
                        for placement in [
                            ExpertPlacement::TensorParallel,
                            ExpertPlacement::Partitioned,
                        ] {
                            // 4 experts of intermediate size 12: T 8 splits neither
                            if t == 8 {
                                continue;
                            }
                            let model = common::moe_model(case_no % 2 == 1);
                            let layout =
                                MegatronLayout::new_moe(model, tp, pp, dp, ep, etp).unwrap();
                            let case = format!(
                                "MoE tied {} TP {tp} PP {pp} DP {dp} EP {ep} ETP {etp} T {t} experts {}",
                                model.tied_embeddings,
                                placement.name()
                            );
                            run_layout(layout, t, placement, case, case_no);
                            case_no += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(case_no > 100, "{case_no} cases");
}
