//! GPU tests: run on a machine with NVIDIA GPUs (2 for the W = 2 cases) with
//! `cargo test --release -p lifecycle-fsdp --test gpu -- --ignored --test-threads=1`
//! (on the project's test machine also `export NCCL_NVLS_ENABLE=0`).
//! In CI (no GPU) they are reported as ignored, not passed.

use std::sync::Arc;

use lifecycle_core::{Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy, Phase, Switching};
use lifecycle_cuda::{device_count, CudaError, RankExecutor, ThreadRankPool, Transport};
use lifecycle_fsdp::{BucketConfig, FsdpBackend, FsdpError, GatherMode};
use lifecycle_host::{reference_rollout, HostBackend, HostTrainState};
use lifecycle_layout::HostRollout;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Shapes with dims not divisible by W = 2, split dims divisible by T; one tensor large enough
/// (~4 MB fp32) to span several 1 MiB buckets and reuse staging slots.
fn specs(tp: usize) -> Vec<TensorSpec> {
    vec![
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
    ]
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

fn need_gpus(n: usize) -> bool {
    match device_count() {
        Ok(c) if c >= n => true,
        other => {
            eprintln!("skipping: needs {n} GPUs, found {other:?}");
            false
        }
    }
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

/// NCCL with batched and per-piece casts, then peer copies where the plan allows them.
fn check_bits(world: usize, tp: usize, memory: MemoryPolicy, config: BucketConfig) -> Res {
    for (batched, transport) in [
        (true, Transport::Nccl),
        (false, Transport::Nccl),
        (true, Transport::Auto),
    ] {
        check_bits_with(world, tp, memory, config, batched, transport)?;
    }
    Ok(())
}

fn check_bits_with(
    world: usize,
    tp: usize,
    memory: MemoryPolicy,
    config: BucketConfig,
    batched: bool,
    transport: Transport,
) -> Res {
    let specs = specs(tp);
    let host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
    let layout = RolloutLayout::new(tp, specs)?;
    let reference = reference_rollout(&host, &layout)?;
    let via_host = host_via_lifecycle(host.clone(), layout.clone())?;
    assert_eq!(reference.first_difference(&via_host), None);

    let pool = Arc::new(ThreadRankPool::new(world)?);
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
            "W={world} T={tp} batched={batched} {transport:?} round {round}: differs from reference_rollout"
        );
        assert_eq!(got.first_difference(&via_host), None);
        drop(session);
        lc.train()?; // exit (and reload when offloaded)
    }
    let peer = lifecycle_core::Reshard::plan(lc.backend(), lc.peek_state())?.peer_copy;
    if transport == Transport::Nccl {
        assert!(!peer, "Transport::Nccl planned peer copies");
    }
    check_device_spans(lc.trace(), world, memory, peer);
    let m = lc.metrics();
    eprintln!("W={world} T={tp} {memory:?} batched={batched} peer copies {peer}:\n{m}");
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
    if !need_gpus(1) {
        return Ok(());
    }
    check_bits(1, 1, MemoryPolicy::default(), BucketConfig::default())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w2_t1() -> Res {
    if !need_gpus(2) {
        return Ok(());
    }
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

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rollout_bit_identical_w2_t2() -> Res {
    if !need_gpus(2) {
        return Ok(());
    }
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
    let world = if need_gpus(2) {
        2
    } else if need_gpus(1) {
        1
    } else {
        return Ok(());
    };
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
    let state = backend.synthetic_state(&tensors, 42, 0.05)?;
    let before = backend.download_state(&state)?;
    assert!(
        before.iter().all(|d| d.m.iter().any(|x| *x != 0.0)),
        "m must be non-zero"
    );
    let mut lc = Lifecycle::new(backend, state); // default policy: offload master + Adam
    let first = {
        let s = lc.rollout()?;
        s.backend().download_rollout(&s.weights())?
    };
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
    let n = device_count()?;
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
