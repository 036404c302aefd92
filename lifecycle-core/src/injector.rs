//! [`FaultInjector`]: a backend wrapper that fails chosen phases, for testing recovery.

use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::fault::{Armed, FaultHandle, FaultKind, InjectedFault};
use crate::phase::Phase;
use crate::reshard::{Reshard, SwitchContext};

/// Errors of a [`FaultInjector`]: injected, or the wrapped backend's own.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{FaultError, FaultInjector, Lifecycle, LifecycleError};
///
/// let (backend, _faults) = FaultInjector::new(CopyBackend::new());
/// let mut lc = Lifecycle::new(backend, Vec::new());
/// assert!(matches!(
///     lc.rollout().map(|_| ()),
///     Err(LifecycleError::Plan(FaultError::Backend(CopyError::Empty)))
/// ));
/// ```
#[derive(Debug, thiserror::Error)]
pub enum FaultError<E: std::error::Error + 'static> {
    /// A fault injected on command.
    #[error(transparent)]
    Injected(InjectedFault),
    /// The wrapped backend failed by itself.
    #[error(transparent)]
    Backend(E),
}

/// Wraps a backend and fails the phases its [`FaultHandle`] names.
///
/// ```
/// use lifecycle_core::testing::CopyBackend;
/// use lifecycle_core::{Fault, FaultAt, FaultInjector, FaultKind, Lifecycle, Mode, Phase};
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let (backend, faults) = FaultInjector::new(CopyBackend::new());
///     let mut lc = Lifecycle::new(backend, vec![1.0, 2.0]);
///     faults.inject(Fault::new(Phase::Transfer, FaultAt::Start, FaultKind::Error));
///     let err = lc.rollout().map(|_| ()).err().ok_or("the transfer should fail")?;
///     assert!(err.to_string().contains("injected fault"));
///     assert_eq!(lc.mode(), Mode::Train);           // restored, usable
///     assert_eq!(lc.rollout()?.weights()[1], 2.0);  // the next call works
///     Ok(())
/// }
/// ```
pub struct FaultInjector<B> {
    inner: B,
    handle: FaultHandle,
}

impl<B: Reshard> FaultInjector<B> {
    /// Wraps `inner`; the handle queues faults.
    pub fn new(inner: B) -> (Self, FaultHandle) {
        let handle = FaultHandle::default();
        (
            FaultInjector {
                inner,
                handle: handle.clone(),
            },
            handle,
        )
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Runs one backend call with the next pending fault armed in the recorder.
    fn armed<T>(
        &mut self,
        ctx: &mut SwitchContext<'_>,
        call: impl FnOnce(&mut B, &mut SwitchContext<'_>) -> Result<T, B::Error>,
    ) -> Result<T, FaultError<B::Error>> {
        let next = {
            let mut q = self.handle.lock();
            match q.pending.front() {
                Some(f) if f.phase != Phase::Plan => q.pending.pop_front(),
                _ => None,
            }
        };
        let Some(fault) = next else {
            return call(&mut self.inner, ctx).map_err(FaultError::Backend);
        };
        ctx.rec.arm(Armed {
            fault,
            fired: false,
            passing: false,
        });
        let inner = &mut self.inner;
        let result = catch_unwind(AssertUnwindSafe(|| call(inner, ctx)));
        let armed = ctx.rec.disarm();
        let mut q = self.handle.lock();
        match armed {
            Some(a) if a.fired => q.fired.push(InjectedFault {
                phase: a.fault.phase,
                at: a.fault.at,
                kind: a.fault.kind,
            }),
            // Not reached in this call: it stays first in line, with the occurrences it saw.
            Some(a) => q.pending.push_front(a.fault),
            None => {}
        }
        drop(q);
        match result {
            Ok(r) => r.map_err(FaultError::Backend),
            Err(payload) => match payload.downcast::<InjectedFault>() {
                Ok(injected) => Err(FaultError::Injected(*injected)),
                Err(payload) => resume_unwind(payload),
            },
        }
    }
}

impl<B: Reshard> Reshard for FaultInjector<B> {
    type TrainState = B::TrainState;
    type Rollout = B::Rollout;
    type Plan = B::Plan;
    type Error = FaultError<B::Error>;

    fn plan(&self, state: &B::TrainState) -> Result<B::Plan, Self::Error> {
        let fault = {
            let mut q = self.handle.lock();
            match q.pending.front_mut() {
                Some(f) if f.phase == Phase::Plan && f.skip > 0 => {
                    f.skip -= 1;
                    None
                }
                Some(f) if f.phase == Phase::Plan => {
                    let f = *f;
                    q.pending.pop_front();
                    let injected = InjectedFault {
                        phase: Phase::Plan,
                        at: f.at,
                        kind: f.kind,
                    };
                    q.fired.push(injected);
                    Some(injected)
                }
                _ => None,
            }
        };
        match fault {
            Some(f) if f.kind == FaultKind::Panic => panic!("{f}"),
            Some(f) => Err(FaultError::Injected(f)),
            None => self.inner.plan(state).map_err(FaultError::Backend),
        }
    }

    fn enter(
        &mut self,
        plan: &B::Plan,
        state: &mut B::TrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<B::Rollout, Self::Error> {
        self.armed(ctx, |b, ctx| b.enter(plan, state, ctx))
    }

    fn refresh(
        &mut self,
        plan: &B::Plan,
        state: &mut B::TrainState,
        rollout: &mut B::Rollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), Self::Error> {
        self.armed(ctx, |b, ctx| b.refresh(plan, state, rollout, ctx))
    }

    fn exit(
        &mut self,
        state: &mut B::TrainState,
        rollout: Option<B::Rollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), Self::Error> {
        self.armed(ctx, |b, ctx| b.exit(state, rollout, ctx))
    }
}

impl<B> fmt::Debug for FaultInjector<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjector")
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}
