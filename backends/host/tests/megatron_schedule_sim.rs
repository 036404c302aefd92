//! Per-rank schedules run on host buffers, message by message, against the reference rollout.

use std::ops::Range;

use half::bf16;
use lifecycle_host::megatron::{reference_rollout, MegatronTrainState};
use lifecycle_host::steps::{run_steps, Source};
use lifecycle_layout::megatron::schedule::*;
use lifecycle_layout::megatron::{
    plan_megatron_to_tp, BucketConfig, MegatronLayout, MegatronPlan, StepShape,
};
use lifecycle_layout::steps::RankSteps;
use lifecycle_layout::HostTensor;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};
use lifecycle_layout::{RolloutLayout, RolloutVocab};

fn apply(tiles: &[Tile], src: &[bf16], dst: &mut [bf16]) {
    for t in tiles {
        for r in 0..t.rows as usize {
            for c in 0..t.cols as usize {
                let s = t.src as usize + r * t.src_ld as usize + c;
                let d = t.dst as usize + r * t.dst_ld as usize + c;
                dst[d] = src[s];
            }
        }
    }
}

/// Rank `rank`'s parameters as Megatron-Core's DDP buffer holds them: the layout's parameters in
/// reverse order, each starting on a multiple of 64 elements, NaN between them. Returns the
/// buffer, each parameter's place in the layout's buffer and in this one.
fn ddp_order(
    layout: &MegatronLayout,
    rank: usize,
    params: &[u16],
) -> (Vec<u16>, Vec<(u64, u64)>, Vec<u64>) {
    let slots = layout.stage_slots(layout.coords(rank).pp);
    let mut at = vec![0u64; slots.len()];
    let mut end = 0usize;
    for (i, s) in slots.iter().enumerate().rev() {
        at[i] = end as u64;
        end = (end + s.numel()).div_ceil(64) * 64;
    }
    let mut buf = vec![0x7fc0u16; end];
    for (s, &a) in slots.iter().zip(&at) {
        let a = a as usize;
        buf[a..a + s.numel()].copy_from_slice(&params[s.offset..s.offset + s.numel()]);
    }
    // the source ends with its last parameter (as a lent one does)
    let last = slots
        .iter()
        .zip(&at)
        .map(|(s, &a)| a as usize + s.numel())
        .max();
    buf.truncate(last.unwrap_or(0));
    let segments = slots
        .iter()
        .map(|s| (s.offset as u64, s.numel() as u64))
        .collect();
    (buf, segments, at)
}

/// Runs every rank's schedule as steps through the CPU executor of step programs, under several
/// stream interleavings, with `in_flight` steps in flight. With `lent`, each rank's steps are
/// rebased onto its parameters laid out as Megatron-Core's DDP buffer holds them
/// ([`ddp_order`]), as a lent Megatron source is read.
fn simulate(
    plan: &MegatronPlan,
    state: &MegatronTrainState,
    opts: ScheduleOptions,
    in_flight: usize,
    (split_local_bulk, lent): (bool, bool),
) -> HostRollout {
    let world = plan.ranks.len();
    let (offsets, len) = rollout_offsets(plan);
    let mut params: Vec<Vec<u16>> = (0..world)
        .map(|r| {
            state
                .params(r)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect();
    let mut rebase = Vec::new();
    if lent {
        for (r, p) in params.iter_mut().enumerate() {
            let (buf, segments, at) = ddp_order(state.layout(), r, p);
            *p = buf;
            rebase.push((segments, at));
        }
    }
    let steps: Vec<RankSteps> = (0..world)
        .map(|r| {
            let s = build_rank(plan, &offsets, r, opts);
            if opts.peer_copy {
                assert!(s.steps.is_empty() && s.send_slot_elems + s.recv_slot_elems == 0);
            }
            let stage_len = state.layout().stage_len(state.layout().coords(r).pp);
            let mut steps = s
                .rank_steps(StepShape {
                    world,
                    source_elems: if lent { stage_len } else { params[r].len() } as u64,
                    rollout_elems: len as u64,
                    in_flight,
                    peer_copy: opts.peer_copy,
                    split_local_bulk,
                })
                .unwrap();
            if let Some((segments, at)) = rebase.get(r) {
                steps.rebase_source(segments, at).unwrap();
            }
            steps
        })
        .collect();
    let sources: Vec<Source<'_>> = params.iter().map(|p| Source::Bf16(p)).collect();
    let rolls = run_steps(steps, &sources, &[1, 2]).unwrap();
    HostRollout {
        ranks: rolls
            .into_iter()
            .map(|roll| RankRollout {
                tensors: plan
                    .tensors
                    .iter()
                    .zip(&offsets)
                    .map(|(t, &o)| RolloutTensor {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        data: roll[o..o + t.numel()]
                            .iter()
                            .map(|&b| bf16::from_bits(b))
                            .collect(),
                        fp8: None,
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn model(groups: usize, tied: bool) -> ModelSpec {
    ModelSpec {
        hidden: 8,
        heads: 8,
        query_groups: groups,
        head_dim: 2,
        ffn: 16,
        vocab: 37,
        layers: 4,
        qkv_bias: groups != 2,
        tied_embeddings: tied,
        make_vocab_size_divisible_by: 4,
        qk_norm: false,
        moe: None,
    }
}

fn tensors(m: &ModelSpec) -> Vec<HostTensor> {
    m.hf_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|e| ((i * 7919 + e * 104_729) % 65_521) as f32 * 1.37e-3 - 40.0)
                .collect();
            HostTensor::f32(name, shape, data)
        })
        .collect()
}

#[test]
fn simulated_schedules_match_the_reference() {
    let mut cases = 0;
    for (tp, pp, dp) in [
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
        (1, 1, 2),
        (2, 2, 1),
        (4, 1, 1),
        (1, 4, 1),
        (2, 1, 2),
        (2, 2, 2),
    ] {
        let world: usize = tp * pp * dp;
        for t in [1, 2, 4, 8]
            .into_iter()
            .filter(|t| world.is_multiple_of(*t))
        {
            for groups in [1, 2, 8] {
                for tied in [false, true] {
                    let m = model(groups, tied);
                    let layout = MegatronLayout::new(m, tp, pp, dp).unwrap();
                    let state = MegatronTrainState::from_hf(layout, tensors(&m)).unwrap();
                    let vocab = [
                        RolloutVocab::PadToMultipleOf(1),
                        RolloutVocab::PadToMultipleOf(5),
                    ][cases % 2];
                    let rollout = RolloutLayout::fused(t, vocab);
                    for (budget, opts) in [
                        (
                            6,
                            ScheduleOptions {
                                direct_min: usize::MAX,
                                memcpy_min: usize::MAX,
                                peer_copy: false,
                                peer_tile_max: 0,
                            },
                        ),
                        (
                            64,
                            ScheduleOptions {
                                direct_min: 0,
                                memcpy_min: 0,
                                peer_copy: false,
                                peer_tile_max: 0,
                            },
                        ),
                        (
                            64,
                            ScheduleOptions {
                                direct_min: 5,
                                memcpy_min: 20,
                                peer_copy: false,
                                peer_tile_max: 0,
                            },
                        ),
                        (1 << 20, ScheduleOptions::default()),
                        (
                            64,
                            ScheduleOptions {
                                direct_min: usize::MAX,
                                memcpy_min: 20,
                                peer_copy: true,
                                peer_tile_max: 0,
                            },
                        ),
                        (
                            64,
                            ScheduleOptions {
                                direct_min: usize::MAX,
                                memcpy_min: usize::MAX,
                                peer_copy: true,
                                peer_tile_max: 8,
                            },
                        ),
                        (
                            64,
                            ScheduleOptions {
                                direct_min: usize::MAX,
                                memcpy_min: usize::MAX,
                                peer_copy: true,
                                peer_tile_max: usize::MAX,
                            },
                        ),
                        (
                            1 << 20,
                            ScheduleOptions {
                                direct_min: 16,
                                memcpy_min: 1,
                                peer_copy: false,
                                peer_tile_max: 0,
                            },
                        ),
                    ] {
                        let plan = plan_megatron_to_tp(
                            state.layout(),
                            &rollout,
                            BucketConfig {
                                bucket_bytes: budget,
                            },
                        )
                        .unwrap();
                        let modes = (cases % 2 == 0, cases % 3 != 1);
                        let got = simulate(&plan, &state, opts, 1 + cases % 3, modes);
                        let want = reference_rollout(&state, &rollout).unwrap();
                        assert_eq!(
                            got.first_difference(&want),
                            None,
                            "TP {tp} PP {pp} DP {dp} T {t} groups {groups} tied {tied} budget {budget} {opts:?}"
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 200, "{cases}");
}

#[test]
fn byte_counts_match_the_plan_and_slots_the_budget() {
    let m = model(2, false);
    let layout = MegatronLayout::new(m, 2, 2, 1).unwrap();
    for t in [1, 2, 4] {
        let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(4));
        let budget = 100;
        let plan = plan_megatron_to_tp(
            &layout,
            &rollout,
            BucketConfig {
                bucket_bytes: budget,
            },
        )
        .unwrap();
        let (offsets, len) = rollout_offsets(&plan);
        assert_eq!(len, plan.tensors.iter().map(|t| t.numel()).sum::<usize>());
        let opts = ScheduleOptions {
            direct_min: 8,
            memcpy_min: 8,
            peer_copy: false,
            peer_tile_max: 0,
        };
        let scheds: Vec<RankSchedule> = (0..4)
            .map(|r| build_rank(&plan, &offsets, r, opts))
            .collect();
        let sent: usize = scheds.iter().map(|s| s.send_elems).sum();
        for (s, rp) in scheds.iter().zip(&plan.ranks) {
            assert_eq!((s.recv_elems * 2) as u64, rp.remote_bytes());
            assert_eq!((s.local_elems * 2) as u64, rp.local_bytes());
            // Every rollout element is copied, received or zeroed as padding.
            assert_eq!(s.local_elems + s.recv_elems + s.zero_elems(), len, "T {t}");
            assert!((s.recv_slot_elems * 2) as u64 <= budget);
            let (sent, got) = s.messages();
            assert!(sent + got > 0);
            let direct = |side: fn(&Step) -> &Vec<Message>| {
                s.steps
                    .iter()
                    .any(|st| side(st).iter().any(|m| matches!(m.place, Place::Buffer(_))))
            };
            let direct = direct(|st| &st.sends) && direct(|st| &st.recvs);
            assert!(direct, "T {t}: some runs travel without staging");
            assert!(s.steps.len() > 1, "T {t}: several steps");
            for st in &s.steps {
                // The pack and unpack tiles fill exactly the slot elements a step uses.
                assert_eq!(s.tile_elems(st.pack.clone()), st.send_slot, "T {t}");
                assert_eq!(s.tile_elems(st.unpack.clone()), st.recv_slot, "T {t}");
            }
            assert_eq!(s.tile_elems(s.tiles.len()..s.tiles.len() + 1), 0);
        }
        assert_eq!((sent * 2) as u64, plan.remote_bytes());
        // Vocabulary 37 padded to a multiple of 4 per rank: some rank zeroes padding rows.
        assert!(scheds.iter().any(|s| s.zero_elems() > 0), "T {t}");
    }
}

#[test]
fn tiles_cover_large_runs_exactly() {
    for run in [
        Run {
            src: 3,
            src_ld: TILE_ELEMS * 2 + 5,
            dst: 1,
            dst_ld: TILE_ELEMS * 2 + 9,
            rows: 3,
            cols: TILE_ELEMS * 2 + 3,
        },
        Run {
            src: 0,
            src_ld: 40,
            dst: 8,
            dst_ld: 24,
            rows: 20_000,
            cols: 24,
        },
        Run {
            src: 16,
            src_ld: 1,
            dst: 0,
            dst_ld: 1,
            rows: 1,
            cols: 3 * TILE_ELEMS + 1,
        },
    ] {
        let mut tiles = Vec::new();
        push_tiles(&run, &mut tiles);
        assert!(tiles.iter().all(|t| t.numel() <= TILE_ELEMS));
        let src_len = run.src + (run.rows - 1) * run.src_ld + run.cols;
        let dst_len = run.dst + (run.rows - 1) * run.dst_ld + run.cols;
        let src: Vec<bf16> = (0..src_len)
            .map(|i| bf16::from_bits(i as u16 | 1))
            .collect();
        let mut got = vec![bf16::ZERO; dst_len];
        apply(&tiles, &src, &mut got);
        let mut want = vec![bf16::ZERO; dst_len];
        apply(
            &[Tile {
                src: run.src as u64,
                dst: run.dst as u64,
                src_ld: run.src_ld as u64,
                dst_ld: run.dst_ld as u64,
                rows: run.rows as u32,
                cols: run.cols as u32,
            }],
            &src,
            &mut want,
        );
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        assert!(bits(&got) == bits(&want));
    }
}

#[test]
fn runs_merge_when_they_continue() {
    let mut runs = Vec::new();
    let r = |src, dst, rows, cols, ld| Run {
        src,
        src_ld: ld,
        dst,
        dst_ld: ld,
        rows,
        cols,
    };
    push_run(&mut runs, r(0, 100, 2, 4, 4), &[]); // dense: one row of 8
    push_run(&mut runs, r(8, 108, 1, 5, 5), &[]);
    assert_eq!(runs, vec![r(0, 100, 1, 13, 13)]);
    push_run(&mut runs, r(50, 200, 2, 3, 6), &[]); // strided
    push_run(&mut runs, r(62, 212, 2, 3, 6), &[]); // continues its rows
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1].rows, 4);
    push_run(&mut runs, r(0, 0, 0, 3, 3), &[]); // empty: ignored
    assert_eq!(runs.len(), 2);
    // the same runs never merge across the start of a parameter (element 8, and 62)
    let mut apart = Vec::new();
    let starts = [0, 8, 50, 62];
    push_run(&mut apart, r(0, 100, 2, 4, 4), &starts);
    push_run(&mut apart, r(8, 108, 1, 5, 5), &starts);
    push_run(&mut apart, r(50, 200, 2, 3, 6), &starts);
    push_run(&mut apart, r(62, 212, 2, 3, 6), &starts);
    assert_eq!(apart.len(), 4);
}

#[test]
fn local_chunks_partition_the_local_tiles() {
    let m = model(2, false);
    let layout = MegatronLayout::new(m, 1, 1, 1).unwrap();
    let rollout = RolloutLayout::fused(1, RolloutVocab::PadToMultipleOf(1));
    let plan = plan_megatron_to_tp(&layout, &rollout, BucketConfig::default()).unwrap();
    let (offsets, _) = rollout_offsets(&plan);
    let s = build_rank(
        &plan,
        &offsets,
        0,
        ScheduleOptions {
            direct_min: 0,
            memcpy_min: 100,
            peer_copy: false,
            peer_tile_max: 0,
        },
    );
    assert!(!s.local_bulk.is_empty() && !s.local.is_empty());
    for n in [1, 2, 3, 7, 1000] {
        let chunks = s.local_chunks(n);
        assert_eq!(chunks.len(), n);
        let elems: usize = chunks.iter().map(|c| s.chunk_elems(c)).sum();
        assert_eq!(
            elems, s.local_elems,
            "n = {n}: chunks copy every local element"
        );
        let tiles: Vec<Range<usize>> = chunks.iter().map(|c| c.0.clone()).collect();
        let bulk: Vec<Range<usize>> = chunks.iter().map(|c| c.1.clone()).collect();
        for (parts, whole) in [(tiles, s.local.clone()), (bulk, 0..s.local_bulk.len())] {
            let mut at = whole.start;
            for p in parts.iter().filter(|p| !p.is_empty()) {
                assert_eq!(p.start, at);
                at = p.end;
            }
            assert_eq!(at, whole.end, "n = {n}");
        }
    }
}
