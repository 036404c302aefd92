//! The Megatron fp8 rollout written in one read of the parameters
//! ([`fp8_one_read`]), as the GPU engine issues it: every rank's steps (the bf16 tensors'
//! copies into the fp8 rollout buffer and the quantisations from its bf16 parameters) run on
//! the CPU executor of step programs under several stream interleavings, bit-identical to the
//! CPU executor's fp8 rollout (`MegatronHostBackend`), dense and MoE, at W ∈ {1, 2, 3, 4}, T up to
//! twice TP.

use crate::common;

use half::bf16;
use lifecycle_host::megatron::MegatronTrainState;
use lifecycle_host::steps::{run_steps, Source};
use lifecycle_layout::fp8::Fp8Keep;
use lifecycle_layout::megatron::schedule::{build_rank, rollout_offsets, ScheduleOptions};
use lifecycle_layout::megatron::{
    fp8_one_read, fp8_rollout, plan_megatron_to_tp, BucketConfig, MegatronLayout, StepShape,
};
use lifecycle_layout::steps::RankSteps;
use lifecycle_layout::{HostRollout, RolloutLayout, RolloutVocab};

use crate::common::{fp8_dense as dense, fp8_moe as moe};

/// The rollout the one-read steps build on the CPU step runner, cut by the fp8 entries.
fn simulate(
    state: &MegatronTrainState,
    rollout: &RolloutLayout,
    keep: Fp8Keep,
    opts: ScheduleOptions,
) -> HostRollout {
    let plan = plan_megatron_to_tp(state.layout(), rollout, BucketConfig::default()).unwrap();
    let (offsets, _) = rollout_offsets(&plan);
    let f = fp8_rollout(&plan.tensors, &offsets, keep);
    let one = fp8_one_read(&plan, &f).expect("every rank holds its rows");
    let world = plan.ranks.len();
    let params: Vec<Vec<u16>> = (0..world)
        .map(|r| {
            let p = state.params(r).unwrap();
            p.iter().map(|x| x.to_bits()).collect()
        })
        .collect();
    let steps: Vec<RankSteps> = (0..world)
        .map(|r| {
            let s = build_rank(&one.plan, &one.offsets, r, opts);
            let mut steps = s
                .rank_steps(StepShape {
                    world,
                    source_elems: params[r].len() as u64,
                    rollout_elems: f.len as u64,
                    in_flight: 2,
                    peer_copy: opts.peer_copy,
                    split_local_bulk: false,
                })
                .unwrap();
            steps.quantise = one.quantise[r].clone();
            steps
                .zero
                .extend(one.zero.iter().map(|z| z.start as u64..z.end as u64));
            steps.validate().unwrap();
            assert!(!steps.quantise.is_empty(), "rank {r} quantises");
            steps
        })
        .collect();
    let sources: Vec<Source<'_>> = params.iter().map(|p| Source::Bf16(p)).collect();
    let rolls = run_steps(steps, &sources, &[1, 2, 3]).unwrap();
    // the gaps zeroed: no slot left unwritten (the runner starts every slot at POISON)
    for (r, roll) in rolls.iter().enumerate() {
        for z in &one.zero {
            assert!(
                roll[z.clone()].iter().all(|&b| b == 0),
                "rank {r}: gap {z:?}"
            );
        }
    }
    let rolls = rolls
        .into_iter()
        .map(|r| r.into_iter().map(bf16::from_bits).collect())
        .collect();
    HostRollout::from_flat(&f.entries, rolls).unwrap()
}

#[test]
fn one_read_steps_match_the_cpu_executor() {
    // (TP, DP, EP) -> T, every row on its own rank
    let layouts = [
        (1, 1, 1, 1),
        (2, 1, 1, 2),
        (1, 2, 1, 1),
        (1, 3, 1, 1),
        (2, 2, 1, 2),
        // T above TP: row-parallel slices read every other run of a parameter's columns
        (1, 2, 1, 2),
        (1, 4, 1, 2),
    ];
    let mut n = 0;
    for (name, model) in [("dense", dense()), ("moe", moe())] {
        for (tp, dp, ep, t) in layouts {
            for keep in ["none", "attention,layer:0"] {
                let keep: Fp8Keep = keep.parse().unwrap();
                let layout = MegatronLayout::new_moe(model, tp, 1, dp, ep, tp).unwrap();
                let state =
                    MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 11)).unwrap();
                let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(4));
                let want = common::host_fp8(&state, &rollout, keep);
                for peer_copy in [false, true] {
                    let opts = ScheduleOptions {
                        peer_copy,
                        memcpy_min: 1 << 12,
                        ..ScheduleOptions::default()
                    };
                    let got = simulate(&state, &rollout, keep, opts);
                    let label = format!("{name} TP{tp} DP{dp} EP{ep} -> T{t} keep {keep:?}");
                    assert_eq!(got.first_difference(&want), None, "{label}");
                    let quantised = got.ranks[0].tensors.iter().filter(|t| t.fp8.is_some());
                    assert!(quantised.count() > 0, "{label}");
                    n += 1;
                }
            }
        }
    }
    assert_eq!(n, 2 * layouts.len() * 2 * 2);
}
