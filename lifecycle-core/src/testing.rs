//! A backend and an engine to try the API with, and to test code written against it: no device,
//! no layout, every byte on the host.
//!
//! - [`CopyBackend`] implements [`Reshard`]: the training state is a `Vec<f32>`, the rollout
//!   weights are a copy of it, and every switch reports its phases and bytes like a real backend
//!   does (an offload it only pretends to do included), so [`Metrics`](crate::Metrics) and
//!   [`Trace`](crate::Trace) show what a switch would move.
//! - [`KvEngine`] implements [`RolloutEngine`]: a "KV cache" of one slot per weight, allocated
//!   when it wakes and freed when it sleeps.
//!
//! ```
//! use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
//! use lifecycle_core::{Lifecycle, LifecycleError};
//!
//! fn main() -> Result<(), LifecycleError<CopyError>> {
//!     let engine = KvEngine::new();
//!     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.5, 1.0]).with_engine(engine);
//!     let mut session = lc.rollout()?;               // copies the weights, wakes the engine
//!     let (weights, mut engine) = session.parts();
//!     engine.kv[1] = weights[1] * 2.0;
//!     session.finish()?;
//!     assert_eq!(lc.engine().kv, [0.0, 2.0]);
//!     assert_eq!(lc.backend().copies(), 1);
//!     Ok(())
//! }
//! ```

use std::convert::Infallible;

use crate::engine::RolloutEngine;
use crate::metrics::EngineBytes;
use crate::phase::{Link, Phase};
use crate::recorder::PhaseScope;
use crate::reshard::{Reshard, SwitchContext};
use crate::view::RolloutView;

/// Bytes of one `f32`.
const F32_BYTES: u64 = 4;

/// Why [`CopyBackend`]'s [`plan`](Reshard::plan) rejected a training state.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::Reshard;
///
/// let backend = CopyBackend::new();
/// assert_eq!(backend.plan(&vec![]), Err(CopyError::Empty));
/// let refused = backend.plan(&vec![1.0, f32::INFINITY]);
/// assert!(matches!(refused, Err(CopyError::NotFinite { index: 1, .. })));
/// assert_eq!(backend.plan(&vec![1.0, 2.0]), Ok(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum CopyError {
    /// There is nothing to copy.
    #[error("the training state is empty: there are no weights to roll out")]
    Empty,
    /// A weight is NaN or infinite.
    #[error("weight {index} is not finite ({value}): refusing to roll out with it")]
    NotFinite {
        /// Its position in the training state.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// A [`Reshard`] backend over one `Vec<f32>`: the rollout weights are a copy of the training
/// state, and [`copies`](CopyBackend::copies) counts the copies it made (the version of the
/// rollout weights it last built, as the backend sees it).
///
/// - `plan` rejects an empty state and a state with a NaN or infinite weight
///   ([`CopyError`]), before anything moves.
/// - `enter` copies the state ([`Phase::Transfer`], local bytes), then, when the
///   [`MemoryPolicy`](crate::MemoryPolicy) offloads anything, reports an offload of the state
///   ([`Phase::Offload`], device → host bytes). The values stay where they are: the offload is
///   only counted, so [`Lifecycle::peek_state`](crate::Lifecycle::peek_state) still reads them.
/// - `refresh` copies the state over the resident weights in place.
/// - `exit` releases the rollout weights ([`Phase::Release`]) and, after an offload, reports the
///   reload ([`Phase::Reload`], host → device bytes). It is idempotent, as the contract asks.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Phase};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0, 3.0]);
///     assert_eq!(lc.rollout()?.weights()[2], 3.0);
///     assert_eq!(lc.rollout()?.weights()[2], 3.0);     // lazy: the same copy, nothing moved
///     assert_eq!(lc.backend().copies(), 1);
///     assert!(lc.backend().offloaded());                // the default policy offloads
///
///     lc.train()?.state_mut()[2] = 4.0;                  // exit: release and reload
///     assert!(!lc.backend().offloaded());
///     assert_eq!(lc.rollout()?.weights()[2], 4.0);
///     assert_eq!(lc.backend().copies(), 2);
///     assert_eq!(lc.metrics().phase(Phase::Transfer).bytes.local, 2 * 3 * 4);
///     assert_eq!(lc.metrics().phase(Phase::Reload).bytes.host_to_device, 3 * 4);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Default)]
pub struct CopyBackend {
    copies: u64,
    offloaded: bool,
}

impl CopyBackend {
    /// A backend that has copied nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many times it built rollout weights (enters and refreshes).
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Whether the training state counts as offloaded now (between an enter that offloaded and
    /// the exit that reloads it).
    pub fn offloaded(&self) -> bool {
        self.offloaded
    }

    fn copy_into(&mut self, state: &[f32], rollout: &mut Vec<f32>, scope: &mut PhaseScope) {
        rollout.clear();
        rollout.extend_from_slice(state);
        scope.add_bytes(Link::Local, bytes_of(state));
        self.copies += 1;
    }
}

fn bytes_of(values: &[f32]) -> u64 {
    values.len() as u64 * F32_BYTES
}

impl Reshard for CopyBackend {
    type TrainState = Vec<f32>;
    type Rollout = Vec<f32>;
    /// The number of weights.
    type Plan = usize;
    type Error = CopyError;

    fn plan(&self, state: &Vec<f32>) -> Result<usize, CopyError> {
        if state.is_empty() {
            return Err(CopyError::Empty);
        }
        match state.iter().position(|w| !w.is_finite()) {
            Some(index) => Err(CopyError::NotFinite {
                index,
                value: state[index],
            }),
            None => Ok(state.len()),
        }
    }

    fn enter(
        &mut self,
        _plan: &usize,
        state: &mut Vec<f32>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<Vec<f32>, CopyError> {
        let mut rollout = Vec::with_capacity(state.len());
        ctx.rec.phase(Phase::Transfer, |scope| {
            self.copy_into(state, &mut rollout, scope);
            Ok::<_, CopyError>(())
        })?;
        if ctx.memory.offload_params || ctx.memory.offload_optimizer {
            ctx.rec.phase(Phase::Offload, |scope| {
                // From here on the state counts as offloaded, even if the phase fails part way:
                // the exit that recovers must reload it.
                self.offloaded = true;
                scope.add_bytes(Link::DeviceToHost, bytes_of(state));
                Ok::<_, CopyError>(())
            })?;
        }
        Ok(rollout)
    }

    fn refresh(
        &mut self,
        _plan: &usize,
        state: &mut Vec<f32>,
        rollout: &mut Vec<f32>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), CopyError> {
        ctx.rec.phase(Phase::Transfer, |scope| {
            self.copy_into(state, rollout, scope);
            Ok(())
        })
    }

    fn exit(
        &mut self,
        state: &mut Vec<f32>,
        rollout: Option<Vec<f32>>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), CopyError> {
        if let Some(rollout) = rollout {
            ctx.rec.phase(Phase::Release, |_| {
                drop(rollout);
                Ok::<_, CopyError>(())
            })?;
        }
        if self.offloaded {
            ctx.rec.phase(Phase::Reload, |scope| {
                scope.add_bytes(Link::HostToDevice, bytes_of(state));
                Ok::<_, CopyError>(())
            })?;
            self.offloaded = false;
        }
        Ok(())
    }
}

/// A [`RolloutEngine`] over `Vec<f32>` weights whose "KV cache" is one slot per weight:
/// allocated (zeroed) when it wakes, freed when it sleeps, reported as device memory.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
/// use lifecycle_core::{EngineState, Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let engine = KvEngine::new();
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]).with_engine(engine);
///     lc.rollout()?.engine_mut().kv[0] = 7.0;       // wakes it: two slots
///     assert_eq!(lc.engine().memory_bytes(), 8);
///     assert_eq!(lc.rollout()?.engine().kv[0], 7.0); // kept across lazy calls
///     lc.train()?;                                   // sleeps before the exit
///     assert_eq!(lc.engine_state(), EngineState::Asleep);
///     assert!(lc.engine().kv.is_empty());
///     assert_eq!(lc.engine().wakes(), 1);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Default)]
pub struct KvEngine {
    /// One slot per weight while awake; empty while asleep.
    pub kv: Vec<f32>,
    wakes: u64,
}

impl KvEngine {
    /// An engine asleep, holding nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many times it woke.
    pub fn wakes(&self) -> u64 {
        self.wakes
    }

    /// The bytes its slots take now.
    pub fn memory_bytes(&self) -> u64 {
        bytes_of(&self.kv)
    }
}

impl RolloutEngine<Vec<f32>> for KvEngine {
    type Error = Infallible;

    fn wake(
        &mut self,
        weights: RolloutView<'_, Vec<f32>>,
        scope: &mut PhaseScope,
    ) -> Result<(), Infallible> {
        self.kv = vec![0.0; weights.len()];
        scope.alloc_extra(self.memory_bytes());
        self.wakes += 1;
        Ok(())
    }

    fn sleep(&mut self, _scope: &mut PhaseScope) -> Result<(), Infallible> {
        self.kv = Vec::new();
        Ok(())
    }

    fn memory(&self) -> EngineBytes {
        EngineBytes::device(self.memory_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy};

    #[test]
    fn plan_rejects_empty_and_non_finite_states() {
        let mut lc = Lifecycle::new(CopyBackend::new(), Vec::new());
        assert!(matches!(
            lc.rollout().map(|_| ()),
            Err(LifecycleError::Plan(CopyError::Empty))
        ));
        let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, f32::NAN]);
        assert!(matches!(
            lc.rollout().map(|_| ()),
            Err(LifecycleError::Plan(CopyError::NotFinite { index: 1, .. }))
        ));
        assert_eq!(lc.backend().copies(), 0);
    }

    #[test]
    fn kept_resident_weights_are_refreshed_in_place() -> Result<(), LifecycleError<CopyError>> {
        let config = LifecycleConfig {
            memory: MemoryPolicy {
                keep_rollout_resident: true,
                ..MemoryPolicy::resident()
            },
            ..LifecycleConfig::default()
        };
        let mut lc = Lifecycle::with_config(CopyBackend::new(), vec![1.0], config)?;
        assert_eq!(lc.rollout()?.weights()[0], 1.0);
        assert!(!lc.backend().offloaded());
        lc.train()?.state_mut()[0] = 2.0;
        assert_eq!(lc.rollout()?.weights()[0], 2.0);
        assert_eq!((lc.metrics().enters, lc.metrics().refreshes), (1, 1));
        assert_eq!(lc.backend().copies(), 2);
        Ok(())
    }
}
