//! Runs the executable plan on the CPU (a simulator of the GPU op lists) and checks the result is
//! bit-identical to the host backend's reference rollout. No GPU needed: runs in CI.

use half::bf16;
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::fsdp::{build_plan, BucketConfig, Buf, FsdpPlan, GatherMode, ShardLayout};
use lifecycle_layout::HostTensor;
use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};

fn specs(tp: usize) -> Vec<TensorSpec> {
    // Dims not divisible by W (3 rows, 7 rows, ...) but split dims divisible by T.
    vec![
        TensorSpec::new("embed", [7 * tp, 5], Parallel::Column),
        TensorSpec::new("q.weight", [4 * tp + 2 * tp + tp, 6], Parallel::Column),
        TensorSpec::new("q.bias", [7 * tp], Parallel::Column),
        TensorSpec::new("o.weight", [7, 4 * tp], Parallel::Row),
        TensorSpec::new("down.weight", [9, 6 * tp], Parallel::Row),
        TensorSpec::new("norm", [5], Parallel::Replicated),
        TensorSpec::new("conv", [3 * tp, 2, 3], Parallel::Column),
        TensorSpec::new("tiny", [1, 3], Parallel::Replicated),
    ]
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

/// Executes `plan` on flat host buffers, bucket by bucket, like the GPU does: sends matched with
/// receives as NCCL does, or, with `peer`, each send written straight to its place in the
/// receiver's rollout buffer ([`SendOp::dst_off`](lifecycle_layout::fsdp::SendOp)) with the
/// receives ignored, as peer copies do.
fn simulate(plan: &FsdpPlan, state: &HostTrainState, peer: bool) -> Vec<Vec<bf16>> {
    let world = plan.core.world;
    let shards = &plan.shards;
    let masters: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            let mut flat = vec![f32::NAN; shards.rank_len as usize];
            for (i, slot) in shards.slots.iter().enumerate() {
                let shard = state.master_shard(r, i).expect("resident");
                flat[slot.offset as usize..slot.offset as usize + shard.len()]
                    .copy_from_slice(shard);
            }
            flat
        })
        .collect();
    let mut rolls = vec![vec![bf16::from_bits(0x7FAA); plan.roll_len as usize]; world];
    for k in 0..plan.buckets() {
        let mut staging = vec![vec![bf16::from_bits(0x7FBB); plan.slot_elems as usize]; world];
        for r in 0..world {
            let b = &plan.ranks[r][k];
            assert!(b.staging_elems <= plan.slot_elems);
            for c in &b.casts {
                let reg = c.region;
                for row in 0..reg.rows {
                    for col in 0..reg.cols {
                        let v = masters[r][(c.src_off + row * reg.src_ld + col) as usize];
                        let d = (c.dst_off + row * reg.dst_ld + col) as usize;
                        match c.dst {
                            Buf::Rollout => rolls[r][d] = bf16::from_f32(v),
                            Buf::Staging => staging[r][d] = bf16::from_f32(v),
                        }
                    }
                }
            }
        }
        let mut recv_staging =
            vec![vec![bf16::from_bits(0x7FCC); plan.recv_slot_elems as usize]; world];
        // In-place all-gathers: every rank's part lands on every other rank.
        for g in &plan.ranks[0][k].gathers {
            for r in 1..world {
                assert_eq!(
                    plan.ranks[r][k].gathers.iter().find(|x| x.off == g.off),
                    Some(g)
                );
            }
            for src in 0..world {
                let at = (g.off + src as u64 * g.count) as usize;
                let part = rolls[src][at..at + g.count as usize].to_vec();
                for (dst, roll) in rolls.iter_mut().enumerate() {
                    if dst != src {
                        roll[at..at + g.count as usize].copy_from_slice(&part);
                    }
                }
            }
        }
        if peer {
            assert!(plan.peer_copyable());
            for src in 0..world {
                for snd in &plan.ranks[src][k].sends {
                    let (lo, n) = (snd.off as usize, snd.count as usize);
                    let data: Vec<bf16> = match snd.buf {
                        Buf::Rollout => rolls[src][lo..lo + n].to_vec(),
                        Buf::Staging => staging[src][lo..lo + n].to_vec(),
                    };
                    let at = snd.dst_off.expect("peer-copyable") as usize;
                    rolls[snd.peer][at..at + n].copy_from_slice(&data);
                }
            }
            continue;
        }
        // Match sends and receives per (src, dst) pair in order.
        for src in 0..world {
            for dst in 0..world {
                let sends: Vec<_> = plan.ranks[src][k]
                    .sends
                    .iter()
                    .filter(|s| s.peer == dst)
                    .collect();
                let recvs: Vec<_> = plan.ranks[dst][k]
                    .recvs
                    .iter()
                    .filter(|r| r.peer == src)
                    .collect();
                assert_eq!(sends.len(), recvs.len(), "bucket {k}: {src} -> {dst}");
                for (s, rv) in sends.iter().zip(&recvs) {
                    assert_eq!(s.count, rv.count);
                    if rv.into == Buf::Rollout {
                        assert_eq!(s.dst_off, Some(rv.off), "a send knows where it lands");
                    }
                    let data: Vec<bf16> = match s.buf {
                        Buf::Rollout => {
                            rolls[src][s.off as usize..(s.off + s.count) as usize].to_vec()
                        }
                        Buf::Staging => {
                            staging[src][s.off as usize..(s.off + s.count) as usize].to_vec()
                        }
                    };
                    match rv.into {
                        Buf::Rollout => rolls[dst][rv.off as usize..(rv.off + rv.count) as usize]
                            .copy_from_slice(&data),
                        Buf::Staging => recv_staging[dst]
                            [rv.off as usize..(rv.off + rv.count) as usize]
                            .copy_from_slice(&data),
                    }
                }
            }
        }
        for (r, roll) in rolls.iter_mut().enumerate() {
            let b = &plan.ranks[r][k];
            assert!(b.recv_staging_elems <= plan.recv_slot_elems);
            for u in &b.unpacks {
                let src = &recv_staging[r][u.src_off as usize..(u.src_off + u.count) as usize];
                roll[u.dst_off as usize..(u.dst_off + u.count) as usize].copy_from_slice(src);
            }
        }
    }
    rolls
}

fn check(world: usize, tp: usize, bucket_bytes: u64, mode: GatherMode) {
    let specs = specs(tp);
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
        for (j, t) in rank.tensors.iter().enumerate() {
            let off = plan.roll_offsets[j] as usize;
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
