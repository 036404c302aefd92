//! The phases of a switch and the link classes bytes cross.

use std::fmt;

/// One phase of a switch between the training and the rollout layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Validating the layouts and computing the transfer plan (enter, refresh).
    Plan,
    /// Moving (and casting) weights into the rollout layout (enter, refresh).
    Transfer,
    /// Moving training state out of device memory (enter, refresh).
    Offload,
    /// Freeing the rollout weights (exit).
    Release,
    /// Bringing the offloaded training state back (exit).
    Reload,
    /// The rollout engine allocating its rollout memory, after the backend's enter (see
    /// [`RolloutEngine`](crate::RolloutEngine)).
    Wake,
    /// The rollout engine freeing its rollout memory, before the backend's exit.
    Sleep,
}

impl Phase {
    /// Every phase a backend reports, in the order a full switch runs them.
    pub const ALL: [Phase; 5] = [
        Phase::Plan,
        Phase::Transfer,
        Phase::Offload,
        Phase::Release,
        Phase::Reload,
    ];

    /// The phases of the rollout engine's hooks, recorded by the lifecycle when an engine is
    /// attached: wake after the backend's enter, sleep before its exit.
    pub const ENGINE: [Phase; 2] = [Phase::Wake, Phase::Sleep];

    /// Lower-case name used in renderings.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Plan => "plan",
            Phase::Transfer => "transfer",
            Phase::Offload => "offload",
            Phase::Release => "release",
            Phase::Reload => "reload",
            Phase::Wake => "wake",
            Phase::Sleep => "sleep",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The class of link a byte crossed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// Between two devices (NVLink / shared memory between host-backend ranks).
    DeviceToDevice,
    /// From a device to host memory (offload).
    DeviceToHost,
    /// From host memory to a device (reload).
    HostToDevice,
    /// Within one device (local copies and casts).
    Local,
}
