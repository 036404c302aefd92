//! The [`Lifecycle`]: owner of the training state, the backend and the resident rollout weights.

use crate::engine::{EngineMemory, EngineState, RolloutEngine};
use crate::error::{
    guarded, AfterFailure, EngineAfter, EngineHook, Failure, LifecycleError, Operation,
};
use crate::metrics::Metrics;
use crate::phase::Phase;
use crate::policy::{LifecycleConfig, Switching};
use crate::recorder::PhaseRecorder;
use crate::reshard::{Reshard, SwitchContext};
use crate::trace::Trace;
use crate::view::RolloutView;

/// Which layout is live ([`Lifecycle::mode`]).
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Mode};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     assert_eq!(lc.mode(), Mode::Train);
///     lc.rollout()?.finish()?;
///     assert_eq!(lc.mode(), Mode::Rollout);            // lazy: stays until training asks
///     lc.train()?;
///     assert_eq!(lc.mode(), Mode::Train);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The training state is on the device; rollout weights are absent (or kept resident, stale
    /// or not, when the memory policy says so).
    Train,
    /// Rollout weights of the current version are resident; training state is offloaded as the
    /// memory policy says.
    Rollout,
    /// A switch and its recovery failed: the training state may be partly offloaded (nothing is
    /// dropped). The next [`train`](Lifecycle::train), [`exit`](Lifecycle::exit) or
    /// [`rollout`](Lifecycle::rollout) first retries bringing it back.
    Faulted,
}

pub(crate) struct Resident<W> {
    pub(crate) weights: W,
    /// Version of the training weights the rollout weights were built from; `None` if a refresh
    /// failed half way.
    pub(crate) version: Option<u64>,
}

/// Owns a backend, its training state, (while resident) its rollout weights and, when one is
/// attached, the rollout engine `E` (see [`RolloutEngine`]; `()` is the no-op engine).
///
/// Rollout weights are reachable only through a [`RolloutSession`](crate::RolloutSession) and the
/// training state only through a [`TrainSession`](crate::TrainSession); both borrow the lifecycle
/// mutably, so rollout weights cannot be used across a training update. Every mutable access to
/// the training state bumps the [`version`](Lifecycle::version); a rollout that finds weights of
/// the current version resident moves zero bytes.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     for _ in 0..3 {
///         let session = lc.rollout()?;              // enters once, then reuses
///         assert_eq!(session.weights()[1], 2.0);
///         session.finish()?;
///     }
///     lc.train()?.state_mut()[1] = 5.0;             // exits, bumps the version
///     assert_eq!(lc.version(), 1);
///     assert_eq!(lc.rollout()?.weights()[1], 5.0);
///     assert_eq!(lc.metrics().enters, 2);
///     assert_eq!(lc.metrics().reuses, 2);
///     let (_backend, state) = lc.into_parts()?;     // leaves rollout mode, hands the state back
///     assert_eq!(state, [1.0, 5.0]);
///     Ok(())
/// }
/// ```
pub struct Lifecycle<B: Reshard, E = ()> {
    pub(crate) backend: B,
    pub(crate) state: B::TrainState,
    pub(crate) resident: Option<Resident<B::Rollout>>,
    pub(crate) version: u64,
    pub(crate) mode: Mode,
    pub(crate) config: LifecycleConfig,
    pub(crate) metrics: Metrics,
    /// A session ended without `finish` under the eager policy: exit before the next operation.
    pub(crate) exit_due: bool,
    pub(crate) trace: Trace,
    pub(crate) engine: E,
    pub(crate) engine_state: EngineState,
    pub(crate) engine_memory: EngineMemory,
    /// A session ended without `finish` under [`EngineMemory::FreeEachCall`]: sleep before the
    /// next operation.
    pub(crate) sleep_due: bool,
}

impl<B: Reshard> Lifecycle<B, ()> {
    /// A lifecycle in train mode with the default configuration (lazy switching, master weights
    /// and optimizer state offloaded during rollout) and no engine.
    pub fn new(backend: B, state: B::TrainState) -> Self {
        Lifecycle {
            backend,
            state,
            resident: None,
            version: 0,
            mode: Mode::Train,
            config: LifecycleConfig::default(),
            metrics: Metrics::default(),
            exit_due: false,
            trace: Trace::disabled(),
            engine: (),
            engine_state: EngineState::Asleep,
            engine_memory: EngineMemory::default(),
            sleep_due: false,
        }
    }

    /// A lifecycle in train mode with `config`, checked for consistency.
    pub fn with_config(
        backend: B,
        state: B::TrainState,
        config: LifecycleConfig,
    ) -> Result<Self, LifecycleError<B::Error>> {
        config.memory.validate().map_err(LifecycleError::Config)?;
        let mut lc = Lifecycle::new(backend, state);
        lc.config = config;
        Ok(lc)
    }

    /// Attaches a rollout engine, asleep, with [`EngineMemory::KeepAcrossCalls`] (change it with
    /// [`set_engine_memory`](Lifecycle::set_engine_memory)). It lives as long as the lifecycle:
    /// from now on every switch into rollout mode wakes it after the backend's enter, and every
    /// switch back puts it to sleep before the backend's exit. See [`RolloutEngine`] for an
    /// example.
    pub fn with_engine<E: RolloutEngine<B::Rollout>>(self, engine: E) -> Lifecycle<B, E> {
        Lifecycle {
            backend: self.backend,
            state: self.state,
            resident: self.resident,
            version: self.version,
            mode: self.mode,
            config: self.config,
            metrics: self.metrics,
            exit_due: self.exit_due,
            trace: self.trace,
            engine,
            engine_state: EngineState::Asleep,
            engine_memory: self.engine_memory,
            sleep_due: false,
        }
    }
}

impl<B: Reshard, E> Lifecycle<B, E> {
    /// The current configuration.
    pub fn config(&self) -> &LifecycleConfig {
        &self.config
    }

    /// Changes the switching policy; takes effect at the next rollout call.
    pub fn set_switching(&mut self, switching: Switching) {
        self.config.switching = switching;
    }

    /// Switches by `decision` from now on (offload by need, [`MemoryPolicy::by_need`]): its
    /// policy becomes the lifecycle's, the decision is kept in the [metrics](Lifecycle::metrics)
    /// (and their table), and a trace that is on gets a mark of it. Only in train mode with
    /// nothing resident, where no switch is half done under the old policy.
    ///
    /// ```
    /// use lifecycle_core::testing::CopyBackend;
    /// use lifecycle_core::{Lifecycle, MemoryPolicy, RoomRequest};
    /// let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
    /// let d = MemoryPolicy::by_need(&RoomRequest { free: 10, rollout: 4, ..RoomRequest::default() })?;
    /// lc.set_memory_decision(d).map_err(|e| e.to_string())?;
    /// assert!(!lc.config().memory.offload_params);
    /// assert!(lc.metrics().to_string().contains("nothing offloaded"));
    /// # Ok::<(), String>(())
    /// ```
    ///
    /// [`MemoryPolicy::by_need`]: crate::MemoryPolicy::by_need
    pub fn set_memory_decision(
        &mut self,
        decision: crate::MemoryDecision,
    ) -> Result<(), LifecycleError<B::Error>> {
        if self.mode != Mode::Train || self.resident.is_some() {
            return Err(LifecycleError::Config(
                "the memory policy changes only in train mode with nothing resident: exit first"
                    .into(),
            ));
        }
        decision.policy.validate().map_err(LifecycleError::Config)?;
        self.config.memory = decision.policy;
        self.metrics.memory = Some(decision);
        if self.trace.is_enabled() {
            let now = self.trace.micros(std::time::Instant::now());
            self.trace.record(crate::Span {
                name: format!("memory {decision}"),
                phase: crate::Phase::Plan,
                rank: None,
                track: "host".into(),
                start_us: now,
                duration_us: 0.0,
                bytes: 0,
                link: None,
            });
        }
        Ok(())
    }

    /// When the engine's rollout memory is released.
    pub fn engine_memory(&self) -> EngineMemory {
        self.engine_memory
    }

    /// Changes when the engine's rollout memory is released; takes effect at the end of the next
    /// rollout call.
    pub fn set_engine_memory(&mut self, memory: EngineMemory) {
        self.engine_memory = memory;
    }

    /// The version of the training weights: bumped by every mutable access to them.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Which layout is live.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether rollout weights of the current version are resident (a rollout would move zero bytes).
    pub fn rollout_is_current(&self) -> bool {
        self.mode != Mode::Faulted
            && self
                .resident
                .as_ref()
                .is_some_and(|r| r.version == Some(self.version))
    }

    /// Metrics of every switch so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Clears the metrics (the memory decision, how the next switches run, stays).
    pub fn reset_metrics(&mut self) {
        // the memory decision stays: it is how the next switches run, not a count
        let memory = self.metrics.memory;
        self.metrics = Metrics::default();
        self.metrics.memory = memory;
    }

    /// Starts recording a timeline of every switch (see [`Trace`]); the clock starts now.
    pub fn enable_trace(&mut self) {
        self.trace = Trace::enabled();
    }

    /// The timeline recorded so far (empty unless [`enable_trace`](Lifecycle::enable_trace) ran).
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The training state wherever it lives now (in rollout mode, possibly offloaded), read-only.
    /// Does not switch.
    pub fn peek_state(&self) -> &B::TrainState {
        &self.state
    }

    /// The engine, read-only (for example its statistics or its memory).
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The engine, mutable, outside of a rollout session: for settings between calls. Rollouts
    /// go through a session ([`RolloutSession::parts`](crate::RolloutSession::parts)), which
    /// proves the weights are current.
    pub fn engine_mut(&mut self) -> &mut E {
        &mut self.engine
    }

    /// Where the engine stands: awake only in rollout mode, after the backend's enter.
    pub fn engine_state(&self) -> EngineState {
        self.engine_state
    }

    pub(crate) fn resident_weights(&self) -> &B::Rollout {
        match &self.resident {
            Some(r) => &r.weights,
            // A session exists only after ensure_rollout succeeded, which leaves weights resident.
            None => unreachable!("rollout session without resident weights"),
        }
    }

    /// The resident weights and the engine, borrowed together, with the version.
    pub(crate) fn weights_and_engine(&mut self) -> (&B::Rollout, &mut E, u64) {
        match &self.resident {
            Some(r) => (&r.weights, &mut self.engine, self.version),
            None => unreachable!("rollout session without resident weights"),
        }
    }
}

impl<B: Reshard, E: RolloutEngine<B::Rollout>> Lifecycle<B, E> {
    /// Enters rollout mode now (no-op when current weights are resident). Under
    /// [`EngineMemory::KeepAcrossCalls`] it also wakes the engine; under
    /// [`EngineMemory::FreeEachCall`] the engine wakes at the next rollout call.
    pub fn enter(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.ensure_rollout()?;
        if self.engine_memory == EngineMemory::KeepAcrossCalls {
            self.wake_engine()?;
        }
        Ok(())
    }

    /// Leaves rollout mode now, releasing the rollout weights even if the memory policy would keep
    /// them resident; the engine sleeps first. No-op in train mode with nothing resident. In
    /// [`Mode::Faulted`] it retries bringing the training state back.
    pub fn exit(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.recover_if_faulted()?;
        self.settle_engine()?;
        self.exit_due = false;
        if self.mode == Mode::Rollout || self.resident.is_some() {
            self.run_exit(true)?;
        }
        Ok(())
    }

    /// Leaves rollout mode and returns the backend and the training state (the engine is dropped).
    ///
    /// If leaving fails, the lifecycle (and the state in it) is dropped with the error: call
    /// [`exit`](Lifecycle::exit) first, which keeps the lifecycle for a retry, when that matters.
    pub fn into_parts(self) -> Result<(B, B::TrainState), LifecycleError<B::Error>> {
        let (backend, state, _) = self.into_parts_with_engine()?;
        Ok((backend, state))
    }

    /// Leaves rollout mode and returns the backend, the training state and the engine (asleep).
    pub fn into_parts_with_engine(
        mut self,
    ) -> Result<(B, B::TrainState, E), LifecycleError<B::Error>> {
        self.exit()?;
        Ok((self.backend, self.state, self.engine))
    }

    fn settle_due_exit(&mut self) -> Result<(), LifecycleError<B::Error>> {
        if self.exit_due {
            self.exit_due = false;
            if self.mode == Mode::Rollout {
                self.run_exit(true)?;
            }
        }
        Ok(())
    }

    /// Retries a failed sleep and runs a sleep deferred by a dropped session.
    fn settle_engine(&mut self) -> Result<(), LifecycleError<B::Error>> {
        if self.sleep_due || self.engine_state == EngineState::SleepFailed {
            self.sleep_due = false;
            self.sleep_engine()?;
        }
        Ok(())
    }

    /// Called when a session is dropped without `finish`: defers what `finish` would have done.
    pub(crate) fn session_dropped(&mut self) {
        if self.config.switching == Switching::Eager {
            self.exit_due = true;
        }
        if self.engine_memory == EngineMemory::FreeEachCall {
            self.sleep_due = true;
        }
    }

    /// In [`Mode::Faulted`], retries `exit(state, None)`: on success the lifecycle is back in
    /// train mode.
    fn recover_if_faulted(&mut self) -> Result<(), LifecycleError<B::Error>> {
        if self.mode != Mode::Faulted {
            return Ok(());
        }
        match self.guarded_exit(None) {
            Ok(()) => {
                self.mode = Mode::Train;
                Ok(())
            }
            Err(Failure::Error(source)) => Err(LifecycleError::Exit { source }),
            Err(Failure::Panic(message)) => Err(LifecycleError::Panicked {
                during: Operation::Exit,
                message,
                after: AfterFailure::Faulted {
                    recovery: "the retried reload panicked".into(),
                },
            }),
        }
    }

    /// Runs `exit(state, rollout)` with panics caught.
    fn guarded_exit(&mut self, rollout: Option<B::Rollout>) -> Result<(), Failure<B::Error>> {
        let held = self.engine.memory().device;
        let mut rec = PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace);
        rec.set_engine_held(held);
        let mut ctx = SwitchContext {
            memory: self.config.memory,
            rec,
        };
        let (backend, state) = (&mut self.backend, &mut self.state);
        guarded(|| backend.exit(state, rollout, &mut ctx))
    }

    /// After a failed enter or refresh: brings offloaded state back (releasing `rollout` if
    /// given) and says where the lifecycle stands.
    fn recover(&mut self, rollout: Option<B::Rollout>) -> AfterFailure {
        self.resident = None;
        match self.guarded_exit(rollout) {
            Ok(()) => {
                self.mode = Mode::Train;
                AfterFailure::Restored
            }
            Err(f) => {
                self.mode = Mode::Faulted;
                AfterFailure::Faulted {
                    recovery: f.describe(),
                }
            }
        }
    }

    pub(crate) fn ensure_rollout(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.recover_if_faulted()?;
        self.settle_engine()?;
        self.settle_due_exit()?;
        if self.rollout_is_current() {
            if self.mode == Mode::Rollout {
                self.metrics.reuses += 1;
            }
            // In train mode with current weights kept resident nothing was offloaded (the policy
            // forbids it), so switching moves zero bytes too.
            self.mode = Mode::Rollout;
            return Ok(());
        }
        debug_assert!(self.mode == Mode::Train || self.resident.is_none());
        debug_assert!(self.engine_state == EngineState::Asleep);
        // The engine memory held while the backend's phases run (zero: the engine is asleep).
        let held = self.engine.memory().device;
        let mut rec = PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace);
        rec.set_engine_held(held);
        let (backend, state) = (&self.backend, &self.state);
        let plan = match rec.phase(Phase::Plan, |_| Ok(guarded(|| backend.plan(state)))) {
            Ok(Ok(plan)) => plan,
            Ok(Err(Failure::Error(e))) | Err(e) => return Err(LifecycleError::Plan(e)),
            Ok(Err(Failure::Panic(message))) => {
                return Err(LifecycleError::Panicked {
                    during: Operation::Plan,
                    message,
                    after: AfterFailure::Restored,
                })
            }
        };
        let mut ctx = SwitchContext {
            memory: self.config.memory,
            rec,
        };
        let (backend, state) = (&mut self.backend, &mut self.state);
        let (failure, operation, rollout) = match self.resident.take() {
            Some(mut resident) => {
                match guarded(|| backend.refresh(&plan, state, &mut resident.weights, &mut ctx)) {
                    Ok(()) => {
                        resident.version = Some(self.version);
                        self.resident = Some(resident);
                        self.metrics.refreshes += 1;
                        self.mode = Mode::Rollout;
                        return Ok(());
                    }
                    // The weights may be half rewritten: release them during recovery.
                    Err(f) => (f, Operation::Refresh, Some(resident.weights)),
                }
            }
            None => match guarded(|| backend.enter(&plan, state, &mut ctx)) {
                Ok(weights) => {
                    self.resident = Some(Resident {
                        weights,
                        version: Some(self.version),
                    });
                    self.metrics.enters += 1;
                    self.mode = Mode::Rollout;
                    return Ok(());
                }
                Err(f) => (f, Operation::Enter, None),
            },
        };
        let after = self.recover(rollout);
        Err(match (failure, operation) {
            (Failure::Error(source), Operation::Refresh) => {
                LifecycleError::Refresh { source, after }
            }
            (Failure::Error(source), _) => LifecycleError::Enter { source, after },
            (Failure::Panic(message), during) => LifecycleError::Panicked {
                during,
                message,
                after,
            },
        })
    }

    pub(crate) fn ensure_train(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.recover_if_faulted()?;
        self.settle_engine()?;
        self.settle_due_exit()?;
        if self.mode == Mode::Rollout {
            // Under keep_rollout_resident nothing was offloaded: exit only reallocates what enter
            // freed (grads) and leaves the rollout weights resident for an in-place refresh.
            let release = !self.config.memory.keep_rollout_resident;
            self.run_exit(release)?;
        }
        Ok(())
    }

    /// Called when a rollout call ends: applies `switching` and the engine's memory policy.
    pub(crate) fn after_rollout_call(
        &mut self,
        switching: Switching,
    ) -> Result<(), LifecycleError<B::Error>> {
        if self.engine_state == EngineState::Awake {
            self.metrics.engine.observe(self.engine.memory());
        }
        match switching {
            Switching::Eager if self.mode == Mode::Rollout => self.run_exit(true),
            _ if self.engine_memory == EngineMemory::FreeEachCall => self.sleep_engine(),
            _ => Ok(()),
        }
    }

    /// Puts the engine to sleep (if awake), then runs the backend's exit. A failed sleep returns
    /// before the exit: the training state does not come back while the engine may still hold its
    /// rollout memory.
    fn run_exit(&mut self, release: bool) -> Result<(), LifecycleError<B::Error>> {
        self.sleep_engine()?;
        let rollout = if release {
            self.resident.take().map(|r| r.weights)
        } else {
            None
        };
        match self.guarded_exit(rollout) {
            Ok(()) => {
                self.metrics.exits += 1;
                self.mode = Mode::Train;
                Ok(())
            }
            Err(failure) => {
                // Kept-resident weights are no longer trusted either.
                self.resident = None;
                self.mode = Mode::Faulted;
                Err(match failure {
                    Failure::Error(source) => LifecycleError::Exit { source },
                    Failure::Panic(message) => LifecycleError::Panicked {
                        during: Operation::Exit,
                        message,
                        after: AfterFailure::Faulted {
                            recovery: "not attempted yet: the next train(), exit() or rollout() \
                                       retries the reload"
                                .into(),
                        },
                    },
                })
            }
        }
    }

    /// Wakes the engine for the resident weights (in rollout mode, after the backend's enter). On
    /// failure the engine is put back to sleep and the lifecycle stays in rollout mode.
    pub(crate) fn wake_engine(&mut self) -> Result<(), LifecycleError<B::Error>> {
        if self.engine_state == EngineState::Awake {
            return Ok(());
        }
        if E::IS_NOOP {
            self.engine_state = EngineState::Awake;
            return Ok(());
        }
        let weights = match &self.resident {
            Some(r) => RolloutView::new(&r.weights, self.version),
            None => unreachable!("the engine wakes only after weights were made resident"),
        };
        let engine = &mut self.engine;
        let Ok(woken) = PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace).phase(
            Phase::Wake,
            |scope| {
                let woken = guarded(|| engine.wake(weights, scope));
                scope.set_engine_bytes(engine.memory().device);
                Ok::<_, std::convert::Infallible>(woken)
            },
        );
        match woken {
            Ok(()) => {
                self.engine_state = EngineState::Awake;
                self.metrics.engine.wakes += 1;
                self.metrics.engine.observe(self.engine.memory());
                Ok(())
            }
            Err(failure) => {
                self.metrics.engine.failed_wakes += 1;
                // Recovery: `sleep` frees whatever the failed wake allocated.
                let after = match self.run_sleep() {
                    Ok(()) => EngineAfter::Asleep,
                    Err(f) => EngineAfter::SleepFailed {
                        recovery: f.describe(),
                    },
                };
                Err(LifecycleError::engine(EngineHook::Wake, failure, after))
            }
        }
    }

    /// Puts the engine to sleep if it may hold rollout memory.
    fn sleep_engine(&mut self) -> Result<(), LifecycleError<B::Error>> {
        if self.engine_state == EngineState::Asleep {
            return Ok(());
        }
        self.run_sleep().map_err(|failure| {
            LifecycleError::engine(
                EngineHook::Sleep,
                failure,
                EngineAfter::SleepFailed {
                    recovery: "not attempted yet".into(),
                },
            )
        })
    }

    /// Runs `sleep` with panics caught, recording the phase; updates the engine's state.
    fn run_sleep(&mut self) -> Result<(), Failure<E::Error>> {
        if E::IS_NOOP {
            self.engine_state = EngineState::Asleep;
            return Ok(());
        }
        let engine = &mut self.engine;
        let Ok((before, slept)) = PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace)
            .phase(Phase::Sleep, |scope| {
                let before = engine.memory();
                scope.set_engine_bytes(before.device);
                Ok::<_, std::convert::Infallible>((before, guarded(|| engine.sleep(scope))))
            });
        self.metrics.engine.observe(before);
        match slept {
            Ok(()) => {
                self.engine_state = EngineState::Asleep;
                self.metrics.engine.sleeps += 1;
                Ok(())
            }
            Err(failure) => {
                self.engine_state = EngineState::SleepFailed;
                self.metrics.engine.failed_sleeps += 1;
                Err(failure)
            }
        }
    }
}

impl<B: Reshard, E> std::fmt::Debug for Lifecycle<B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("mode", &self.mode)
            .field("version", &self.version)
            .field("rollout_is_current", &self.rollout_is_current())
            .field("engine_state", &self.engine_state)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
