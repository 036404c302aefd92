//! The comparison of the lazy and eager policies, and the digest of a run's samples.

use std::time::Duration;

use lifecycle_core::HumanBytes;

use super::policy::PolicyReport;
use crate::dapo::{Group, StepReport};

/// Seconds, for the tables.
pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Prints lazy against eager: phases, switches, bytes, and the measured saving next to the
/// prediction (gen batches - 1) x switch time.
pub(crate) fn compare(lazy: &PolicyReport, eager: &PolicyReport) {
    let tokens = |p: &PolicyReport| -> Vec<(u64, Vec<Vec<usize>>)> {
        p.run
            .groups
            .iter()
            .map(|g| (g.prompt, g.samples.clone()))
            .collect()
    };
    let identical = tokens(lazy) == tokens(eager);
    println!();
    println!(
        "lazy vs eager (same seeds; samples identical: {}; their log-probabilities {})",
        if identical { "yes" } else { "NO" },
        logprob_agreement(&lazy.run.groups, &eager.run.groups)
    );
    let row = |what: &str, l: String, e: String| println!("  {what:<34} {l:>14} {e:>14}");
    row("", "lazy".into(), "eager".into());
    let gb = |p: &PolicyReport| {
        p.run
            .steps
            .iter()
            .map(|s| s.gen_batches.to_string())
            .collect::<Vec<_>>()
            .join("+")
    };
    row("gen batches (per step)", gb(lazy), gb(eager));
    let d = |p: &PolicyReport, f: &dyn Fn(&StepReport) -> Duration| {
        format!("{:.3} s", secs(p.sum(|s| f(s))))
    };
    row(
        "rollout phase",
        d(lazy, &|s| s.rollout_time),
        d(eager, &|s| s.rollout_time),
    );
    row(
        "  of which generate",
        d(lazy, &|s| s.generate),
        d(eager, &|s| s.generate),
    );
    row(
        "  of which decoder setup",
        d(lazy, &|s| s.setup),
        d(eager, &|s| s.setup),
    );
    row(
        "update phase (incl. lazy's exit)",
        d(lazy, &|s| s.update_time),
        d(eager, &|s| s.update_time),
    );
    row(
        "  of which the update itself",
        d(lazy, &|s| s.update_apply),
        d(eager, &|s| s.update_apply),
    );
    row(
        "rollout + update",
        d(lazy, &|s| s.rollout_time + s.update_time),
        d(eager, &|s| s.rollout_time + s.update_time),
    );
    row(
        "switches",
        lazy.switches().to_string(),
        eager.switches().to_string(),
    );
    row("exits", lazy.exits().to_string(), eager.exits().to_string());
    if let Some(line) = lazy.run.short_steps() {
        println!("  lazy: {line}");
    }
    if let Some(line) = eager.run.short_steps() {
        println!("  eager: {line}");
    }
    row(
        "bytes moved",
        HumanBytes(lazy.bytes()).to_string(),
        HumanBytes(eager.bytes()).to_string(),
    );
    row(
        "switch time (enter + exit)",
        d(lazy, &|s| s.switch_time),
        d(eager, &|s| s.switch_time),
    );
    let per = |p: &PolicyReport| {
        let n = p.switches().max(1) as f64;
        format!("{:.3} s", secs(p.sum(|s| s.switch_time)) / n)
    };
    row("time per switch", per(lazy), per(eager));
    // Eager's switch per rollout call (enter + exit): the updates are in place, so every call
    // does the same work (no host memory pinned anew after an update).
    let steady: Vec<Duration> = eager
        .run
        .steps
        .iter()
        .flat_map(|s| s.batch_switch.iter().copied())
        .collect();
    let steady_mean = if steady.is_empty() {
        None
    } else {
        Some(secs(steady.iter().sum::<Duration>()) / steady.len() as f64)
    };
    let saving_rollout = secs(eager.sum(|s| s.rollout_time)) - secs(lazy.sum(|s| s.rollout_time));
    let saving_step = secs(eager.sum(|s| s.rollout_time + s.update_time))
        - secs(lazy.sum(|s| s.rollout_time + s.update_time));
    let extra: usize = lazy
        .run
        .steps
        .iter()
        .map(|s| s.gen_batches.saturating_sub(1))
        .sum();
    println!(
        "  warm-ups (not measured): lazy {:.3} s, eager {:.3} s",
        secs(lazy.warmup),
        secs(eager.warmup)
    );
    println!(
        "  measured saving, rollout phase: {saving_rollout:.3} s; rollout + update: \
         {saving_step:.3} s (lazy pays its exit in the update phase)"
    );
    // The same samples cost the same generation work under both policies: the difference of
    // their generation times is this run's timer noise.
    let noise = (secs(eager.sum(|s| s.generate + s.setup))
        - secs(lazy.sum(|s| s.generate + s.setup)))
    .abs();
    match steady_mean {
        Some(t) => {
            let predicted = extra as f64 * t;
            let ratios = if predicted > noise {
                format!(
                    "measured / predicted: rollout phase {:.2}, rollout + update {:.2}",
                    saving_rollout / predicted,
                    saving_step / predicted
                )
            } else {
                format!(
                    "measured / predicted: below timer noise (the prediction is within the \
                     {noise:.3} s by which the two policies' generation of the same samples \
                     differs)"
                )
            };
            println!(
                "  prediction (gen batches - 1) x switch time = {extra} x {t:.3} s (eager's mean \
                 enter + exit per rollout call, over {} calls) = {predicted:.3} s; {ratios}",
                steady.len(),
            );
        }
        None => println!("  prediction: no step needed more than one gen batch"),
    }
}

/// How the rollout log-probabilities of two runs' groups agree: "identical", the largest
/// difference, or why they cannot be compared.
pub(crate) fn logprob_agreement(a: &[Group], b: &[Group]) -> String {
    let flat = |gs: &[Group]| -> Vec<Vec<f32>> {
        gs.iter().flat_map(|g| g.logprobs.iter().cloned()).collect()
    };
    let (x, y) = (flat(a), flat(b));
    if x.len() != y.len() || x.iter().zip(&y).any(|(p, q)| p.len() != q.len()) {
        return "not comparable (other samples)".to_string();
    }
    let worst = x
        .iter()
        .flatten()
        .zip(y.iter().flatten())
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    if worst == 0.0 {
        "identical".to_string()
    } else {
        format!("differ by at most {worst:.3e}")
    }
}

/// FNV-1a of every group's prompt id and sample tokens, in order, and the number of samples.
pub(crate) fn samples_digest(groups: &[Group]) -> (u64, usize) {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
    };
    let mut samples = 0;
    for g in groups {
        eat(g.prompt);
        for s in &g.samples {
            samples += 1;
            eat(s.len() as u64);
            s.iter().for_each(|&t| eat(t as u64));
        }
    }
    (h, samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_digest_sees_every_token() {
        let g = |t: usize| Group {
            prompt: 1,
            samples: vec![vec![1, 2], vec![3, t]],
            rewards: vec![0.0, 1.0],
            logprobs: Vec::new(),
        };
        let (a, n) = samples_digest(&[g(4)]);
        assert_eq!(n, 2);
        assert_eq!(a, samples_digest(&[g(4)]).0);
        assert_ne!(a, samples_digest(&[g(5)]).0);
    }

    #[test]
    fn logprob_agreement_says_identical_or_by_how_much() {
        let g = |lp: f32| Group {
            prompt: 1,
            samples: vec![vec![1, 2]],
            rewards: vec![0.0],
            logprobs: vec![vec![-1.0, lp]],
        };
        assert_eq!(logprob_agreement(&[g(-2.0)], &[g(-2.0)]), "identical");
        assert_eq!(
            logprob_agreement(&[g(-2.0)], &[g(-2.5)]),
            "differ by at most 5.000e-1"
        );
        assert!(logprob_agreement(&[g(-2.0)], &[]).starts_with("not comparable"));
    }
}
