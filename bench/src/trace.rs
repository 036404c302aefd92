//! Traced switches: one enter + exit recorded and written as a Chrome / Perfetto trace, and
//! summaries of its spans per rank and stream (when the work started and ended, how long it was
//! busy, the bytes it moved).

use std::error::Error;
use std::path::{Path, PathBuf};

use lifecycle_core::{Lifecycle, Reshard, Span};

/// The work of one track (a rank's stream, or the lifecycle's host row) of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TrackSummary {
    /// The rank (`None`: the lifecycle's host row).
    pub rank: Option<usize>,
    /// The stream (`compute`, `aux`, `nccl`, `copy`, …) or `switch` for the host row.
    pub track: String,
    /// Start of the first span, in microseconds of the trace.
    pub first_us: f64,
    /// End of the last span.
    pub last_us: f64,
    /// Sum of the span durations.
    pub busy_us: f64,
    /// Spans.
    pub spans: usize,
    /// Bytes the spans moved.
    pub bytes: u64,
}

/// One [`TrackSummary`] per (rank, track) of `spans`, the host row first, then by rank and
/// track name.
pub fn summarise(spans: &[Span]) -> Vec<TrackSummary> {
    let mut keys: Vec<(Option<usize>, &str)> =
        spans.iter().map(|s| (s.rank, s.track.as_str())).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .map(|(rank, track)| {
            let mine = spans.iter().filter(|s| s.rank == rank && s.track == track);
            let mut t = TrackSummary {
                rank,
                track: track.to_string(),
                first_us: f64::INFINITY,
                last_us: f64::NEG_INFINITY,
                busy_us: 0.0,
                spans: 0,
                bytes: 0,
            };
            for s in mine {
                t.first_us = t.first_us.min(s.start_us);
                t.last_us = t.last_us.max(s.start_us + s.duration_us);
                t.busy_us += s.duration_us;
                t.spans += 1;
                t.bytes += s.bytes;
            }
            t
        })
        .collect()
}

/// Start of the earliest span, in microseconds: the origin of the printed times (infinite when
/// there is no span).
pub fn origin_us(spans: &[Span]) -> f64 {
    spans
        .iter()
        .map(|s| s.start_us)
        .fold(f64::INFINITY, f64::min)
}

/// The first `n` spans of `track` as `name start+duration`, in milliseconds after `t0_us`.
pub fn first_spans(spans: &[Span], track: &TrackSummary, t0_us: f64, n: usize) -> Vec<String> {
    spans
        .iter()
        .filter(|s| s.rank == track.rank && s.track == track.track)
        .take(n)
        .map(|s| {
            format!(
                "{} {:.3}+{:.3}",
                s.name,
                (s.start_us - t0_us) / 1e3,
                s.duration_us / 1e3
            )
        })
        .collect()
}

/// A track of a trace as report text.
#[derive(Debug, Clone, PartialEq)]
pub struct TrackReport {
    /// The track's figures.
    pub summary: TrackSummary,
    /// `first .. last ms, busy b ms, n spans`, in milliseconds after the trace's earliest span.
    pub times: String,
    /// Its first spans as `name start+duration` ([`first_spans`]), comma-separated.
    pub first: String,
}

/// One [`TrackReport`] per track of `spans` (in the order of [`summarise`]), with the first
/// `first_n` spans of each.
pub fn track_reports(spans: &[Span], first_n: usize) -> Vec<TrackReport> {
    let t0 = origin_us(spans);
    summarise(spans)
        .into_iter()
        .map(|t| TrackReport {
            times: format!(
                "{:.3} .. {:.3} ms, busy {:.3} ms, {} spans",
                (t.first_us - t0) / 1e3,
                (t.last_us - t0) / 1e3,
                t.busy_us / 1e3,
                t.spans
            ),
            first: first_spans(spans, &t, t0, first_n).join(", "),
            summary: t,
        })
        .collect()
}

/// A traced enter + exit, written out.
#[derive(Debug, Clone, PartialEq)]
pub struct TracedCycle {
    /// The Chrome trace file.
    pub path: PathBuf,
    /// Spans recorded.
    pub spans: usize,
    /// Its tracks ([`track_reports`]).
    pub tracks: Vec<TrackReport>,
}

impl TracedCycle {
    /// `(N spans) written to PATH`.
    pub fn written(&self) -> String {
        format!("({} spans) written to {}", self.spans, self.path.display())
    }
}

/// Traces one enter + exit of `lc` and writes the Chrome trace to `dir/name.json` (creating
/// `dir`), with the report of its tracks (`first_n` spans of each). The spans stay in
/// `lc.trace()`.
pub fn trace_cycle<B: Reshard>(
    lc: &mut Lifecycle<B>,
    dir: &Path,
    name: &str,
    first_n: usize,
) -> Result<TracedCycle, Box<dyn Error>> {
    lc.enable_trace();
    lc.enter()?;
    lc.exit()?;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{name}.json"));
    lc.trace().write_chrome(&path)?;
    let spans = lc.trace().spans();
    Ok(TracedCycle {
        path,
        spans: spans.len(),
        tracks: track_reports(spans, first_n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_core::Phase;

    fn span(rank: Option<usize>, track: &str, start_us: f64, duration_us: f64, bytes: u64) -> Span {
        Span {
            name: "x".into(),
            phase: Phase::Transfer,
            rank,
            track: track.into(),
            start_us,
            duration_us,
            bytes,
            link: None,
        }
    }

    #[test]
    fn summaries_per_rank_and_stream() {
        let spans = vec![
            span(Some(1), "nccl", 10.0, 5.0, 100),
            span(None, "switch", 0.0, 50.0, 0),
            span(Some(0), "nccl", 12.0, 4.0, 40),
            span(Some(1), "nccl", 20.0, 10.0, 300),
            span(Some(1), "aux", 2.0, 1.0, 8),
        ];
        let got = summarise(&spans);
        let keys: Vec<(Option<usize>, &str)> =
            got.iter().map(|t| (t.rank, t.track.as_str())).collect();
        assert_eq!(
            keys,
            [
                (None, "switch"),
                (Some(0), "nccl"),
                (Some(1), "aux"),
                (Some(1), "nccl")
            ]
        );
        let n1 = &got[3];
        assert_eq!((n1.first_us, n1.last_us, n1.busy_us), (10.0, 30.0, 15.0));
        assert_eq!((n1.spans, n1.bytes), (2, 400));
        assert!(summarise(&[]).is_empty());
    }

    #[test]
    fn origin_and_first_spans() {
        let spans = vec![
            span(Some(1), "nccl", 1500.0, 500.0, 0),
            span(Some(1), "nccl", 3000.0, 250.0, 0),
            span(Some(0), "nccl", 1000.0, 10.0, 0),
        ];
        assert_eq!(origin_us(&spans), 1000.0);
        assert_eq!(origin_us(&[]), f64::INFINITY);
        let tracks = summarise(&spans);
        assert_eq!(
            first_spans(&spans, &tracks[1], 1000.0, 8),
            ["x 0.500+0.500", "x 2.000+0.250"]
        );
        assert_eq!(first_spans(&spans, &tracks[1], 1000.0, 1).len(), 1);
    }

    #[test]
    fn reports_in_ms_after_the_earliest_span() {
        let spans = vec![
            span(Some(0), "copy", 1000.0, 250.0, 0),
            span(Some(0), "copy", 2000.0, 500.0, 0),
            span(None, "switch", 1000.0, 2000.0, 0),
        ];
        let got = track_reports(&spans, 1);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].summary.rank, None);
        assert_eq!(got[1].times, "0.000 .. 1.500 ms, busy 0.750 ms, 2 spans");
        assert_eq!(got[1].first, "x 0.000+0.250");
    }
}
