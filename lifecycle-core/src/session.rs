//! Sessions: the only ways to reach the rollout weights ([`RolloutSession`], [`RolloutView`]) and
//! the training state ([`TrainSession`]).

use std::ops::Deref;

use crate::error::LifecycleError;
use crate::lifecycle::Lifecycle;
use crate::policy::Switching;
use crate::reshard::Reshard;

/// Access to resident rollout weights of the current version, borrowed from the lifecycle.
///
/// While a session (or any [`RolloutView`] taken from it) lives, the lifecycle is mutably borrowed:
/// no training update can run, so the weights cannot go stale under the reader. End the call with
/// [`finish`](RolloutSession::finish) (applies the switching policy) or leave rollout mode with
/// [`exit`](RolloutSession::exit); both consume the session.
///
/// Dropping a session without `finish` under [`Switching::Eager`] defers the exit to the next
/// lifecycle operation.
pub struct RolloutSession<'lc, B: Reshard> {
    lc: &'lc mut Lifecycle<B>,
    done: bool,
}

impl<'lc, B: Reshard> RolloutSession<'lc, B> {
    pub(crate) fn new(lc: &'lc mut Lifecycle<B>) -> Self {
        RolloutSession { lc, done: false }
    }

    /// A view of the rollout weights, valid while this session is borrowed.
    pub fn weights(&self) -> RolloutView<'_, B::Rollout> {
        RolloutView {
            weights: self.lc.resident_weights(),
            version: self.lc.version(),
        }
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
    /// [`Switching::Eager`] the lifecycle exits now.
    pub fn finish(mut self) -> Result<(), LifecycleError<B::Error>> {
        self.done = true;
        self.lc.after_rollout_call()
    }

    /// Leaves rollout mode now, whatever the switching policy.
    pub fn exit(mut self) -> Result<(), LifecycleError<B::Error>> {
        self.done = true;
        self.lc.exit()
    }
}

impl<B: Reshard> Drop for RolloutSession<'_, B> {
    fn drop(&mut self) {
        if !self.done && self.lc.config().switching == Switching::Eager {
            self.lc.exit_due = true;
        }
    }
}

impl<B: Reshard> std::fmt::Debug for RolloutSession<'_, B> {
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
    /// The version of the training weights these rollout weights were built from.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The weights, with the view's lifetime.
    pub fn get(&self) -> &'s W {
        self.weights
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
pub struct TrainSession<'lc, B: Reshard> {
    lc: &'lc mut Lifecycle<B>,
}

impl<'lc, B: Reshard> TrainSession<'lc, B> {
    pub(crate) fn new(lc: &'lc mut Lifecycle<B>) -> Self {
        TrainSession { lc }
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

impl<B: Reshard> std::fmt::Debug for TrainSession<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainSession")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}
