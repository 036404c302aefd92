//! Errors of the lifecycle itself, wrapping the backend's, and the state each failure leaves.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::engine::{EngineAfter, EngineHook};

/// Which backend operation failed.
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

/// Where the lifecycle stands after a failed switch.
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

/// Why a lifecycle operation failed, and the state the lifecycle is left in.
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

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}
