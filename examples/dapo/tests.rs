//! The command line's rules, each backend's options, and the GPU backend without a GPU.

use std::path::PathBuf;

use lifecycle_core::MemoryPolicy;
use lifecycle_cuda::{driver_present, CudaError};
use lifecycle_examples::dapo::{DapoConfig, HostTrain, Objective};
use lifecycle_examples::gpu_dapo::{
    self as gpu_dapo, DapoGpuError, GpuLayout, LifecycleChoice, SyntheticModel,
};
use lifecycle_layout::fp8::Fp8Compute;

use crate::cli::{Args, ArgsError, Backend, Plan};

fn plan(argv: &[&str]) -> Result<Plan, ArgsError> {
    let (args, matches) =
        Args::parse_from_argv(std::iter::once("dapo").chain(argv.iter().copied())).unwrap();
    args.plan(&matches)
}

fn fsdp(argv: &[&str]) -> gpu_dapo::Options {
    match plan(argv) {
        Ok(Plan::Gpu(o)) => o,
        other => panic!("expected the fsdp backend, got {other:?}"),
    }
}

#[test]
fn w8a8_reaches_every_backend() {
    match plan(&["--rollout-dtype", "fp8", "--fp8-compute", "weight-only"]) {
        Ok(Plan::Host { config, .. }) => assert_eq!(config.fp8_compute, Fp8Compute::WeightOnly),
        other => panic!("expected the host backend, got {other:?}"),
    }
    match plan(&[]) {
        Ok(Plan::Host { config, .. }) => {
            assert_eq!(config.fp8_compute, Fp8Compute::W8A8)
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
    let o = fsdp(&[
        "--backend",
        "fsdp",
        "--rollout-dtype",
        "fp8",
        "--fp8-compute",
        "weight-only",
    ]);
    assert_eq!(o.run.fp8_compute, Fp8Compute::WeightOnly);
    assert_eq!(
        fsdp(&["--backend", "fsdp"]).run.fp8_compute,
        Fp8Compute::W8A8
    );
}

#[test]
fn the_gpu_engine_keeps_bf16_kv_unless_told_otherwise() {
    use lifecycle_decoder::KvDtype;
    assert_eq!(fsdp(&["--backend", "fsdp"]).gpu.kv_dtype, KvDtype::Bf16);
    let o = fsdp(&["--backend", "megatron", "--kv-dtype", "f32"]);
    assert_eq!(o.gpu.kv_dtype, KvDtype::F32);
    assert!(o.check().is_ok());
    let fp8 = fsdp(&["--backend", "fsdp", "--kv-dtype", "fp8"]);
    assert_eq!(fp8.gpu.kv_dtype, KvDtype::Fp8);
    assert!(fp8.check().is_ok());
    // a GPU engine option on the host backend is refused by name
    match plan(&["--kv-dtype", "f32"]) {
        Err(e) => assert!(e.to_string().contains("--kv-dtype"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(Args::parse_from_argv(["dapo", "--kv-dtype", "f16"]).is_err());
}

#[test]
fn gpu_runs_offload_by_need_unless_told_otherwise() {
    use lifecycle_examples::gpu_dapo::memory::MemoryChoice;
    assert_eq!(
        fsdp(&["--backend", "fsdp"]).gpu.memory,
        MemoryChoice::ByNeed
    );
    let o = fsdp(&[
        "--backend",
        "fsdp",
        "--memory",
        "offload",
        "--kv-tokens",
        "500000",
    ]);
    assert_eq!(
        (o.gpu.memory, o.gpu.kv_tokens),
        (MemoryChoice::Offload, Some(500000))
    );
    assert!(fsdp(&["--backend", "fsdp"]).gpu.offload_overlap);
    let o = fsdp(&["--backend", "fsdp", "--offload-overlap", "false"]);
    assert!(!o.gpu.offload_overlap);
    let msg = plan(&["--memory", "resident"]).unwrap_err().to_string();
    assert!(
        msg.contains("--memory only applies to --backend fsdp"),
        "{msg}"
    );
}

#[test]
fn the_default_is_the_host_backend_with_its_defaults() {
    match plan(&[]).unwrap() {
        Plan::Host {
            config,
            lifecycle,
            checkpoint,
            trace,
            verbose,
        } => {
            assert_eq!(
                format!("{config:?}"),
                format!("{:?}", DapoConfig::default())
            );
            assert_eq!(lifecycle, LifecycleChoice::Both);
            assert!(checkpoint.is_none() && trace.is_none() && !verbose);
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
    // the loop options and the host-only ones reach the host config
    match plan(&[
        "--steps",
        "3",
        "--tp",
        "1",
        "--world",
        "3",
        "--vocab",
        "32",
        "--seed",
        "9",
        "--no-offload",
        "--lifecycle",
        "eager",
        "--trace",
        "/tmp/t",
        "--verbose",
        "--objective",
        "population",
    ])
    .unwrap()
    {
        Plan::Host {
            config,
            lifecycle,
            trace,
            verbose,
            ..
        } => {
            assert!(verbose);
            assert_eq!(config.update.objective, Objective::Population);
            assert_eq!((config.steps, config.tp, config.world), (3, 1, 3));
            assert_eq!((config.policy.vocab, config.seed), (32, 9));
            assert_eq!(config.memory, MemoryPolicy::resident());
            assert!(config.trace);
            assert_eq!(lifecycle, LifecycleChoice::Eager);
            assert_eq!(trace.as_deref(), Some("/tmp/t"));
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
}

#[test]
fn truncated_importance_sampling_is_on_by_default_and_zero_turns_it_off() {
    let tis = |argv: &[&str]| match plan(argv).unwrap() {
        Plan::Host { config, .. } => config.update.tis_cap,
        other => panic!("expected the host backend, got {other:?}"),
    };
    assert_eq!(tis(&[]), Some(2.0));
    assert_eq!(tis(&["--tis-cap", "1.5"]), Some(1.5));
    assert_eq!(tis(&["--tis-cap", "0"]), None);
    // a cap that is no cap is refused by the run's checks, naming the option
    let Plan::Host { config, .. } = plan(&["--tis-cap=-1"]).unwrap() else {
        panic!("expected the host backend");
    };
    let msg = lifecycle_examples::dapo::validate(&config)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("--tis-cap") && msg.contains("-1"), "{msg}");
    // the GPU backends' update is synthetic: no TIS to set there
    let msg = plan(&["--backend", "fsdp", "--tis-cap", "2"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--tis-cap only applies to --backend host"),
        "{msg}"
    );
}

#[test]
fn fsdp_takes_the_loop_options_and_its_own_defaults() {
    // nothing given: exactly the GPU run's defaults (not the host's)
    assert_eq!(fsdp(&["--backend", "fsdp"]), gpu_dapo::Options::default());
    let o = fsdp(&[
        "--backend",
        "fsdp",
        "--gpus",
        "2",
        "--tp",
        "2",
        "--steps",
        "1",
        "--checkpoint",
        "some/model",
        "--lifecycle",
        "lazy",
        "--seed",
        "7",
        "--group-size",
        "6",
        "--no-offload",
        "--lr",
        "0.001",
    ]);
    assert_eq!((o.gpu.gpus, o.run.tp, o.run.steps), (2, 2, 1));
    assert_eq!(o.run.checkpoint, Some(PathBuf::from("some/model")));
    assert_eq!(o.run.lifecycle, LifecycleChoice::Lazy);
    assert_eq!((o.run.seed, o.run.group_size), (7, 6));
    assert!(o.run.no_offload);
    assert_eq!(o.gpu.lr, 0.001);
    // the options not given keep the GPU run's defaults
    let d = gpu_dapo::Options::default();
    assert_eq!(o.run.tokens, d.run.tokens);
    assert_eq!(o.run.prompts_per_batch, d.run.prompts_per_batch);
    let o = fsdp(&["--backend", "fsdp", "--synthetic", "7b", "--tp", "1"]);
    assert_eq!(o.gpu.synthetic, Some(SyntheticModel::Qwen7b));
}

#[test]
fn options_of_the_other_backend_are_errors() {
    let e = plan(&["--backend", "fsdp", "--vocab", "32", "--world", "3"]).unwrap_err();
    let ArgsError::WrongBackend {
        options,
        only,
        chosen,
        ..
    } = &e
    else {
        panic!("expected WrongBackend, got {e:?}");
    };
    assert_eq!(options, &["--world", "--vocab"]);
    assert_eq!((*only, *chosen), (Backend::Host, Backend::Fsdp));
    let msg = e.to_string();
    assert!(
        msg.contains("--world, --vocab only apply to --backend host")
            && msg.contains("this run is --backend fsdp"),
        "{msg}"
    );
    let msg = plan(&["--backend", "fsdp", "--world", "2"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--world only applies") && msg.contains("--gpus"),
        "{msg}"
    );
    // the objective is the host update's (the GPU backends' update is synthetic)
    let msg = plan(&["--backend", "fsdp", "--objective", "verl"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--objective only applies to --backend host"),
        "{msg}"
    );
    // the default backend is host: GPU-only options need --backend fsdp
    let msg = plan(&["--gpus", "2"]).unwrap_err().to_string();
    assert!(
        msg.contains("--gpus only applies to --backend fsdp") && msg.contains("--world"),
        "{msg}"
    );
    let msg = plan(&["--backend", "host", "--lr", "0.1", "--synthetic", "small"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--synthetic, --lr only apply to --backend fsdp"),
        "{msg}"
    );
    // a checkpoint and a synthetic model exclude each other (clap's own check)
    let e = Args::parse_from_argv([
        "dapo",
        "--backend",
        "fsdp",
        "--checkpoint",
        "x",
        "--synthetic",
        "7b",
    ])
    .unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
}

#[test]
fn every_backend_parses_its_options() {
    // host, Megatron training layout: the degrees reach the config
    match plan(&[
        "--train",
        "megatron",
        "--train-tp",
        "2",
        "--pp",
        "1",
        "--verbose",
    ])
    .unwrap()
    {
        Plan::Host {
            config, verbose, ..
        } => {
            assert_eq!(
                config.train,
                HostTrain::Megatron {
                    tp: 2,
                    pp: 1,
                    ep: 1,
                    etp: 2
                }
            );
            assert!(verbose);
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
    // host default: FSDP layout, Megatron defaults unused
    match plan(&[]).unwrap() {
        Plan::Host { config, .. } => assert_eq!(config.train, HostTrain::Fsdp),
        other => panic!("expected the host backend, got {other:?}"),
    }
    // fsdp on GPUs
    let o = fsdp(&["--backend", "fsdp", "--verbose", "--trace", "/tmp/t"]);
    assert_eq!(o.layout, GpuLayout::Fsdp);
    assert!(o.run.verbose && o.run.trace.as_deref() == Some("/tmp/t"));
    // megatron on GPUs: its degrees, the GPU options, the loop options
    let o = fsdp(&[
        "--backend",
        "megatron",
        "--gpus",
        "2",
        "--train-tp",
        "1",
        "--pp",
        "2",
        "--tp",
        "2",
        "--steps",
        "1",
        "--lr",
        "0.001",
    ]);
    assert_eq!(
        o.layout,
        GpuLayout::Megatron {
            tp: 1,
            pp: 2,
            ep: 1,
            etp: 1
        }
    );
    assert_eq!(
        (o.gpu.gpus, o.run.tp, o.run.steps, o.gpu.lr),
        (2, 2, 1, 0.001)
    );
    let o = fsdp(&["--backend", "megatron"]);
    assert_eq!(
        o.layout,
        GpuLayout::Megatron {
            tp: 1,
            pp: 2,
            ep: 1,
            etp: 1
        }
    );
    assert_eq!(o.run, gpu_dapo::Options::default().run);
    // One GPU makes one stage unless told otherwise.
    let o = fsdp(&["--backend", "megatron", "--gpus", "1", "--tp", "1"]);
    assert_eq!(
        o.layout,
        GpuLayout::Megatron {
            tp: 1,
            pp: 1,
            ep: 1,
            etp: 1
        }
    );
    // Megatron degrees without a Megatron layout
    let msg = plan(&["--pp", "2"]).unwrap_err().to_string();
    assert!(
        msg.contains("--pp only applies to the Megatron training layout"),
        "{msg}"
    );
    let msg = plan(&["--backend", "fsdp", "--train-tp", "2"])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("--train-tp only applies"), "{msg}");
    // --train is the host's: on GPUs the layout is the backend
    let msg = plan(&["--backend", "megatron", "--train", "megatron"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--train only applies to --backend host"),
        "{msg}"
    );
    assert!(msg.contains("--backend megatron"), "{msg}");
    let msg = plan(&["--backend", "megatron", "--world", "2"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--world only applies") && msg.contains("--gpus"),
        "{msg}"
    );
}

#[test]
fn fsdp_without_a_gpu_is_a_typed_error() {
    let options = fsdp(&[
        "--backend",
        "fsdp",
        "--gpus",
        "2",
        "--tp",
        "2",
        "--steps",
        "1",
    ]);
    let result = gpu_dapo::run(&options);
    if driver_present() {
        // a GPU machine: it runs, or fails with a value (e.g. fewer than 2 GPUs)
        if let Err(e) = result {
            println!("on this machine: {e}");
        }
        return;
    }
    match result {
        Err(e @ DapoGpuError::Cuda(CudaError::NoDriver)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda") && msg.contains("LD_LIBRARY_PATH"),
                "{msg}"
            );
        }
        other => panic!("expected Cuda(NoDriver), got {other:?}"),
    }
    // settings are checked before the GPUs are looked for
    let options = fsdp(&["--backend", "fsdp", "--gpus", "1", "--tp", "2"]);
    assert!(matches!(
        gpu_dapo::run(&options),
        Err(DapoGpuError::Gpu(
            lifecycle_decoder_gpu::GpuDecodeError::Topology { .. }
        ))
    ));
}

#[test]
fn streamed_sampling_needs_a_decoder_and_its_settings_need_it() {
    use lifecycle_decoder::Leftovers;
    let e = plan(&["--sampling", "stream"]).unwrap_err().to_string();
    assert!(e.contains("--checkpoint DIR"), "{e}");
    let e = plan(&["--leftovers", "partial"]).unwrap_err().to_string();
    assert!(
        e.contains("--leftovers only applies to --sampling stream"),
        "{e}"
    );
    let e = plan(&[
        "--sampling",
        "stream",
        "--train",
        "megatron",
        "--max-staleness",
        "3",
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("--max-staleness"), "{e}");
    let argv = [
        "--sampling",
        "stream",
        "--train",
        "megatron",
        "--leftovers",
        "partial",
        "--max-staleness",
        "2",
    ];
    match plan(&argv) {
        Ok(Plan::Host { config, .. }) => {
            assert_eq!(config.stream, Some(Leftovers::Partial { max_staleness: 2 }))
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
    match plan(&[]) {
        Ok(Plan::Host { config, .. }) => assert_eq!(config.stream, None),
        other => panic!("expected the host backend, got {other:?}"),
    }
}

#[test]
fn lora_needs_a_checkpoint_in_the_fsdp_layout_and_reaches_the_config() {
    for argv in [
        &["--lora", "4"][..],
        &["--lora", "4", "--train", "megatron", "--checkpoint", "m"][..],
    ] {
        let e = plan(argv).unwrap_err().to_string();
        assert!(
            e.contains("--lora") && e.contains("--checkpoint DIR"),
            "{e}"
        );
    }
    let e = plan(&["--backend", "fsdp", "--lora", "4"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--lora") && e.contains("--backend host"), "{e}");
    match plan(&["--lora", "8", "--checkpoint", "some/model"]) {
        Ok(Plan::Host { config, .. }) => assert_eq!(config.lora, 8),
        other => panic!("expected the host backend, got {other:?}"),
    }
    let argv = [
        "--lora",
        "8",
        "--lora-modules",
        "attention",
        "--checkpoint",
        "m",
    ];
    match plan(&argv) {
        Ok(Plan::Host { config, .. }) => {
            assert_eq!(config.lora_modules.targets().len(), 4)
        }
        other => panic!("expected the host backend, got {other:?}"),
    }
    let e = plan(&["--lora-modules", "attention"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--lora-modules only applies with --lora"), "{e}");
    match plan(&[]) {
        Ok(Plan::Host { config, .. }) => assert_eq!(config.lora, 0),
        other => panic!("expected the host backend, got {other:?}"),
    }
}
