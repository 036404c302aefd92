//! Runs the executable plan's steps on the CPU (the executor of step programs, with random
//! stream interleavings) and checks the result is
//! bit-identical to the host backend's reference rollout. No GPU needed: runs in CI.

use half::bf16;
use lifecycle_host::steps::{run_steps, Source};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::fsdp::{build_plan, BucketConfig, FsdpPlan, GatherMode, ShardLayout};
use lifecycle_layout::steps::RankSteps;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};

fn specs(tp: usize) -> Vec<TensorSpec> {
    // Dims not divisible by W (3 rows, 7 rows, ...) but split dims divisible by T; and experts
    // partitioned over the T ranks (two per rank, of uneven FSDP shards: 5 and 3 rows).
    let mut specs = vec![
        TensorSpec::new("embed", [7 * tp, 5], Parallel::Column),
        TensorSpec::new("q.weight", [4 * tp + 2 * tp + tp, 6], Parallel::Column),
        TensorSpec::new("q.bias", [7 * tp], Parallel::Column),
        TensorSpec::new("o.weight", [7, 4 * tp], Parallel::Row),
        TensorSpec::new("down.weight", [9, 6 * tp], Parallel::Row),
        TensorSpec::new("norm", [5], Parallel::Replicated),
        TensorSpec::new("conv", [3 * tp, 2, 3], Parallel::Column),
        TensorSpec::new("tiny", [1, 3], Parallel::Replicated),
    ];
    for e in 0..2 * tp {
        let rank = e / 2;
        specs.push(TensorSpec::new(
            format!("expert{e}.up"),
            [5, 3],
            Parallel::Owned { rank },
        ));
        specs.push(TensorSpec::new(
            format!("expert{e}.down"),
            [3, 5],
            Parallel::Owned { rank },
        ));
    }
    specs
}

fn host_state(world: usize, specs: &[TensorSpec]) -> HostTrainState {
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.numel();
            let data = (0..n)
                .map(|e| {
                    let x = (i * 1000 + e) as f32;
                    // Values whose bf16 rounding exercises ties and carries.
                    x * 1.000_123_4 + 0.003_906_25 * (e % 7) as f32 - 17.5
                })
                .collect();
            HostTensor::f32(s.name.clone(), s.shape.clone(), data)
        })
        .collect();
    HostTrainState::from_tensors(world, tensors).expect("valid state")
}

/// Runs `plan`'s steps (with `peer`, as peer copies) through the CPU executor of step programs
/// under several stream interleavings, as the GPU engine issues them.
fn simulate(plan: &FsdpPlan, state: &HostTrainState, peer: bool) -> Vec<Vec<bf16>> {
    let world = plan.core.world;
    let shards = &plan.shards;
    let masters: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            let mut flat = vec![0.0; shards.rank_len as usize];
            for (i, slot) in shards.slots.iter().enumerate() {
                let shard = state.master_shard(r, i).expect("resident");
                flat[slot.offset as usize..slot.offset as usize + shard.len()]
                    .copy_from_slice(shard);
            }
            flat
        })
        .collect();
    let mut plan = plan.clone();
    plan.peer_copy = peer;
    let steps: Vec<RankSteps> = (0..world)
        .map(|r| plan.rank_steps(r).expect("valid steps"))
        .collect();
    let sources: Vec<Source<'_>> = masters.iter().map(|m| Source::F32(m)).collect();
    run_steps(steps, &sources, &[1, 2, 3])
        .expect("the programs run")
        .into_iter()
        .map(|r| r.into_iter().map(bf16::from_bits).collect())
        .collect()
}

fn check(world: usize, tp: usize, bucket_bytes: u64, mode: GatherMode) {
    check_specs(specs(tp), world, tp, bucket_bytes, mode);
}

fn check_specs(
    specs: Vec<TensorSpec>,
    world: usize,
    tp: usize,
    bucket_bytes: u64,
    mode: GatherMode,
) {
    let state = host_state(world, &specs);
    let layout = RolloutLayout::new(tp, specs.clone()).expect("layout");
    let core = plan_fsdp_to_tp(state.layout(), &layout).expect("plan");
    let plan = build_plan(
        core,
        state.layout(),
        BucketConfig {
            bucket_bytes,
            in_flight: 2,
            mode,
        },
    );
    let reference = reference_rollout(&state, &layout).expect("reference");
    let peer_copyable = plan.peer_copyable();
    assert_eq!(
        peer_copyable,
        mode == GatherMode::SendRecv
            || (mode == GatherMode::AllGather && (tp > 1 || world == 1))
            || (mode == GatherMode::Packed && (tp == 1 || world == 1)),
        "W={world} T={tp} {mode:?}"
    );
    for peer in [false, true].into_iter().filter(|p| !p || peer_copyable) {
        check_rolls(
            &plan,
            &simulate(&plan, &state, peer),
            &reference,
            bucket_bytes,
        );
    }
    if mode == GatherMode::Packed && tp > 1 && world > 1 {
        assert!(plan.ranks.iter().flatten().any(|b| !b.unpacks.is_empty()));
    }
    if mode == GatherMode::AllGather && tp == 1 {
        return;
    }
    // Every rank receives exactly the remote bytes of the core plan.
    for r in 0..world {
        assert_eq!(
            plan.recv_bytes(r),
            2 * plan.core.ranks[r].remote_elements() as u64
        );
    }
}

fn check_rolls(
    plan: &FsdpPlan,
    rolls: &[Vec<bf16>],
    reference: &lifecycle_layout::HostRollout,
    bucket_bytes: u64,
) {
    let (world, tp) = (plan.core.world, plan.core.tp);
    for (r, rank) in reference.ranks.iter().enumerate() {
        assert_eq!(rank.tensors.len(), plan.roll_offsets[r].len(), "rank {r}");
        for (j, t) in rank.tensors.iter().enumerate() {
            let off = plan.roll_offsets[r][j] as usize;
            let got = &rolls[r][off..off + t.data.len()];
            assert!(
                got.iter()
                    .zip(&t.data)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "W={world} T={tp} budget={bucket_bytes}: rank {r} tensor {} differs",
                t.name
            );
        }
        // Staged sends never happen when the receiver needs the sender's own slice.
        if tp == 1 {
            assert_eq!(plan.slot_elems, 0, "T = 1 needs no staging");
        }
    }
}

#[test]
fn plan_matches_reference_for_every_w_t_and_budget() {
    for world in [1, 2, 3, 4] {
        for tp in (1..=world).filter(|t| world % t == 0) {
            // Tiny budgets force chunking of pieces and many buckets.
            for budget in [16, 40, 128, 1 << 20] {
                check(world, tp, budget, GatherMode::SendRecv);
                check(world, tp, budget, GatherMode::AllGather);
                check(world, tp, budget, GatherMode::Packed);
            }
        }
    }
}

#[test]
fn w2_t2_column_slices_move_nothing_and_row_slices_a_quarter() {
    let specs = vec![
        TensorSpec::new("up", [8, 6], Parallel::Column),
        TensorSpec::new("down", [6, 8], Parallel::Row),
    ];
    let train =
        FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone()))).expect("train");
    let layout = RolloutLayout::new(2, specs).expect("layout");
    let core = plan_fsdp_to_tp(&train, &layout).expect("plan");
    let plan = build_plan(core, &train, BucketConfig::default());
    // down: 48 elements; each rank receives a quarter (12 elements, 24 bytes) from its peer.
    assert_eq!(plan.recv_bytes(0), 24);
    assert_eq!(plan.recv_bytes(1), 24);
    let sl = ShardLayout::new(&train);
    assert_eq!(sl.slots[0].padded_rows, 4);
    assert!(plan.slot_elems > 0);
}

#[test]
fn first_buckets_ramp_up_to_the_budget() {
    use lifecycle_layout::fsdp::{bucket_budget, RAMP_MIN_BYTES};
    let mib = 1u64 << 20;
    assert_eq!(
        (0..5)
            .map(|k| bucket_budget(256 * mib, k) / mib)
            .collect::<Vec<_>>(),
        vec![32, 64, 128, 256, 256]
    );
    // Never below the minimum, never above the budget (small test budgets get no ramp).
    assert_eq!(bucket_budget(64 * mib, 0), RAMP_MIN_BYTES);
    assert_eq!(bucket_budget(mib, 0), mib);
    assert_eq!(bucket_budget(4096 * mib, 40), 4096 * mib);

    // Qwen-7B-like row-parallel tensors at T = 2: the first bucket stages one piece (a quarter of
    // a tensor, 33.9 MB: a piece under the full budget is never cut to fit a ramped one), later
    // buckets several, up to the budget.
    let specs: Vec<TensorSpec> = (0..8)
        .map(|i| TensorSpec::new(format!("l{i}.down"), [3584, 18944], Parallel::Row))
        .collect();
    let train =
        FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone()))).expect("train");
    let layout = RolloutLayout::new(2, specs).expect("layout");
    let core = plan_fsdp_to_tp(&train, &layout).expect("plan");
    let plan = build_plan(core, &train, BucketConfig::default());
    let staged: Vec<u64> = plan.ranks[0].iter().map(|b| b.staging_elems * 2).collect();
    assert!(staged.len() > 3, "{staged:?}");
    assert_eq!(staged[0], 1792 * 9472 * 2, "{staged:?}");
    assert!(staged.iter().all(|&b| b <= 256 * mib), "{staged:?}");
    assert!(staged[0] < staged[3], "{staged:?}");
}

/// The executor of step programs notices a missing dependency: dropping the wait before an
/// unpack (it then reads the receive slot before the network filled it) or before a pack that
/// reuses a slot (it overwrites data not yet sent) changes the rollout in some interleaving.
#[test]
fn a_program_missing_a_wait_is_caught() {
    use lifecycle_host::steps::run_programs;
    use lifecycle_layout::steps::{compile, CopyRole, Op, Stream};
    let (world, tp) = (2, 2);
    let specs = specs(tp);
    let state = host_state(world, &specs);
    let layout = RolloutLayout::new(tp, specs).expect("layout");
    let masters: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            let shards = ShardLayout::new(state.layout());
            let mut flat = vec![0.0; shards.rank_len as usize];
            for (i, slot) in shards.slots.iter().enumerate() {
                let shard = state.master_shard(r, i).expect("resident");
                flat[slot.offset as usize..slot.offset as usize + shard.len()]
                    .copy_from_slice(shard);
            }
            flat
        })
        .collect();
    let sources: Vec<Source<'_>> = masters.iter().map(|m| Source::F32(m)).collect();
    for (role, mode) in [
        ("unpack", GatherMode::Packed),
        ("pack", GatherMode::SendRecv),
    ] {
        let core = plan_fsdp_to_tp(state.layout(), &layout).expect("plan");
        let config = BucketConfig {
            bucket_bytes: 64,
            in_flight: 1,
            mode,
        };
        let plan = build_plan(core, state.layout(), config);
        let ranks: Vec<_> = (0..world)
            .map(|r| {
                let s = plan.rank_steps(r).expect("steps");
                let p = compile(&s).expect("program");
                (s, p)
            })
            .collect();
        let good = run_programs(&ranks, &sources, 0).expect("runs");
        let ops = ranks[0].1.ops();
        // The compute-stream wait right before the first unpack / the first slot-reusing pack.
        let target = (0..ops.len())
            .find(|&i| {
                let next = ops.get(i + 1);
                matches!(
                    ops[i],
                    Op::Wait {
                        stream: Stream::Compute,
                        ..
                    }
                ) && match role {
                    "unpack" => {
                        matches!(
                            next,
                            Some(Op::Copies {
                                role: CopyRole::Unpack(_),
                                ..
                            })
                        )
                    }
                    _ => matches!(
                        next,
                        Some(Op::Copies { role: CopyRole::Pack(k), .. }) if *k > 0
                    ),
                }
            })
            .unwrap_or_else(|| panic!("a wait before a {role}"));
        let mut broken = ranks.clone();
        broken[0].1 = ranks[0].1.without(|i, _| i != target);
        let caught = (0..64)
            .any(|seed| run_programs(&broken, &sources, seed).map_or(true, |out| out != good));
        assert!(caught, "dropping the wait before a {role} went unnoticed");
    }
}

/// A small Qwen3-MoE model (q/k norms, a dense layer and a layer of 4 experts with a router) with
/// its experts split by TP and partitioned over the ranks: the step programs against the
/// reference at W ≤ 4 (W = 3: uneven FSDP shards of every expert), every T, every gather mode.
#[test]
fn qwen3_moe_plans_match_reference_for_both_expert_placements() {
    use lifecycle_layout::{ExpertPlacement, ModelSpec};
    let m = ModelSpec {
        vocab: 40,
        moe: ModelSpec::tiny_moe()
            .moe
            .map(|e| lifecycle_layout::MoeSpec { ffn: 8, ..e }),
        ..ModelSpec::tiny_moe()
    };
    let experts = m.moe.map_or(0, |e| e.experts);
    for world in [1, 2, 3, 4] {
        // T dividing W and the model's heads (8) and experts (4)
        for tp in [1, 2, 4].into_iter().filter(|t| world % t == 0) {
            for placement in [
                ExpertPlacement::TensorParallel,
                ExpertPlacement::Partitioned,
            ] {
                let specs = RolloutLayout::from_hf_names(tp, m.hf_tensors())
                    .expect("layout")
                    .tensors()
                    .to_vec();
                let specs = placement.apply(specs, experts, tp).expect("placement");
                if placement == ExpertPlacement::Partitioned && tp > 1 {
                    assert!(specs
                        .iter()
                        .any(|s| matches!(s.parallel, Parallel::Owned { rank } if rank == tp - 1)));
                }
                for mode in [
                    GatherMode::SendRecv,
                    GatherMode::AllGather,
                    GatherMode::Packed,
                ] {
                    check_specs(specs.clone(), world, tp, 96, mode);
                }
            }
        }
    }
}

/// A rank's shards as separate allocations (PyTorch FSDP2's per-parameter shards), lent by
/// address: the steps rebased onto them (`FsdpPlan::rank_steps_at`) and run on the host step
/// runner with tensors in another order and gaps between them give the reference rollout bit for
/// bit; a shard shorter than the plan reads is refused by name.
#[test]
fn steps_rebased_onto_separate_shards_match_the_reference() {
    for (world, tp) in [(1, 1), (2, 1), (2, 2), (3, 1), (4, 2)] {
        let specs = specs(tp);
        let state = host_state(world, &specs);
        let layout = RolloutLayout::new(tp, specs.clone()).expect("layout");
        let core = plan_fsdp_to_tp(state.layout(), &layout).expect("plan");
        let plan = build_plan(core, state.layout(), BucketConfig::default());
        let reference = reference_rollout(&state, &layout).expect("reference");
        let n = plan.shards.slots.len();
        let mut sources = Vec::new();
        let mut steps = Vec::new();
        for r in 0..world {
            // tensors laid out last to first, 7 elements apart
            let mut at = vec![0u64; n];
            let mut next = 3u64;
            for i in (0..n).rev() {
                at[i] = next;
                next += state.master_shard(r, i).map_or(0, |s| s.len() as u64) + 7;
            }
            // the last tensor ends the buffer (its base is the first one's address)
            let mut buf = vec![f32::NAN; (next - 7) as usize];
            for i in 0..n {
                let shard = state.master_shard(r, i).expect("resident");
                buf[at[i] as usize..at[i] as usize + shard.len()].copy_from_slice(shard);
            }
            steps.push(plan.rank_steps_at(r, &at).expect("rebased steps"));
            sources.push(buf);
        }
        let srcs: Vec<Source<'_>> = sources.iter().map(|m| Source::F32(m)).collect();
        let got: Vec<Vec<bf16>> = run_steps(steps, &srcs, &[1, 2])
            .expect("the programs run")
            .into_iter()
            .map(|r| r.into_iter().map(bf16::from_bits).collect())
            .collect();
        let got = lifecycle_layout::HostRollout::from_rank_flats(
            &(0..world).map(|r| plan.entries(r)).collect::<Vec<_>>(),
            got,
        )
        .expect("rollout buffers");
        assert_eq!(reference.first_difference(&got), None, "W={world} T={tp}");
    }
    // a segment that does not hold the rows the plan reads
    let specs = specs(1);
    let state = host_state(1, &specs);
    let layout = RolloutLayout::new(1, specs).expect("layout");
    let core = plan_fsdp_to_tp(state.layout(), &layout).expect("plan");
    let plan = build_plan(core, state.layout(), BucketConfig::default());
    let mut steps = plan.rank_steps(0).expect("steps");
    let n = plan.shards.slots.len();
    let mut segments: Vec<(u64, u64)> = plan
        .shards
        .slots
        .iter()
        .map(|s| (s.offset, (s.padded_rows * s.cols) as u64))
        .collect();
    segments[0].1 -= 1;
    let e = steps
        .rebase_source(&segments, &vec![0; n])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside every segment"), "{e}");
}

/// A plan of some tensors (`build_plan_of`, what a frozen base's refresh runs: the adapters
/// alone) writes exactly those tensors' bytes, as the whole plan does, and no other byte of the
/// rollout buffers (they keep the executor's poison), at every W, T, budget and gather mode.
#[test]
fn a_plan_of_some_tensors_writes_those_and_nothing_else() {
    use lifecycle_host::steps::POISON;
    use lifecycle_layout::fsdp::build_plan_of;

    let kept = |name: &str| name.starts_with('q') || name.ends_with(".down") || name == "norm";
    for world in [1, 2, 4] {
        for tp in (1..=world).filter(|t| world % t == 0) {
            for (budget, mode) in [
                (16, GatherMode::SendRecv),
                (1 << 20, GatherMode::SendRecv),
                (40, GatherMode::AllGather),
                (40, GatherMode::Packed),
            ] {
                let specs = specs(tp);
                let state = host_state(world, &specs);
                let layout = RolloutLayout::new(tp, specs).expect("layout");
                let core = plan_fsdp_to_tp(state.layout(), &layout).expect("plan");
                let config = BucketConfig {
                    bucket_bytes: budget,
                    in_flight: 2,
                    mode,
                };
                let all = build_plan(core.clone(), state.layout(), config);
                let some = build_plan_of(core, state.layout(), config, &kept);
                assert_eq!(some.roll_offsets, all.roll_offsets);
                assert_eq!(some.roll_len, all.roll_len);
                let reference = reference_rollout(&state, &layout).expect("reference");
                let what = format!("W={world} T={tp} budget={budget} {mode:?}");
                let rolls = simulate(&some, &state, false);
                for (r, rank) in reference.ranks.iter().enumerate() {
                    // a tensor's place: from its offset to the next one's (an all-gather plan
                    // also writes the padding rows of its shards there)
                    let mut starts = some.roll_offsets[r].clone();
                    starts.sort_unstable();
                    let end_of = |off: u64| {
                        starts
                            .iter()
                            .find(|&&o| o > off)
                            .map_or(rolls[r].len(), |&o| o as usize)
                    };
                    let mut written = vec![false; rolls[r].len()];
                    for (j, t) in rank.tensors.iter().enumerate() {
                        let off = some.roll_offsets[r][j] as usize;
                        let got = &rolls[r][off..off + t.data.len()];
                        if kept(&t.name) {
                            written[off..end_of(off as u64)].fill(true);
                            let same = got
                                .iter()
                                .zip(&t.data)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{what}: rank {r}: kept tensor {} differs", t.name);
                        }
                    }
                    let stray = rolls[r]
                        .iter()
                        .zip(&written)
                        .position(|(v, &w)| !w && v.to_bits() != POISON);
                    assert_eq!(
                        stray, None,
                        "{what}: rank {r} wrote outside the kept tensors"
                    );
                }
                assert!(
                    some.cast_bytes(0) < all.cast_bytes(0),
                    "{what}: fewer bytes cast"
                );
            }
        }
    }
}
