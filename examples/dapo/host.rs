//! The host backend's run: one lifecycle or both on the same seed, compared.

use std::path::PathBuf;
use std::process::ExitCode;

use lifecycle_core::{Ceilings, Switching};
use lifecycle_decoder::{load_checkpoint, Checkpoint};
use lifecycle_examples::dapo::megatron::{run_megatron, MegatronDriver};
use lifecycle_examples::dapo::{
    self, DapoBackend, DapoConfig, HostTrain, RunReport, StepReport, ToyDriver,
};
use lifecycle_examples::gpu_dapo::LifecycleChoice;
use lifecycle_examples::lm_policy::{checkpoint_driver, run_checkpoint, with_lora_memory};

use crate::report::{ms, name, prediction_line, step_table, summary};

/// The host's memory copy rate (GB/s of bytes copied), the ceiling every host-backend link is
/// measured against: ranks are threads and "links" are copies in one memory.
fn host_copy_rate() -> f64 {
    let n = 32 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src); // fault the pages in
    let best = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            dst.copy_from_slice(&src);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    std::hint::black_box(&dst);
    n as f64 / best / 1e9
}

/// Runs one lifecycle on the toy policy, or on the checkpoint when there is one.
fn run_dapo(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, dapo::DapoError> {
    match (config.train, checkpoint) {
        (HostTrain::Megatron { .. }, ckpt) => run_megatron(config, ckpt, switching, on_step),
        (HostTrain::Fsdp, Some(ckpt)) => run_checkpoint(config, ckpt, switching, on_step),
        (HostTrain::Fsdp, None) => dapo::run(config, switching, on_step),
    }
}

/// Runs one lifecycle; returns its report and its per-phase detail (for `--verbose`).
fn run_one(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    trace: Option<&str>,
) -> Result<(RunReport, String), dapo::DapoError> {
    let name = name(switching);
    eprint!("running the {name} lifecycle ({} steps):", config.steps);
    let report = run_dapo(config, checkpoint, switching, |s| eprint!(" {}", s.step))?;
    eprintln!(" done in {}", ms(report.total_time));
    let rate = host_copy_rate();
    let ceilings = Ceilings {
        device_to_device_gbps: Some(rate),
        device_to_host_gbps: Some(rate),
        host_to_device_gbps: Some(rate),
        local_gbps: Some(rate),
    };
    let mut detail = format!(
        "\n== {name} lifecycle: per phase ==\n{}\nagainst this host's copy rate ({rate:.1} GB/s \
         copied; for the host backend every link is a copy in one memory):\n{}",
        report.metrics.table(),
        report.metrics.report(&ceilings)
    );
    if let Some(base) = trace {
        let path = format!("{base}.{name}.json");
        match report.trace.write_chrome(&path) {
            Ok(()) => detail.push_str(&format!(
                "\nswitch timeline: {path} ({} spans; open it at ui.perfetto.dev)\n",
                report.trace.spans().len()
            )),
            Err(e) => eprintln!("warning: could not write the trace {path}: {e}"),
        }
    }
    Ok((report, detail))
}

/// Whether two runs have the same learning curve (bit for bit) and the same samples.
fn same_run(a: &RunReport, b: &RunReport) -> bool {
    let bits = |r: &RunReport| -> Vec<u32> { r.curve().iter().map(|x| x.to_bits()).collect() };
    bits(a) == bits(b) && a.groups == b.groups
}

/// The host backend's run: the toy policy or the checkpoint, one lifecycle or both compared.
pub(crate) fn run_host(
    config: DapoConfig,
    lifecycle: LifecycleChoice,
    checkpoint_path: Option<PathBuf>,
    trace: Option<String>,
    verbose: bool,
) -> ExitCode {
    let checkpoint = match &checkpoint_path {
        None => None,
        Some(path) => match load_checkpoint(path) {
            Ok(ckpt) => Some(ckpt),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let header = match (config.train, &checkpoint, &checkpoint_path) {
        (HostTrain::Megatron { .. }, ckpt, path) => {
            let run = match (ckpt, path) {
                (Some(c), Some(p)) => Some((c, p.as_path())),
                _ => None,
            };
            match MegatronDriver::for_run(&config, run) {
                Ok(d) => DapoBackend::describe(&d),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        (HostTrain::Fsdp, Some(ckpt), Some(path)) => {
            DapoBackend::describe(&checkpoint_driver(&config, ckpt, path))
        }
        _ => DapoBackend::describe(&ToyDriver::new(config)),
    };
    for line in header {
        println!("{line}");
    }
    let ckpt = checkpoint.as_ref();
    let trace = trace.as_deref();
    // Warm the allocator and caches once, untimed, so neither policy pays the first-touch cost.
    let warmup = DapoConfig {
        steps: 1,
        trace: false,
        ..config
    };
    if let Err(e) = run_dapo(&warmup, ckpt, Switching::Lazy, |_| {}) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let choices: &[Switching] = match lifecycle {
        LifecycleChoice::Lazy => &[Switching::Lazy],
        LifecycleChoice::Eager => &[Switching::Eager],
        LifecycleChoice::Both => &[Switching::Lazy, Switching::Eager],
    };
    let mut runs = Vec::new();
    for &switching in choices {
        match run_one(&config, ckpt, switching, trace) {
            Ok(run) => runs.push(run),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let reports: Vec<&RunReport> = runs.iter().map(|(r, _)| r).collect();
    println!();
    print!("{}", summary(&reports));
    let identical = match reports.as_slice() {
        [lazy, eager] => {
            let same = same_run(lazy, eager);
            println!(
                "lazy vs eager on the same seed: {}",
                if same {
                    "identical learning curves and samples"
                } else {
                    "DIFFERENT learning curves or samples (a lifecycle bug: both must see the \
                     same weights)"
                }
            );
            same
        }
        _ => true,
    };
    if let Some(line) = prediction_line(&with_lora_memory(&config), checkpoint.as_ref()) {
        println!("{line}");
    }
    if let Some(first) = reports.first() {
        println!("\nper step ({}):", name(first.switching));
        print!("{}", step_table(first, &reports));
    }
    if verbose {
        for (_, detail) in &runs {
            print!("{detail}");
        }
    }
    if identical {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: the lazy and eager lifecycles gave different learning curves or samples");
        ExitCode::FAILURE
    }
}
