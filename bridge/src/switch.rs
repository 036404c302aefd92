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
    /// Exits.
    pub exits: u64,
    /// Rollout calls that found current weights resident.
    pub reuses: u64,
    /// Wall time of every phase of every switch.
    pub switch_time: Duration,
    /// The generation of the resident weights.
    pub generation: u64,
}

impl SwitchStats {
    pub(crate) fn of(m: &Metrics, generation: u64) -> Self {
        SwitchStats {
            enters: m.enters,
            refreshes: m.refreshes,
            exits: m.exits,
            reuses: m.reuses,
            switch_time: m.switch_time(),
            generation,
        }
    }
}
