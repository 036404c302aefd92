//! Errors of the lifecycle itself, wrapping the backend's, and the state each failure leaves.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Which backend operation failed (in [`LifecycleError::Panicked`]).
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, LifecycleError};
/// use lifecycle_core::{Operation, Phase};
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// faults.inject(Fault::new(Phase::Transfer, FaultAt::Start, FaultKind::Panic));
/// match lc.rollout().map(|_| ()) {
///     Err(LifecycleError::Panicked { during, .. }) => assert_eq!(during, Operation::Enter),
///     other => panic!("expected a caught panic, got {other:?}"),
/// }
/// assert_eq!(Operation::Enter.to_string(), "enter");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Validating the layouts (nothing had moved).
    Plan,
    /// Materialising rollout weights.
    Enter,
    /// Rewriting resident rollout weights in place.
    Refresh,
    /// Releasing rollout weights and bringing the training state back.
    Exit,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Plan => "plan",
            Operation::Enter => "enter",
            Operation::Refresh => "refresh",
            Operation::Exit => "exit",
        })
    }
}

/// Where the lifecycle stands after a failed switch ([`LifecycleError::after`]).
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{AfterFailure, Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, Mode};
/// use lifecycle_core::Phase;
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let (backend, faults) = FaultInjector::new(CopyBackend::new());
///     let mut lc = Lifecycle::new(backend, vec![1.0]);
///
///     // The offload fails; the recovery brings the state back.
///     faults.inject(Fault::new(Phase::Offload, FaultAt::End, FaultKind::Error));
///     let err = lc.rollout().map(|_| ()).err().ok_or("the offload should fail")?;
///     assert_eq!(err.after(), Some(&AfterFailure::Restored));
///     assert_eq!(lc.mode(), Mode::Train);
///
///     // The offload fails, and so does the reload of the recovery.
///     faults.inject(Fault::new(Phase::Offload, FaultAt::End, FaultKind::Error));
///     faults.inject(Fault::new(Phase::Reload, FaultAt::Start, FaultKind::Error));
///     let err = lc.rollout().map(|_| ()).err().ok_or("the offload should fail")?;
///     assert!(matches!(err.after(), Some(AfterFailure::Faulted { .. })));
///     assert_eq!(lc.mode(), Mode::Faulted);
///     lc.train()?;                                   // retries the reload: back in train mode
///     assert_eq!(lc.mode(), Mode::Train);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// The training state is back on the device as it was before the call (gradients, which a
    /// switch always frees, are zero); no rollout weights are resident; the lifecycle is in train
    /// mode and usable.
    Restored,
    /// Bringing the training state back failed too: the lifecycle is in
    /// [`Mode::Faulted`](crate::Mode::Faulted) and the next `train()`, `exit()` or `rollout()`
    /// retries it. Nothing was dropped.
    Faulted {
        /// Why the recovery failed.
        recovery: String,
    },
}

impl fmt::Display for AfterFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AfterFailure::Restored => f.write_str(
                "training state restored, lifecycle in train mode, no rollout weights resident",
            ),
            AfterFailure::Faulted { recovery } => write!(
                f,
                "restoring the training state failed too ({recovery}); the lifecycle is faulted: \
                 the next train(), exit() or rollout() retries bringing it back"
            ),
        }
    }
}

/// Which engine hook failed (in [`LifecycleError::Engine`] and
/// [`LifecycleError::EnginePanicked`]); [`EngineAfter`] shows a failed wake.
///
/// ```
/// use lifecycle_core::EngineHook;
///
/// assert_eq!(format!("the {} failed", EngineHook::Sleep), "the sleep failed");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineHook {
    /// [`RolloutEngine::wake`](crate::RolloutEngine::wake).
    Wake,
    /// [`RolloutEngine::sleep`](crate::RolloutEngine::sleep).
    Sleep,
}

impl fmt::Display for EngineHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineHook::Wake => "wake",
            EngineHook::Sleep => "sleep",
        })
    }
}

/// Where the lifecycle stands after an engine hook failed ([`LifecycleError::engine_after`]).
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{EngineAfter, EngineBytes, EngineHook, Lifecycle, LifecycleError, Mode};
/// use lifecycle_core::{PhaseScope, RolloutEngine, RolloutView};
///
/// /// An engine whose KV cache never fits.
/// struct TooBig;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("out of device memory")]
/// struct OutOfMemory;
///
/// impl RolloutEngine<Vec<f32>> for TooBig {
///     type Error = OutOfMemory;
///     fn wake(&mut self, _: RolloutView<'_, Vec<f32>>, _: &mut PhaseScope)
///         -> Result<(), OutOfMemory> {
///         Err(OutOfMemory)
///     }
///     fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), OutOfMemory> {
///         Ok(())
///     }
///     fn memory(&self) -> EngineBytes {
///         EngineBytes::default()
///     }
/// }
///
/// let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]).with_engine(TooBig);
/// match lc.rollout().map(|_| ()) {
///     Err(err @ LifecycleError::Engine { hook: EngineHook::Wake, .. }) => {
///         assert_eq!(err.engine_after(), Some(&EngineAfter::Asleep));
///         assert!(err.engine_source::<OutOfMemory>().is_some());
///     }
///     other => panic!("expected the wake to fail, got {other:?}"),
/// }
/// assert_eq!(lc.mode(), Mode::Rollout);               // the weights stay resident
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineAfter {
    /// The engine is asleep (a failed wake was undone by `sleep`); the lifecycle is in rollout
    /// mode with the current weights resident and the training state as the switch left it. The
    /// next `rollout()` retries the wake without switching again; `train()` and `exit()` work as
    /// usual.
    Asleep,
    /// The engine may still hold its rollout memory; the lifecycle stays in rollout mode (the
    /// backend's exit does not run while the KV cache may be on the device) and the next
    /// `rollout()`, `enter()`, `train()` or `exit()` retries the sleep first.
    SleepFailed {
        /// Why the engine could not be put to sleep, or that the retry is still to come.
        recovery: String,
    },
}

impl fmt::Display for EngineAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineAfter::Asleep => f.write_str(
                "the engine is asleep; the lifecycle stays in rollout mode with the current \
                 weights resident: the next rollout() retries the wake",
            ),
            EngineAfter::SleepFailed { recovery } => write!(
                f,
                "the engine may still hold its rollout memory ({recovery}); the lifecycle stays in \
                 rollout mode: the next rollout(), enter(), train() or exit() retries the sleep \
                 before the backend's exit"
            ),
        }
    }
}

/// Why a lifecycle operation failed, and the state the lifecycle is left in.
///
/// `E` is the backend's [`Reshard::Error`](crate::Reshard::Error). Every variant says what moved
/// and what a retry does; [`after`](LifecycleError::after) and
/// [`engine_after`](LifecycleError::engine_after) give the state without matching.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Mode};
///
/// let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, f32::NAN]);
/// match lc.rollout().map(|_| ()) {
///     Err(LifecycleError::Plan(CopyError::NotFinite { index, .. })) => assert_eq!(index, 1),
///     other => panic!("expected the plan to refuse a NaN, got {other:?}"),
/// }
/// assert_eq!(lc.mode(), Mode::Train);                 // nothing moved
///
/// let err = lc.rollout().map(|_| ()).err();
/// let message = err.map(|e| e.to_string()).unwrap_or_default();
/// assert!(message.starts_with("planning the rollout layout failed (nothing moved)"));
/// ```
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError<E: std::error::Error + 'static> {
    /// The backend rejected the layouts. No data moved; the lifecycle is unchanged.
    #[error("planning the rollout layout failed (nothing moved): {0}")]
    Plan(#[source] E),
    /// Entering rollout mode failed; `after` says what the recovery achieved.
    #[error("entering rollout mode failed: {source}; {after}")]
    Enter {
        /// The backend's error.
        #[source]
        source: E,
        /// The state the lifecycle is in now.
        after: AfterFailure,
    },
    /// Refreshing resident rollout weights failed; they were released.
    #[error("refreshing resident rollout weights failed: {source}; {after}")]
    Refresh {
        /// The backend's error.
        #[source]
        source: E,
        /// The state the lifecycle is in now.
        after: AfterFailure,
    },
    /// Leaving rollout mode failed. The training state may be partly offloaded (nothing was
    /// dropped); the lifecycle is faulted and the next `train()`, `exit()` or `rollout()` retries.
    #[error(
        "leaving rollout mode failed: {source}; the training state may be partly offloaded \
         (nothing dropped): the next train(), exit() or rollout() retries bringing it back"
    )]
    Exit {
        /// The backend's error.
        #[source]
        source: E,
    },
    /// The backend panicked; the panic was caught so the training state is not lost.
    #[error("the backend panicked during {during}: {message}; {after}")]
    Panicked {
        /// What it was doing.
        during: Operation,
        /// The panic message.
        message: String,
        /// The state the lifecycle is in now.
        after: AfterFailure,
    },
    /// The configuration is inconsistent.
    #[error("invalid lifecycle configuration: {0}")]
    Config(String),
    /// A hook of the rollout engine returned an error; `after` says where the lifecycle stands
    /// (the training state is never touched by the engine's hooks).
    #[error("the rollout engine's {hook} failed: {source}; {after}")]
    Engine {
        /// Which hook.
        hook: EngineHook,
        /// The engine's error (its [`RolloutEngine::Error`](crate::RolloutEngine::Error);
        /// [`engine_source`](LifecycleError::engine_source) downcasts it).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
        /// The state the lifecycle is in now.
        after: EngineAfter,
    },
    /// A hook of the rollout engine panicked; the panic was caught.
    #[error("the rollout engine panicked during {hook}: {message}; {after}")]
    EnginePanicked {
        /// Which hook.
        hook: EngineHook,
        /// The panic message.
        message: String,
        /// The state the lifecycle is in now.
        after: EngineAfter,
    },
}

impl<E: std::error::Error + 'static> LifecycleError<E> {
    /// The state the lifecycle was left in, for failures of a switch.
    pub fn after(&self) -> Option<&AfterFailure> {
        match self {
            LifecycleError::Enter { after, .. }
            | LifecycleError::Refresh { after, .. }
            | LifecycleError::Panicked { after, .. } => Some(after),
            _ => None,
        }
    }

    /// Where the lifecycle stands after a failed engine hook.
    pub fn engine_after(&self) -> Option<&EngineAfter> {
        match self {
            LifecycleError::Engine { after, .. } | LifecycleError::EnginePanicked { after, .. } => {
                Some(after)
            }
            _ => None,
        }
    }

    /// The engine's own error, when a hook failed with one of type `T`.
    pub fn engine_source<T: std::error::Error + 'static>(&self) -> Option<&T> {
        match self {
            LifecycleError::Engine { source, .. } => source.downcast_ref::<T>(),
            _ => None,
        }
    }

    pub(crate) fn engine<G: std::error::Error + Send + Sync + 'static>(
        hook: EngineHook,
        failure: Failure<G>,
        after: EngineAfter,
    ) -> Self {
        match failure {
            Failure::Error(source) => LifecycleError::Engine {
                hook,
                source: Box::new(source),
                after,
            },
            Failure::Panic(message) => LifecycleError::EnginePanicked {
                hook,
                message,
                after,
            },
        }
    }
}

/// A backend call that returned an error or panicked.
pub(crate) enum Failure<E> {
    Error(E),
    Panic(String),
}

impl<E: fmt::Display> Failure<E> {
    pub(crate) fn describe(&self) -> String {
        match self {
            Failure::Error(e) => e.to_string(),
            Failure::Panic(m) => format!("panicked: {m}"),
        }
    }
}

/// Runs a backend call, catching a panic so the only copy of the training state survives it.
pub(crate) fn guarded<T, E>(f: impl FnOnce() -> Result<T, E>) -> Result<T, Failure<E>> {
    // Unwind safety: after a panic the lifecycle never trusts the backend's half-done work; it
    // runs the recovery path (`exit`), whose contract covers a partly switched state.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(Failure::Error(e)),
        Err(payload) => Err(Failure::Panic(panic_message(payload.as_ref()))),
    }
}

/// The text of a panic payload: the message of `panic!("...")` with or without arguments.
///
/// ```
/// use lifecycle_core::panic_message;
///
/// let payload = std::panic::catch_unwind(|| panic!("rank {} lost", 3)).err();
/// let message = payload.map(|p| panic_message(p.as_ref()));
/// assert_eq!(message.as_deref(), Some("rank 3 lost"));
/// ```
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}
