//! A timeline of every switch: spans per phase, rank and stream, written as a Chrome / Perfetto
//! trace (`ui.perfetto.dev` and `chrome://tracing` open it). Off by default; when off, recording
//! is a branch on a bool.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::phase::{Link, Phase};

/// One interval of work.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Phase};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     lc.enable_trace();
///     lc.rollout()?.finish()?;
///     let transfer = lc.trace().spans().iter().find(|s| s.phase == Phase::Transfer);
///     let transfer = transfer.map(|s| (s.name.as_str(), s.rank, s.bytes));
///     assert_eq!(transfer, Some(("transfer", None, 4)));       // the lifecycle's row, 4 bytes
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// What ran (e.g. `transfer`, `bucket 3`, `offload master`).
    pub name: String,
    /// The phase it belongs to.
    pub phase: Phase,
    /// The rank that did it; `None` for the lifecycle's own row (whole phases).
    pub rank: Option<usize>,
    /// The stream or thread that did it (`host`, `compute`, `nccl`, `copy`, …): one track each.
    pub track: String,
    /// Start, in microseconds since the trace began.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
    /// Bytes moved during the span, if any.
    pub bytes: u64,
    /// The link those bytes crossed.
    pub link: Option<Link>,
}

/// Spans of a run; records nothing unless enabled.
///
/// ```
/// use lifecycle_core::{Phase, Span, Trace};
/// let mut trace = Trace::enabled();
/// let start = trace.micros(std::time::Instant::now());
/// trace.record(Span { name: "transfer".into(), phase: Phase::Transfer, rank: Some(0),
///     track: "host".into(), start_us: start, duration_us: 12.5, bytes: 4096, link: None });
/// let json = trace.to_chrome_json();
/// assert!(json.contains("\"traceEvents\""));
/// assert!(json.contains("\"name\":\"transfer\""));
/// ```
#[derive(Debug, Clone)]
pub struct Trace {
    origin: Instant,
    enabled: bool,
    spans: Vec<Span>,
}

impl Default for Trace {
    fn default() -> Self {
        Trace::disabled()
    }
}

impl Trace {
    /// A trace that records nothing.
    pub fn disabled() -> Self {
        Trace {
            origin: Instant::now(),
            enabled: false,
            spans: Vec::new(),
        }
    }

    /// A trace that records, with its clock starting now.
    pub fn enabled() -> Self {
        Trace {
            enabled: true,
            ..Trace::disabled()
        }
    }

    /// Whether spans are recorded.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The instant time zero stands for.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Microseconds from the origin to `t` (negative before it).
    pub fn micros(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.origin) {
            Some(d) => d.as_secs_f64() * 1e6,
            None => -(self.origin.duration_since(t).as_secs_f64() * 1e6),
        }
    }

    /// Adds a span (nothing when disabled).
    pub fn record(&mut self, span: Span) {
        if self.enabled {
            self.spans.push(span);
        }
    }

    /// Adds a span measured with host timers: from `start` for `duration`.
    #[allow(clippy::too_many_arguments)]
    pub fn record_host(
        &mut self,
        name: impl Into<String>,
        phase: Phase,
        rank: Option<usize>,
        track: &str,
        start: Instant,
        duration: Duration,
        bytes: u64,
        link: Option<Link>,
    ) {
        if self.enabled {
            let start_us = self.micros(start);
            self.spans.push(Span {
                name: name.into(),
                phase,
                rank,
                track: track.to_string(),
                start_us,
                duration_us: duration.as_secs_f64() * 1e6,
                bytes,
                link,
            });
        }
    }

    /// The spans recorded so far.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Drops the spans, keeping the origin and the setting.
    pub fn clear(&mut self) {
        self.spans.clear();
    }

    /// The Chrome trace-event JSON: one process per rank (plus one for the lifecycle), one thread
    /// per track, complete (`"ph":"X"`) events with bytes and link as arguments.
    pub fn to_chrome_json(&self) -> String {
        let pid = |rank: Option<usize>| rank.map_or(0, |r| r + 1);
        let mut tracks: Vec<(Option<usize>, &str)> = Vec::new();
        for s in &self.spans {
            if !tracks.iter().any(|(r, t)| *r == s.rank && *t == s.track) {
                tracks.push((s.rank, &s.track));
            }
        }
        let tid = |rank: Option<usize>, track: &str| {
            tracks
                .iter()
                .filter(|(r, _)| *r == rank)
                .position(|(_, t)| *t == track)
                .unwrap_or(0)
        };
        let mut ranks: Vec<Option<usize>> = tracks.iter().map(|(r, _)| *r).collect();
        ranks.sort();
        ranks.dedup();
        let mut events = Vec::new();
        for rank in &ranks {
            let name = rank.map_or("lifecycle".to_string(), |r| format!("rank {r}"));
            events.push(json!({"ph": "M", "name": "process_name", "pid": pid(*rank), "args": {"name": name}}));
            events.push(json!({"ph": "M", "name": "process_sort_index", "pid": pid(*rank), "args": {"sort_index": pid(*rank)}}));
        }
        for (rank, track) in &tracks {
            events.push(json!({"ph": "M", "name": "thread_name", "pid": pid(*rank), "tid": tid(*rank, track), "args": {"name": track}}));
        }
        for s in &self.spans {
            let link = s.link.map(|l| match l {
                Link::DeviceToDevice => "device-device",
                Link::DeviceToHost => "device-host",
                Link::HostToDevice => "host-device",
                Link::Local => "local",
            });
            events.push(json!({
                "ph": "X",
                "name": s.name,
                "cat": s.phase.name(),
                "pid": pid(s.rank),
                "tid": tid(s.rank, &s.track),
                "ts": s.start_us,
                "dur": s.duration_us.max(0.0),
                "args": {"bytes": s.bytes, "link": link},
            }));
        }
        json!({"displayTimeUnit": "ms", "traceEvents": events}).to_string()
    }

    /// Writes [`to_chrome_json`](Trace::to_chrome_json) to `path`.
    pub fn write_chrome(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_chrome_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_records_nothing() {
        let mut t = Trace::disabled();
        t.record_host(
            "x",
            Phase::Plan,
            None,
            "host",
            Instant::now(),
            Duration::ZERO,
            0,
            None,
        );
        assert!(t.spans().is_empty());
    }

    #[test]
    fn chrome_json_has_one_track_per_rank_and_stream() {
        let mut t = Trace::enabled();
        let now = Instant::now();
        for (rank, track) in [
            (Some(0), "compute"),
            (Some(0), "copy"),
            (Some(1), "compute"),
            (None, "switch"),
        ] {
            t.record_host(
                "a \"quoted\" name",
                Phase::Transfer,
                rank,
                track,
                now,
                Duration::from_micros(5),
                10,
                Some(Link::DeviceToDevice),
            );
        }
        let json = t.to_chrome_json();
        assert!(json.contains("\"name\":\"rank 1\""));
        assert!(json.contains("\"name\":\"lifecycle\""));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        assert!(events.iter().any(|e| e["name"] == "thread_name"
            && e["pid"] == 1
            && e["tid"] == 1
            && e["args"]["name"] == "copy"));
        assert!(json.contains("a \\\"quoted\\\" name"));
        assert_eq!(json.matches("\"ph\":\"X\"").count(), 4);
    }
}
