//! What every switch reports: whether an enter switched, and the counts and times so far.

use std::time::Duration;

use lifecycle_core::Metrics;

/// What an enter did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entered {
    /// Whether it switched (false: the resident weights were current, nothing moved).
    pub switched: bool,
    /// The generation of the weights now resident (one more at every switch).
    pub generation: u64,
    /// Wall time of the switch (zero when reused).
    pub wall: Duration,
}

impl Entered {
    pub(crate) fn reused(generation: u64) -> Self {
        Entered {
            switched: false,
            generation,
            wall: Duration::ZERO,
        }
    }

    pub(crate) fn switched(generation: u64, wall: Duration) -> Self {
        Entered {
            switched: true,
            generation,
            wall,
        }
    }
}

/// Counts and times of a switch's lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SwitchStats {
    /// Enters (rollout weights materialised).
    pub enters: u64,
    /// In-place refreshes of resident weights.
    pub refreshes: u64,
    /// Exits out of rollout mode (a refresh of resident weights is not one).
    pub exits: u64,
    /// Rollout calls that found current weights resident (reading tensors is not one).
    pub reuses: u64,
    /// Wall time of every phase of every switch.
    pub switch_time: Duration,
    /// The generation of the resident weights.
    pub generation: u64,
}

/// The counts a switch reports, kept by the switch itself (across the GPU switch's lendings):
/// a rollout call that reuses current weights, an exit out of rollout mode, and the enters,
/// refreshes and time of the lifecycle's switches. Reading views is not a rollout call, and
/// the exit a kept-resident refresh makes inside the lifecycle is not the caller's exit.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally(SwitchStats);

impl Tally {
    /// A switch whose lifecycle work is `delta` (metrics after minus before).
    pub(crate) fn switched(&mut self, delta: &Metrics) {
        self.0.enters += delta.enters;
        self.0.refreshes += delta.refreshes;
        self.0.switch_time += delta.switch_time();
    }

    /// A rollout call that found current weights resident.
    pub(crate) fn reused(&mut self) {
        self.0.reuses += 1;
    }

    /// An exit out of rollout mode whose lifecycle work is `delta`.
    pub(crate) fn exited(&mut self, delta: &Metrics) {
        self.0.exits += 1;
        self.0.switch_time += delta.switch_time();
    }

    /// The counts, at weight generation `generation`.
    pub(crate) fn stats(&self, generation: u64) -> SwitchStats {
        SwitchStats {
            generation,
            ..self.0
        }
    }
}
