//! GPU tests: run on a machine with NVIDIA GPUs with
//! `cargo test --release -p lifecycle-fsdp --test gpu -- --ignored --test-threads=1`
//! (on the project's test machine also `export NCCL_NVLS_ENABLE=0`), or through
//! `scripts/gpu-suite.sh`. In CI (no GPU) they are reported as ignored, not passed. A test that
//! needs more GPUs than the machine shows fails saying so ([`require_gpus`]).
//!
//! - 1 GPU: W = 1; W = 2, 3, 4 ranks sharing GPU 0 (peer copies between ranks of one GPU, no
//!   NCCL), bit for bit against the CPU executor; the refusal of NCCL on such a pool.
//! - 2 GPUs: W = 2 over NCCL (batched and per-piece casts, all-gather and packed gather modes)
//!   and peer copies over the link; four ranks on two GPUs.

use lifecycle_layout::settings::Configure;
use std::sync::Arc;

use lifecycle_core::{Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy, Phase, Switching};
use lifecycle_cuda::cudarc::nccl::ReduceOp;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{
    alloc_zeros, peer_copy_rate, CudaError, RankExecutor, SharedGpu, ThreadRankPool, Transport,
};
use lifecycle_fsdp::{BucketConfig, FsdpBackend, FsdpError, GatherMode};
use lifecycle_host::{reference_rollout, HostBackend, HostTrainState};
use lifecycle_layout::fsdp::build_plan;
use lifecycle_layout::HostRollout;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{plan_fsdp_to_tp, Parallel, RolloutLayout, TensorSpec};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Shapes with dims not divisible by W = 2, split dims divisible by T; one tensor large enough
/// (~4 MB fp32) to span several 1 MiB buckets and reuse staging slots; and the experts of a
/// mixture-of-experts layer partitioned over the T rollout ranks (two whole experts per rank,
/// only on their owner), with uneven FSDP shards.
fn specs(tp: usize) -> Vec<TensorSpec> {
    let mut specs = vec![
        TensorSpec::new("model.embed_tokens.weight", [37 * tp, 24], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [9 * tp, 24],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.bias",
            [9 * tp],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [23, 6 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.down_proj.weight",
            [1031, 1024 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.up_proj.weight",
            [1025 * tp, 515],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            [23],
            Parallel::Replicated,
        ),
        TensorSpec::new("model.norm.weight", [5], Parallel::Replicated),
        TensorSpec::new(
            "model.layers.0.mlp.gate.weight",
            [2 * tp, 24],
            Parallel::Replicated,
        ),
    ];
    for e in 0..2 * tp {
        let owner = Parallel::Owned { rank: e / 2 };
        let name = |p: &str| format!("model.layers.0.mlp.experts.{e}.{p}.weight");
        specs.push(TensorSpec::new(name("up_proj"), [37, 24], owner));
        specs.push(TensorSpec::new(name("down_proj"), [24, 37], owner));
    }
    specs
}

fn host_tensors(specs: &[TensorSpec]) -> Vec<HostTensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let data = (0..s.numel())
                .map(|e| {
                    let x = ((i as u64 * 2_654_435_761 + e as u64 * 40_503) % 1_000_003) as f32;
                    (x - 500_000.0) * 1.234_567e-4 + 0.001_953_125 * (e % 5) as f32
                })
                .collect();
            HostTensor::f32(s.name.clone(), s.shape.clone(), data)
        })
        .collect()
}

fn host_via_lifecycle(
    state: HostTrainState,
    layout: RolloutLayout,
) -> Result<HostRollout, Box<dyn std::error::Error>> {
    let mut lc = Lifecycle::new(HostBackend::new(layout), state);
    let session = lc.rollout()?;
    let w = session.weights();
    Ok((*w).clone())
}

/// GPUs `0..world`, one rank each.
fn one_per_gpu(world: usize) -> Vec<usize> {
    (0..world).collect()
}

/// NCCL with batched and per-piece casts, then peer copies where the plan allows them.
fn check_bits(world: usize, tp: usize, memory: MemoryPolicy, config: BucketConfig) -> Res {
    for (batched, transport) in [
        (true, Transport::Nccl),
        (false, Transport::Nccl),
        (true, Transport::Auto),
    ] {
        check_bits_with(&one_per_gpu(world), tp, memory, config, batched, transport)?;
    }
    Ok(())
}

/// Three rollout → train cycles on ranks placed on `devices` (rank r on GPU `devices[r]`):
/// every rollout bit-identical to `reference_rollout` and to the CPU executor's, the master
/// weights unchanged at the end, device spans on every rank.
fn check_bits_with(
    devices: &[usize],
    tp: usize,
    memory: MemoryPolicy,
    config: BucketConfig,
    batched: bool,
    transport: Transport,
) -> Res {
    let world = devices.len();
    let specs = specs(tp);
    let host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
    let layout = RolloutLayout::new(tp, specs)?;
    let reference = reference_rollout(&host, &layout)?;
    let via_host = host_via_lifecycle(host.clone(), layout.clone())?;
    assert_eq!(reference.first_difference(&via_host), None);

    let pool = Arc::new(ThreadRankPool::on_devices(devices)?);
    let shared = pool.shared_gpu().is_some();
    let backend = FsdpBackend::new(pool, layout)
        .with_config(config)?
        .with_batched_casts(batched)
        .with_transport(transport);
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )?;
    for round in 0..3 {
        if round == 2 {
            lc.enable_trace();
        }
        let session = lc.rollout()?;
        let got = session.backend().download_rollout(&session.weights())?;
        assert_eq!(
            got.first_difference(&reference),
            None,
            "W={world} on GPUs {devices:?} T={tp} batched={batched} {transport:?} round {round}: \
             differs from reference_rollout"
        );
        assert_eq!(got.first_difference(&via_host), None);
        drop(session);
        lc.train()?; // exit (and reload when offloaded)
    }
    let peer = lifecycle_core::Reshard::plan(lc.backend(), lc.peek_state())?.peer_copy;
    if transport == Transport::Nccl {
        assert!(!peer, "Transport::Nccl planned peer copies");
    }
    if shared {
        assert!(peer, "GPUs {devices:?}: ranks sharing a GPU planned NCCL");
    }
    check_device_spans(lc.trace(), world, memory, peer);
    let m = lc.metrics();
    eprintln!(
        "W={world} on GPUs {devices:?} T={tp} {memory:?} batched={batched} peer copies {peer}:\n{m}"
    );
    let (backend, state) = lc.into_parts()?;
    for spec in backend.layout().tensors() {
        let a = backend.full_master(&state, &spec.name)?;
        let b = host.full_master(&spec.name)?;
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{}",
            spec.name
        );
    }
    Ok(())
}

/// The traced cycle has device spans on every rank: casts on a compute stream, NCCL work when
/// W > 1, copies when offloading; each inside the host span of its phase (within 1 ms).
fn check_device_spans(
    trace: &lifecycle_core::Trace,
    world: usize,
    memory: MemoryPolicy,
    peer: bool,
) {
    let spans = trace.spans();
    let host_transfer: Vec<_> = spans
        .iter()
        .filter(|s| s.rank.is_none() && s.phase == Phase::Transfer)
        .collect();
    assert_eq!(
        host_transfer.len(),
        1,
        "one transfer phase traced: {spans:#?}"
    );
    let (lo, hi) = (
        host_transfer[0].start_us,
        host_transfer[0].start_us + host_transfer[0].duration_us,
    );
    for rank in 0..world {
        let mine: Vec<_> = spans.iter().filter(|s| s.rank == Some(rank)).collect();
        let on = |track: &str| mine.iter().any(|s| s.track == track && s.duration_us > 0.0);
        assert!(on("aux"), "rank {rank}: no local-cast span: {mine:#?}");
        if world > 1 {
            let (yes, no) = if peer {
                ("peer", "nccl")
            } else {
                ("nccl", "peer")
            };
            assert!(on(yes), "rank {rank}: no {yes} span: {mine:#?}");
            assert!(
                !mine.iter().any(|s| s.track == no),
                "rank {rank}: {no} spans with peer copies {peer}: {mine:#?}"
            );
        }
        if memory.offload_params || memory.offload_optimizer {
            assert!(on("copy"), "rank {rank}: no copy span: {mine:#?}");
        }
        for s in mine.iter().filter(|s| s.phase == Phase::Transfer) {
            assert!(
                s.start_us >= lo - 1e3 && s.start_us + s.duration_us <= hi + 1e3,
                "rank {rank}: {} at {}+{} us outside the transfer phase {lo}..{hi}",
                s.name,
                s.start_us,
                s.duration_us
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w1_t1() -> Res {
    require_gpus(1)?;
    check_bits(1, 1, MemoryPolicy::default(), BucketConfig::default())
}

/// Needs 2 GPUs: its subject is NCCL (send/recv, all-gather) and peer copies over the link,
/// which ranks on one GPU do not have.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w2_t1() -> Res {
    require_gpus(2)?;
    check_bits(2, 1, MemoryPolicy::resident(), BucketConfig::default())?;
    check_bits(
        2,
        1,
        MemoryPolicy::default(),
        BucketConfig {
            bucket_bytes: 1 << 20,
            in_flight: 2,
            ..Default::default()
        },
    )?;
    let gather = BucketConfig {
        bucket_bytes: 1 << 20,
        in_flight: 2,
        mode: GatherMode::AllGather,
    };
    check_bits(2, 1, MemoryPolicy::default(), gather)?;
    check_bits(
        2,
        1,
        MemoryPolicy::resident(),
        BucketConfig {
            mode: GatherMode::AllGather,
            ..Default::default()
        },
    )
}

/// Needs 2 GPUs: NCCL send/recv and packed messages, and peer copies over the link.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w2_t2() -> Res {
    require_gpus(2)?;
    check_bits(2, 2, MemoryPolicy::resident(), BucketConfig::default())?;
    check_bits(
        2,
        2,
        MemoryPolicy::default(),
        BucketConfig {
            bucket_bytes: 1 << 20,
            in_flight: 2,
            ..Default::default()
        },
    )?;
    check_bits(
        2,
        2,
        MemoryPolicy::default(),
        BucketConfig {
            bucket_bytes: 1 << 20,
            in_flight: 3,
            ..Default::default()
        },
    )?;
    let packed = BucketConfig {
        mode: GatherMode::Packed,
        ..Default::default()
    };
    check_bits(2, 2, MemoryPolicy::resident(), packed)?;
    check_bits(
        2,
        2,
        MemoryPolicy::default(),
        BucketConfig {
            bucket_bytes: 1 << 20,
            in_flight: 2,
            mode: GatherMode::Packed,
        },
    )
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn offload_reload_round_trip_bit_exact_100_cycles() -> Res {
    // W = 2 where the machine has 2 GPUs, W = 1 on one.
    let world = require_gpus(1)?.min(2);
    let pool = Arc::new(ThreadRankPool::new(world)?);
    let specs = specs(world);
    let layout = RolloutLayout::new(world, specs.clone())?;
    // Offload copies cut into 1 MiB pieces (the last one shorter): the chunked path runs on
    // every buffer.
    let backend = FsdpBackend::new(pool, layout)
        .with_config(BucketConfig {
            bucket_bytes: 1 << 20,
            in_flight: 2,
            ..Default::default()
        })?
        .with_offload_chunk_bytes(1 << 20);
    let tensors: Vec<(String, Vec<usize>)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    let mut state = backend.synthetic_state(&tensors, 42, 0.05)?;
    let before = backend.download_state(&state)?;
    assert!(
        before.iter().all(|d| d.m.iter().any(|x| *x != 0.0)),
        "m must be non-zero"
    );
    // The pinned memory is reserved in the background from setup; the first offload takes
    // exactly those chunks and pins nothing more.
    let pinning = backend.reserve_pinned_in_background(&mut state, MemoryPolicy::default())?;
    let pinned = backend.pinned_pool().clone();
    let locals = backend.pool().local_ranks().to_vec();
    let mut lc = Lifecycle::new(backend, state); // default policy: offload master + Adam
    let first = {
        let s = lc.rollout()?;
        s.backend().download_rollout(&s.weights())?
    };
    let reserved = pinning.wait()?;
    let state_bytes: u64 = before
        .iter()
        .map(|d| 4 * (d.master.len() + d.m.len() + d.v.len()) as u64)
        .sum();
    // Each buffer's last piece is rounded up to 1 MiB.
    let slack = 3 * locals.len() as u64 * (1 << 20);
    assert!(
        (state_bytes..state_bytes + slack).contains(&reserved.bytes),
        "reserved at setup: {} B for {state_bytes} B of state",
        reserved.bytes
    );
    assert_eq!(lc.peek_state().pinned_host_bytes(), state_bytes);
    for r in &locals {
        assert_eq!(
            pinned.cached_bytes(*r),
            0,
            "rank {r}: every reserved chunk in use"
        );
    }
    lc.train()?;
    for cycle in 1..100 {
        let s = lc.rollout()?;
        if cycle % 33 == 0 {
            let again = s.backend().download_rollout(&s.weights())?;
            assert_eq!(again.first_difference(&first), None, "cycle {cycle}");
        }
        drop(s);
        let t = lc.train()?;
        assert!(!t.state().master_offloaded());
    }
    assert_eq!(lc.metrics().enters, 100);
    assert_eq!(lc.metrics().exits, 100);
    eprintln!("{}", lc.metrics());
    let (backend, state) = lc.into_parts()?;
    let after = backend.download_state(&state)?;
    for (r, (a, b)) in before.iter().zip(&after).enumerate() {
        assert!(
            a.same_bits(b),
            "rank {r}: training state changed over 100 offload/reload cycles"
        );
        let g = b.grads.as_ref().ok_or("grads not reallocated")?;
        assert!(
            g.iter().all(|x| x.to_bits() == 0),
            "grads must come back as zeros"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_are_typed_and_leave_the_state_intact() -> Res {
    let n = require_gpus(1)?;
    // More ranks than GPUs: a typed error, not a panic.
    match ThreadRankPool::new(n + 1) {
        Err(CudaError::TooFewGpus {
            requested,
            available,
        }) => {
            assert_eq!((requested, available), (n + 1, n));
        }
        other => panic!("expected TooFewGpus, got {other:?}"),
    }
    // A placement on a GPU that does not exist: the rank is named.
    match ThreadRankPool::on_devices(&[0, 0, n]) {
        Err(e @ CudaError::NoSuchGpu { .. }) => {
            assert!(
                matches!(e, CudaError::NoSuchGpu { rank: 2, device, available } if device == n && available == n),
                "{e:?}"
            );
            assert!(
                e.to_string()
                    .contains(&format!("rank 2 is placed on GPU {n}")),
                "{e}"
            );
        }
        other => panic!("expected NoSuchGpu, got {other:?}"),
    }
    let world = n.min(2);
    let pool = Arc::new(ThreadRankPool::new(world)?);
    // A host state of another W: typed error.
    let host3 = HostTrainState::from_tensors(world + 1, host_tensors(&specs(1)))?;
    let b = FsdpBackend::new(pool.clone(), RolloutLayout::new(1, specs(1))?);
    assert!(matches!(
        b.state_from_host(&host3),
        Err(FsdpError::WorldMismatch { .. })
    ));
    // A layout the planner rejects (T = 2 does not divide W = 1, or a shape mismatch): the error
    // comes from plan, before any data moves, and the state is intact.
    let mut bad = specs(1);
    bad[0].shape = vec![38, 24];
    let backend = FsdpBackend::new(pool.clone(), RolloutLayout::new(1, bad)?);
    let state = backend.state_from_tensors(host_tensors(&specs(1)))?;
    let before = backend.download_state(&state)?;
    let mut lc = Lifecycle::new(backend, state);
    match lc.rollout() {
        Err(LifecycleError::Plan(FsdpError::Layout(_))) => {}
        Err(e) => panic!("expected a layout error, got {e:?}"),
        Ok(_) => panic!("expected a layout error"),
    }
    let after = lc.backend().download_state(lc.peek_state())?;
    assert!(before
        .iter()
        .zip(&after)
        .all(|(a, b)| a.same_bits(b) && a.grads == b.grads));
    // An impossible allocation: a typed OOM error, not a panic.
    let oom = pool.run(&|ctx| {
        // SAFETY: never read; the allocation is expected to fail.
        unsafe {
            lifecycle_cuda::alloc_device::<f32>(
                &ctx.compute,
                1 << 44,
                ctx.rank,
                "a 64 TiB test buffer",
            )
        }
        .map(|_| ())
    });
    match oom {
        Err(e) => assert!(e.is_oom(), "{e:?}"),
        Ok(_) => panic!("a 64 TiB allocation succeeded"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Several ranks on one GPU: the multi-rank logic of the plans without a second GPU
// ---------------------------------------------------------------------------------------------

/// Every (W, T) with T dividing W, for W = 2, 3, 4: T < W (replicated TP groups) and T = W.
fn shared_cases() -> Vec<(usize, usize)> {
    (2..=4)
        .flat_map(|w| (1..=w).filter(move |t| w % t == 0).map(move |t| (w, t)))
        .collect()
}

#[test]
fn the_shared_gpu_cases_cover_t_below_and_at_w() {
    let cases = shared_cases();
    assert_eq!(
        cases,
        [(2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4)]
    );
    // Every case is a valid layout whose host rollout matches the reference: the GPU test
    // compares against a real answer.
    for (w, t) in cases {
        let specs = specs(t);
        let host = HostTrainState::from_tensors(w, host_tensors(&specs)).unwrap();
        let layout = RolloutLayout::new(t, specs).unwrap();
        let reference = reference_rollout(&host, &layout).unwrap();
        assert_eq!(reference.ranks.len(), w);
        let via_host = host_via_lifecycle(host.clone(), layout.clone()).unwrap();
        assert_eq!(reference.first_difference(&via_host), None, "W={w} T={t}");
        // The default gather mode places every piece in the receivers' buffers, so the plans
        // run as peer copies on ranks sharing a GPU; the modes that need NCCL do not.
        let plan = |mode| {
            let core = plan_fsdp_to_tp(host.layout(), &layout).unwrap();
            let config = BucketConfig {
                mode,
                ..Default::default()
            };
            build_plan(core, host.layout(), config).peer_copyable()
        };
        assert!(plan(GatherMode::SendRecv), "W={w} T={t}");
        if t == 1 {
            assert!(!plan(GatherMode::AllGather), "W={w} T={t}: all-gathers");
        } else {
            assert!(!plan(GatherMode::Packed), "W={w} T={t}: packed messages");
        }
    }
}

/// W = 2, 3, 4 ranks all on GPU 0, every T dividing W: peer copies between ranks of one GPU
/// (device-local), under both memory policies, small and large buckets, batched and per-piece
/// casts; every rollout bit-identical to the CPU executor (`HostBackend`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ranks_sharing_one_gpu_match_the_cpu_executor_bit_for_bit() -> Res {
    require_gpus(1)?;
    let small = |in_flight| BucketConfig {
        bucket_bytes: 1 << 20,
        in_flight,
        ..Default::default()
    };
    let mut n = 0;
    for (world, tp) in shared_cases() {
        let devices = vec![0; world];
        for (memory, config, batched, transport) in [
            (
                MemoryPolicy::resident(),
                BucketConfig::default(),
                true,
                Transport::Auto,
            ),
            (
                MemoryPolicy::default(),
                small(2),
                false,
                Transport::PeerCopy,
            ),
            (MemoryPolicy::default(), small(3), true, Transport::Auto),
        ] {
            check_bits_with(&devices, tp, memory, config, batched, transport)?;
            n += 1;
        }
    }
    assert_eq!(n, 21);
    Ok(())
}

/// Ranks on one GPU have no NCCL communicators: every NCCL entry point is the typed error
/// naming the ranks and the GPU, `Transport::Nccl` and NCCL-only gather modes fail in planning
/// before anything moves, `Transport::Auto` resolves to peer copies.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ranks_sharing_one_gpu_refuse_nccl_up_front() -> Res {
    require_gpus(1)?;
    let pool = Arc::new(ThreadRankPool::on_devices(&[0, 0])?);
    assert_eq!(pool.devices(), &[0, 0]);
    assert_eq!(
        pool.shared_gpu(),
        Some(SharedGpu {
            first: 0,
            second: 1,
            device: 0
        })
    );
    let refusal =
        "the NCCL transport needs one GPU per rank; this pool places ranks 0 and 1 on GPU 0";
    let e = pool.require_nccl().expect_err("no NCCL on a shared GPU");
    assert!(e.to_string().starts_with(refusal), "{e}");
    assert!(pool.peer_access()?, "ranks of one GPU copy device-locally");
    assert!(Transport::Auto.resolve(&pool)?);
    assert!(Transport::PeerCopy.resolve(&pool)?);
    assert!(matches!(
        Transport::Nccl.resolve(&pool),
        Err(CudaError::NcclNeedsOneGpuPerRank {
            first: 0,
            second: 1,
            device: 0
        })
    ));
    // On the ranks: no communicator, and every NCCL call fails at once with the same error.
    let seen = pool.run(&|ctx| {
        let mut buf = alloc_zeros::<f32>(&ctx.compute, 16, ctx.rank, "a test buffer")?;
        let errors = [
            ctx.group_start().err(),
            ctx.comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).err(),
            ctx.comm.broadcast_in_place(&mut buf, 0).err(),
            ctx.group_end().err(),
        ];
        ctx.sync_all()?;
        Ok((
            ctx.comm.is_available(),
            ctx.comm.is_aborted(),
            errors.map(|e| e.map(|e| e.to_string())),
        ))
    })?;
    for (rank, (available, aborted, errors)) in seen.into_iter().enumerate() {
        assert!(!available && !aborted, "rank {rank}");
        for e in errors {
            let e = e.ok_or(format!("rank {rank}: an NCCL call succeeded"))?;
            assert!(e.starts_with(refusal), "rank {rank}: {e}");
        }
    }
    assert!(pool.comm_fault().is_none(), "a refusal is not a fault");
    // Peer copies between the ranks run (device-local copies).
    let rate = peer_copy_rate(&pool, 64 << 20, 3)?.ok_or("no peer-copy rate on W = 2")?;
    assert!(rate > 0.0, "{rate}");
    // The FSDP backend: what needs NCCL fails in planning, the state untouched.
    let gather = |mode| BucketConfig {
        mode,
        ..Default::default()
    };
    for (tp, transport, config, expect) in [
        (1, Transport::Nccl, BucketConfig::default(), refusal),
        (2, Transport::Nccl, BucketConfig::default(), refusal),
        (
            1,
            Transport::Auto,
            gather(GatherMode::AllGather),
            "gather mode AllGather at T = 1 needs NCCL",
        ),
        (
            2,
            Transport::Auto,
            gather(GatherMode::Packed),
            "gather mode Packed at T = 2 needs NCCL",
        ),
    ] {
        let what = format!("T={tp} {transport:?} {:?}", config.mode);
        let specs = specs(tp);
        let backend = FsdpBackend::new(pool.clone(), RolloutLayout::new(tp, specs.clone())?)
            .with_config(config)?
            .with_transport(transport);
        let state = backend.state_from_tensors(host_tensors(&specs))?;
        let before = backend.download_state(&state)?;
        let mut lc = Lifecycle::new(backend, state);
        let err = lc.rollout().map(|_| ()).expect_err(&what);
        let msg = err.to_string();
        assert!(matches!(err, LifecycleError::Plan(_)), "{what}: {msg}");
        assert!(
            msg.contains(expect) && msg.contains("GPU 0"),
            "{what}: {msg}"
        );
        assert_eq!(lc.mode(), lifecycle_core::Mode::Train, "{what}");
        assert_eq!(lc.metrics().bytes().moved() + lc.metrics().bytes().local, 0);
        let after = lc.backend().download_state(lc.peek_state())?;
        assert!(
            before.iter().zip(&after).all(|(a, b)| a.same_bits(b)),
            "{what}: state changed"
        );
    }
    Ok(())
}

/// Needs 2 GPUs: four ranks, two on each GPU: peer copies device-local between ranks of one GPU
/// and over the link between GPUs, in one plan.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn two_ranks_on_each_of_two_gpus_match_the_cpu_executor() -> Res {
    require_gpus(2)?;
    for tp in [1, 2, 4] {
        check_bits_with(
            &[0, 0, 1, 1],
            tp,
            MemoryPolicy::default(),
            BucketConfig {
                bucket_bytes: 1 << 20,
                in_flight: 2,
                ..Default::default()
            },
            true,
            Transport::Auto,
        )?;
    }
    Ok(())
}

/// An fp8 switch on the GPU (W = 1: enter through the lifecycle, downloaded) equals the CPU
/// executor's fp8 switch bit for bit: every e4m3 byte and block scale, and the tensors kept bf16,
/// over shapes that are not multiples of 128, an all-zero block and subnormal-range values.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_switch_matches_the_cpu_executor_at_w1() -> Res {
    use lifecycle_host::fp8::fp8_switch;
    use lifecycle_layout::fp8::RolloutDtype;
    require_gpus(1)?;
    let specs = vec![
        TensorSpec::new("model.embed_tokens.weight", [40, 256], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [512, 256],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [260, 515],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            [256],
            Parallel::Replicated,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.experts.0.up_proj.weight",
            [300, 129],
            Parallel::Column,
        ),
        TensorSpec::new("model.layers.0.mlp.down_proj.weight", [7, 3], Parallel::Row),
    ];
    let mut tensors = host_tensors(&specs);
    if let lifecycle_layout::TensorData::F32(v) = &mut tensors[2].data {
        // one all-zero block and a block of tiny values next to it
        for r in 0..128 {
            for c in 128..256 {
                v[r * 515 + c] = 0.0;
                v[r * 515 + c + 128] *= 1e-6;
            }
        }
    }
    let host = HostTrainState::from_tensors(1, tensors)?;
    let layout = RolloutLayout::new(1, specs)?;
    let want = fp8_switch(&host, &layout)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let probe = FsdpBackend::new(pool.clone(), layout.clone());
    let state = probe.state_from_host(&host)?;
    let backend = FsdpBackend::new(pool, layout).with_rollout_dtype(RolloutDtype::Fp8);
    let mut lc = Lifecycle::new(backend, state);
    // twice: the second enter reuses the cached plan and its entries
    for round in 0..2 {
        let session = lc.rollout()?;
        let got = session.backend().download_rollout(&session.weights())?;
        if let Some((rank, name)) = got.first_difference(&want) {
            panic!("round {round}: rank {rank} `{name}` differs from the CPU executor");
        }
        assert_eq!(got, want);
        let quantised = got.ranks[0]
            .tensors
            .iter()
            .filter(|t| t.fp8.is_some())
            .count();
        assert_eq!(quantised, 4, "the quantised tensors");
        let rollout = session.weights();
        let held = rollout.bytes_per_rank();
        drop(session);
        lc.exit()?;
        eprintln!(
            "fp8 in the switch on the GPU, round {round}: 4 fp8 and 2 bf16 tensors bit-identical \
             to the CPU executor ({held} bytes of rollout buffer)"
        );
    }
    Ok(())
}

/// Shapes for fp8 at W > 1 and T ∈ {1, 2, 3, 4}: every TP slice of a quantised tensor keeps
/// whole 128 × 128 blocks, FSDP shards cut blocks (rows not multiples of 128 · W), the edge
/// blocks are partial, experts live on rank 0 (even widths: every shard split moves whole
/// 2-byte elements), the embedding and the norm stay bf16.
fn fp8_specs(tp: usize) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new(
            "model.embed_tokens.weight",
            [40 * tp, 256],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [256 * tp, 256],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [260, 128 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            [256],
            Parallel::Replicated,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.experts.0.up_proj.weight",
            [300, 130],
            Parallel::Owned { rank: 0 },
        ),
        TensorSpec::new(
            "model.layers.0.mlp.down_proj.weight",
            [7, 128 * tp],
            Parallel::Row,
        ),
    ]
}

/// An fp8 switch at W > 1 on `devices` (one rank each) at rollout degree `tp`, entered twice
/// through the lifecycle under `memory` and downloaded: every e4m3 byte, block scale and bf16
/// tensor equal to the CPU executor's fp8 switch (`lifecycle_host::fp8::fp8_switch`). Returns
/// whether the plan ran as peer copies.
fn check_fp8_at(
    devices: &[usize],
    tp: usize,
    memory: MemoryPolicy,
) -> Result<bool, Box<dyn std::error::Error>> {
    use lifecycle_host::fp8::fp8_switch;
    use lifecycle_layout::fp8::RolloutDtype;
    let world = devices.len();
    let specs = fp8_specs(tp);
    let host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
    let layout = RolloutLayout::new(tp, specs)?;
    let want = fp8_switch(&host, &layout)?;
    let pool = Arc::new(ThreadRankPool::on_devices(devices)?);
    let backend = FsdpBackend::new(pool, layout).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )?;
    let what = format!("fp8 W={world} on GPUs {devices:?} T={tp} {memory:?}");
    for round in 0..2 {
        let session = lc.rollout()?;
        let got = session.backend().download_rollout(&session.weights())?;
        if let Some((rank, name)) = got.first_difference(&want) {
            return Err(format!(
                "{what} round {round}: rank {rank} `{name}` differs from the CPU executor"
            )
            .into());
        }
        assert_eq!(got, want, "{what}");
        let quantised = got
            .ranks
            .iter()
            .flat_map(|r| &r.tensors)
            .filter(|t| t.fp8.is_some())
            .count();
        assert!(
            quantised >= 3 * world,
            "{what}: {quantised} quantised slices"
        );
        drop(session);
        lc.train()?;
    }
    let peer = lifecycle_core::Reshard::plan(lc.backend(), lc.peek_state())?.peer_copy;
    eprintln!("{what}: bit-identical to the CPU executor, twice (peer copies {peer})");
    Ok(peer)
}

/// fp8 at W = 2, 3, 4 ranks sharing GPU 0, every T dividing W: the ranks have no NCCL, so they
/// agree their block scales at the transfer's meeting (each copies its peers' partial amax
/// grids), then move e4m3 bytes as peer copies; bit-identical to the CPU executor, resident and
/// with the masters offloaded.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_ranks_sharing_one_gpu_match_the_cpu_executor() -> Res {
    require_gpus(1)?;
    let mut n = 0;
    for (world, tp) in shared_cases() {
        for memory in [MemoryPolicy::resident(), MemoryPolicy::default()] {
            assert!(
                check_fp8_at(&vec![0; world], tp, memory)?,
                "shared GPU: peer copies"
            );
            n += 1;
        }
    }
    assert_eq!(n, 14);
    Ok(())
}

/// Needs 2 GPUs: fp8 at W = 2 over NCCL (the agreement an all-reduce by max), T = 1 and 2.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_at_w2_over_nccl_matches_the_cpu_executor() -> Res {
    require_gpus(2)?;
    for tp in [1, 2] {
        check_fp8_at(&[0, 1], tp, MemoryPolicy::default())?;
    }
    Ok(())
}

/// The fp8 cases of the GPU tests plan on any machine: every shared-GPU (W, T) builds an fp8
/// plan whose ranks agree their scales, and the CPU executor's answer exists to compare with.
#[test]
fn the_fp8_shared_gpu_cases_plan_and_have_a_cpu_answer() {
    use lifecycle_layout::fp8::Fp8Keep;
    use lifecycle_layout::fsdp::build_fp8_plan;
    for (w, t) in shared_cases() {
        let specs = fp8_specs(t);
        let host = HostTrainState::from_tensors(w, host_tensors(&specs)).unwrap();
        let layout = RolloutLayout::new(t, specs).unwrap();
        let want = lifecycle_host::fp8::fp8_switch(&host, &layout).unwrap();
        assert_eq!(want.ranks.len(), w);
        let core = plan_fsdp_to_tp(host.layout(), &layout).unwrap();
        let plan = build_fp8_plan(
            core,
            host.layout(),
            BucketConfig::default(),
            Fp8Keep::default(),
        )
        .unwrap();
        assert!(plan.peer_copyable(), "W={w} T={t}");
        for r in 0..w {
            let steps = plan.rank_steps(r).unwrap();
            assert!(steps.agree.is_some(), "W={w} T={t} rank {r}");
        }
    }
}
