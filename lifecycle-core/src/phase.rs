//! The phases of a switch and the link classes bytes cross.

use std::fmt;

/// One phase of a switch between the training and the rollout layout.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Phase};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     lc.rollout()?.finish()?;
///     lc.train()?;
///     let ran: Vec<&str> = Phase::ALL
///         .into_iter()
///         .filter(|&p| lc.metrics().phase(p).count > 0)
///         .map(Phase::name)
///         .collect();
///     assert_eq!(ran, ["plan", "transfer", "offload", "release", "reload"]);
///     Ok(())
/// }
/// ```
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

/// The class of link a byte crossed; a backend names it when it reports bytes
/// ([`PhaseScope::add_bytes`](crate::PhaseScope::add_bytes)).
///
/// ```
/// use lifecycle_core::{Link, Metrics, Phase, PhaseRecorder};
///
/// let mut metrics = Metrics::default();
/// let _ = PhaseRecorder::new(&mut metrics).phase(Phase::Offload, |scope| {
///     scope.add_bytes(Link::DeviceToHost, 1 << 20);
///     Ok::<(), std::convert::Infallible>(())
/// });
/// assert_eq!(metrics.phase(Phase::Offload).bytes.device_to_host, 1 << 20);
/// ```
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
