//! Sessions: the only ways to reach the rollout weights and the awake engine
//! ([`RolloutSession`], which lends a [`RolloutView`] and an [`EngineMut`]) and the training state
//! ([`TrainSession`]).
//!
//! They are opened here too, by [`Lifecycle::rollout`] and [`Lifecycle::train`]: the lifecycle
//! runs the switches, the sessions are the borrow-checked access built on top of it.

use crate::engine::RolloutEngine;
use crate::error::LifecycleError;
use crate::lifecycle::Lifecycle;
use crate::policy::Switching;
use crate::reshard::Reshard;
use crate::view::{EngineMut, RolloutView};

impl<B: Reshard, E: RolloutEngine<B::Rollout>> Lifecycle<B, E> {
    /// Opens a rollout session: enters rollout mode only if the resident weights are missing or
    /// older than the training weights, then wakes the engine if it is asleep.
    pub fn rollout(&mut self) -> Result<RolloutSession<'_, B, E>, LifecycleError<B::Error>> {
        self.ensure_rollout()?;
        self.wake_engine()?;
        self.metrics.rollout_calls += 1;
        Ok(RolloutSession::new(self))
    }

    /// Opens a training session: leaves rollout mode if needed (the engine sleeps, then the
    /// backend releases rollout weights and brings offloaded state back).
    pub fn train(&mut self) -> Result<TrainSession<'_, B, E>, LifecycleError<B::Error>> {
        self.ensure_train()?;
        Ok(TrainSession::new(self))
    }
}

/// Access to resident rollout weights of the current version (and to the awake engine), borrowed
/// from the lifecycle.
///
/// While a session (or any [`RolloutView`] or [`EngineMut`] taken from it) lives, the lifecycle is
/// mutably borrowed: no training update can run, so the weights cannot go stale under the reader.
/// End the call with [`finish`](RolloutSession::finish) (applies the switching policy and the
/// engine's memory policy) or leave rollout mode with [`exit`](RolloutSession::exit); both consume
/// the session.
///
/// Dropping a session without `finish` under [`Switching::Eager`] defers the exit to the next
/// lifecycle operation (and under
/// [`EngineMemory::FreeEachCall`](crate::EngineMemory::FreeEachCall), the engine's sleep).
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Mode, RolloutView, Switching};
///
/// fn greedy(weights: RolloutView<'_, Vec<f32>>) -> usize {
///     (0..weights.len()).max_by(|&a, &b| weights[a].total_cmp(&weights[b])).unwrap_or(0)
/// }
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.1, 0.7, 0.2]);
///     lc.set_switching(Switching::Eager);
///     let session = lc.rollout()?;                  // enters rollout mode
///     assert_eq!(session.version(), 0);
///     assert_eq!(greedy(session.weights()), 1);
///     session.finish()?;                            // eager: exits now
///     assert_eq!(lc.mode(), Mode::Train);
///
///     let session = lc.rollout()?;
///     session.exit()?;                              // leaves whatever the policy
///     assert_eq!(lc.mode(), Mode::Train);
///     Ok(())
/// }
/// ```
pub struct RolloutSession<'lc, B: Reshard, E: RolloutEngine<B::Rollout> = ()> {
    lc: &'lc mut Lifecycle<B, E>,
    done: bool,
}

impl<'lc, B: Reshard, E: RolloutEngine<B::Rollout>> RolloutSession<'lc, B, E> {
    fn new(lc: &'lc mut Lifecycle<B, E>) -> Self {
        RolloutSession { lc, done: false }
    }

    /// A view of the rollout weights, valid while this session is borrowed.
    pub fn weights(&self) -> RolloutView<'_, B::Rollout> {
        RolloutView::new(self.lc.resident_weights(), self.lc.version())
    }

    /// The weights view and the awake engine together, both borrowed from this session: what a
    /// rollout call needs.
    ///
    /// ```
    /// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
    /// use lifecycle_core::{Lifecycle, LifecycleError};
    ///
    /// fn main() -> Result<(), LifecycleError<CopyError>> {
    ///     let engine = KvEngine::new();
    ///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]).with_engine(engine);
    ///     let mut session = lc.rollout()?;
    ///     let (weights, mut engine) = session.parts();
    ///     engine.kv = weights.iter().map(|w| 2.0 * w).collect();
    ///     session.finish()?;
    ///     assert_eq!(lc.engine().kv, [2.0, 4.0]);
    ///     Ok(())
    /// }
    /// ```
    pub fn parts(&mut self) -> (RolloutView<'_, B::Rollout>, EngineMut<'_, E>) {
        let (weights, engine, version) = self.lc.weights_and_engine();
        (
            RolloutView::new(weights, version),
            EngineMut::new(engine, version),
        )
    }

    /// The awake engine, mutable (use [`parts`](RolloutSession::parts) to hold the weights view
    /// at the same time).
    pub fn engine_mut(&mut self) -> EngineMut<'_, E> {
        self.parts().1
    }

    /// The engine, read-only.
    pub fn engine(&self) -> &E {
        self.lc.engine()
    }

    /// The version of the training weights these rollout weights were built from.
    pub fn version(&self) -> u64 {
        self.lc.version()
    }

    /// The backend, read-only (for example to reach its devices).
    pub fn backend(&self) -> &B {
        self.lc.backend()
    }

    /// Ends the rollout call: under [`Switching::Lazy`] the weights stay resident; under
    /// [`Switching::Eager`] the lifecycle exits now (the engine sleeps first). Under
    /// [`EngineMemory::FreeEachCall`](crate::EngineMemory::FreeEachCall) the engine sleeps now.
    pub fn finish(self) -> Result<(), LifecycleError<B::Error>> {
        let switching = self.lc.config().switching;
        self.end(switching)
    }

    /// Ends the rollout call with `switching` instead of the lifecycle's policy.
    pub(crate) fn end(mut self, switching: Switching) -> Result<(), LifecycleError<B::Error>> {
        self.done = true;
        self.lc.after_rollout_call(switching)
    }

    /// Leaves rollout mode now, whatever the switching policy (the engine sleeps first).
    pub fn exit(mut self) -> Result<(), LifecycleError<B::Error>> {
        self.done = true;
        self.lc.exit()
    }
}

impl<B: Reshard, E: RolloutEngine<B::Rollout>> Drop for RolloutSession<'_, B, E> {
    fn drop(&mut self) {
        if !self.done {
            self.lc.session_dropped();
        }
    }
}

impl<B: Reshard, E: RolloutEngine<B::Rollout>> std::fmt::Debug for RolloutSession<'_, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutSession")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

/// Access to the training state, borrowed from the lifecycle in train mode.
///
/// [`state_mut`](TrainSession::state_mut) bumps the weight version, so the next rollout rebuilds
/// its weights; [`state`](TrainSession::state) reads without bumping it.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     lc.rollout()?.finish()?;
///
///     let mut train = lc.train()?;                   // exits rollout mode
///     let norm: f32 = train.state().iter().map(|w| w * w).sum();
///     assert_eq!((norm, train.version()), (5.0, 0));  // reading does not bump the version
///     for w in train.state_mut() {
///         *w -= 0.5;                                 // an optimizer step
///     }
///     assert_eq!(train.version(), 1);
///
///     assert_eq!(*lc.rollout()?.weights(), [0.5, 1.5]); // rebuilt from the new state
///     Ok(())
/// }
/// ```
pub struct TrainSession<'lc, B: Reshard, E = ()> {
    lc: &'lc mut Lifecycle<B, E>,
}

impl<'lc, B: Reshard, E> TrainSession<'lc, B, E> {
    fn new(lc: &'lc mut Lifecycle<B, E>) -> Self {
        TrainSession { lc }
    }

    /// The engine (asleep while training), read-only.
    pub fn engine(&self) -> &E {
        &self.lc.engine
    }

    /// The training state, read-only (does not bump the version).
    pub fn state(&self) -> &B::TrainState {
        &self.lc.state
    }

    /// The training state, mutable: bumps the weight version.
    pub fn state_mut(&mut self) -> &mut B::TrainState {
        self.lc.version += 1;
        &mut self.lc.state
    }

    /// The backend, read-only.
    pub fn backend(&self) -> &B {
        &self.lc.backend
    }

    /// The backend and the mutable training state together (bumps the version), for updates that
    /// need the backend's devices.
    pub fn backend_and_state_mut(&mut self) -> (&B, &mut B::TrainState) {
        self.lc.version += 1;
        (&self.lc.backend, &mut self.lc.state)
    }

    /// The current weight version.
    pub fn version(&self) -> u64 {
        self.lc.version
    }
}

impl<B: Reshard, E> std::fmt::Debug for TrainSession<'_, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainSession")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}
