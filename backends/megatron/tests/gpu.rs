//! GPU tests of the Megatron executor: run on a machine with NVIDIA GPUs with
//! `cargo test --release -p lifecycle-megatron --test gpu -- --ignored --test-threads=1`
//! (on the project's test machine also `export NCCL_NVLS_ENABLE=0`), or `scripts/gpu-suite.sh`.
//! In CI (no GPU) they are reported as ignored, not passed. A test that needs more GPUs than the
//! machine shows fails saying so ([`require_gpus`]).
//!
//! - 1 GPU: W = 1 (TP = PP = DP = 1); W = 2, 3, 4 ranks sharing GPU 0 in every TP/PP/DP layout
//!   the models allow (peer copies between ranks of one GPU, no NCCL), bit for bit against the
//!   CPU executor; mixture-of-experts models in Megatron-Core's expert layouts (EP × ETP, both
//!   rollout expert placements) at W = 1 and on ranks sharing GPU 0; the refusal of NCCL on
//!   such a pool.
//! - 2 GPUs: W = 2 with NCCL steps and peer copies over the link; four ranks on two GPUs.

#[path = "../../host/tests/common/megatron.rs"]
mod common;

use std::sync::Arc;

use lifecycle_core::{
    Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, LifecycleConfig, LifecycleError, Link,
    MemoryPolicy, Mode, Phase, Reshard, Span, Switching, Trace,
};
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{CudaError, ThreadRankPool};
use lifecycle_host::megatron::{reference_rollout, MegatronHostBackend, MegatronTrainState};
use lifecycle_layout::megatron::{plan_megatron_to_tp, BucketConfig, MegatronLayout};
use lifecycle_layout::AdamParams;
use lifecycle_layout::HostRollout;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{ExpertPlacement, LayerSet, MoeSpec, RolloutLayout, RolloutVocab};
use lifecycle_megatron::{
    GpuConfig, MegatronGpuBackend, MegatronGpuError, MegatronGpuPlan, MegatronGpuState, Transport,
};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Tiny models (odd vocabulary, odd layer count, 1 or 2 query groups, tied and untied) and one
/// with tensors larger than a copy tile and widths that allow 16-byte copies.
fn models() -> Vec<(&'static str, ModelSpec)> {
    let mut tiny = common::model(2, false);
    tiny.layers = 3;
    let mut tied = common::model(1, true);
    tied.qkv_bias = false;
    let medium = ModelSpec {
        hidden: 256,
        heads: 8,
        query_groups: 4,
        head_dim: 32,
        ffn: 1024,
        vocab: 3001,
        layers: 3,
        qkv_bias: true,
        tied_embeddings: false,
        make_vocab_size_divisible_by: 64,
        qk_norm: false,
        moe: None,
    };
    vec![("tiny", tiny), ("tied", tied), ("medium", medium)]
}

/// The CPU executor's rollout through a lifecycle.
fn via_host(state: &MegatronTrainState, rollout: RolloutLayout, bucket: u64) -> HostRollout {
    let backend = MegatronHostBackend::new(rollout)
        .with_config(BucketConfig {
            bucket_bytes: bucket,
        })
        .unwrap();
    let mut lc = Lifecycle::new(backend, state.clone());
    let session = lc.rollout().unwrap();

    session.weights().get().clone()
}

struct Case {
    model: ModelSpec,
    tp: usize,
    pp: usize,
    dp: usize,
    /// Expert parallelism and expert TP (mixture-of-experts models; 1 and TP otherwise).
    ep: usize,
    etp: usize,
    /// How the rollout places the experts.
    experts: ExpertPlacement,
    t: usize,
    vocab: RolloutVocab,
    config: GpuConfig,
    memory: MemoryPolicy,
    cycles: usize,
}

/// Enter `cycles` times: every rollout bit-identical to `reference_rollout` and to the CPU
/// executor; after every exit the training state bit-identical to the start; metrics as planned;
/// the last cycle traced, with the device spans its schedules call for. Returns whether the plan
/// used peer copies.
fn check(
    pool: &Arc<ThreadRankPool>,
    name: &str,
    c: &Case,
) -> Result<bool, Box<dyn std::error::Error>> {
    let layout = MegatronLayout::new_moe(c.model, c.tp, c.pp, c.dp, c.ep, c.etp)?;
    let host = MegatronTrainState::from_hf(layout, common::hf_tensors(&c.model, 5))?;
    let rollout = RolloutLayout::fused(c.t, c.vocab).with_expert_placement(c.experts);
    let reference = reference_rollout(&host, &rollout)?;
    let cpu = via_host(&host, rollout.clone(), c.config.bucket_bytes);
    let case = format!(
        "{name} TP{} PP{} DP{} EP{} ETP{} -> T{} experts {} {:?} {:?} bucket {} x{} {:?}",
        c.tp,
        c.pp,
        c.dp,
        c.ep,
        c.etp,
        c.t,
        c.experts.name(),
        c.vocab,
        c.config.transport,
        c.config.bucket_bytes,
        c.config.in_flight,
        c.memory
    );
    assert_eq!(
        cpu.first_difference(&reference),
        None,
        "{case}: CPU executor"
    );
    let backend = MegatronGpuBackend::new(pool.clone(), rollout.clone())?.with_config(c.config)?;
    let state = backend.state_from_host(&host)?;
    let start = backend.download_state(&state)?.snapshot();
    assert!(start == host.snapshot(), "{case}: upload is not bit-exact");
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory: c.memory,
        },
    )?;
    for cycle in 0..c.cycles {
        if cycle + 1 == c.cycles {
            lc.enable_trace();
        }
        let session = lc.rollout()?;
        let got = session.backend().download_rollout(&session.weights())?;
        assert_eq!(
            got.first_difference(&reference),
            None,
            "{case} cycle {cycle}"
        );
        drop(session);
        lc.train()?;
        let now = lc.backend().download_state(lc.peek_state())?.snapshot();
        assert!(now == start, "{case} cycle {cycle}: training state changed");
    }
    let plan = plan_megatron_to_tp(
        lc.peek_state().layout(),
        &rollout,
        BucketConfig {
            bucket_bytes: c.config.bucket_bytes,
        },
    )?;
    let gpu_plan = lc.backend().plan(lc.peek_state())?;
    check_device_spans(lc.trace(), &gpu_plan, lc.peek_state(), c.memory, &case);
    let m = lc.metrics();
    let n = c.cycles as u64;
    let tr = m.phase(Phase::Transfer);
    assert_eq!(tr.bytes.device_to_device, n * plan.remote_bytes(), "{case}");
    assert_eq!(tr.bytes.local, n * plan.local_bytes(), "{case}");
    let off = m.phase(Phase::Offload).bytes.device_to_host;
    let back = m.phase(Phase::Reload).bytes.host_to_device;
    assert_eq!(off, back, "{case}: offloaded and reloaded bytes");
    assert_eq!(
        off > 0,
        c.memory.offload_params || c.memory.offload_optimizer,
        "{case}"
    );
    Ok(gpu_plan.peer_copy())
}

/// The host span of `phase` (the lifecycle's row; at most one): start and end in microseconds.
fn host_span(spans: &[Span], phase: Phase, case: &str) -> Option<(f64, f64)> {
    let host: Vec<&Span> = spans
        .iter()
        .filter(|s| s.rank.is_none() && s.phase == phase)
        .collect();
    assert!(
        host.len() <= 1,
        "{case}: one {phase:?} phase traced: {host:#?}"
    );
    host.first()
        .map(|h| (h.start_us, h.start_us + h.duration_us))
}

/// One traced enter (or refresh) and, if traced, exit has, on every rank, the device spans its schedule calls for: local
/// copies and padding zeroes on the auxiliary stream (the local bytes), packs and unpacks on the
/// compute stream (the slot bytes), one grouped send/receive per network step on the NCCL stream
/// (the received bytes; so NCCL spans on every rank of a W > 1 plan that moves bytes between
/// ranks), offload and reload copies on the copy stream when offloading (the offloaded bytes).
/// Every transfer span lies inside the host span of the transfer phase, offload copies between
/// its start and the end of the offload phase, reload copies inside the reload phase (1 ms
/// slack: the device clock is placed on the host's by one event).
fn check_device_spans(
    trace: &Trace,
    plan: &MegatronGpuPlan,
    state: &MegatronGpuState,
    memory: MemoryPolicy,
    case: &str,
) {
    let spans = trace.spans();
    let missing = |phase: Phase| format!("{case}: no {phase:?} phase traced: {spans:#?}");
    let transfer = host_span(spans, Phase::Transfer, case).unwrap_or_else(|| {
        panic!("{}", missing(Phase::Transfer));
    });
    let offload = host_span(spans, Phase::Offload, case).unwrap_or_else(|| {
        panic!("{}", missing(Phase::Offload));
    });
    let reload = host_span(spans, Phase::Reload, case);
    let slack = 1e3;
    let world = plan.plan().ranks.len();
    for rank in 0..world {
        let s = plan
            .schedule(rank)
            .expect("every rank is local in these tests");
        let mine: Vec<&Span> = spans.iter().filter(|x| x.rank == Some(rank)).collect();
        let on = |track: &str, phase: Phase| -> Vec<&Span> {
            mine.iter()
                .copied()
                .filter(|x| x.track == track && x.phase == phase)
                .collect()
        };
        let bytes = |v: &[&Span]| v.iter().map(|x| x.bytes).sum::<u64>();
        let what = format!("{case}: rank {rank}");
        // Local work: on the auxiliary stream, the driver's bulk copies possibly on compute.
        let is_local = |x: &&Span| x.name.starts_with("local copies") || x.name == "zero padding";
        let aux = on("aux", Phase::Transfer);
        assert!(aux.iter().all(is_local), "{what}: aux spans {aux:#?}");
        let local: Vec<&Span> = mine
            .iter()
            .copied()
            .filter(|x| x.phase == Phase::Transfer && is_local(x))
            .collect();
        assert_eq!(
            bytes(&local),
            ((s.local_elems + s.zero_elems()) * 2) as u64,
            "{what}: local spans {local:#?}"
        );
        if s.local_elems > 0 {
            assert!(
                local.iter().any(|x| x.duration_us > 0.0),
                "{what}: no local-copy span"
            );
        }
        // One NCCL group per step.
        let nccl = on("nccl", Phase::Transfer);
        assert_eq!(nccl.len(), s.steps.len(), "{what}: NCCL spans {nccl:#?}");
        let pushed: usize = s.pushes.iter().map(|p| p.run.numel()).sum();
        let (received, sent) = if plan.peer_copy() {
            (0, pushed * 2)
        } else {
            (s.recv_elems * 2, 0)
        };
        assert_eq!(bytes(&nccl), received as u64, "{what}");
        assert!(nccl.iter().all(|x| x.link == Some(Link::DeviceToDevice)));
        if world > 1 && plan.plan().remote_bytes() > 0 && !plan.peer_copy() {
            assert!(
                nccl.iter().any(|x| x.duration_us > 0.0),
                "{what}: no NCCL span on W = {world}"
            );
        }
        // Peer copies: one span per destination, the bytes this rank sends.
        let peer = on("peer", Phase::Transfer);
        let mut dests: Vec<usize> = s.pushes.iter().map(|p| p.peer).collect();
        dests.dedup();
        assert_eq!(peer.len(), dests.len(), "{what}: peer spans {peer:#?}");
        assert_eq!(bytes(&peer), sent as u64, "{what}");
        assert!(peer.iter().all(|x| x.link == Some(Link::DeviceToDevice)));
        if plan.peer_copy() {
            assert!(s.steps.is_empty(), "{what}: NCCL steps with peer copies");
            if pushed > 0 {
                assert!(
                    peer.iter().any(|x| x.duration_us > 0.0),
                    "{what}: no peer-copy span though it sends"
                );
            }
        } else {
            assert!(s.pushes.is_empty(), "{what}: peer copies with NCCL steps");
        }
        // Packs and unpacks, or the tile launches writing small runs into peers.
        let compute: Vec<&Span> = on("compute", Phase::Transfer)
            .into_iter()
            .filter(|x| !is_local(x))
            .collect();
        let staged: usize = s
            .steps
            .iter()
            .map(|st| st.send_slot + st.recv_slot)
            .sum::<usize>()
            + s.peer_tiles
                .iter()
                .map(|(_, r)| s.tile_elems(r.clone()))
                .sum::<usize>();
        assert_eq!(
            pushed + staged,
            if plan.peer_copy() {
                s.send_elems
            } else {
                staged
            },
            "{what}: every element sent is pushed or tiled"
        );
        let launches = s.peer_tiles.len()
            + s.steps
                .iter()
                .map(|st| usize::from(!st.pack.is_empty()) + usize::from(!st.unpack.is_empty()))
                .sum::<usize>();
        assert_eq!(
            compute.len(),
            launches,
            "{what}: compute spans {compute:#?}"
        );
        assert_eq!(bytes(&compute), (staged * 2) as u64, "{what}");
        // Offload and reload copies.
        let (params, optimizer) = state.offload_bytes(rank).unwrap_or((0, 0));
        let expected = u64::from(memory.offload_params) * params
            + u64::from(memory.offload_optimizer) * optimizer;
        let buffers =
            2 * (usize::from(memory.offload_params) + usize::from(memory.offload_optimizer));
        let off = on("copy", Phase::Offload);
        let back = on("copy", Phase::Reload);
        // Reload copies only when an exit was traced.
        let (reloads, reloaded) = match reload {
            Some(_) => (buffers, expected),
            None => (0, 0),
        };
        assert_eq!(off.len(), buffers, "{what}: offload spans {off:#?}");
        assert_eq!(back.len(), reloads, "{what}: reload spans {back:#?}");
        assert_eq!(bytes(&off), expected, "{what}");
        assert_eq!(bytes(&back), reloaded, "{what}");
        assert!(off.iter().all(|x| x.link == Some(Link::DeviceToHost)));
        assert!(back.iter().all(|x| x.link == Some(Link::HostToDevice)));
        if buffers > 0 {
            assert!(
                off.iter().any(|x| x.duration_us > 0.0),
                "{what}: no offload span"
            );
            assert!(
                back.iter().any(|x| x.duration_us > 0.0),
                "{what}: no reload span"
            );
        }
        // Every span of this rank is one of the above, inside its phase.
        assert_eq!(
            mine.len(),
            local.len() + nccl.len() + peer.len() + compute.len() + off.len() + back.len(),
            "{what}: unexpected spans {mine:#?}"
        );
        for x in &mine {
            let (lo, hi) = match (x.phase, reload) {
                (Phase::Transfer, _) => transfer,
                (Phase::Offload, _) => (transfer.0, offload.1),
                (_, Some(r)) => r,
                (_, None) => panic!("{what}: {} outside any traced phase", x.name),
            };
            assert!(
                x.duration_us >= 0.0
                    && x.start_us >= lo - slack
                    && x.start_us + x.duration_us <= hi + slack,
                "{what}: {} ({:?}, {}) at {}+{} us outside {lo}..{hi}",
                x.name,
                x.phase,
                x.track,
                x.start_us,
                x.duration_us
            );
        }
    }
}

fn matrix(world: usize, layouts: &[(usize, usize, usize)]) -> Res {
    let pool = Arc::new(ThreadRankPool::new(world)?);
    let mut n = 0;
    for (name, model) in models() {
        for &(tp, pp, dp) in layouts {
            for t in [1, 2].into_iter().filter(|t| world.is_multiple_of(*t)) {
                let small = if name == "medium" { 256 << 10 } else { 64 };
                // NCCL steps with a tiny and a large budget, then peer copies.
                for (k, bucket) in [small, 256 << 20, 256 << 20].into_iter().enumerate() {
                    let transport = if k == 2 {
                        Transport::PeerCopy
                    } else {
                        Transport::Nccl
                    };
                    let vocab = [
                        RolloutVocab::PadToMultipleOf(1),
                        RolloutVocab::PadToMultipleOf(7),
                    ][(n + k) % 2];
                    let memory = if (n + k).is_multiple_of(2) {
                        MemoryPolicy::default()
                    } else {
                        MemoryPolicy::resident()
                    };
                    let case = Case {
                        model,
                        tp,
                        pp,
                        dp,
                        ep: 1,
                        etp: tp,
                        experts: ExpertPlacement::TensorParallel,
                        t,
                        vocab,
                        config: GpuConfig {
                            transport,
                            bucket_bytes: bucket,
                            in_flight: 1 + (n + k) % 3,
                            // Every remote run its own message / everything packed / a mix.
                            direct_min_bytes: [0, u64::MAX, 16][(n + 2 * k) % 3],
                            memcpy_min_bytes: [0, u64::MAX, 64][(n + k) % 3],
                            // Copy engines only / tiles below 64 B / tiles only.
                            peer_tile_max_bytes: [0, 64, u64::MAX][n % 3],
                            split_local_bulk: (n + k).is_multiple_of(2),
                            overlap_blocks_per_sm: [1, 8, 2][(n + k) % 3],
                        },
                        memory,
                        cycles: 2,
                    };
                    check(&pool, name, &case)?;
                }
                n += 1;
            }
        }
    }
    eprintln!("{n} layout cases checked on W = {world}");
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w1() -> Res {
    require_gpus(1)?;
    matrix(1, &[(1, 1, 1)])
}

/// Needs 2 GPUs: NCCL steps (packed and direct messages) and peer copies over the link, which
/// ranks on one GPU do not have.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w2() -> Res {
    require_gpus(2)?;
    matrix(2, &[(2, 1, 1), (1, 2, 1), (1, 1, 2)])
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn offload_reload_round_trip_and_refresh() -> Res {
    // W = 2 where the machine has 2 GPUs, W = 1 on one.
    let world = require_gpus(1)?.min(2);
    let pool = Arc::new(ThreadRankPool::new(world)?);
    let model = models()[2].1;
    let layout = MegatronLayout::from_world(model, world, 1, world)?;
    let rollout = RolloutLayout::fused(world, RolloutVocab::PadToMultipleOf(1));
    // Synthetic state made on the devices: its rollout matches the reference built from its
    // own download, and 10 offload/reload cycles give it back bit for bit.
    let backend =
        MegatronGpuBackend::new(pool.clone(), rollout.clone())?.with_config(GpuConfig {
            bucket_bytes: 64 << 10,
            ..GpuConfig::default()
        })?;
    let state = backend.synthetic_state(layout.clone(), 99, 0.05)?;
    let start = backend.download_state(&state)?;
    // Adam m of rank 0 is non-zero, so the round trip checks real bits.
    assert!(start.snapshot()[3].iter().any(|&x| x != 0));
    let reference = reference_rollout(&start, &rollout)?;
    let reserved = backend.reserve_pinned(&state, MemoryPolicy::default())?;
    assert!(reserved > 0);
    let mut lc = Lifecycle::new(backend, state); // offloads params and optimizer state
    for cycle in 0..10 {
        let s = lc.rollout()?;
        if cycle % 3 == 0 {
            let got = s.backend().download_rollout(&s.weights())?;
            assert_eq!(got.first_difference(&reference), None, "cycle {cycle}");
        }
        drop(s);
        if cycle % 3 == 1 {
            // Still in rollout mode (lazy): the copy comes from pinned memory, the same bits.
            let off = lc.backend().download_state(lc.peek_state())?;
            assert!(off.is_offloaded() && lc.mode() == Mode::Rollout);
            assert!(weight_bits(&off) == weight_bits(&start), "cycle {cycle}");
        }
        let t = lc.train()?;
        assert!(!t.state().is_offloaded() && t.state().has_grads());
    }
    assert_eq!((lc.metrics().enters, lc.metrics().exits), (10, 10));
    let after = lc.backend().download_state(lc.peek_state())?;
    assert!(
        after.snapshot() == start.snapshot(),
        "state changed over 10 cycles"
    );
    // Every switch reused the reserved pinned chunks and gave them back.
    let pinned = lc.backend().pinned_pool();
    let cached: u64 = (0..world).map(|r| pinned.cached_bytes(r)).sum();
    assert_eq!(cached, reserved);

    // Keep-resident policy: training replaces the state (one Adam step on the CPU, uploaded),
    // the next rollout refreshes the resident weights in place.
    let (backend, _) = lc.into_parts()?;
    let host_layout = MegatronLayout::from_world(model, world, 1, world)?;
    let mut host = MegatronTrainState::from_hf(host_layout, common::hf_tensors(&model, 3))?;
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory: MemoryPolicy {
                offload_params: false,
                offload_optimizer: false,
                keep_rollout_resident: true,
            },
        },
    )?;
    let first = {
        let s = lc.rollout()?;
        s.backend().download_rollout(&s.weights())?
    };
    assert_eq!(
        first.first_difference(&reference_rollout(&host, &rollout)?),
        None
    );
    host.set_grads_from_hf(common::hf_tensors(&model, 4))?;
    host.adam_step(AdamParams::default())?;
    {
        let mut tr = lc.train()?;
        let (b, s) = tr.backend_and_state_mut();
        *s = b.state_from_host(&host)?;
    }
    lc.enable_trace();
    let second = {
        let s = lc.rollout()?;
        s.backend().download_rollout(&s.weights())?
    };
    assert_eq!(lc.metrics().refreshes, 1);
    // The refresh is traced like an enter (nothing offloaded, no exit).
    let gpu_plan = lc.backend().plan(lc.peek_state())?;
    let memory = lc.config().memory;
    check_device_spans(lc.trace(), &gpu_plan, lc.peek_state(), memory, "refresh");
    assert_eq!(
        second.first_difference(&reference_rollout(&host, &rollout)?),
        None
    );
    assert!(
        second.first_difference(&first).is_some(),
        "the step changed nothing"
    );
    Ok(())
}

/// Params, main params, Adam m and v of every rank (grads left out), bit for bit.
fn weight_bits(state: &MegatronTrainState) -> Vec<Vec<u32>> {
    state
        .snapshot()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 5 != 1)
        .map(|(_, b)| b)
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_are_typed_and_leave_the_state_intact() -> Res {
    let n = require_gpus(1)?;
    match ThreadRankPool::new(n + 1) {
        Err(CudaError::TooFewGpus {
            requested,
            available,
        }) => assert_eq!((requested, available), (n + 1, n)),
        other => panic!("expected TooFewGpus, got {other:?}"),
    }
    let world = n.min(2);
    let pool = Arc::new(ThreadRankPool::new(world)?);
    let model = models()[0].1;
    // A host state of another W: typed error before anything is uploaded.
    let other = MegatronLayout::new(model, 1, 1, world + 1)?;
    let host_other = MegatronTrainState::from_hf(other, common::hf_tensors(&model, 1))?;
    let ok_rollout = RolloutLayout::fused(1, RolloutVocab::PadToMultipleOf(1));
    let b = MegatronGpuBackend::new(pool.clone(), ok_rollout.clone())?;
    assert!(matches!(
        b.state_from_host(&host_other),
        Err(MegatronGpuError::WorldMismatch { .. })
    ));
    let wrong_w = MegatronLayout::new(model, 1, 1, world + 1)?;
    assert!(matches!(
        b.synthetic_state(wrong_w, 1, 0.1),
        Err(MegatronGpuError::WorldMismatch { .. })
    ));
    // A rollout degree that does not divide W: the plan fails, nothing moves, state intact.
    let layout = MegatronLayout::from_world(model, world, 1, 1)?;
    let host = MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 2))?;
    let bad = MegatronGpuBackend::new(
        pool.clone(),
        RolloutLayout::fused(world + 1, RolloutVocab::PadToMultipleOf(1)),
    )?;
    let state = bad.state_from_host(&host)?;
    let mut lc = Lifecycle::new(bad, state);
    match lc.rollout() {
        Err(LifecycleError::Plan(MegatronGpuError::Layout(e))) => {
            assert!(e.to_string().contains("does not divide"), "{e}")
        }
        Err(e) => panic!("expected a layout error, got {e:?}"),
        Ok(_) => panic!("expected a layout error"),
    }
    let now = lc.backend().download_state(lc.peek_state())?;
    assert!(now.snapshot() == host.snapshot());
    // Faults in every phase of a switch: the lifecycle restores the state bit for bit.
    let (_, state) = lc.into_parts()?;
    let (faulty, faults) =
        FaultInjector::new(MegatronGpuBackend::new(pool.clone(), ok_rollout.clone())?);
    let mut lc = Lifecycle::new(faulty, state); // offloads params and optimizer state
    let reference = reference_rollout(&host, &ok_rollout)?;
    // Every phase x {start, end} x {error, panic}.
    let mut cases = Vec::new();
    for phase in [
        Phase::Plan,
        Phase::Transfer,
        Phase::Offload,
        Phase::Release,
        Phase::Reload,
    ] {
        for at in [FaultAt::Start, FaultAt::End] {
            for kind in [FaultKind::Error, FaultKind::Panic] {
                cases.push((phase, at, kind));
            }
        }
    }
    for (phase, at, kind) in cases {
        faults.inject(Fault::new(phase, at, kind));
        let entered = lc.rollout().map(|s| {
            s.backend()
                .inner()
                .download_rollout(&s.weights())
                .map(|r| r.first_difference(&reference))
        });
        match entered {
            Ok(diff) => assert_eq!(diff?, None),
            Err(e) => assert!(e.to_string().contains("injected"), "{e}"),
        }
        let _ = lc.train(); // an exit fault leaves it faulted: retried below
        lc.train()?;
        assert_eq!(lc.mode(), Mode::Train);
        let now = lc.backend().inner().download_state(lc.peek_state())?;
        assert!(
            now.snapshot() == host.snapshot(),
            "{phase:?} {at:?} {kind:?}: state changed"
        );
    }
    assert_eq!(faults.pending(), 0, "every fault fired");
    // An impossible allocation: a typed OOM error, not a panic.
    let mut huge = model;
    huge.hidden = 1 << 16;
    huge.ffn = 1 << 20;
    huge.heads = 8;
    huge.head_dim = 1 << 13;
    let huge = MegatronLayout::from_world(huge, world, world, 1)?;
    match MegatronGpuBackend::new(pool, ok_rollout)?.synthetic_state(huge, 1, 0.1) {
        Err(MegatronGpuError::Cuda(e)) => assert!(e.is_oom(), "{e:?}"),
        other => panic!("expected out of memory, got {other:?}"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Several ranks on one GPU: the multi-rank logic of the plans without a second GPU
// ---------------------------------------------------------------------------------------------

/// One layout case of the shared-GPU matrix: model, TP, PP, DP (W = TP · PP · DP) and rollout T.
type Layout = (&'static str, ModelSpec, usize, usize, usize, usize);

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// For W = 2, 3, 4: every TP · PP · DP = W layout of every model of [`models`] and every rollout
/// degree T dividing W that the model allows (heads, query groups and layers must split).
fn shared_layouts() -> Vec<Layout> {
    let mut out = Vec::new();
    for (name, model) in models() {
        for world in 2..=4 {
            for tp in divisors(world) {
                for pp in divisors(world / tp) {
                    let dp = world / tp / pp;
                    let Ok(layout) = MegatronLayout::new(model, tp, pp, dp) else {
                        continue;
                    };
                    for t in divisors(world) {
                        let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(1));
                        let bucket = BucketConfig {
                            bucket_bytes: 256 << 20,
                        };
                        if plan_megatron_to_tp(&layout, &rollout, bucket).is_ok() {
                            out.push((name, model, tp, pp, dp, t));
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_shared_gpu_layouts_cover_tp_pp_dp_and_t() {
    let cases = shared_layouts();
    for (name, _, tp, pp, dp, t) in &cases {
        eprintln!("{name}: TP{tp} PP{pp} DP{dp} -> T{t}");
    }
    let any = |f: &dyn Fn(&Layout) -> bool| cases.iter().any(f);
    for w in [2, 4] {
        let of_w = |c: &Layout| c.2 * c.3 * c.4 == w;
        assert!(any(&|c| of_w(c) && c.2 > 1), "W={w}: no TP > 1");
        assert!(any(&|c| of_w(c) && c.3 > 1), "W={w}: no PP > 1");
        assert!(any(&|c| of_w(c) && c.4 > 1), "W={w}: no DP > 1");
        assert!(any(&|c| of_w(c) && c.5 < w), "W={w}: no T < W");
        assert!(any(&|c| of_w(c) && c.5 == w), "W={w}: no T = W");
    }
    assert!(any(&|c| c.2 * c.3 * c.4 == 3 && c.3 == 3), "W=3: no PP = 3");
    assert!(any(&|c| c.2 * c.3 * c.4 == 3 && c.4 == 3), "W=3: no DP = 3");
    assert!(any(&|c| c.2 > 1 && c.3 > 1), "no TP and PP together");
    assert!(any(&|c| c.2 > 1 && c.4 > 1), "no TP and DP together");
    assert!(any(&|c| c.3 > 1 && c.4 > 1), "no PP and DP together");
    assert_eq!(cases.len(), SHARED_LAYOUTS, "the layout matrix changed");
    // The CPU executor agrees with the reference on every case: the GPU test compares against a
    // real answer.
    for (name, model, tp, pp, dp, t) in cases {
        let layout = MegatronLayout::new(model, tp, pp, dp).unwrap();
        let host = MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 5)).unwrap();
        let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(7));
        let reference = reference_rollout(&host, &rollout).unwrap();
        let cpu = via_host(&host, rollout, 256 << 20);
        assert_eq!(
            cpu.first_difference(&reference),
            None,
            "{name} TP{tp} PP{pp} DP{dp} -> T{t}"
        );
    }
}

/// Cases of [`shared_layouts`] (pinned, so a change of the matrix is seen).
const SHARED_LAYOUTS: usize = 72;

/// The settings of the `k`-th shared-GPU case, varied over the cases: peer copies by
/// [`Transport::Auto`] and [`Transport::PeerCopy`], copy engines and tile kernels for remote
/// runs, both memory policies, both vocabulary paddings.
fn shared_case(layout: &Layout, k: usize) -> Case {
    let &(_, model, tp, pp, dp, t) = layout;
    Case {
        model,
        tp,
        pp,
        dp,
        ep: 1,
        etp: tp,
        experts: ExpertPlacement::TensorParallel,
        t,
        vocab: [
            RolloutVocab::PadToMultipleOf(1),
            RolloutVocab::PadToMultipleOf(7),
        ][k % 2],
        config: GpuConfig {
            transport: [Transport::Auto, Transport::PeerCopy][k % 2],
            // Copy engines only / tiles below 64 B / tiles only.
            peer_tile_max_bytes: [0, 64, u64::MAX][k % 3],
            memcpy_min_bytes: [0, u64::MAX, 64][(k + 1) % 3],
            split_local_bulk: k % 2 == 1,
            overlap_blocks_per_sm: [1, 8, 2][k % 3],
            ..GpuConfig::default()
        },
        memory: if k.is_multiple_of(2) {
            MemoryPolicy::default()
        } else {
            MemoryPolicy::resident()
        },
        cycles: 2,
    }
}

/// Runs every case of `layouts` whose W equals the pool's (settings by [`shared_case`]): peer
/// copies are planned, every rollout and the training state bit for bit as on the CPU.
fn shared_matrix(
    pool: &Arc<ThreadRankPool>,
    layouts: &[Layout],
) -> Result<usize, Box<dyn std::error::Error>> {
    let world = pool.devices().len();
    let mut n = 0;
    for (i, layout) in layouts.iter().enumerate() {
        if layout.2 * layout.3 * layout.4 != world {
            continue;
        }
        let case = shared_case(layout, i);
        let peer = check(pool, layout.0, &case)?;
        assert!(
            peer,
            "{} TP{} PP{} DP{} on GPUs {:?}: NCCL steps planned",
            layout.0,
            layout.2,
            layout.3,
            layout.4,
            pool.devices()
        );
        n += 1;
    }
    eprintln!(
        "{n} layout cases checked on W = {world}, GPUs {:?}",
        pool.devices()
    );
    Ok(n)
}

/// W = 2, 3, 4 ranks all on GPU 0, every layout of [`shared_layouts`]: peer copies between
/// ranks of one GPU (device-local), every rollout bit-identical to the CPU executor
/// (`MegatronHostBackend`) and to `reference_rollout`, the training state unchanged.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ranks_sharing_one_gpu_match_the_cpu_executor_bit_for_bit() -> Res {
    require_gpus(1)?;
    let layouts = shared_layouts();
    let mut n = 0;
    for world in 2..=4 {
        let pool = Arc::new(ThreadRankPool::on_devices(&vec![0; world])?);
        n += shared_matrix(&pool, &layouts)?;
    }
    assert_eq!(n, SHARED_LAYOUTS);
    Ok(())
}

/// On ranks sharing one GPU, `Transport::Nccl` fails in planning with the error naming the
/// ranks and the GPU; nothing moves and the state is intact.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ranks_sharing_one_gpu_refuse_nccl_up_front() -> Res {
    require_gpus(1)?;
    let pool = Arc::new(ThreadRankPool::on_devices(&[0, 0, 0, 0])?);
    let model = models()[0].1;
    let layout = MegatronLayout::new(model, 2, 1, 2)?;
    let host = MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 8))?;
    let rollout = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(1));
    let backend =
        MegatronGpuBackend::new(pool.clone(), rollout.clone())?.with_config(GpuConfig {
            transport: Transport::Nccl,
            ..GpuConfig::default()
        })?;
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::new(backend, state);
    match lc.rollout() {
        Err(LifecycleError::Plan(MegatronGpuError::Cuda(
            e @ CudaError::NcclNeedsOneGpuPerRank { .. },
        ))) => {
            assert!(
                e.to_string().starts_with(
                    "the NCCL transport needs one GPU per rank; this pool places ranks 0 and 1 on GPU 0"
                ),
                "{e}"
            );
        }
        Err(e) => panic!("expected the NCCL refusal, got {e}"),
        Ok(_) => panic!("Transport::Nccl planned on ranks sharing a GPU"),
    }
    assert_eq!(lc.mode(), Mode::Train);
    assert_eq!(lc.metrics().bytes().moved() + lc.metrics().bytes().local, 0);
    let now = lc.backend().download_state(lc.peek_state())?;
    assert!(now.snapshot() == host.snapshot(), "state changed");
    // The same backend with the default transport works on this pool.
    let (backend, state) = lc.into_parts()?;
    let backend = backend.with_config(GpuConfig::default())?;
    let mut lc = Lifecycle::new(backend, state);
    let s = lc.rollout()?;
    let got = s.backend().download_rollout(&s.weights())?;
    assert_eq!(
        got.first_difference(&reference_rollout(&host, &rollout)?),
        None
    );
    Ok(())
}

/// Needs 2 GPUs: four ranks, two on each GPU: device-local copies between ranks of one GPU and
/// copies over the link between GPUs, in one plan.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn two_ranks_on_each_of_two_gpus_match_the_cpu_executor() -> Res {
    require_gpus(2)?;
    let pool = Arc::new(ThreadRankPool::on_devices(&[0, 0, 1, 1])?);
    let n = shared_matrix(&pool, &shared_layouts())?;
    assert!(n > 0);
    Ok(())
}

/// Mixture-of-experts models: the tiny one (4 experts of 12, layer 0 dense) and one with 8
/// experts of 256 over hidden 256 (copies larger than a tile).
fn moe_models() -> Vec<(&'static str, ModelSpec)> {
    let medium = ModelSpec {
        qk_norm: true,
        qkv_bias: false,
        moe: Some(MoeSpec {
            experts: 8,
            top_k: 2,
            ffn: 256,
            norm_topk_prob: true,
            sparse_step: 1,
            dense_layers: LayerSet::EMPTY,
            shared_ffn: 0,
        }),
        ..models()[2].1
    };
    vec![
        ("moe-tiny", common::moe_model(false)),
        ("moe-tied", common::moe_model(true)),
        ("moe-medium", medium),
    ]
}

/// Megatron-Core expert layouts on W ranks: (TP, PP, DP, EP, ETP, T, rollout placement).
type MoeLayout = (usize, usize, usize, usize, usize, usize, ExpertPlacement);

const MOE_LAYOUTS: [MoeLayout; 10] = {
    use ExpertPlacement::{Partitioned as Ep, TensorParallel as Tp};
    [
        (1, 1, 1, 1, 1, 1, Tp),
        (1, 1, 1, 1, 1, 1, Ep),
        (1, 1, 2, 2, 1, 2, Ep),
        (1, 1, 2, 2, 1, 1, Tp),
        (2, 1, 1, 1, 2, 2, Tp),
        (2, 1, 1, 2, 1, 1, Ep),
        (1, 2, 2, 2, 1, 2, Tp),
        (2, 1, 2, 4, 1, 4, Ep),
        (1, 1, 4, 2, 2, 2, Tp),
        (1, 3, 1, 1, 1, 1, Ep),
    ]
};

/// W = 1 and W = 2, 3, 4 ranks on GPU 0: every expert layout of [`MOE_LAYOUTS`] with every
/// MoE model, bit for bit against the CPU executor and the reference (settings varied as in the
/// shared-GPU matrix); then a synthetic expert-parallel state made on the device rolls out as
/// the reference of its own download says.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_expert_layouts_match_the_cpu_executor_on_one_gpu() -> Res {
    require_gpus(1)?;
    let mut n = 0;
    for world in 1..=4 {
        let pool = Arc::new(ThreadRankPool::on_devices(&vec![0; world])?);
        for (name, model) in moe_models() {
            for (i, &(tp, pp, dp, ep, etp, t, experts)) in MOE_LAYOUTS.iter().enumerate() {
                if tp * pp * dp != world {
                    continue;
                }
                let mut case = shared_case(&(name, model, tp, pp, dp, t), i + n);
                case.ep = ep;
                case.etp = etp;
                case.experts = experts;
                check(&pool, name, &case)?;
                n += 1;
            }
        }
        // synthetic: the expert parts seeded per expert, equal on expert-DP replicas
        if let Some(&(tp, pp, dp, ep, etp, t, experts)) =
            MOE_LAYOUTS.iter().rev().find(|l| l.0 * l.1 * l.2 == world)
        {
            let model = moe_models()[2].1;
            let layout = MegatronLayout::new_moe(model, tp, pp, dp, ep, etp)?;
            let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(1))
                .with_expert_placement(experts);
            let backend = MegatronGpuBackend::new(pool.clone(), rollout.clone())?;
            let state = backend.synthetic_state(layout.clone(), 7, 0.05)?;
            let host = backend.download_state(&state)?;
            for rank in 0..world {
                let group = layout.expert_dp_group(rank);
                let base = layout.dense_len(layout.coords(rank).pp);
                let mine = &host.params_anywhere(rank).unwrap_or_default()[base..];
                for &other in &group {
                    let theirs = &host.params_anywhere(other).unwrap_or_default()[base..];
                    assert!(
                        mine == theirs,
                        "W{world}: expert parts of {rank} and {other}"
                    );
                }
            }
            let reference = reference_rollout(&host, &rollout)?;
            let mut lc = Lifecycle::new(backend, state);
            let s = lc.rollout()?;
            let got = s.backend().download_rollout(&s.weights())?;
            assert_eq!(got.first_difference(&reference), None, "W{world} synthetic");
        }
    }
    eprintln!("{n} mixture-of-experts layout cases checked on GPU 0");
    assert!(n >= 25, "{n} cases");
    Ok(())
}

#[test]
fn the_moe_gpu_layouts_are_valid_and_the_cpu_executor_agrees_with_the_reference() {
    for (name, model) in moe_models() {
        for &(tp, pp, dp, ep, etp, t, experts) in &MOE_LAYOUTS {
            let layout = MegatronLayout::new_moe(model, tp, pp, dp, ep, etp).unwrap();
            let host = MegatronTrainState::from_hf(layout, common::hf_tensors(&model, 5)).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(7))
                .with_expert_placement(experts);
            let reference = reference_rollout(&host, &rollout).unwrap();
            let cpu = via_host(&host, rollout, 256 << 20);
            assert_eq!(
                cpu.first_difference(&reference),
                None,
                "{name} TP{tp} PP{pp} DP{dp} EP{ep} ETP{etp} -> T{t}"
            );
        }
    }
}
