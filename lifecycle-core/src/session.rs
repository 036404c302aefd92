//! Sessions: the only ways to reach the rollout weights ([`RolloutSession`], [`RolloutView`]), the
//! awake engine ([`EngineMut`]) and the training state ([`TrainSession`]).

use std::ops::Deref;

use crate::cache::{Branded, Stamp};
use crate::engine::{EngineMut, RolloutEngine};
use crate::error::LifecycleError;
use crate::lifecycle::Lifecycle;
use crate::policy::Switching;
use crate::reshard::Reshard;

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
pub struct RolloutSession<'lc, B: Reshard, E: RolloutEngine<B::Rollout> = ()> {
    lc: &'lc mut Lifecycle<B, E>,
    done: bool,
}

impl<'lc, B: Reshard, E: RolloutEngine<B::Rollout>> RolloutSession<'lc, B, E> {
    pub(crate) fn new(lc: &'lc mut Lifecycle<B, E>) -> Self {
        RolloutSession { lc, done: false }
    }

    /// A view of the rollout weights, valid while this session is borrowed.
    pub fn weights(&self) -> RolloutView<'_, B::Rollout> {
        RolloutView {
            weights: self.lc.resident_weights(),
            version: self.lc.version(),
        }
    }

    /// The weights view and the awake engine together, both borrowed from this session: what a
    /// rollout call needs.
    ///
    /// ```
    /// # use lifecycle_core::{EngineBytes, Lifecycle, PhaseScope, RolloutEngine, RolloutView};
    /// # use lifecycle_core::{Reshard, SwitchContext};
    /// # struct Copying;
    /// # impl Reshard for Copying {
    /// #     type TrainState = Vec<f32>; type Rollout = Vec<f32>; type Plan = (); type Error = std::io::Error;
    /// #     fn plan(&self, _: &Vec<f32>) -> std::io::Result<()> { Ok(()) }
    /// #     fn enter(&mut self, _: &(), s: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<Vec<f32>> { Ok(s.clone()) }
    /// #     fn refresh(&mut self, _: &(), s: &mut Vec<f32>, r: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { r.clone_from(s); Ok(()) }
    /// #     fn exit(&mut self, _: &mut Vec<f32>, _: Option<Vec<f32>>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { Ok(()) }
    /// # }
    /// /// Remembers the last logits it produced.
    /// #[derive(Default)]
    /// struct Scorer { last: Vec<f32> }
    /// impl RolloutEngine<Vec<f32>> for Scorer {
    ///     type Error = std::convert::Infallible;
    ///     fn wake(&mut self, _: RolloutView<'_, Vec<f32>>, _: &mut PhaseScope) -> Result<(), Self::Error> { Ok(()) }
    ///     fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Self::Error> { self.last.clear(); Ok(()) }
    ///     fn memory(&self) -> EngineBytes { EngineBytes::host(4 * self.last.len() as u64) }
    /// }
    ///
    /// let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Scorer::default());
    /// let mut session = lc.rollout()?;
    /// let (weights, mut scorer) = session.parts();
    /// scorer.last = weights.iter().map(|w| 2.0 * w).collect();
    /// session.finish()?;
    /// assert_eq!(lc.engine().last, vec![2.0, 4.0]);
    /// # Ok::<(), lifecycle_core::LifecycleError<std::io::Error>>(())
    /// ```
    pub fn parts(&mut self) -> (RolloutView<'_, B::Rollout>, EngineMut<'_, E>) {
        let (weights, engine, version) = self.lc.weights_and_engine();
        (
            RolloutView { weights, version },
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

/// A shared view of rollout weights, borrowed from a [`RolloutSession`].
///
/// It dereferences to the backend's rollout weights. It cannot outlive its session, so it cannot
/// be kept across a training update, used after exit, or sent to a thread that may outlive the
/// session (scoped threads inside the session are fine when the weights are `Sync`).
pub struct RolloutView<'s, W> {
    weights: &'s W,
    version: u64,
}

impl<W> Clone for RolloutView<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W> Copy for RolloutView<'_, W> {}

impl<'s, W> RolloutView<'s, W> {
    pub(crate) fn new(weights: &'s W, version: u64) -> Self {
        RolloutView { weights, version }
    }

    /// The version of the training weights these rollout weights were built from.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The weights, with the view's lifetime.
    pub fn get(&self) -> &'s W {
        self.weights
    }

    /// A proof of this view's weight version for [`VersionedCache`](crate::VersionedCache)
    /// lookups, with the view's lifetime.
    pub fn stamp(&self) -> Stamp<'s> {
        Stamp::new(self.version)
    }

    /// Ties `value` (a KV handle, a batch's cache blocks) to this view: the result cannot outlive
    /// the session, so it cannot be used across a training update or after exit.
    pub fn brand<T>(&self, value: T) -> Branded<'s, T> {
        Branded::new(value, self.version)
    }
}

impl<W> Deref for RolloutView<'_, W> {
    type Target = W;
    fn deref(&self) -> &W {
        self.weights
    }
}

impl<W: std::fmt::Debug> std::fmt::Debug for RolloutView<'_, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutView")
            .field("version", &self.version)
            .field("weights", self.weights)
            .finish()
    }
}

/// Access to the training state, borrowed from the lifecycle in train mode.
///
/// [`state_mut`](TrainSession::state_mut) bumps the weight version, so the next rollout rebuilds
/// its weights.
pub struct TrainSession<'lc, B: Reshard, E = ()> {
    lc: &'lc mut Lifecycle<B, E>,
}

impl<'lc, B: Reshard, E> TrainSession<'lc, B, E> {
    pub(crate) fn new(lc: &'lc mut Lifecycle<B, E>) -> Self {
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
