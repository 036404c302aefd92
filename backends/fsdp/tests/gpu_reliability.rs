//! Reliability of the FSDP backend on GPUs:
//! - a rank that stalls before its part of a collective: the others return
//!   [`CudaError::CollectiveTimeout`] within the deadline, the training state survives on the
//!   devices, the lifecycle is restored and the pool refuses later collectives at once (2 GPUs:
//!   the deadline guards NCCL work, and NCCL needs one GPU per rank);
//! - the fault matrix of [`FaultInjector`] around [`FsdpBackend`]: every phase × {error, panic} ×
//!   {start, end} under the offloading policy and the three that offload by need decides on the
//!   machine's free memory (nothing, kept resident; the optimizer state; both), at W = 1 and W = 2,
//!   with the offload settled before the rollout and overlapped with it;
//! - verification mode: device hashes equal their host twin, corrupted offloads and rollout
//!   weights are reported with their tensor, non-finite weights are refused, at W = 1 and W = 2.
//!
//! The W = 2 cases without NCCL place their two ranks on two GPUs where the machine has them and
//! on one GPU otherwise ([`spread`]), so every test but the stall tests runs on one GPU.
//!
//! `cargo test --release -p lifecycle-fsdp --test gpu_reliability -- --ignored --test-threads=1`
//! (on the project's test machine also `export NCCL_NVLS_ENABLE=0`), or `scripts/gpu-suite.sh`.
//! Without GPUs they are reported as ignored; with too few, a test fails saying how many it needs.

use lifecycle_layout::settings::Configure;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lifecycle_core::{
    AfterFailure, Fault, FaultAt, FaultError, FaultInjector, FaultKind, Lifecycle, LifecycleConfig,
    LifecycleError, MemoryPolicy, Metrics, Mode, Operation, Phase, PhaseRecorder, Reshard,
    RoomRequest, SwitchContext, Switching,
};
use lifecycle_cuda::cudarc::driver::DevicePtr;
use lifecycle_cuda::testing::{require_gpus, spread};
use lifecycle_cuda::{
    ChunkTable, CollectiveSettings, CudaError, RankExecutor, ThreadRankPool, Transport, WordSize,
};
use lifecycle_fsdp::{BucketConfig, FsdpBackend, FsdpError, FsdpTrainState, GatherMode, RankDump};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::HostRollout;
use lifecycle_layout::HostTensor;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

type Res = Result<(), Box<dyn std::error::Error>>;

/// `world` ranks over this machine's GPUs, sharing one where there are fewer GPUs than ranks.
fn pool(world: usize) -> Result<Arc<ThreadRankPool>, Box<dyn std::error::Error>> {
    Ok(Arc::new(ThreadRankPool::on_devices(
        spread(world)?.devices(),
    )?))
}

/// The worlds of the tests that run at W = 1 and W = 2.
const WORLDS: [usize; 2] = [1, 2];

/// A small model: dims not divisible by W = 2, one tensor spanning several 1 MiB buckets.
fn specs(tp: usize) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("model.embed_tokens.weight", [37 * tp, 24], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [9 * tp, 24],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [23, 6 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.down_proj.weight",
            [515, 512 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.up_proj.weight",
            [513 * tp, 515],
            Parallel::Column,
        ),
        TensorSpec::new("model.norm.weight", [5], Parallel::Replicated),
    ]
}

fn shapes(specs: &[TensorSpec]) -> Vec<(String, Vec<usize>)> {
    specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect()
}

fn config() -> BucketConfig {
    BucketConfig {
        bucket_bytes: 1 << 20,
        in_flight: 2,
        ..Default::default()
    }
}

/// The host twin of a GPU state (same master weights), for `reference_rollout`.
fn host_twin(backend: &FsdpBackend, state: &FsdpTrainState) -> Result<HostTrainState, FsdpError> {
    Ok(HostTrainState::from_tensors(
        state.world(),
        backend.full_masters(state)?,
    )?)
}

fn same_state(a: &[RankDump], b: &[RankDump]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_bits(y))
}

// ---------------------------------------------------------------------------------------------
// Collective deadline
// ---------------------------------------------------------------------------------------------

const DEADLINE: Duration = Duration::from_secs(3);
/// Recovery, the stalled rank noticing the abort (5 ms naps) and NCCL's abort itself.
const SLACK: Duration = Duration::from_secs(4);

fn stall_case(tp: usize, mode: GatherMode, warm_up: bool) -> Res {
    // Created with the default deadline (NCCL's own setup can take seconds), then shortened.
    let pool = Arc::new(ThreadRankPool::with_settings(
        2,
        CollectiveSettings::default(),
    )?);
    assert_eq!(pool.collective_timeout(), Duration::from_secs(600));
    pool.set_collective_timeout(DEADLINE);
    assert_eq!(pool.collective_timeout(), DEADLINE);
    let specs = specs(tp);
    // The deadline guards NCCL work: peer copies (the default in one process) have no
    // collective a peer could stall.
    let backend = FsdpBackend::new(pool.clone(), RolloutLayout::new(tp, specs.clone())?)
        .with_config(BucketConfig { mode, ..config() })?
        .with_transport(Transport::Nccl);
    let state = backend.synthetic_state(&shapes(&specs), 5, 0.05)?;
    let before = backend.download_state(&state)?;
    let mut lc = Lifecycle::new(backend, state);
    if warm_up {
        // NCCL's connections exist; the stall then hangs the kernels on the GPU.
        lc.rollout()?;
        lc.train()?;
    }
    pool.inject_stall(1, Duration::from_secs(60));
    let start = Instant::now();
    let err = lc.rollout().map(|_| ()).expect_err("rank 1 stalled");
    let took = start.elapsed();
    eprintln!("T={tp} {mode:?} warm={warm_up}: failed after {took:?}: {err}");
    assert!(took >= DEADLINE, "returned before the deadline: {took:?}");
    assert!(took < DEADLINE + SLACK, "took {took:?}");
    match &err {
        LifecycleError::Enter {
            source: FsdpError::Cuda(CudaError::CollectiveTimeout { rank, op, deadline }),
            after: AfterFailure::Restored,
        } => {
            assert_eq!((*rank, *deadline), (0, DEADLINE));
            assert!(!op.is_empty());
        }
        other => panic!("expected a timeout of rank 0, restored: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("rank 0 waited 3.0 s") && msg.contains("rebuild"),
        "{msg}"
    );
    assert_eq!(lc.mode(), Mode::Train);
    let fault = pool.comm_fault().expect("the pool records the fault");
    assert_eq!(fault.rank, 0, "{fault}");
    // The training state survived on the devices, bit for bit.
    let after = lc.backend().download_state(lc.peek_state())?;
    assert!(same_state(&before, &after), "training state changed");
    assert!(!lc.peek_state().master_offloaded() && !lc.peek_state().optimizer_offloaded());
    // Later collectives are refused at once with a clear error.
    let start = Instant::now();
    let again = lc.rollout().map(|_| ()).expect_err("the pool is unusable");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            &again,
            LifecycleError::Enter {
                source: FsdpError::Cuda(CudaError::CommAborted { .. }),
                after: AfterFailure::Restored,
            }
        ),
        "{again}"
    );
    assert!(
        again.to_string().contains("rebuild the rank pool"),
        "{again}"
    );
    assert_eq!(lc.mode(), Mode::Train);
    let (backend, state) = lc.into_parts()?;
    assert!(same_state(&before, &backend.download_state(&state)?));
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_stalled_rank_times_out_after_warm_up_and_the_state_survives() -> Res {
    require_gpus(2)?;
    stall_case(2, GatherMode::SendRecv, true)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_rank_stalled_before_the_first_collective_times_out_too() -> Res {
    require_gpus(2)?;
    stall_case(1, GatherMode::AllGather, false)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_new_pool_after_a_timeout_works() -> Res {
    require_gpus(2)?;
    stall_case(2, GatherMode::SendRecv, false)?;
    let pool = Arc::new(ThreadRankPool::new(2)?);
    assert!(pool.comm_fault().is_none());
    let specs = specs(2);
    let layout = RolloutLayout::new(2, specs.clone())?;
    let backend = FsdpBackend::new(pool, layout.clone()).with_config(config())?;
    let state = backend.synthetic_state(&shapes(&specs), 6, 0.05)?;
    let host = host_twin(&backend, &state)?;
    let mut lc = Lifecycle::new(backend, state);
    let s = lc.rollout()?;
    let got = s.backend().download_rollout(&s.weights())?;
    assert_eq!(
        got.first_difference(&reference_rollout(&host, &layout)?),
        None
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Fault matrix
// ---------------------------------------------------------------------------------------------

type Lc = Lifecycle<FaultInjector<FsdpBackend>>;

struct Case {
    lc: Lc,
    faults: lifecycle_core::FaultHandle,
    layout: RolloutLayout,
    reference: HostRollout,
    before: Vec<RankDump>,
    /// Whether an enter hands out its weights with the offload still running.
    overlapping: bool,
}

/// A lifecycle on `pool` with T = W.
fn setup(
    pool: &Arc<ThreadRankPool>,
    memory: MemoryPolicy,
    seed: u64,
    overlap: bool,
) -> Result<Case, Box<dyn std::error::Error>> {
    let tp = pool.world();
    let specs = specs(tp);
    let layout = RolloutLayout::new(tp, specs.clone())?;
    let backend = FsdpBackend::new(pool.clone(), layout.clone())
        .with_config(config())?
        .with_offload_overlap(overlap);
    let state = backend.synthetic_state(&shapes(&specs), seed, 0.05)?;
    let before = backend.download_state(&state)?;
    assert!(
        before.iter().all(|d| d.m.iter().any(|x| *x != 0.0)),
        "m must be non-zero"
    );
    let reference = reference_rollout(&host_twin(&backend, &state)?, &layout)?;
    let (backend, faults) = FaultInjector::new(backend);
    let lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )?;
    Ok(Case {
        lc,
        faults,
        layout,
        reference,
        before,
        overlapping: overlap && (memory.offload_params || memory.offload_optimizer),
    })
}

fn state_now(lc: &Lc) -> Result<Vec<RankDump>, FsdpError> {
    lc.backend().inner().download_state(lc.peek_state())
}

/// The next rollout works and matches `reference_rollout`; then training sees the state as
/// before.
fn rollout_works(c: &mut Case, what: &str) -> Res {
    {
        let s =
            c.lc.rollout()
                .map_err(|e| format!("{what}: the next rollout failed: {e}"))?;
        let overlapped = s.weights().get().freeing(0).is_some();
        assert_eq!(
            overlapped, c.overlapping,
            "{what}: whether the offload overlapped"
        );
        let got = s.backend().inner().download_rollout(&s.weights())?;
        assert_eq!(got.first_difference(&c.reference), None, "{what}");
    }
    c.lc.train()?;
    assert!(
        same_state(&c.before, &state_now(&c.lc)?),
        "{what}: state after the next cycle"
    );
    let _ = &c.layout;
    Ok(())
}

/// The policies the matrix runs: the explicit default (master + Adam offloaded), then the three
/// that offload by need decides on this machine's free device memory (read on `pool`'s ranks)
/// for the test state's sizes: a rollout that fits (nothing offloaded, kept resident, index 1),
/// one whose engine needs the optimizer state out, and one that needs both.
fn policies(
    pool: &ThreadRankPool,
) -> Result<Vec<(&'static str, MemoryPolicy)>, Box<dyn std::error::Error>> {
    let free = pool.run(&|ctx| ctx.device_memory())?;
    let free = free.iter().map(|&(f, _)| f).min().unwrap_or(0);
    let elements: usize = specs(pool.world())
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum();
    let params = 4 * (elements as u64).div_ceil(pool.world() as u64);
    let fits = RoomRequest {
        free,
        rollout: params / 2,
        margin: 64 << 20,
        optimizer: 2 * params,
        params,
        ..RoomRequest::default()
    };
    let room = free.saturating_sub(fits.rollout + fits.margin);
    let by_need = |engine: u64, offload_optimizer: bool, offload_params: bool| {
        let d = MemoryPolicy::by_need(&RoomRequest { engine, ..fits })?;
        if d.policy.offload_optimizer != offload_optimizer
            || d.policy.offload_params != offload_params
        {
            return Err(format!("by need decided {d} for an engine of {engine} B").into());
        }
        Ok::<_, Box<dyn std::error::Error>>(d.policy)
    };
    let resident = by_need(0, false, false)?;
    assert!(resident.keep_rollout_resident);
    let optimizer = by_need(room + fits.optimizer / 2, true, false)?;
    let both = by_need(room + fits.optimizer + fits.params / 2, true, true)?;
    Ok(vec![
        ("offload", MemoryPolicy::default()),
        ("by need: keep resident", resident),
        ("by need: optimizer out", optimizer),
        ("by need: master + optimizer out", both),
    ])
}

const KINDS: [FaultKind; 2] = [FaultKind::Error, FaultKind::Panic];
const ATS: [FaultAt; 2] = [FaultAt::Start, FaultAt::End];

fn is_injected(e: &LifecycleError<FaultError<FsdpError>>) -> bool {
    e.to_string().contains("injected fault")
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fault_matrix_on_gpus_restores_the_training_state_bit_for_bit() -> Res {
    require_gpus(1)?;
    for world in WORLDS {
        let pool = pool(world)?;
        fault_matrix(&pool, false)?;
        fault_matrix(&pool, true)?;
    }
    Ok(())
}

/// Every phase × {error, panic} × {start, end} for each policy; with `overlap`, enter hands out
/// the rollout weights with the offload copies still running
/// (`with_offload_overlap`).
fn fault_matrix(pool: &Arc<ThreadRankPool>, overlap: bool) -> Res {
    let w = pool.world();
    let pool = pool.clone();
    let policies = policies(&pool)?;
    let mut cases = 0;
    // Entering: plan, transfer, offload.
    for (name, memory) in policies.iter().copied() {
        for phase in [Phase::Plan, Phase::Transfer, Phase::Offload] {
            for kind in KINDS {
                for at in ATS {
                    let what = format!("W={w} enter, {name}: {kind:?} at {at:?} of {phase}");
                    let mut c = setup(&pool, memory, 11, overlap)?;
                    c.faults.inject(Fault::new(phase, at, kind));
                    let err = c.lc.rollout().map(|_| ()).expect_err(&what);
                    assert_eq!(c.faults.pending(), 0, "{what}: the fault fired");
                    let ok = matches!(
                        (&err, phase, kind),
                        (LifecycleError::Plan(_), Phase::Plan, FaultKind::Error)
                            | (
                                LifecycleError::Panicked {
                                    during: Operation::Plan,
                                    ..
                                },
                                Phase::Plan,
                                FaultKind::Panic,
                            )
                            | (
                                LifecycleError::Enter {
                                    after: AfterFailure::Restored,
                                    ..
                                },
                                _,
                                FaultKind::Error,
                            )
                            | (
                                LifecycleError::Panicked {
                                    during: Operation::Enter,
                                    after: AfterFailure::Restored,
                                    ..
                                },
                                _,
                                FaultKind::Panic,
                            )
                    );
                    assert!(ok && is_injected(&err), "{what}: unexpected error {err}");
                    assert_eq!(c.lc.mode(), Mode::Train, "{what}");
                    let st = c.lc.peek_state();
                    assert!(
                        !st.master_offloaded() && !st.optimizer_offloaded(),
                        "{what}"
                    );
                    assert!(
                        same_state(&c.before, &state_now(&c.lc)?),
                        "{what}: state changed"
                    );
                    rollout_works(&mut c, &what)?;
                    cases += 1;
                }
            }
        }
    }
    // Refreshing resident weights in place (keep-resident).
    let memory = policies[1].1;
    for kind in KINDS {
        for at in ATS {
            let what = format!("W={w} refresh: {kind:?} at {at:?} of the transfer");
            let mut c = setup(&pool, memory, 12, overlap)?;
            c.lc.enter()?;
            let _ = c.lc.train()?.state_mut(); // a training step: the resident weights are stale
            c.faults.inject(Fault::new(Phase::Transfer, at, kind));
            let err = c.lc.rollout().map(|_| ()).expect_err(&what);
            assert!(
                matches!(
                    err,
                    LifecycleError::Refresh {
                        after: AfterFailure::Restored,
                        ..
                    } | LifecycleError::Panicked {
                        during: Operation::Refresh,
                        after: AfterFailure::Restored,
                        ..
                    }
                ),
                "{what}: {err}"
            );
            assert!(!c.lc.rollout_is_current(), "{what}");
            assert_eq!(c.lc.mode(), Mode::Train, "{what}");
            assert!(
                same_state(&c.before, &state_now(&c.lc)?),
                "{what}: state changed"
            );
            rollout_works(&mut c, &what)?;
            assert_eq!(
                c.lc.metrics().enters,
                2,
                "{what}: the half-refreshed weights were replaced"
            );
            cases += 1;
        }
    }
    // Exiting: release, reload. The lifecycle is faulted until a retry brings the state back.
    for (name, memory) in policies.iter().copied() {
        for phase in [Phase::Release, Phase::Reload] {
            if phase == Phase::Release && memory.keep_rollout_resident {
                continue; // nothing is released when training starts under this policy
            }
            for kind in KINDS {
                for at in ATS {
                    let what = format!("W={w} exit, {name}: {kind:?} at {at:?} of {phase}");
                    let mut c = setup(&pool, memory, 13, overlap)?;
                    c.lc.enter()?;
                    c.faults.inject(Fault::new(phase, at, kind));
                    let err = c.lc.train().map(|_| ()).expect_err(&what);
                    assert!(
                        matches!(
                            err,
                            LifecycleError::Exit { .. }
                                | LifecycleError::Panicked {
                                    during: Operation::Exit,
                                    after: AfterFailure::Faulted { .. },
                                    ..
                                }
                        ),
                        "{what}: {err}"
                    );
                    assert!(err.to_string().contains("retries"), "{what}: {err}");
                    assert_eq!(c.lc.mode(), Mode::Faulted, "{what}");
                    // Whatever is offloaded is still readable from its pinned copy.
                    assert!(
                        same_state(&c.before, &state_now(&c.lc)?),
                        "{what}: while faulted"
                    );
                    c.lc.train()
                        .map_err(|e| format!("{what}: the retry failed: {e}"))?;
                    assert_eq!(c.lc.mode(), Mode::Train, "{what}");
                    assert!(
                        same_state(&c.before, &state_now(&c.lc)?),
                        "{what}: after the retry"
                    );
                    rollout_works(&mut c, &what)?;
                    cases += 1;
                }
            }
        }
    }
    eprintln!(
        "fault matrix, W = {w} on GPUs {:?}, offload {}: {cases} cases, state bit-identical and \
         the next rollout correct after each",
        pool.devices(),
        if overlap { "overlapped" } else { "settled" }
    );
    // Enter: 4 policies × 3 phases × 4; refresh: 4; exit: 7 (policy, phase) pairs × 4.
    assert_eq!(cases, 48 + 4 + 28);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Verification mode
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_hashes_and_the_non_finite_scan_match_the_host() -> Res {
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let n = 3_000_001usize;
    let words: Vec<u32> = (0..n as u64)
        .map(|i| (lifecycle_cuda::fill_uniform_value(3, i, 1.0)).to_bits())
        .collect();
    let table = ChunkTable::new([(5, 1_500_000), (1_600_000, 1_400_001)], 1 << 18);
    let expected = table.host_hashes_u32(&words);
    let halves: Vec<u16> = words.iter().map(|w| (w >> 16) as u16).collect();
    let t16 = ChunkTable::new([(0, n as u64)], 1 << 20);
    let expected16: Vec<u64> = (0..t16.len())
        .map(|i| {
            let (o, l) = t16.chunk(i);
            lifecycle_cuda::chunk_hash_u16(&halves[o as usize..(o + l) as usize])
        })
        .collect();
    let out = pool.run(&|ctx| {
        let k = ctx.verify_kernels()?;
        let mut dev = ctx
            .compute
            .clone_htod(&words)
            .map_err(ctx.drv("upload", 0))?;
        let d16 = ctx
            .compute
            .clone_htod(&halves)
            .map_err(ctx.drv("upload", 0))?;
        let p = dev.device_ptr(&ctx.compute).0;
        let p16 = d16.device_ptr(&ctx.compute).0;
        // SAFETY: both tables lie inside the uploaded buffers, alive until the downloads.
        let h = unsafe { k.hash(&ctx.compute, p, WordSize::B32, &table, ctx.rank)? }.download()?;
        // SAFETY: as above.
        let h16 =
            unsafe { k.hash(&ctx.compute, p16, WordSize::B16, &t16, ctx.rank)? }.download()?;
        // SAFETY: as above.
        let none = unsafe { k.first_nonfinite_f32(&ctx.compute, p, &table, ctx.rank)? };
        let mut bad = words.clone();
        bad[2_000_000] = f32::INFINITY.to_bits();
        bad[2_500_000] = f32::NAN.to_bits();
        bad[3] = f32::NAN.to_bits(); // outside every chunk: not scanned
        ctx.compute
            .memcpy_htod(&bad, &mut dev)
            .map_err(ctx.drv("upload", 0))?;
        // SAFETY: as above.
        let first = unsafe { k.first_nonfinite_f32(&ctx.compute, p, &table, ctx.rank)? };
        Ok((h, h16, none, first))
    })?;
    let (h, h16, none, first) = &out[0];
    assert_eq!(h, &expected, "32-bit hashes");
    assert_eq!(h16, &expected16, "16-bit hashes");
    assert_eq!(*none, None);
    assert_eq!(*first, Some(2_000_000));
    Ok(())
}

fn direct_ctx(metrics: &mut Metrics) -> SwitchContext<'_> {
    SwitchContext {
        memory: MemoryPolicy::default(),
        rec: PhaseRecorder::new(metrics),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_flipped_bit_in_offloaded_state_is_reported_with_its_tensor() -> Res {
    require_gpus(1)?;
    for world in WORLDS {
        flipped_offload_bit(world)?;
    }
    Ok(())
}

/// The flip lands on the last rank.
fn flipped_offload_bit(world: usize) -> Res {
    let rank = world - 1;
    let pool = pool(world)?;
    let specs = specs(world);
    let mut backend = FsdpBackend::new(pool, RolloutLayout::new(world, specs.clone())?)
        .with_config(config())?
        .with_verification(true);
    assert!(backend.verifies());
    let mut state = backend.synthetic_state(&shapes(&specs), 21, 0.05)?;
    let before = backend.download_state(&state)?;
    let mut metrics = Metrics::default();
    let plan = backend.plan(&state)?;
    let rollout = backend.enter(&plan, &mut state, &mut direct_ctx(&mut metrics))?;
    let tensor = "model.layers.0.mlp.up_proj.weight";
    assert!(state.inject_offloaded_bit_flip(rank, tensor, "adam_m", 7, 17)?);
    let err = backend
        .exit(&mut state, Some(rollout), &mut direct_ctx(&mut metrics))
        .expect_err("the flip is detected");
    match &err {
        FsdpError::Corrupted {
            rank: r,
            tensor: t,
            buffer: "adam_m",
            ..
        } if t == tensor && *r == rank => {}
        other => panic!("W={world}: expected adam_m of {tensor} on rank {rank}: {other}"),
    }
    assert!(
        err.to_string().contains(&format!(
            "adam_m of tensor `{tensor}` on rank {rank} is corrupted"
        )),
        "{err}"
    );
    assert!(
        state.optimizer_offloaded(),
        "the corrupted buffer stays offloaded"
    );
    assert!(!state.master_offloaded(), "everything else came back");
    // A retry fails the same way; undoing the flip lets it through, bit for bit.
    assert!(backend
        .exit(&mut state, None, &mut direct_ctx(&mut metrics))
        .is_err());
    assert!(state.inject_offloaded_bit_flip(rank, tensor, "adam_m", 7, 17)?);
    backend.exit(&mut state, None, &mut direct_ctx(&mut metrics))?;
    assert!(same_state(&before, &backend.download_state(&state)?));

    // Without verification the same flip goes unnoticed.
    let mut plain =
        FsdpBackend::new(backend.pool().clone(), backend.layout().clone()).with_config(config())?;
    let plan = plain.plan(&state)?;
    let rollout = plain.enter(&plan, &mut state, &mut direct_ctx(&mut metrics))?;
    assert!(state.inject_offloaded_bit_flip(0, "model.norm.weight", "master", 0, 3)?);
    plain.exit(&mut state, Some(rollout), &mut direct_ctx(&mut metrics))?;
    assert!(!state.master_offloaded());
    assert!(!same_state(&before, &plain.download_state(&state)?));
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_changed_rollout_tensor_is_reported_before_release() -> Res {
    require_gpus(1)?;
    for world in WORLDS {
        changed_rollout_tensor(world)?;
    }
    Ok(())
}

/// The change lands on the last rank.
fn changed_rollout_tensor(world: usize) -> Res {
    let rank = world - 1;
    let pool = pool(world)?;
    let specs = specs(world);
    let mut backend = FsdpBackend::new(pool, RolloutLayout::new(world, specs.clone())?)
        .with_config(config())?
        .with_verification(true);
    let mut state = backend.synthetic_state(&shapes(&specs), 22, 0.05)?;
    let before = backend.download_state(&state)?;
    let mut metrics = Metrics::default();
    let plan = backend.plan(&state)?;
    // An untouched rollout passes.
    let rollout = backend.enter(&plan, &mut state, &mut direct_ctx(&mut metrics))?;
    backend.exit(&mut state, Some(rollout), &mut direct_ctx(&mut metrics))?;
    let mut rollout = backend.enter(&plan, &mut state, &mut direct_ctx(&mut metrics))?;
    let tensor = "model.layers.0.self_attn.o_proj.weight";
    assert!(backend.inject_rollout_bit_flip(&mut rollout, rank, tensor, 4, 0)?);
    let err = backend
        .exit(&mut state, Some(rollout), &mut direct_ctx(&mut metrics))
        .expect_err("the flip is detected");
    match &err {
        FsdpError::RolloutCorrupted { rank: r, tensor: t } if t == tensor && *r == rank => {}
        other => panic!("W={world}: expected {tensor} on rank {rank}: {other}"),
    }
    assert!(err
        .to_string()
        .contains(&format!("`{tensor}` on rank {rank} changed while resident")));
    assert!(
        !state.master_offloaded() && !state.optimizer_offloaded(),
        "reloaded intact"
    );
    assert!(same_state(&before, &backend.download_state(&state)?));
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn non_finite_master_weights_are_refused_before_anything_moves() -> Res {
    require_gpus(1)?;
    for world in WORLDS {
        non_finite_refused(world)?;
    }
    Ok(())
}

fn non_finite_refused(world: usize) -> Res {
    let pool = pool(world)?;
    let specs = specs(world);
    let layout = RolloutLayout::new(world, specs.clone())?;
    // The bad value is row 12, column 5 of o_proj, [23, 6·W]. At W = 2 rank 1 holds rows 12..23,
    // so it is rank 1's element 5; at W = 1 rank 0 holds every row: element 12·6 + 5.
    let cols = 6 * world;
    let (rank, index) = if world == 2 {
        (1, 5)
    } else {
        (0, 12 * cols + 5)
    };
    for (bad, text) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
    ] {
        let tensors: Vec<HostTensor> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut data: Vec<f32> = (0..s.numel())
                    .map(|e| lifecycle_cuda::fill_uniform_value(i as u64, e as u64, 0.1))
                    .collect();
                if s.name == "model.layers.0.self_attn.o_proj.weight" {
                    data[12 * cols + 5] = bad;
                }
                HostTensor::f32(s.name.clone(), s.shape.clone(), data)
            })
            .collect();
        let backend = FsdpBackend::new(pool.clone(), layout.clone())
            .with_config(config())?
            .with_verification(true);
        let state = backend.state_from_tensors(tensors.clone())?;
        let before = backend.download_state(&state)?;
        let mut lc = Lifecycle::new(backend, state);
        let err = lc.rollout().map(|_| ()).expect_err("non-finite weights");
        match &err {
            LifecycleError::Plan(FsdpError::NonFinite {
                tensor,
                rank: r,
                index: i,
                value,
            }) if tensor == "model.layers.0.self_attn.o_proj.weight"
                && (*r, *i) == (rank, index as u64)
                && value.to_bits() == bad.to_bits() => {}
            other => panic!("W={world} {text}: {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(text) && msg.contains(&format!("element {index} of rank {rank}")),
            "{msg}"
        );
        assert_eq!(lc.metrics().bytes().moved() + lc.metrics().bytes().local, 0);
        assert!(same_state(
            &before,
            &lc.backend().download_state(lc.peek_state())?
        ));
        // Without verification the switch's own casts find it (no scan before), name it by the
        // scan that runs only then, and the lifecycle is restored: the state as it was.
        let plain = FsdpBackend::new(pool.clone(), layout.clone()).with_config(config())?;
        let state = plain.state_from_tensors(tensors)?;
        let before = plain.download_state(&state)?;
        let mut lc = Lifecycle::new(plain, state);
        for attempt in 0..2 {
            let err = lc
                .rollout()
                .map(|_| ())
                .expect_err("non-finite weights, unverified");
            match &err {
                LifecycleError::Enter {
                    source:
                        FsdpError::NonFinite {
                            tensor,
                            rank: r,
                            index: i,
                            value,
                        },
                    after: AfterFailure::Restored,
                } if tensor == "model.layers.0.self_attn.o_proj.weight"
                    && (*r, *i) == (rank, index as u64)
                    && value.to_bits() == bad.to_bits() => {}
                other => panic!("W={world} {text}, unverified, attempt {attempt}: {other}"),
            }
            assert!(!lc.rollout_is_current());
            assert!(same_state(
                &before,
                &lc.backend().download_state(lc.peek_state())?
            ));
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn verified_cycles_keep_the_state_and_rollouts_exact() -> Res {
    require_gpus(1)?;
    for world in WORLDS {
        verified_cycles(world)?;
    }
    Ok(())
}

fn verified_cycles(world: usize) -> Res {
    let pool = pool(world)?;
    assert!(pool.local_ranks().len() == world);
    for (name, memory) in policies(&pool)? {
        let name = format!("W={world} {name}");
        let specs = specs(world);
        let layout = RolloutLayout::new(world, specs.clone())?;
        let backend = FsdpBackend::new(pool.clone(), layout.clone())
            .with_config(config())?
            .with_verification(true);
        let state = backend.synthetic_state(&shapes(&specs), 30, 0.05)?;
        let before = backend.download_state(&state)?;
        let reference = reference_rollout(&host_twin(&backend, &state)?, &layout)?;
        let mut lc = Lifecycle::with_config(
            backend,
            state,
            LifecycleConfig {
                switching: Switching::Eager,
                memory,
            },
        )?;
        for cycle in 0..20 {
            let s = lc.rollout()?;
            if cycle % 5 == 0 {
                let got = s.backend().download_rollout(&s.weights())?;
                assert_eq!(
                    got.first_difference(&reference),
                    None,
                    "{name} cycle {cycle}"
                );
            }
            s.finish()?;
            let _ = lc.train()?.state_mut();
        }
        let after = lc.backend().download_state(lc.peek_state())?;
        assert!(same_state(&before, &after), "{name}");
    }
    Ok(())
}
