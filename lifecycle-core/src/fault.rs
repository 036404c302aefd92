//! Fault injection: a wrapper backend that fails chosen phases on command, to test (and let users
//! test) that a failure at any point of a switch leaves the training state intact.
//!
//! Faults inside a backend's phases (transfer, offload, release, reload) fire from the
//! [`PhaseRecorder`](crate::PhaseRecorder) when the backend reports the phase — at its start or
//! after its work — so any backend that reports its phases can be tested without changes. An
//! injected *error* unwinds out of the backend call (dropping what the backend held, as an early
//! `?` return would) and comes back as [`FaultError::Injected`](crate::FaultError::Injected); an injected *panic* is a real
//! panic.

use std::collections::VecDeque;
use std::panic::resume_unwind;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::phase::Phase;

/// When in a phase a fault fires.
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, Phase};
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// // At the end of the transfer: the weights were copied, then the call fails.
/// faults.inject(Fault::new(Phase::Transfer, FaultAt::End, FaultKind::Error));
/// assert!(lc.rollout().is_err());
/// assert_eq!(lc.backend().inner().copies(), 1);
/// // At its start: nothing was copied.
/// faults.inject(Fault::new(Phase::Transfer, FaultAt::Start, FaultKind::Error));
/// assert!(lc.rollout().is_err());
/// assert_eq!(lc.backend().inner().copies(), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAt {
    /// Before the phase does any work.
    Start,
    /// After the phase did its work (a half-switched state for the phases that follow).
    End,
}

/// What an injected fault does: an error return, or a real panic (which the lifecycle catches).
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, LifecycleError};
/// use lifecycle_core::Phase;
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// faults.inject(Fault::new(Phase::Transfer, FaultAt::Start, FaultKind::Error));
/// assert!(matches!(lc.rollout().map(|_| ()), Err(LifecycleError::Enter { .. })));
/// faults.inject(Fault::new(Phase::Transfer, FaultAt::Start, FaultKind::Panic));
/// assert!(matches!(lc.rollout().map(|_| ()), Err(LifecycleError::Panicked { .. })));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The backend call returns an error.
    Error,
    /// The backend call panics.
    Panic,
}

/// One fault to inject.
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, Phase};
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// // Let two reloads pass, fail the third.
/// let fault = Fault { skip: 2, ..Fault::new(Phase::Reload, FaultAt::Start, FaultKind::Error) };
/// faults.inject(fault);
/// for round in 0..3 {
///     assert!(lc.rollout().is_ok());
///     let exited = lc.train().map(|_| ());
///     assert_eq!(exited.is_err(), round == 2);
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The phase that fails ([`Phase::Plan`] fails the `plan` call itself).
    pub phase: Phase,
    /// When in the phase.
    pub at: FaultAt,
    /// Error or panic.
    pub kind: FaultKind,
    /// Occurrences of the phase to let pass before failing.
    pub skip: usize,
}

impl Fault {
    /// Fails the next occurrence of `phase` at `at` with `kind`.
    pub fn new(phase: Phase, at: FaultAt, kind: FaultKind) -> Self {
        Fault {
            phase,
            at,
            kind,
            skip: 0,
        }
    }
}

/// The error an injected fault produces ([`FaultError::Injected`](crate::FaultError::Injected)),
/// and the record of a fault that fired ([`FaultHandle::fired`]).
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, InjectedFault, Lifecycle, Phase};
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// faults.inject(Fault::new(Phase::Offload, FaultAt::Start, FaultKind::Error));
/// assert!(lc.rollout().is_err());
/// let fired = InjectedFault { phase: Phase::Offload, at: FaultAt::Start, kind: FaultKind::Error };
/// assert_eq!(faults.fired(), [fired]);
/// assert_eq!(fired.to_string(), "injected fault: Error at the Start of offload");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("injected fault: {kind:?} at the {at:?} of {phase}")]
pub struct InjectedFault {
    /// The phase.
    pub phase: Phase,
    /// When in it.
    pub at: FaultAt,
    /// What it did.
    pub kind: FaultKind,
}

/// Faults waiting to fire, shared between a [`FaultInjector`](crate::FaultInjector) and its [`FaultHandle`]s.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    pub(crate) pending: VecDeque<Fault>,
    pub(crate) fired: Vec<InjectedFault>,
}

/// Commands a [`FaultInjector`](crate::FaultInjector) that a lifecycle owns: clone it freely, every
/// clone queues into the same injector.
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, Phase};
///
/// let (backend, faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, vec![1.0]);
/// faults.inject(Fault::new(Phase::Release, FaultAt::Start, FaultKind::Error));
/// assert_eq!(faults.pending(), 1);
/// assert!(lc.rollout().is_ok());                      // no release during an enter: still pending
/// assert_eq!(faults.pending(), 1);
/// faults.clear();
/// assert!(lc.exit().is_ok());
/// assert!(faults.fired().is_empty());
/// ```
#[derive(Debug, Clone, Default)]
pub struct FaultHandle {
    queue: Arc<Mutex<Queue>>,
}

impl FaultHandle {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock cannot leave the queue inconsistent: take it anyway.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a fault; faults fire in the order queued.
    pub fn inject(&self, fault: Fault) {
        self.lock().pending.push_back(fault);
    }

    /// Faults not fired yet.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Faults fired so far.
    pub fn fired(&self) -> Vec<InjectedFault> {
        self.lock().fired.clone()
    }

    /// Drops every pending fault.
    pub fn clear(&self) {
        self.lock().pending.clear();
    }
}

/// What the recorder checks at each phase boundary while a fault is armed.
#[derive(Debug)]
pub(crate) struct Armed {
    pub(crate) fault: Fault,
    pub(crate) fired: bool,
    /// The current occurrence of the phase is one of those `skip` lets pass.
    pub(crate) passing: bool,
}

impl Armed {
    /// Called at the start (`at = Start`) and end of every phase occurrence.
    pub(crate) fn check(&mut self, phase: Phase, at: FaultAt) {
        if self.fired || phase != self.fault.phase {
            return;
        }
        if at == FaultAt::Start {
            self.passing = self.fault.skip > 0;
            if self.passing {
                self.fault.skip -= 1;
                return;
            }
        }
        if !self.passing && at == self.fault.at {
            self.fired = true;
            fire(InjectedFault {
                phase,
                at,
                kind: self.fault.kind,
            });
        }
    }
}

fn fire(fault: InjectedFault) -> ! {
    match fault.kind {
        FaultKind::Panic => panic!("{fault}"),
        // Unwinding without the panic hook: this is an error return, not a crash.
        FaultKind::Error => resume_unwind(Box::new(fault)),
    }
}
