//! The [`Lifecycle`]: owner of the training state, the backend and the resident rollout weights.

use crate::error::{guarded, AfterFailure, Failure, LifecycleError, Operation};
use crate::metrics::Metrics;
use crate::phase::Phase;
use crate::policy::{LifecycleConfig, Switching};
use crate::recorder::PhaseRecorder;
use crate::reshard::{Reshard, SwitchContext};
use crate::session::{RolloutSession, TrainSession};
use crate::trace::Trace;

/// Which layout is live.
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

/// Owns a backend, its training state and (while resident) its rollout weights.
///
/// Rollout weights are reachable only through a [`RolloutSession`] and the training state only
/// through a [`TrainSession`]; both borrow the lifecycle mutably, so rollout weights cannot be
/// used across a training update. Every mutable access to the training state bumps the
/// [`version`](Lifecycle::version); a rollout that finds weights of the current version resident
/// moves zero bytes.
///
/// ```
/// # use lifecycle_core::{Lifecycle, Reshard, SwitchContext};
/// # struct Copying;
/// # impl Reshard for Copying {
/// #     type TrainState = Vec<f32>; type Rollout = Vec<f32>; type Plan = (); type Error = std::io::Error;
/// #     fn plan(&self, _: &Vec<f32>) -> std::io::Result<()> { Ok(()) }
/// #     fn enter(&mut self, _: &(), s: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<Vec<f32>> { Ok(s.clone()) }
/// #     fn refresh(&mut self, _: &(), s: &mut Vec<f32>, r: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { r.clone_from(s); Ok(()) }
/// #     fn exit(&mut self, _: &mut Vec<f32>, _: Option<Vec<f32>>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { Ok(()) }
/// # }
/// let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
/// for _ in 0..3 {
///     let session = lc.rollout()?;          // enters once, then reuses
///     assert_eq!(session.weights()[1], 2.0);
/// }
/// lc.train()?.state_mut()[1] = 5.0;         // exits, bumps the version
/// assert_eq!(lc.rollout()?.weights()[1], 5.0);
/// assert_eq!(lc.metrics().enters, 2);
/// assert_eq!(lc.metrics().reuses, 2);
/// # Ok::<(), lifecycle_core::LifecycleError<std::io::Error>>(())
/// ```
pub struct Lifecycle<B: Reshard> {
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
}

impl<B: Reshard> Lifecycle<B> {
    /// A lifecycle in train mode with the default configuration (lazy switching, master weights
    /// and optimizer state offloaded during rollout).
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

    /// The current configuration.
    pub fn config(&self) -> &LifecycleConfig {
        &self.config
    }

    /// Changes the switching policy; takes effect at the next rollout call.
    pub fn set_switching(&mut self, switching: Switching) {
        self.config.switching = switching;
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

    /// Clears the metrics.
    pub fn reset_metrics(&mut self) {
        self.metrics = Metrics::default();
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

    /// Opens a rollout session: enters rollout mode only if the resident weights are missing or
    /// older than the training weights.
    pub fn rollout(&mut self) -> Result<RolloutSession<'_, B>, LifecycleError<B::Error>> {
        self.ensure_rollout()?;
        self.metrics.rollout_calls += 1;
        Ok(RolloutSession::new(self))
    }

    /// Opens a training session: leaves rollout mode if needed (releasing rollout weights and
    /// bringing offloaded state back).
    pub fn train(&mut self) -> Result<TrainSession<'_, B>, LifecycleError<B::Error>> {
        self.ensure_train()?;
        Ok(TrainSession::new(self))
    }

    /// Enters rollout mode now (no-op when current weights are resident).
    pub fn enter(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.ensure_rollout()
    }

    /// Leaves rollout mode now, releasing the rollout weights even if the memory policy would keep
    /// them resident. No-op in train mode with nothing resident. In [`Mode::Faulted`] it retries
    /// bringing the training state back.
    pub fn exit(&mut self) -> Result<(), LifecycleError<B::Error>> {
        self.recover_if_faulted()?;
        self.exit_due = false;
        if self.mode == Mode::Rollout || self.resident.is_some() {
            self.run_exit(true)?;
        }
        Ok(())
    }

    /// Leaves rollout mode and returns the backend and the training state.
    ///
    /// If leaving fails, the lifecycle (and the state in it) is dropped with the error: call
    /// [`exit`](Lifecycle::exit) first, which keeps the lifecycle for a retry, when that matters.
    pub fn into_parts(mut self) -> Result<(B, B::TrainState), LifecycleError<B::Error>> {
        self.exit()?;
        Ok((self.backend, self.state))
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
        let mut ctx = SwitchContext {
            memory: self.config.memory,
            rec: PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace),
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
        let mut rec = PhaseRecorder::with_trace(&mut self.metrics, &mut self.trace);
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
        self.settle_due_exit()?;
        if self.mode == Mode::Rollout {
            // Under keep_rollout_resident nothing was offloaded: exit only reallocates what enter
            // freed (grads) and leaves the rollout weights resident for an in-place refresh.
            let release = !self.config.memory.keep_rollout_resident;
            self.run_exit(release)?;
        }
        Ok(())
    }

    /// Called when a rollout call ends: applies the switching policy.
    pub(crate) fn after_rollout_call(&mut self) -> Result<(), LifecycleError<B::Error>> {
        match self.config.switching {
            Switching::Lazy => Ok(()),
            Switching::Eager => {
                if self.mode == Mode::Rollout {
                    self.run_exit(true)?;
                }
                Ok(())
            }
        }
    }

    fn run_exit(&mut self, release: bool) -> Result<(), LifecycleError<B::Error>> {
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

    pub(crate) fn resident_weights(&self) -> &B::Rollout {
        match &self.resident {
            Some(r) => &r.weights,
            // A session exists only after ensure_rollout succeeded, which leaves weights resident.
            None => unreachable!("rollout session without resident weights"),
        }
    }
}

impl<B: Reshard> std::fmt::Debug for Lifecycle<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("mode", &self.mode)
            .field("version", &self.version)
            .field("rollout_is_current", &self.rollout_is_current())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
