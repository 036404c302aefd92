//! The switch timeline on the host backend: one span per phase on the lifecycle row, one per rank
//! and phase on each rank's track, bytes that add up to the metrics, valid Chrome trace JSON.

use crate::common;

use lifecycle_core::{Ceilings, Lifecycle, Phase};
use lifecycle_host::HostBackend;

#[test]
fn host_switches_are_traced_per_rank_and_phase() {
    let specs = common::specs(2);
    let mut lc = Lifecycle::new(
        HostBackend::new(common::layout(2, specs.clone())),
        common::state(4, &specs, 3),
    );
    // off by default: nothing recorded
    lc.enter().unwrap();
    lc.exit().unwrap();
    assert!(lc.trace().spans().is_empty());

    lc.enable_trace();
    lc.reset_metrics();
    lc.enter().unwrap();
    lc.exit().unwrap();
    let spans = lc.trace().spans();
    for phase in [
        Phase::Plan,
        Phase::Transfer,
        Phase::Offload,
        Phase::Release,
        Phase::Reload,
    ] {
        assert_eq!(
            spans
                .iter()
                .filter(|s| s.phase == phase && s.rank.is_none())
                .count(),
            1,
            "{phase} on the lifecycle row"
        );
    }
    for phase in [Phase::Transfer, Phase::Offload, Phase::Reload] {
        let per_rank: Vec<_> = spans
            .iter()
            .filter(|s| s.phase == phase && s.rank.is_some())
            .collect();
        assert_eq!(per_rank.len(), 4, "{phase}: one span per rank");
        let m = lc.metrics().phase(phase);
        let bytes: u64 = per_rank.iter().map(|s| s.bytes).sum();
        assert_eq!(
            bytes,
            m.bytes.moved() + m.bytes.local,
            "{phase} bytes add up"
        );
        let whole = spans
            .iter()
            .find(|s| s.phase == phase && s.rank.is_none())
            .unwrap();
        for s in per_rank {
            assert!(
                s.start_us >= whole.start_us - 1.0
                    && s.start_us + s.duration_us <= whole.start_us + whole.duration_us + 1.0,
                "rank spans lie inside their phase"
            );
        }
    }
    let json: serde_json::Value = serde_json::from_str(&lc.trace().to_chrome_json()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["args"]["name"] == "rank 3"));
    let report = lc.metrics().report(&Ceilings {
        host_to_device_gbps: Some(10.0),
        ..Default::default()
    });
    assert!(
        report
            .lines()
            .any(|l| l.starts_with("reload") && l.contains("host-device")),
        "{report}"
    );
}
