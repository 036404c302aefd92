//! What a host run prints: the summary, the prediction for the same switch on GPUs, the
//! per-step table.

use std::time::Duration;

use lifecycle_core::{HumanBytes, HumanDuration, Switching};
use lifecycle_decoder::Checkpoint;
use lifecycle_examples::dapo::{DapoConfig, HostTrain, RunReport, UpdateOutcome};
use lifecycle_examples::prediction;

pub(crate) fn ms(d: Duration) -> String {
    HumanDuration(d).to_string()
}

pub(crate) fn name(switching: Switching) -> &'static str {
    match switching {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    }
}

/// The prediction line of a host run: the same switch at 7.6B on GPUs (`lifecycle-plan`).
pub(crate) fn prediction_line(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
) -> Option<String> {
    let _ = checkpoint;
    let train = match config.train {
        HostTrain::Fsdp => lifecycle_plan::TrainLayout::Fsdp {
            world: config.world,
        },
        HostTrain::Megatron { tp, pp, .. } => lifecycle_plan::TrainLayout::Megatron {
            tp,
            pp,
            dp: config.world / (tp * pp).max(1),
            ep: 1,
            etp: tp,
        },
    };
    let offload = config.memory.offload_params || config.memory.offload_optimizer;
    match prediction::qwen7b_switch(train, config.tp, offload) {
        Ok(p) => Some(p.line()),
        Err(e) => Some(format!(
            "prediction (lifecycle-plan): not available for this layout: {e}"
        )),
    }
}

/// The report's first lines: per lifecycle, switches per step, bytes moved and switch time
/// (measured); then the learning curve.
pub(crate) fn summary(runs: &[&RunReport]) -> String {
    let mut out = String::new();
    let per_step = |r: &RunReport, x: f64| x / r.steps.len().max(1) as f64;
    let row = |label: &str, cell: &dyn Fn(&RunReport) -> String| {
        let mut line = format!("{label:<22}");
        for r in runs {
            line.push_str(&format!("{:>14}", cell(r)));
        }
        line.push('\n');
        line
    };
    out.push_str(&row("", &|r| name(r.switching).to_string()));
    out.push_str(&row("switches per step", &|r| {
        format!("{:.2}", per_step(r, r.metrics.switches() as f64))
    }));
    out.push_str(&row("gen batches per step", &|r| {
        format!("{:.2}", per_step(r, r.gen_batches() as f64))
    }));
    out.push_str(&row("bytes moved per step", &|r| {
        HumanBytes((per_step(r, r.metrics.bytes().moved() as f64)) as u64).to_string()
    }));
    out.push_str(&row("switch time per step", &|r| {
        ms(r.metrics.switch_time() / r.steps.len().max(1) as u32)
    }));
    out.push_str(&row("switch time, run", &|r| ms(r.metrics.switch_time())));
    out.push_str(&row("run time", &|r| ms(r.total_time)));
    if let [lazy, eager] = runs {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        out.push_str(&format!(
            "eager / lazy: switches {:.2}x, bytes {:.2}x, switch time {:.2}x (measured on this \
             host: ranks are threads, links are memory copies)\n",
            ratio(
                eager.metrics.switches() as f64,
                lazy.metrics.switches() as f64
            ),
            ratio(
                eager.metrics.bytes().moved() as f64,
                lazy.metrics.bytes().moved() as f64
            ),
            ratio(
                eager.metrics.switch_time().as_secs_f64(),
                lazy.metrics.switch_time().as_secs_f64()
            ),
        ));
    }
    if let Some(first) = runs.first() {
        let curve = first.curve();
        let (early, late) = first.quarters();
        let q = (curve.len() / 4).max(1);
        out.push_str(&format!(
            "learning curve (mean reward of every sample generated, per step):\n  {}\n  first \
             quarter (steps 1-{q}) {early:.3} -> last quarter (steps {}-{}) {late:.3}\n",
            curve
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" "),
            curve.len() - q + 1,
            curve.len(),
        ));
        if let Some(line) = first.short_steps() {
            out.push_str(&line);
            out.push('\n');
        }
        if first
            .steps
            .iter()
            .any(|s| matches!(s.update, UpdateOutcome::Synthetic))
        {
            out.push_str(
                "  (the update is synthetic — seeded noise, then Adam: there is no backward pass \
                 for checkpoint models, so this curve is not expected to rise)\n",
            );
        }
    }
    out
}

/// One line per step of `report`: sampling, the update (with the rollout / trainer log-prob
/// mismatch `|dlogp|` and the k3 KL estimate, and the mean TIS weight) and the switches of each
/// lifecycle.
pub(crate) fn step_table(report: &RunReport, runs: &[&RunReport]) -> String {
    let mut out = format!(
        "{:>4} {:>5} {:>9} {:>7} {:>7} {:>8} {:>6} {:>7} {:>9} {:>9} {:>6} {:>10}",
        "step",
        "gen",
        "kept/gen",
        "reward",
        "kept r",
        "loss",
        "clip",
        "|r-1|",
        "|dlogp|",
        "KL k3",
        "tis w",
        "update"
    );
    for r in runs {
        out.push_str(&format!(
            " {:>13}",
            format!("{} sw/moved", name(r.switching))
        ));
    }
    out.push('\n');
    for (i, s) in report.steps.iter().enumerate() {
        let dash = || "-".to_string();
        let (loss, clip, ratio, dlogp, k3, tis) = match &s.update {
            UpdateOutcome::Dapo(pg) => (
                format!("{:.4}", pg.loss),
                format!("{:.3}", pg.clip_fraction),
                format!("{:.3}", pg.max_ratio_deviation),
                pg.mismatch
                    .map_or_else(dash, |m| format!("{:.2e}", m.mean_abs)),
                pg.mismatch.map_or_else(dash, |m| format!("{:.2e}", m.k3)),
                pg.tis
                    .map_or_else(dash, |t| format!("{:.4}", t.mean_weight)),
            ),
            UpdateOutcome::Synthetic => {
                ("synth".to_string(), dash(), dash(), dash(), dash(), dash())
            }
        };
        out.push_str(&format!(
            "{:>4} {:>5} {:>9} {:>7.3} {:>7.3} {:>8} {:>6} {:>7} {:>9} {:>9} {:>6} {:>10}",
            s.step,
            s.gen_batches,
            format!("{}/{}", s.kept, s.groups),
            s.mean_reward,
            s.kept_reward,
            loss,
            clip,
            ratio,
            dlogp,
            k3,
            tis,
            ms(s.update_time),
        ));
        for r in runs {
            if let Some(t) = r.steps.get(i) {
                out.push_str(&format!(
                    " {:>13}",
                    format!("{} / {}", t.switches, HumanBytes(t.bytes.moved()))
                ));
            }
        }
        out.push('\n');
    }
    for s in &report.steps {
        if let Some(f) = &s.streamed {
            out.push_str(&format!(
                "  step {} streamed: {} samples finished (mean {:.1} tokens; kept samples {:.1}), \
                 {} aborted, {} carried into the next step, {} dropped as stale\n",
                s.step,
                f.finished,
                f.finished_mean_len(),
                f.kept_mean_len(),
                f.aborted,
                f.carried,
                f.stale,
            ));
        }
    }
    if report
        .steps
        .iter()
        .any(|s| matches!(&s.update, UpdateOutcome::Dapo(pg) if pg.mismatch.is_some()))
    {
        out.push_str(
            "  |dlogp|: mean |trainer - rollout log-prob| of the kept tokens (fp32 masters vs the \
             bf16 rollout weights); KL k3: mean(exp(r) - 1 - r), r = trainer - rollout log-prob, \
             an estimate of KL(rollout || trainer); tis w: mean truncated importance weight \
             min(exp(r), C) (--tis-cap C, 0 for off)\n",
        );
    }
    out
}
