//! Device-side spans: CUDA events recorded on the streams that do the work, turned into trace
//! spans once the work has finished. Host timers around asynchronous calls measure when work was
//! *queued*; these measure when it *ran*.
//!
//! A [`StreamTimeline`] is created per rank per switch. When tracing is off it records nothing
//! and costs one branch per mark; when on, each mark is two timing events (created from a small
//! per-timeline list, so no driver allocation sits between two kernels of a hot loop beyond the
//! event creation itself).

use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};
use lifecycle_core::{Link, Phase, Span, Trace};

use crate::pool::RankCtx;
use crate::CudaError;

/// One span measured on a stream: start and end in microseconds after the timeline's base event.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSpan {
    /// The phase the work belongs to.
    pub phase: Phase,
    /// What ran (`casts b3`, `send/recv b3`, `offload master`, …).
    pub name: String,
    /// The stream that ran it (`compute`, `aux`, `nccl`, `copy`): one track per stream.
    pub track: &'static str,
    /// Microseconds from the base event to the start event.
    pub start_us: f64,
    /// Microseconds from the start event to the end event.
    pub duration_us: f64,
    /// Bytes the work moved.
    pub bytes: u64,
    /// The link those bytes crossed.
    pub link: Option<Link>,
}

/// The spans one rank measured in one phase, with the host instant its base event stands for.
#[derive(Debug, Clone, Default)]
pub struct RankSpans {
    /// Host time at which the base event was recorded (the device reaches it within microseconds
    /// when its stream is idle, which it is at the start of a switch).
    pub base: Option<Instant>,
    /// The spans, in recording order.
    pub spans: Vec<DeviceSpan>,
}

impl RankSpans {
    /// Appends these spans to `trace` as spans of `rank`, on tracks named after the streams.
    pub fn record_into(&self, trace: &mut Trace, rank: usize) {
        let Some(base) = self.base else { return };
        let base_us = trace.micros(base);
        for s in &self.spans {
            trace.record(Span {
                name: s.name.clone(),
                phase: s.phase,
                rank: Some(rank),
                track: s.track.to_string(),
                start_us: base_us + s.start_us,
                duration_us: s.duration_us,
                bytes: s.bytes,
                link: s.link,
            });
        }
    }
}

struct Open {
    phase: Phase,
    name: String,
    track: &'static str,
    start: CudaEvent,
    end: CudaEvent,
    bytes: u64,
    link: Option<Link>,
}

/// Marks on a rank's streams, read back after the work is done.
///
/// ```no_run
/// # fn demo(ctx: &lifecycle_cuda::RankCtx) -> Result<(), lifecycle_cuda::CudaError> {
/// use lifecycle_cuda::StreamTimeline;
/// let mut tl = StreamTimeline::new(ctx, true)?;
/// let mark = tl.begin(ctx, &ctx.compute)?;
/// // ... queue kernels on ctx.compute ...
/// tl.end(ctx, &ctx.compute, mark, lifecycle_core::Phase::Transfer, "casts", "compute", 1 << 20, None)?;
/// ctx.compute.synchronize().map_err(ctx.drv("synchronizing", 0))?;
/// let spans = tl.finish()?; // microseconds after the base event
/// # let _ = spans; Ok(()) }
/// ```
pub struct StreamTimeline {
    base: Option<(CudaEvent, Instant)>,
    done: Vec<Open>,
}

/// A started mark: `None` when the timeline is off.
pub type Mark = Option<CudaEvent>;

impl StreamTimeline {
    /// A timeline that records when `enabled`, its base event on `ctx.compute` now.
    pub fn new(ctx: &RankCtx, enabled: bool) -> Result<Self, CudaError> {
        if !enabled {
            return Ok(StreamTimeline {
                base: None,
                done: Vec::new(),
            });
        }
        let ev = timing_event(ctx)?;
        let now = Instant::now();
        ev.record(&ctx.compute)
            .map_err(ctx.drv("recording a timeline event", 0))?;
        Ok(StreamTimeline {
            base: Some((ev, now)),
            done: Vec::new(),
        })
    }

    /// Whether marks are recorded.
    pub fn enabled(&self) -> bool {
        self.base.is_some()
    }

    /// Starts a mark on `stream` (records an event there when enabled).
    pub fn begin(&mut self, ctx: &RankCtx, stream: &CudaStream) -> Result<Mark, CudaError> {
        if self.base.is_none() {
            return Ok(None);
        }
        let ev = timing_event(ctx)?;
        ev.record(stream)
            .map_err(ctx.drv("recording a timeline event", 0))?;
        Ok(Some(ev))
    }

    /// Ends `mark` on `stream`: the span covers what the stream ran between the two events.
    #[allow(clippy::too_many_arguments)]
    pub fn end(
        &mut self,
        ctx: &RankCtx,
        stream: &CudaStream,
        mark: Mark,
        phase: Phase,
        name: impl Into<String>,
        track: &'static str,
        bytes: u64,
        link: Option<Link>,
    ) -> Result<(), CudaError> {
        let Some(start) = mark else { return Ok(()) };
        let end = timing_event(ctx)?;
        end.record(stream)
            .map_err(ctx.drv("recording a timeline event", 0))?;
        self.done.push(Open {
            phase,
            name: name.into(),
            track,
            start,
            end,
            bytes,
            link,
        });
        Ok(())
    }

    /// Reads the spans back. Call after the streams that ran the marked work are synchronised
    /// (events that have not completed give a driver error, not a wait).
    pub fn finish(self) -> Result<RankSpans, CudaError> {
        let Some((base, at)) = self.base else {
            return Ok(RankSpans::default());
        };
        let mut spans = Vec::with_capacity(self.done.len());
        for o in self.done {
            let (s, d) = match (base.elapsed_ms(&o.start), o.start.elapsed_ms(&o.end)) {
                (Ok(s), Ok(d)) => (s, d),
                (Err(e), _) | (_, Err(e)) => {
                    return Err(CudaError::driver(
                        0,
                        format!("reading the timeline event of {}", o.name),
                        0,
                        e,
                    ))
                }
            };
            spans.push(DeviceSpan {
                phase: o.phase,
                name: o.name,
                track: o.track,
                start_us: s as f64 * 1e3,
                duration_us: d as f64 * 1e3,
                bytes: o.bytes,
                link: o.link,
            });
        }
        Ok(RankSpans {
            base: Some(at),
            spans,
        })
    }
}

fn timing_event(ctx: &RankCtx) -> Result<CudaEvent, CudaError> {
    ctx.ctx
        .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(ctx.drv("creating a timing event", 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_spans_land_on_their_rank_and_stream_tracks() {
        let mut trace = Trace::enabled();
        let base = trace.origin() + std::time::Duration::from_micros(100);
        let spans = RankSpans {
            base: Some(base),
            spans: vec![
                DeviceSpan {
                    phase: Phase::Transfer,
                    name: "casts b0".into(),
                    track: "aux",
                    start_us: 5.0,
                    duration_us: 20.0,
                    bytes: 64,
                    link: Some(Link::Local),
                },
                DeviceSpan {
                    phase: Phase::Transfer,
                    name: "send/recv b0".into(),
                    track: "nccl",
                    start_us: 30.0,
                    duration_us: 10.0,
                    bytes: 32,
                    link: Some(Link::DeviceToDevice),
                },
            ],
        };
        spans.record_into(&mut trace, 1);
        let got = trace.spans();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].rank, Some(1));
        assert_eq!(got[0].track, "aux");
        assert!(
            (got[0].start_us - 105.0).abs() < 1e-6,
            "{}",
            got[0].start_us
        );
        assert!((got[1].start_us - 130.0).abs() < 1e-6);
        assert_eq!(got[1].link, Some(Link::DeviceToDevice));
        let json = trace.to_chrome_json();
        assert!(json.contains("send/recv b0"), "{json}");
    }

    #[test]
    fn empty_spans_record_nothing() {
        let mut trace = Trace::enabled();
        RankSpans::default().record_into(&mut trace, 0);
        assert!(trace.spans().is_empty());
    }
}
