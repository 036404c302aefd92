//! Enter / exit cycles of a lifecycle: building one that switches lazily, timing its switches,
//! and the per-switch means of its phase metrics.

use std::time::Instant;

use lifecycle_core::{
    Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy, Metrics, Phase, Reshard, Switching,
};

use crate::timing::{median, ms};

/// A lifecycle in train mode that switches lazily, with `memory`.
pub fn lazy_lifecycle<B: Reshard>(
    backend: B,
    state: B::TrainState,
    memory: MemoryPolicy,
) -> Result<Lifecycle<B>, LifecycleError<B::Error>> {
    Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )
}

/// The medians, in seconds, of `iters` enters and of their exits. With `warm_up`, one untimed
/// enter + exit first (pinned buffers, NCCL connections, allocator pools). The metrics are reset
/// before the timed cycles, so they describe those only.
pub fn time_cycles<B: Reshard>(
    lc: &mut Lifecycle<B>,
    iters: usize,
    warm_up: bool,
) -> Result<(f64, f64), LifecycleError<B::Error>> {
    if warm_up {
        lc.enter()?;
        lc.exit()?;
    }
    lc.reset_metrics();
    let (mut en, mut ex) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        lc.enter()?;
        en.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        lc.exit()?;
        ex.push(t.elapsed().as_secs_f64());
    }
    Ok((median(en), median(ex)))
}

/// Mean wall time of one run of `phase`, in seconds (0 when it never ran).
pub fn phase_secs(m: &Metrics, phase: Phase) -> f64 {
    let p = m.phase(phase);
    p.wall.as_secs_f64() / p.count.max(1) as f64
}

/// `enter E (transfer phase T avg), exit X`: the medians of an enter and an exit, and the mean
/// transfer phase of their metrics `m`.
pub fn resident_times(enter: f64, exit: f64, m: &Metrics) -> String {
    format!(
        "enter {} (transfer phase {} avg), exit {}",
        ms(enter),
        ms(phase_secs(m, Phase::Transfer)),
        ms(exit)
    )
}

/// `enter E (transfer T, offload wait O), exit X (release R, reload L)`: the medians of an enter
/// and an exit with offload, and the mean phases of their metrics `m`.
pub fn offload_times(enter: f64, exit: f64, m: &Metrics) -> String {
    let per = |p| ms(phase_secs(m, p));
    format!(
        "enter {} (transfer {}, offload wait {}), exit {} (release {}, reload {})",
        ms(enter),
        per(Phase::Transfer),
        per(Phase::Offload),
        ms(exit),
        per(Phase::Release),
        per(Phase::Reload)
    )
}

/// Mean device-to-device bytes of one run of `phase` (0 when it never ran).
pub fn phase_d2d_bytes(m: &Metrics, phase: Phase) -> f64 {
    let p = m.phase(phase);
    p.bytes.device_to_device as f64 / p.count.max(1) as f64
}
