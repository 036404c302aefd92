//! Where a backend reports the phases of one switch: time, bytes per link, peak extra memory.

use std::time::{Duration, Instant};

use crate::fault::{Armed, FaultAt};
use crate::metrics::{Metrics, PhaseSample};
use crate::phase::{Link, Phase};
use crate::trace::Trace;

/// Where a backend reports the phases of one switch.
///
/// ```
/// use lifecycle_core::{Link, Phase, PhaseRecorder, Metrics};
/// let mut metrics = Metrics::default();
/// let mut rec = PhaseRecorder::new(&mut metrics);
/// let copied: Result<u64, std::convert::Infallible> = rec.phase(Phase::Transfer, |scope| {
///     scope.add_bytes(Link::DeviceToDevice, 1024);
///     Ok(1024)
/// });
/// assert_eq!(copied, Ok(1024));
/// assert_eq!(metrics.phase(Phase::Transfer).bytes.device_to_device, 1024);
/// ```
pub struct PhaseRecorder<'m> {
    metrics: &'m mut Metrics,
    trace: Option<&'m mut Trace>,
    armed: Option<Armed>,
    /// Device memory the rollout engine holds while the phases recorded here run.
    engine_held: u64,
}

impl<'m> PhaseRecorder<'m> {
    /// A recorder that adds to `metrics`.
    pub fn new(metrics: &'m mut Metrics) -> Self {
        PhaseRecorder {
            metrics,
            trace: None,
            armed: None,
            engine_held: 0,
        }
    }

    /// A recorder that adds to `metrics` and, when `trace` is enabled, records spans in it.
    pub fn with_trace(metrics: &'m mut Metrics, trace: &'m mut Trace) -> Self {
        PhaseRecorder {
            metrics,
            trace: Some(trace),
            armed: None,
            engine_held: 0,
        }
    }

    /// Whether spans are being recorded: backends skip collecting per-rank spans when not.
    pub fn tracing(&self) -> bool {
        self.trace.as_ref().is_some_and(|t| t.is_enabled())
    }

    /// The trace, when spans are being recorded.
    pub fn trace(&mut self) -> Option<&mut Trace> {
        self.trace.as_deref_mut().filter(|t| t.is_enabled())
    }

    /// Runs `f` as one instance of `phase`, timing it and recording what it reported in its
    /// [`PhaseScope`]. The phase is recorded whether `f` succeeds or not.
    pub fn phase<T, E>(
        &mut self,
        phase: Phase,
        f: impl FnOnce(&mut PhaseScope) -> Result<T, E>,
    ) -> Result<T, E> {
        self.check_fault(phase, FaultAt::Start);
        let mut scope = PhaseScope::default();
        let start = Instant::now();
        let out = f(&mut scope);
        let wall = start.elapsed();
        tracing::debug!(
            phase = phase.name(),
            ?wall,
            bytes = scope.sample.bytes.moved(),
            "phase"
        );
        let engine = self.engine_held.max(scope.engine_bytes);
        self.note(phase, (start, wall), &scope.sample, engine);
        self.check_fault(phase, FaultAt::End);
        out
    }

    /// Records one instance of `phase` that began at `span.0` and took `span.1`: the metrics, and
    /// the host span of the trace when tracing.
    fn note(
        &mut self,
        phase: Phase,
        (start, wall): (Instant, Duration),
        sample: &PhaseSample,
        engine: u64,
    ) {
        self.metrics.record(phase, wall, sample, engine);
        if let Some(trace) = self.trace() {
            let b = &sample.bytes;
            trace.record_host(
                phase.name(),
                phase,
                None,
                "switch",
                start,
                wall,
                b.moved() + b.local,
                None,
            );
        }
    }

    fn check_fault(&mut self, phase: Phase, at: FaultAt) {
        if let Some(armed) = self.armed.as_mut() {
            armed.check(phase, at);
        }
    }

    pub(crate) fn arm(&mut self, armed: Armed) {
        self.armed = Some(armed);
    }

    pub(crate) fn disarm(&mut self) -> Option<Armed> {
        self.armed.take()
    }

    /// Records a phase measured by the backend itself (for example from device events).
    pub fn record(&mut self, phase: Phase, wall: Duration, sample: PhaseSample) {
        self.check_fault(phase, FaultAt::Start);
        self.metrics.record(phase, wall, &sample, self.engine_held);
        self.check_fault(phase, FaultAt::End);
    }

    /// Records a phase the backend timed itself from `start` until now (its work spread over
    /// rank threads, say): the metrics and, when tracing, the host span of the trace, as
    /// [`PhaseRecorder::phase`] records its own.
    ///
    /// ```
    /// use std::time::Instant;
    /// use lifecycle_core::{Metrics, Phase, PhaseRecorder, PhaseSample};
    ///
    /// let mut metrics = Metrics::default();
    /// let start = Instant::now();
    /// PhaseRecorder::new(&mut metrics).record_since(Phase::Transfer, start, PhaseSample::default());
    /// assert_eq!(metrics.phase(Phase::Transfer).count, 1);
    /// ```
    pub fn record_since(&mut self, phase: Phase, start: Instant, sample: PhaseSample) {
        self.check_fault(phase, FaultAt::Start);
        let engine = self.engine_held;
        self.note(phase, (start, start.elapsed()), &sample, engine);
        self.check_fault(phase, FaultAt::End);
    }

    /// Notes the rollout engine's device memory held while the following phases run.
    pub(crate) fn set_engine_held(&mut self, bytes: u64) {
        self.engine_held = bytes;
    }
}

/// What a running phase reports: bytes per link and peak extra memory.
///
/// ```
/// use lifecycle_core::{Link, Metrics, Phase, PhaseRecorder};
///
/// let mut metrics = Metrics::default();
/// let mut rec = PhaseRecorder::new(&mut metrics);
/// let sent: Result<(), std::convert::Infallible> = rec.phase(Phase::Transfer, |scope| {
///     for _bucket in 0..4 {
///         scope.alloc_extra(1 << 20);                 // a staging buffer per bucket
///         scope.add_bytes(Link::DeviceToDevice, 1 << 20);
///         scope.free_extra(1 << 20);
///     }
///     assert_eq!(scope.sample().bytes.device_to_device, 4 << 20);
///     Ok(())
/// });
/// assert!(sent.is_ok());
/// assert_eq!(metrics.phase(Phase::Transfer).peak_extra_bytes, 1 << 20); // one at a time
/// ```
#[derive(Debug, Default)]
pub struct PhaseScope {
    sample: PhaseSample,
    current_extra: u64,
    /// The engine's device memory, for the engine's own phases (wake, sleep).
    engine_bytes: u64,
}

impl PhaseScope {
    /// Counts `bytes` moved over `link`.
    pub fn add_bytes(&mut self, link: Link, bytes: u64) {
        self.sample.bytes.add(link, bytes);
    }

    /// Notes that the phase now holds `bytes` more extra memory (staging buffers, buckets).
    pub fn alloc_extra(&mut self, bytes: u64) {
        self.current_extra += bytes;
        self.sample.peak_extra_bytes = self.sample.peak_extra_bytes.max(self.current_extra);
    }

    /// Notes that `bytes` of extra memory were freed.
    pub fn free_extra(&mut self, bytes: u64) {
        self.current_extra = self.current_extra.saturating_sub(bytes);
    }

    /// Raises the recorded peak to at least `bytes` (for peaks measured by the backend).
    pub fn note_peak_extra(&mut self, bytes: u64) {
        self.sample.peak_extra_bytes = self.sample.peak_extra_bytes.max(bytes);
    }

    /// What has been reported so far.
    pub fn sample(&self) -> &PhaseSample {
        &self.sample
    }

    pub(crate) fn set_engine_bytes(&mut self, bytes: u64) {
        self.engine_bytes = bytes;
    }
}
