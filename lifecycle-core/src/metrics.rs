//! Per-phase switch metrics: counts, wall time, bytes per link class and peak extra memory.
//!
//! Backends report what each phase did through a [`PhaseRecorder`](crate::PhaseRecorder); the lifecycle owns the
//! resulting [`Metrics`], which users read as a struct or print as one line or a table.

use std::fmt;
use std::time::Duration;

use crate::phase::{Link, Phase};

/// Bytes moved, split by link class.
///
/// ```
/// use lifecycle_core::{Link, LinkBytes};
///
/// let mut bytes = LinkBytes::default();
/// bytes.add(Link::DeviceToHost, 300);
/// bytes.add(Link::HostToDevice, 300);
/// bytes.add(Link::Local, 50);
/// assert_eq!(bytes.moved(), 600);                  // local copies cross no link
/// assert_eq!(bytes.device_host(), 600);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkBytes {
    /// Bytes that crossed a device↔device link.
    pub device_to_device: u64,
    /// Bytes copied from device to host memory.
    pub device_to_host: u64,
    /// Bytes copied from host to device memory.
    pub host_to_device: u64,
    /// Bytes written by copies or casts that stayed on one device.
    pub local: u64,
}

impl LinkBytes {
    /// Adds `bytes` to the counter of `link`.
    pub fn add(&mut self, link: Link, bytes: u64) {
        match link {
            Link::DeviceToDevice => self.device_to_device += bytes,
            Link::DeviceToHost => self.device_to_host += bytes,
            Link::HostToDevice => self.host_to_device += bytes,
            Link::Local => self.local += bytes,
        }
    }

    /// Bytes that crossed a link between memories (everything but [`LinkBytes::local`]).
    pub fn moved(&self) -> u64 {
        self.device_to_device + self.device_to_host + self.host_to_device
    }

    /// Bytes that crossed a device↔host link, either way.
    pub fn device_host(&self) -> u64 {
        self.device_to_host + self.host_to_device
    }

    fn merge(&mut self, other: &LinkBytes) {
        self.device_to_device += other.device_to_device;
        self.device_to_host += other.device_to_host;
        self.host_to_device += other.host_to_device;
        self.local += other.local;
    }
}

/// Accumulated statistics of one phase ([`Metrics::phase`]).
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Phase};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.0; 256]);
///     for _ in 0..2 {
///         lc.rollout()?.finish()?;
///         lc.train()?;
///     }
///     let offload = lc.metrics().phase(Phase::Offload);
///     assert_eq!(offload.count, 2);
///     assert_eq!(offload.bytes.device_to_host, 2 * 256 * 4);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseStats {
    /// How many times the phase ran.
    pub count: u64,
    /// Total wall time.
    pub wall: Duration,
    /// Bytes moved, by link class.
    pub bytes: LinkBytes,
    /// Largest extra memory (bytes, on any one device) the phase held above its inputs and outputs.
    pub peak_extra_bytes: u64,
    /// Largest device memory the rollout engine held while the phase ran: its KV cache and
    /// workspace during [`Phase::Wake`] and [`Phase::Sleep`], and zero during the backend's phases
    /// (the engine sleeps before the exit and wakes after the enter), so the peak of a switch is
    /// never the training state, the rollout weights and the KV cache together.
    pub peak_engine_bytes: u64,
}

/// What one run of a phase reports; filled by the backend through
/// [`PhaseScope`](crate::PhaseScope), or given whole to
/// [`PhaseRecorder::record`](crate::PhaseRecorder::record) for a phase the backend timed itself.
///
/// ```
/// use std::time::Duration;
/// use lifecycle_core::{Link, LinkBytes, Metrics, Phase, PhaseRecorder, PhaseSample};
///
/// let mut metrics = Metrics::default();
/// let mut bytes = LinkBytes::default();
/// bytes.add(Link::DeviceToDevice, 4096);
/// let sample = PhaseSample { bytes, peak_extra_bytes: 1024 };
/// PhaseRecorder::new(&mut metrics).record(Phase::Transfer, Duration::from_micros(80), sample);
/// assert_eq!(metrics.phase(Phase::Transfer).peak_extra_bytes, 1024);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseSample {
    /// Bytes moved, by link class.
    pub bytes: LinkBytes,
    /// Peak extra memory held during the phase.
    pub peak_extra_bytes: u64,
}

/// Memory an engine holds, in bytes: on the devices it drives (the largest of them for several)
/// and in host memory; what [`RolloutEngine::memory`](crate::RolloutEngine::memory) reports.
///
/// ```
/// use lifecycle_core::EngineBytes;
///
/// let kv = EngineBytes::device(1 << 20);
/// let prefixes = EngineBytes::host(4096);
/// let both = EngineBytes { device: kv.device, host: prefixes.host };
/// assert_eq!((both.device, both.host), (1 << 20, 4096));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineBytes {
    /// Device memory (per device, the largest when the engine drives several).
    pub device: u64,
    /// Host memory (for example a prefix cache kept off the device, or a CPU decoder's KV cache).
    pub host: u64,
}

impl EngineBytes {
    /// `bytes` of device memory, no host memory.
    pub fn device(bytes: u64) -> Self {
        EngineBytes {
            device: bytes,
            host: 0,
        }
    }

    /// `bytes` of host memory, no device memory.
    pub fn host(bytes: u64) -> Self {
        EngineBytes {
            device: 0,
            host: bytes,
        }
    }
}

/// Statistics of the attached engine's hooks and memory, in [`Metrics::engine`].
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.0; 64]).with_engine(KvEngine::new());
///     lc.rollout()?.finish()?;
///     lc.train()?;
///     let engine = lc.metrics().engine;
///     assert_eq!((engine.wakes, engine.sleeps, engine.failed_wakes), (1, 1, 0));
///     assert_eq!(engine.peak_device_bytes, 64 * 4);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Successful wakes.
    pub wakes: u64,
    /// Successful sleeps.
    pub sleeps: u64,
    /// Wakes that failed (error or panic).
    pub failed_wakes: u64,
    /// Sleeps that failed (error or panic).
    pub failed_sleeps: u64,
    /// Largest device memory the engine held while awake (after a wake, after a call, before a
    /// sleep).
    pub peak_device_bytes: u64,
    /// Largest host memory the engine held while awake.
    pub peak_host_bytes: u64,
}

impl EngineStats {
    pub(crate) fn observe(&mut self, bytes: EngineBytes) {
        self.peak_device_bytes = self.peak_device_bytes.max(bytes.device);
        self.peak_host_bytes = self.peak_host_bytes.max(bytes.host);
    }

    pub(crate) fn since(&self, earlier: &EngineStats) -> EngineStats {
        EngineStats {
            wakes: self.wakes - earlier.wakes.min(self.wakes),
            sleeps: self.sleeps - earlier.sleeps.min(self.sleeps),
            failed_wakes: self.failed_wakes - earlier.failed_wakes.min(self.failed_wakes),
            failed_sleeps: self.failed_sleeps - earlier.failed_sleeps.min(self.failed_sleeps),
            ..*self
        }
    }
}

/// Counters and per-phase statistics of every switch a lifecycle ran ([`Lifecycle::metrics`]),
/// readable as fields, as one line ([`summary_line`](Metrics::summary_line)) or as a table
/// ([`Display`](fmt::Display)).
///
/// [`Lifecycle::metrics`]: crate::Lifecycle::metrics
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.0; 1000]);
///     let before = lc.metrics().clone();
///     for _ in 0..3 {
///         lc.rollout()?.finish()?;                 // one switch for three calls
///     }
///     lc.train()?;
///     let step = lc.metrics().since(&before);
///     assert_eq!((step.switches(), step.exits, step.rollout_calls, step.reuses), (1, 1, 3, 2));
///     assert_eq!(step.bytes().device_host(), 2 * 4000);  // offload and reload
///     assert!(step.summary_line().starts_with("switches 1 (enter 1, refresh 0), exits 1"));
///     println!("{step}");                           // one row per phase
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metrics {
    phases: [PhaseStats; 7],
    /// Full enters (rollout weights materialised from nothing).
    pub enters: u64,
    /// In-place refreshes of resident rollout weights.
    pub refreshes: u64,
    /// Exits (rollout weights released and/or training state brought back).
    pub exits: u64,
    /// Rollout calls served.
    pub rollout_calls: u64,
    /// Rollout calls that found current weights resident and moved zero bytes.
    pub reuses: u64,
    /// The rollout engine's wakes, sleeps and peak memory (all zero without an engine).
    pub engine: EngineStats,
    /// The memory decision the switches follow, when offload was decided by need
    /// ([`Lifecycle::set_memory_decision`](crate::Lifecycle::set_memory_decision)).
    pub memory: Option<crate::MemoryDecision>,
}

impl Metrics {
    /// Statistics of one phase.
    pub fn phase(&self, phase: Phase) -> &PhaseStats {
        &self.phases[phase.index()]
    }

    /// Switches into the rollout layout that moved weights (enters + refreshes).
    pub fn switches(&self) -> u64 {
        self.enters + self.refreshes
    }

    /// Bytes moved over all phases.
    pub fn bytes(&self) -> LinkBytes {
        let mut total = LinkBytes::default();
        for p in &self.phases {
            total.merge(&p.bytes);
        }
        total
    }

    /// Wall time over all phases.
    pub fn switch_time(&self) -> Duration {
        self.phases.iter().map(|p| p.wall).sum()
    }

    /// Largest peak extra memory of any phase.
    pub fn peak_extra_bytes(&self) -> u64 {
        self.phases
            .iter()
            .map(|p| p.peak_extra_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Difference `self - earlier`, for per-step reporting. Peaks are kept from `self`.
    pub fn since(&self, earlier: &Metrics) -> Metrics {
        let mut out = self.clone();
        for (p, e) in out.phases.iter_mut().zip(&earlier.phases) {
            p.count -= e.count.min(p.count);
            p.wall = p.wall.saturating_sub(e.wall);
            p.bytes.device_to_device -= e.bytes.device_to_device.min(p.bytes.device_to_device);
            p.bytes.device_to_host -= e.bytes.device_to_host.min(p.bytes.device_to_host);
            p.bytes.host_to_device -= e.bytes.host_to_device.min(p.bytes.host_to_device);
            p.bytes.local -= e.bytes.local.min(p.bytes.local);
        }
        out.enters -= earlier.enters.min(out.enters);
        out.refreshes -= earlier.refreshes.min(out.refreshes);
        out.exits -= earlier.exits.min(out.exits);
        out.rollout_calls -= earlier.rollout_calls.min(out.rollout_calls);
        out.reuses -= earlier.reuses.min(out.reuses);
        out.engine = self.engine.since(&earlier.engine);
        out
    }

    /// Largest device memory the rollout engine held in any phase or while serving calls.
    pub fn peak_engine_bytes(&self) -> u64 {
        self.phases
            .iter()
            .map(|p| p.peak_engine_bytes)
            .max()
            .unwrap_or(0)
            .max(self.engine.peak_device_bytes)
    }

    pub(crate) fn record(
        &mut self,
        phase: Phase,
        wall: Duration,
        sample: &PhaseSample,
        engine_bytes: u64,
    ) {
        let stats = &mut self.phases[phase.index()];
        stats.count += 1;
        stats.wall += wall;
        stats.bytes.merge(&sample.bytes);
        stats.peak_extra_bytes = stats.peak_extra_bytes.max(sample.peak_extra_bytes);
        stats.peak_engine_bytes = stats.peak_engine_bytes.max(engine_bytes);
    }

    /// Whether an engine's hooks ran (then renderings show the wake and sleep phases).
    fn engine_ran(&self) -> bool {
        Phase::ENGINE.iter().any(|p| self.phase(*p).count > 0)
    }

    /// The phases renderings show: the backend's, then the engine's when it ran.
    fn shown_phases(&self) -> Vec<Phase> {
        let mut phases = Phase::ALL.to_vec();
        if self.engine_ran() {
            phases.extend(Phase::ENGINE);
        }
        phases
    }

    /// One-line summary, e.g. `switches 1 (enter 1, refresh 0), exits 1, calls 3 (2 reused), moved 1.2 MB in 3.1 ms`.
    pub fn summary_line(&self) -> String {
        let bytes = self.bytes();
        let engine = if self.engine_ran() {
            format!(
                ", engine wakes {} / sleeps {}, rollout memory peak {} device, {} host",
                self.engine.wakes,
                self.engine.sleeps,
                HumanBytes(self.peak_engine_bytes()),
                HumanBytes(self.engine.peak_host_bytes),
            )
        } else {
            String::new()
        };
        format!(
            "switches {} (enter {}, refresh {}), exits {}, calls {} ({} reused), \
             moved {} (d2d {}, d2h {}, h2d {}), switch time {}{engine}",
            self.switches(),
            self.enters,
            self.refreshes,
            self.exits,
            self.rollout_calls,
            self.reuses,
            HumanBytes(bytes.moved()),
            HumanBytes(bytes.device_to_device),
            HumanBytes(bytes.device_to_host),
            HumanBytes(bytes.host_to_device),
            HumanDuration(self.switch_time()),
        )
    }

    /// A table with one row per phase.
    pub fn table(&self) -> String {
        self.to_string()
    }

    /// A table per phase of time, bytes, achieved GB/s and the ceiling of the link the phase
    /// mostly used (from `ceilings`), with the achieved fraction of it.
    ///
    /// ```
    /// use lifecycle_core::{Ceilings, Metrics};
    /// let report = Metrics::default().report(&Ceilings { device_to_host_gbps: Some(54.0), ..Default::default() });
    /// assert!(report.contains("offload"));
    /// ```
    pub fn report(&self, ceilings: &Ceilings) -> String {
        let mut out = format!(
            "{:<9} {:>6} {:>11} {:>11} {:>9} {:>22} {:>7}\n",
            "phase", "count", "time", "bytes", "GB/s", "ceiling", "of it"
        );
        for phase in self.shown_phases() {
            let s = self.phase(phase);
            let b = &s.bytes;
            let links = [
                (
                    b.device_to_device,
                    "device-device",
                    ceilings.device_to_device_gbps,
                ),
                (
                    b.device_to_host,
                    "device-host",
                    ceilings.device_to_host_gbps,
                ),
                (
                    b.host_to_device,
                    "host-device",
                    ceilings.host_to_device_gbps,
                ),
                (b.local, "local", ceilings.local_gbps),
            ];
            let bytes: u64 = links.iter().map(|l| l.0).sum();
            let secs = s.wall.as_secs_f64();
            let gbps = if secs > 0.0 {
                bytes as f64 / secs / 1e9
            } else {
                0.0
            };
            let main = links.iter().max_by_key(|l| l.0).filter(|l| l.0 > 0);
            let (ceiling, fraction) = match main {
                Some((_, name, Some(c))) => (
                    format!("{c:.1} GB/s {name}"),
                    format!("{:.0}%", 100.0 * gbps / c),
                ),
                Some((_, name, None)) => (format!("? ({name})"), "-".to_string()),
                None => ("-".to_string(), "-".to_string()),
            };
            out.push_str(&format!(
                "{:<9} {:>6} {:>11} {:>11} {:>9.2} {:>22} {:>7}\n",
                phase.name(),
                s.count,
                HumanDuration(s.wall).to_string(),
                HumanBytes(bytes).to_string(),
                gbps,
                ceiling,
                fraction
            ));
        }
        out
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let engine = self.engine_ran();
        write!(
            f,
            "{:<9} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "phase", "count", "wall", "d2d", "d2h", "h2d", "local", "peak extra"
        )?;
        if engine {
            write!(f, " {:>11}", "engine mem")?;
        }
        writeln!(f)?;
        for phase in self.shown_phases() {
            let s = self.phase(phase);
            write!(
                f,
                "{:<9} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
                phase.name(),
                s.count,
                HumanDuration(s.wall).to_string(),
                HumanBytes(s.bytes.device_to_device).to_string(),
                HumanBytes(s.bytes.device_to_host).to_string(),
                HumanBytes(s.bytes.host_to_device).to_string(),
                HumanBytes(s.bytes.local).to_string(),
                HumanBytes(s.peak_extra_bytes).to_string(),
            )?;
            if engine {
                write!(f, " {:>11}", HumanBytes(s.peak_engine_bytes).to_string())?;
            }
            writeln!(f)?;
        }
        write!(f, "{}", self.summary_line())?;
        if let Some(d) = &self.memory {
            write!(f, "\nmemory {d}")?;
        }
        Ok(())
    }
}

/// Link bandwidths a run is measured against, in GB/s (10^9 bytes per second); `None` where
/// unknown. [`Metrics::report`] prints each phase's achieved rate against them.
///
/// ```
/// use lifecycle_core::{Ceilings, Metrics};
///
/// let h200 = Ceilings {
///     device_to_device_gbps: Some(290.0),
///     device_to_host_gbps: Some(55.0),
///     host_to_device_gbps: Some(55.0),
///     local_gbps: Some(4100.0),
/// };
/// let report = Metrics::default().report(&h200);
/// assert!(report.starts_with("phase"));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ceilings {
    /// Device↔device (NVLink) receive rate per rank.
    pub device_to_device_gbps: Option<f64>,
    /// Device → pinned host copy rate.
    pub device_to_host_gbps: Option<f64>,
    /// Pinned host → device copy rate.
    pub host_to_device_gbps: Option<f64>,
    /// On-device copy / cast rate (bytes written).
    pub local_gbps: Option<f64>,
}

/// Formats a byte count with a decimal unit (B, kB, MB, GB).
///
/// ```
/// use lifecycle_core::HumanBytes;
///
/// assert_eq!(HumanBytes(999).to_string(), "999 B");
/// assert_eq!(HumanBytes(1_500_000).to_string(), "1.5 MB");
/// assert_eq!(HumanBytes(45_700_000_000).to_string(), "45.70 GB");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct HumanBytes(pub u64);

impl fmt::Display for HumanBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if self.0 < 1_000 {
            write!(f, "{} B", self.0)
        } else if b < 1e6 {
            write!(f, "{:.1} kB", b / 1e3)
        } else if b < 1e9 {
            write!(f, "{:.1} MB", b / 1e6)
        } else {
            write!(f, "{:.2} GB", b / 1e9)
        }
    }
}

/// Formats a duration in µs, ms or s.
///
/// ```
/// use std::time::Duration;
/// use lifecycle_core::HumanDuration;
///
/// assert_eq!(HumanDuration(Duration::from_micros(42)).to_string(), "42.0 µs");
/// assert_eq!(HumanDuration(Duration::from_millis(12)).to_string(), "12.00 ms");
/// assert_eq!(HumanDuration(Duration::from_millis(1500)).to_string(), "1.500 s");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0.as_secs_f64();
        if s < 1e-3 {
            write!(f, "{:.1} µs", s * 1e6)
        } else if s < 1.0 {
            write!(f, "{:.2} ms", s * 1e3)
        } else {
            write!(f, "{:.3} s", s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PhaseRecorder;

    #[test]
    fn recorder_accumulates_and_since_subtracts() {
        let mut m = Metrics::default();
        {
            let mut rec = PhaseRecorder::new(&mut m);
            let _: Result<(), ()> = rec.phase(Phase::Offload, |s| {
                s.add_bytes(Link::DeviceToHost, 100);
                s.alloc_extra(10);
                s.alloc_extra(5);
                s.free_extra(15);
                s.alloc_extra(3);
                Ok(())
            });
        }
        let snapshot = m.clone();
        {
            let mut rec = PhaseRecorder::new(&mut m);
            let _: Result<(), ()> = rec.phase(Phase::Offload, |s| {
                s.add_bytes(Link::DeviceToHost, 50);
                Err(())
            });
        }
        let off = m.phase(Phase::Offload);
        assert_eq!(off.count, 2);
        assert_eq!(off.bytes.device_to_host, 150);
        assert_eq!(off.peak_extra_bytes, 15);
        let delta = m.since(&snapshot);
        assert_eq!(delta.phase(Phase::Offload).count, 1);
        assert_eq!(delta.phase(Phase::Offload).bytes.device_to_host, 50);
        assert!(m.table().contains("offload"));
        assert!(m.summary_line().contains("d2h 150 B"));
    }

    #[test]
    fn human_units() {
        assert_eq!(HumanBytes(999).to_string(), "999 B");
        assert_eq!(HumanBytes(1_500_000).to_string(), "1.5 MB");
        assert_eq!(
            HumanDuration(Duration::from_millis(12)).to_string(),
            "12.00 ms"
        );
    }
}
