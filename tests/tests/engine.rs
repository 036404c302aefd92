//! The rollout engine as a resource of the lifecycle, on the host backend, with a reference engine
//! that counts its wakes and sleeps, allocates a KV cache on wake and keeps a host-side prefix
//! cache across calls:
//!
//! - lazy: one wake per weight version, rollout memory kept across calls, released at exit;
//! - free each call: a wake and a sleep around every call;
//! - hook order: wake after the backend's enter (training state already offloaded), sleep before
//!   its exit, under every switching and memory policy (a property test replays the event log);
//! - peak memory of each phase (engine memory included) in the metrics;
//! - failed hooks: a failed wake leaves the lifecycle in rollout mode with the engine asleep and
//!   the weights current; a failed sleep keeps the training state away until the engine sleeps;
//! - the prefix cache serves an entry within its weight version, never after an update.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lifecycle_core::{
    sharded_rollout, EngineAfter, EngineBytes, EngineHook, EngineMemory, EngineMut, EngineState,
    Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, LifecycleConfig, LifecycleError,
    MemoryPolicy, Metrics, Mode, Phase, PhaseScope, PrefixCache, Reshard, RolloutEngine,
    RolloutView, SwitchContext, Switching,
};
use lifecycle_host::{HostBackend, HostError, HostTrainState};
use lifecycle_layout::HostRollout;
use proptest::prelude::*;

/// What happened, in order: the backend's switches and the engine's hooks and calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// The backend's enter finished; whether the training state was offloaded by then.
    Entered { offloaded: bool },
    /// The backend's in-place refresh finished.
    Refreshed,
    /// The backend's exit starts; whether it releases the rollout weights.
    Exiting { releases: bool },
    /// The engine woke for this weight version.
    Wake { version: u64 },
    /// The engine went to sleep.
    Sleep,
    /// A rollout call ran at this version.
    Call { version: u64 },
}

type Log = Arc<Mutex<Vec<Event>>>;

fn push(log: &Log, event: Event) {
    log.lock().unwrap_or_else(|p| p.into_inner()).push(event);
}

fn events(log: &Log) -> Vec<Event> {
    std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()))
}

/// The host backend, logging when its switches finish (enter, refresh) and start (exit).
struct Logged {
    inner: HostBackend,
    log: Log,
}

impl Reshard for Logged {
    type TrainState = HostTrainState;
    type Rollout = HostRollout;
    type Plan = <HostBackend as Reshard>::Plan;
    type Error = HostError;

    fn plan(&self, state: &HostTrainState) -> Result<Self::Plan, HostError> {
        self.inner.plan(state)
    }

    fn enter(
        &mut self,
        plan: &Self::Plan,
        state: &mut HostTrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<HostRollout, HostError> {
        let rollout = self.inner.enter(plan, state, ctx)?;
        let offloaded = state.is_offloaded();
        push(&self.log, Event::Entered { offloaded });
        Ok(rollout)
    }

    fn refresh(
        &mut self,
        plan: &Self::Plan,
        state: &mut HostTrainState,
        rollout: &mut HostRollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), HostError> {
        self.inner.refresh(plan, state, rollout, ctx)?;
        push(&self.log, Event::Refreshed);
        Ok(())
    }

    fn exit(
        &mut self,
        state: &mut HostTrainState,
        rollout: Option<HostRollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), HostError> {
        let releases = rollout.is_some();
        push(&self.log, Event::Exiting { releases });
        self.inner.exit(state, rollout, ctx)
    }
}

/// How an injected engine failure fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    Error,
    Panic,
}

#[derive(Debug, PartialEq, Eq)]
enum KvError {
    OutOfMemory { wanted: u64, free: u64 },
    Busy,
}

impl std::fmt::Display for KvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvError::OutOfMemory { wanted, free } => write!(
                f,
                "KV cache of {wanted} bytes does not fit: {free} bytes free"
            ),
            KvError::Busy => f.write_str("the KV cache is still in use by a stream"),
        }
    }
}

impl std::error::Error for KvError {}

/// The reference engine: a KV cache of `kv_bytes` allocated on wake and freed on sleep, and a
/// prefix cache of computed logits kept in host memory across sleeps (so only its version brand
/// keeps it from serving old weights). A naive, unversioned map beside it shows what would be
/// served without the brand.
struct KvEngine {
    log: Log,
    kv_bytes: u64,
    kv: Option<Vec<u8>>,
    prefix: PrefixCache<u32, f32>,
    naive: HashMap<Vec<u32>, f32>,
    wakes: u64,
    sleeps: u64,
    fail_wake: Vec<Fail>,
    fail_sleep: Vec<Fail>,
}

const KV_BYTES: u64 = 4096;

impl KvEngine {
    fn new(log: Log) -> Self {
        KvEngine {
            log,
            kv_bytes: KV_BYTES,
            kv: None,
            prefix: PrefixCache::new(),
            naive: HashMap::new(),
            wakes: 0,
            sleeps: 0,
            fail_wake: Vec::new(),
            fail_sleep: Vec::new(),
        }
    }

    fn prefix_bytes(&self) -> u64 {
        (self.prefix.len() * 4) as u64
    }
}

impl RolloutEngine<HostRollout> for KvEngine {
    type Error = KvError;

    fn wake(
        &mut self,
        weights: RolloutView<'_, HostRollout>,
        _scope: &mut PhaseScope,
    ) -> Result<(), KvError> {
        // Half the cache first: a failure part way leaves something for `sleep` to free.
        self.kv = Some(vec![0; (self.kv_bytes / 2) as usize]);
        match self.fail_wake.pop() {
            Some(Fail::Error) => {
                return Err(KvError::OutOfMemory {
                    wanted: self.kv_bytes,
                    free: self.kv_bytes / 2,
                })
            }
            Some(Fail::Panic) => panic!("injected panic while allocating the KV cache"),
            None => {}
        }
        self.kv = Some(vec![0; self.kv_bytes as usize]);
        self.wakes += 1;
        push(
            &self.log,
            Event::Wake {
                version: weights.version(),
            },
        );
        Ok(())
    }

    fn sleep(&mut self, _scope: &mut PhaseScope) -> Result<(), KvError> {
        match self.fail_sleep.pop() {
            Some(Fail::Error) => return Err(KvError::Busy),
            Some(Fail::Panic) => panic!("injected panic while freeing the KV cache"),
            None => {}
        }
        self.kv = None;
        self.sleeps += 1;
        push(&self.log, Event::Sleep);
        Ok(())
    }

    fn memory(&self) -> EngineBytes {
        EngineBytes {
            device: self.kv.as_ref().map_or(0, |kv| kv.len() as u64),
            host: self.prefix_bytes(),
        }
    }
}

/// A logit of `prompt` under `weights` (what a decoder would compute, in miniature).
fn score(weights: &HostRollout, prompt: &[u32]) -> f32 {
    let data = &weights.ranks[0].tensors[0].data;
    prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| data[(i + t as usize) % data.len()].to_f32() * (t as f32 + 1.0))
        .sum()
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Generated {
    logit: f32,
    version: u64,
    from_cache: bool,
    kv_ready: bool,
}

/// One rollout call: serves the prompt's logit from the prefix cache when built at this version.
#[sharded_rollout]
fn generate(
    weights: RolloutView<'_, HostRollout>,
    mut engine: EngineMut<'_, KvEngine>,
    prompt: &[u32],
) -> Generated {
    let version = weights.version();
    push(&engine.log, Event::Call { version });
    let kv_ready = engine.kv.is_some();
    if let Some((len, logit)) = engine.prefix.longest_prefix(weights, prompt)
        && len == prompt.len()
    {
        return Generated {
            logit: *logit,
            version,
            from_cache: true,
            kv_ready,
        };
    }
    let logit = score(&weights, prompt);
    engine.prefix.insert(weights, prompt.to_vec(), logit);
    engine.naive.insert(prompt.to_vec(), logit);
    Generated {
        logit,
        version,
        from_cache: false,
        kv_ready,
    }
}

/// The logit computed from the resident weights, no cache.
#[sharded_rollout]
fn fresh_score(weights: RolloutView<'_, HostRollout>, prompt: &[u32]) -> f32 {
    score(&weights, prompt)
}

type Lc = Lifecycle<Logged, KvEngine>;
type TestResult<T = ()> = Result<T, LifecycleError<HostError>>;

const PROMPT: &[u32] = &[3, 1, 4, 1, 5];

fn setup(config: LifecycleConfig, memory: EngineMemory) -> (Lc, Log) {
    let specs = common::specs(2);
    let layout = common::layout(2, specs.clone());
    let log = Log::default();
    let backend = Logged {
        inner: HostBackend::new(layout),
        log: log.clone(),
    };
    let mut lc = Lifecycle::with_config(backend, common::state(2, &specs, 7), config)
        .expect("a consistent configuration")
        .with_engine(KvEngine::new(log.clone()));
    lc.set_engine_memory(memory);
    (lc, log)
}

fn lazy(memory: EngineMemory) -> (Lc, Log) {
    setup(LifecycleConfig::default(), memory)
}

fn update(lc: &mut Lc, step: u64) -> TestResult {
    common::perturb(lc.train()?.state_mut(), step);
    Ok(())
}

fn masters(state: &HostTrainState) -> Vec<Vec<f32>> {
    common::specs(2)
        .iter()
        .map(|s| {
            state
                .full_master(&s.name)
                .expect("every tensor has masters")
        })
        .collect()
}

use Event::{Call, Entered, Exiting, Refreshed, Sleep, Wake};

const ENTERED: Event = Entered { offloaded: true };
const EXITING: Event = Exiting { releases: true };

#[test]
fn lazy_wakes_once_per_version_and_keeps_rollout_memory_until_exit() -> TestResult {
    let (mut lc, log) = lazy(EngineMemory::KeepAcrossCalls);
    for _ in 0..3 {
        let out = generate(&mut lc, PROMPT)?;
        assert!(out.kv_ready, "the KV cache is allocated during every call");
        assert_eq!(
            lc.engine().memory().device,
            KV_BYTES,
            "kept across lazy calls"
        );
        assert_eq!(lc.engine_state(), EngineState::Awake);
    }
    update(&mut lc, 1)?;
    assert_eq!(
        lc.engine().memory().device,
        0,
        "released when training takes over"
    );
    assert_eq!(lc.engine_state(), EngineState::Asleep);
    for _ in 0..3 {
        generate(&mut lc, PROMPT)?;
    }
    lc.exit()?;
    assert_eq!(lc.engine().memory().device, 0, "released at exit");
    assert_eq!((lc.engine().wakes, lc.engine().sleeps), (2, 2));
    let m = lc.metrics();
    assert_eq!((m.engine.wakes, m.engine.sleeps), (2, 2));
    assert_eq!((m.enters, m.exits, m.rollout_calls), (2, 2, 6));
    let v0 = Call { version: 0 };
    let v1 = Call { version: 1 };
    assert_eq!(
        events(&log),
        [
            ENTERED,
            Wake { version: 0 },
            v0,
            v0,
            v0,
            Sleep,
            EXITING,
            ENTERED,
            Wake { version: 1 },
            v1,
            v1,
            v1,
            Sleep,
            EXITING,
        ]
    );
    Ok(())
}

#[test]
fn free_each_call_wakes_and_sleeps_around_every_call() -> TestResult {
    let (mut lc, log) = lazy(EngineMemory::FreeEachCall);
    for _ in 0..3 {
        let out = generate(&mut lc, PROMPT)?;
        assert!(out.kv_ready);
        assert_eq!(
            lc.engine().memory().device,
            0,
            "freed at the end of the call"
        );
        assert_eq!(lc.mode(), Mode::Rollout, "the weights stay resident (lazy)");
    }
    update(&mut lc, 1)?;
    generate(&mut lc, PROMPT)?;
    let call = Call { version: 0 };
    let mut expected = vec![ENTERED];
    for _ in 0..3 {
        expected.extend([Wake { version: 0 }, call, Sleep]);
    }
    expected.extend([
        EXITING,
        ENTERED,
        Wake { version: 1 },
        Call { version: 1 },
        Sleep,
    ]);
    assert_eq!(events(&log), expected);
    assert_eq!((lc.metrics().enters, lc.metrics().engine.wakes), (2, 4));
    // explicit enter does not wake under this policy: the next call does
    lc.exit()?;
    lc.enter()?;
    assert_eq!(lc.engine_state(), EngineState::Asleep);
    Ok(())
}

#[test]
fn eager_switching_sleeps_before_every_exit() -> TestResult {
    let config = LifecycleConfig {
        switching: Switching::Eager,
        ..LifecycleConfig::default()
    };
    let (mut lc, log) = setup(config, EngineMemory::KeepAcrossCalls);
    for _ in 0..2 {
        generate(&mut lc, PROMPT)?;
        assert_eq!(
            (lc.mode(), lc.engine_state()),
            (Mode::Train, EngineState::Asleep)
        );
    }
    let one = [
        ENTERED,
        Wake { version: 0 },
        Call { version: 0 },
        Sleep,
        EXITING,
    ];
    assert_eq!(events(&log), [one, one].concat());
    Ok(())
}

#[test]
fn in_place_refresh_wakes_after_the_refresh() -> TestResult {
    let config = LifecycleConfig {
        memory: MemoryPolicy {
            keep_rollout_resident: true,
            ..MemoryPolicy::resident()
        },
        ..LifecycleConfig::default()
    };
    let (mut lc, log) = setup(config, EngineMemory::KeepAcrossCalls);
    generate(&mut lc, PROMPT)?;
    update(&mut lc, 1)?;
    generate(&mut lc, PROMPT)?;
    assert_eq!(
        events(&log),
        [
            Entered { offloaded: false },
            Wake { version: 0 },
            Call { version: 0 },
            Sleep,
            Exiting { releases: false },
            Refreshed,
            Wake { version: 1 },
            Call { version: 1 },
        ]
    );
    Ok(())
}

#[test]
fn a_failed_enter_never_wakes_the_engine() {
    let specs = common::specs(2);
    let log = Log::default();
    let (backend, faults) = FaultInjector::new(Logged {
        inner: HostBackend::new(common::layout(2, specs.clone())),
        log: log.clone(),
    });
    let mut lc = Lifecycle::new(backend, common::state(2, &specs, 7))
        .with_engine(KvEngine::new(log.clone()));
    faults.inject(Fault::new(Phase::Offload, FaultAt::End, FaultKind::Error));
    let err = generate(&mut lc, PROMPT).expect_err("the enter fails");
    assert!(err.to_string().contains("injected fault"), "{err}");
    assert_eq!(
        (lc.mode(), lc.engine_state()),
        (Mode::Train, EngineState::Asleep)
    );
    assert_eq!(lc.engine().wakes, 0);
    assert!(!events(&log).contains(&Wake { version: 0 }));
    assert!(generate(&mut lc, PROMPT).is_ok_and(|g| g.kv_ready));
}

#[test]
fn peak_memory_of_each_phase_includes_the_engine() -> TestResult {
    let (mut lc, _log) = lazy(EngineMemory::KeepAcrossCalls);
    generate(&mut lc, PROMPT)?;
    generate(&mut lc, &[2, 7])?;
    update(&mut lc, 1)?;
    generate(&mut lc, PROMPT)?;
    lc.exit()?;
    let m = lc.metrics();
    let wake = m.phase(Phase::Wake);
    let sleep = m.phase(Phase::Sleep);
    assert_eq!((wake.count, sleep.count), (2, 2));
    assert_eq!(wake.peak_engine_bytes, KV_BYTES);
    assert_eq!(sleep.peak_engine_bytes, KV_BYTES, "what the sleep released");
    for phase in Phase::ALL {
        assert!(m.phase(phase).count > 0, "{phase} ran");
        assert_eq!(
            m.phase(phase).peak_engine_bytes,
            0,
            "{phase}: the backend never switches while the KV cache is allocated"
        );
    }
    assert_eq!(m.engine.peak_device_bytes, KV_BYTES);
    assert_eq!(
        m.engine.peak_host_bytes, 8,
        "two prefix entries at version 0"
    );
    assert_eq!(m.peak_engine_bytes(), KV_BYTES);
    let table = m.table();
    assert!(
        table.contains("wake") && table.contains("engine mem"),
        "{table}"
    );
    assert!(
        m.summary_line().contains("engine wakes 2 / sleeps 2"),
        "{table}"
    );
    let delta = m.since(&Metrics::default());
    assert_eq!(delta.engine.wakes, 2);

    // Without an engine nothing about engines is recorded or shown.
    let specs = common::specs(2);
    let mut plain = Lifecycle::new(
        HostBackend::new(common::layout(2, specs.clone())),
        common::state(2, &specs, 7),
    );
    plain.rollout()?.finish()?;
    plain.exit()?;
    assert_eq!(plain.metrics().phase(Phase::Wake).count, 0);
    assert_eq!(plain.metrics().engine, Default::default());
    assert!(!plain.metrics().table().contains("wake"));
    assert!(!plain.metrics().summary_line().contains("engine"));
    Ok(())
}

#[test]
fn a_failed_wake_leaves_rollout_mode_with_the_engine_asleep() -> TestResult {
    for kind in [Fail::Error, Fail::Panic] {
        let (mut lc, log) = lazy(EngineMemory::KeepAcrossCalls);
        let before = masters(lc.peek_state());
        lc.engine_mut().fail_wake.push(kind);
        let err = generate(&mut lc, PROMPT).expect_err("the wake fails");
        match (&err, kind) {
            (
                LifecycleError::Engine {
                    hook: EngineHook::Wake,
                    after: EngineAfter::Asleep,
                    ..
                },
                Fail::Error,
            ) => {
                assert_eq!(
                    err.engine_source::<KvError>(),
                    Some(&KvError::OutOfMemory {
                        wanted: KV_BYTES,
                        free: KV_BYTES / 2
                    })
                );
                assert!(err.to_string().contains("does not fit"), "{err}");
            }
            (
                LifecycleError::EnginePanicked {
                    hook: EngineHook::Wake,
                    message,
                    after: EngineAfter::Asleep,
                },
                Fail::Panic,
            ) => assert!(message.contains("injected panic"), "{message}"),
            _ => panic!("{kind:?}: unexpected error {err}"),
        }
        assert!(
            err.to_string().contains("next rollout() retries the wake"),
            "{err}"
        );
        // Rollout mode, current weights resident, no engine memory left (the recovery sleep
        // freed the half-allocated cache).
        assert_eq!(lc.mode(), Mode::Rollout);
        assert!(lc.rollout_is_current());
        assert_eq!(lc.engine_state(), EngineState::Asleep);
        assert_eq!(lc.engine().memory().device, 0);
        assert_eq!(lc.metrics().engine.failed_wakes, 1);
        assert_eq!(events(&log), [ENTERED, Sleep]);

        // The next call wakes without switching again.
        let out = generate(&mut lc, PROMPT)?;
        assert!(out.kv_ready);
        assert_eq!((lc.metrics().enters, lc.engine().wakes), (1, 1));
        assert_eq!(events(&log), [Wake { version: 0 }, Call { version: 0 }]);

        // Training works as usual and nothing was lost.
        lc.train()?;
        assert_eq!(masters(lc.peek_state()), before);
    }
    Ok(())
}

#[test]
fn training_after_a_failed_wake_does_not_sleep_again() -> TestResult {
    let (mut lc, log) = lazy(EngineMemory::KeepAcrossCalls);
    lc.engine_mut().fail_wake.push(Fail::Error);
    assert!(generate(&mut lc, PROMPT).is_err());
    update(&mut lc, 1)?;
    assert_eq!(events(&log), [ENTERED, Sleep, EXITING]);
    assert_eq!(lc.mode(), Mode::Train);
    Ok(())
}

#[test]
fn a_failed_wake_whose_recovery_fails_is_retried_first() -> TestResult {
    let (mut lc, log) = lazy(EngineMemory::KeepAcrossCalls);
    lc.engine_mut().fail_wake.push(Fail::Error);
    lc.engine_mut().fail_sleep.push(Fail::Error);
    let err = generate(&mut lc, PROMPT).expect_err("wake and its recovery fail");
    match err.engine_after() {
        Some(EngineAfter::SleepFailed { recovery }) => {
            assert!(recovery.contains("still in use"), "{recovery}")
        }
        other => panic!("unexpected {other:?}: {err}"),
    }
    assert_eq!(lc.engine_state(), EngineState::SleepFailed);
    assert_eq!(
        lc.engine().memory().device,
        KV_BYTES / 2,
        "the half cache is still held"
    );
    generate(&mut lc, PROMPT)?;
    assert_eq!(
        events(&log),
        [ENTERED, Sleep, Wake { version: 0 }, Call { version: 0 }]
    );
    Ok(())
}

#[test]
fn a_failed_sleep_keeps_the_training_state_away_until_the_engine_sleeps() -> TestResult {
    for kind in [Fail::Error, Fail::Panic] {
        let (mut lc, log) = lazy(EngineMemory::KeepAcrossCalls);
        let before = masters(lc.peek_state());
        generate(&mut lc, PROMPT)?;
        events(&log);
        lc.engine_mut().fail_sleep.push(kind);
        let err = lc.train().map(|_| ()).expect_err("the sleep fails");
        assert!(
            matches!(
                (&err, kind),
                (
                    LifecycleError::Engine {
                        hook: EngineHook::Sleep,
                        after: EngineAfter::SleepFailed { .. },
                        ..
                    },
                    Fail::Error
                ) | (
                    LifecycleError::EnginePanicked {
                        hook: EngineHook::Sleep,
                        after: EngineAfter::SleepFailed { .. },
                        ..
                    },
                    Fail::Panic
                )
            ),
            "{kind:?}: {err}"
        );
        assert!(
            err.to_string().contains("before the backend's exit"),
            "{err}"
        );
        // The backend's exit did not run: the KV cache may still be on the device.
        assert_eq!(events(&log), []);
        assert_eq!(lc.mode(), Mode::Rollout);
        assert_eq!(lc.engine_state(), EngineState::SleepFailed);
        assert_eq!(lc.metrics().engine.failed_sleeps, 1);
        assert!(lc.peek_state().is_offloaded());

        // The next operation retries the sleep, then exits.
        update(&mut lc, 1)?;
        assert_eq!(events(&log), [Sleep, EXITING]);
        assert_eq!(lc.engine_state(), EngineState::Asleep);
        assert_ne!(masters(lc.peek_state()), before, "the update ran");
    }
    Ok(())
}

#[test]
fn a_dropped_session_under_free_each_call_sleeps_at_the_next_operation() -> TestResult {
    let (mut lc, log) = lazy(EngineMemory::FreeEachCall);
    drop(lc.rollout()?);
    assert_eq!(lc.engine_state(), EngineState::Awake);
    generate(&mut lc, PROMPT)?;
    let v0 = Wake { version: 0 };
    assert_eq!(
        events(&log),
        [ENTERED, v0, Sleep, v0, Call { version: 0 }, Sleep]
    );
    Ok(())
}

#[test]
fn the_prefix_cache_is_served_within_a_version_and_never_across() -> TestResult {
    let (mut lc, _log) = lazy(EngineMemory::KeepAcrossCalls);
    let built = generate(&mut lc, PROMPT)?;
    assert!(!built.from_cache);
    // Several rollout calls at the same version: served from the cache.
    for _ in 0..3 {
        let served = generate(&mut lc, PROMPT)?;
        assert!(served.from_cache, "served within version {}", built.version);
        assert_eq!(served.logit, built.logit);
    }
    // A training update: the prefix (kept in host memory across the sleep) is not served.
    update(&mut lc, 1)?;
    assert_eq!(
        lc.engine().prefix.len(),
        1,
        "still stored, branded with version 0"
    );
    let after = generate(&mut lc, PROMPT)?;
    assert_eq!(after.version, built.version + 1);
    assert!(
        !after.from_cache,
        "an entry of version 0 must not be served at version 1"
    );
    assert_eq!(after.logit, fresh_score(&mut lc, PROMPT)?);
    assert_ne!(after.logit, built.logit, "the update changed the logit");
    let stats = lc.engine().prefix.stats();
    assert_eq!((stats.hits, stats.invalidations), (3, 1));
    // And the rebuilt entry is served again within version 1.
    assert!(generate(&mut lc, PROMPT)?.from_cache);
    Ok(())
}

#[test]
fn an_unversioned_cache_would_serve_the_old_policy() -> TestResult {
    // The control for the test above: the scenario does catch stale entries.
    let (mut lc, _log) = lazy(EngineMemory::KeepAcrossCalls);
    let built = generate(&mut lc, PROMPT)?;
    update(&mut lc, 1)?;
    let stale = lc.engine().naive.get(PROMPT).copied();
    assert_eq!(stale, Some(built.logit));
    assert_ne!(stale, Some(fresh_score(&mut lc, PROMPT)?));
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Call,
    Update,
    ReadTrain,
    Enter,
    Exit,
    DropSession,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Call),
        2 => Just(Op::Update),
        1 => Just(Op::ReadTrain),
        1 => Just(Op::Enter),
        1 => Just(Op::Exit),
        1 => Just(Op::DropSession),
    ]
}

/// Replays the log: the engine wakes only after the backend's enter or refresh, sleeps before
/// every exit, and every call runs with the engine awake for the weights it reads.
fn check_order(log: &[Event], offloads: bool) -> Result<(), String> {
    // Whether rollout weights are resident (entered or refreshed, and not released since).
    let mut resident = false;
    let mut awake: Option<u64> = None;
    for (i, event) in log.iter().enumerate() {
        let at = || format!("event {i} ({event:?}) of {log:?}");
        match *event {
            Entered { offloaded } => {
                if awake.is_some() || offloaded != offloads {
                    return Err(at());
                }
                resident = true;
            }
            Refreshed => {
                if awake.is_some() {
                    return Err(at());
                }
                resident = true;
            }
            Wake { version } => {
                if !resident || awake.is_some() {
                    return Err(at());
                }
                awake = Some(version);
            }
            Call { version } => {
                if awake != Some(version) {
                    return Err(at());
                }
            }
            Sleep => awake = None,
            Exiting { releases } => {
                if awake.is_some() {
                    return Err(at());
                }
                resident &= !releases;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_engine_is_awake_only_between_enter_and_exit(
        ops in prop::collection::vec(op(), 1..30),
        eager in any::<bool>(),
        free_each_call in any::<bool>(),
        memory in 0..3u8,
    ) {
        let memory = match memory {
            0 => MemoryPolicy::default(),
            1 => MemoryPolicy::resident(),
            _ => MemoryPolicy { keep_rollout_resident: true, ..MemoryPolicy::resident() },
        };
        let config = LifecycleConfig {
            switching: if eager { Switching::Eager } else { Switching::Lazy },
            memory,
        };
        let engine_memory = if free_each_call {
            EngineMemory::FreeEachCall
        } else {
            EngineMemory::KeepAcrossCalls
        };
        let (mut lc, log) = setup(config, engine_memory);
        let mut all = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Call => {
                    let out = generate(&mut lc, PROMPT).unwrap();
                    prop_assert!(out.kv_ready);
                    prop_assert_eq!(out.version, lc.version());
                    prop_assert_eq!(out.logit, fresh_score(&mut lc, PROMPT).unwrap());
                }
                Op::Update => update(&mut lc, step as u64).unwrap(),
                Op::ReadTrain => { lc.train().unwrap(); }
                Op::Enter => lc.enter().unwrap(),
                Op::Exit => lc.exit().unwrap(),
                Op::DropSession => drop(lc.rollout().unwrap()),
            }
            let awake = lc.engine_state() == EngineState::Awake;
            prop_assert_eq!(awake, lc.engine().memory().device > 0, "{:?}", op);
            if awake {
                prop_assert!(lc.mode() == Mode::Rollout && lc.rollout_is_current(), "{:?}", op);
            }
            if free_each_call && matches!(op, Op::Call) {
                prop_assert!(!awake, "free each call: asleep after a call");
            }
            all.extend(events(&log));
        }
        lc.exit().unwrap();
        all.extend(events(&log));
        let offloads = memory.offload_params || memory.offload_optimizer;
        if let Err(e) = check_order(&all, offloads) {
            return Err(TestCaseError::fail(e));
        }
        prop_assert_eq!(lc.engine().wakes, lc.engine().sleeps);
        prop_assert_eq!(lc.engine().memory().device, 0);
    }
}
