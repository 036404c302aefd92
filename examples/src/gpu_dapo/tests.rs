//! Settings, launch modes and the no-GPU path, checked without a GPU.

use clap::Parser;
use lifecycle_cuda::{driver_present, CudaError};

use super::*;
use lifecycle_decoder_gpu::GpuDecodeError;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    options: Options,
}

fn parse(extra: &[&str]) -> Options {
    let mut v = vec!["dapo_gpu"];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).unwrap().options
}

fn launcher(rank: usize, world: usize) -> RankEnv {
    let vars = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", "29533".to_string()),
    ];
    RankEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
        .unwrap()
        .unwrap()
}

#[test]
fn the_defaults_are_those_of_an_empty_command_line() {
    assert_eq!(parse(&[]), Options::default());
    let o = parse(&["--steps", "3", "--lr", "0.5", "--synthetic", "small"]);
    assert_eq!((o.run.steps, o.gpu.lr), (3, 0.5));
    assert_eq!(o.gpu.synthetic, Some(SyntheticModel::Small));
    let e = Cli::try_parse_from(["dapo_gpu", "--checkpoint", "x", "--synthetic", "7b"])
        .err()
        .unwrap();
    assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
}

#[test]
fn bad_settings_are_errors_before_any_gpu_work() {
    let e = run_in(&parse(&["--group-size", "1"]), None).unwrap_err();
    assert!(e.to_string().contains("--group-size"), "{e}");
    let e = run_in(&parse(&["--temperature", "0"]), None).unwrap_err();
    assert!(e.to_string().contains("--temperature"), "{e}");
    let e = run_in(&parse(&["--lr=-1"]), None).unwrap_err();
    assert!(
        e.to_string().contains("--lr") && e.to_string().contains("lr = -1"),
        "{e}"
    );
    let e = run_in(&parse(&["--grad-scale", "inf"]), None).unwrap_err();
    assert!(e.to_string().contains("--grad-scale"), "{e}");
    // several tensor-parallel groups: not supported
    let e = run_in(&parse(&["--gpus", "4", "--tp", "2"]), None).unwrap_err();
    assert!(
        matches!(e, DapoGpuError::Gpu(GpuDecodeError::Topology { .. })),
        "{e:?}"
    );
    assert!(e.to_string().contains("not supported"), "{e}");
    let e = run_in(&parse(&["--gpus", "1", "--tp", "2"]), None).unwrap_err();
    assert!(e.to_string().contains("at least T ranks"), "{e}");
    // a missing checkpoint: a typed error before any GPU work
    let e = run_in(&parse(&["--checkpoint", "/nonexistent/model"]), None).unwrap_err();
    assert!(matches!(e, DapoGpuError::Checkpoint(_)), "{e:?}");
}

#[test]
fn launch_modes_are_checked_before_any_gpu_work() {
    // thread mode: one group, or replicas at T = 1
    let (launch, topo) = check_launch(&parse(&["--gpus", "2", "--tp", "2"]), None).unwrap();
    assert_eq!((launch, topo), (Launch::Threads, DecodeTopology::Group));
    let (_, topo) = check_launch(&parse(&["--gpus", "2", "--tp", "1"]), None).unwrap();
    assert_eq!(topo, DecodeTopology::Replicas(2));
    // process mode: --gpus must equal WORLD_SIZE
    let e = check_launch(&parse(&["--gpus", "2", "--tp", "2"]), Some(launcher(1, 4)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("WORLD_SIZE = 4") && e.contains("--gpus 2"),
        "{e}"
    );
    let (launch, topo) =
        check_launch(&parse(&["--gpus", "2", "--tp", "2"]), Some(launcher(1, 2))).unwrap();
    assert_eq!(launch, Launch::Process(launcher(1, 2)));
    assert_eq!(topo, DecodeTopology::Group);
    // process mode: replicas are not supported
    let e = check_launch(&parse(&["--gpus", "2", "--tp", "1"]), Some(launcher(0, 2)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("one process per rank"), "{e}");
}

#[test]
fn without_a_gpu_the_run_is_a_typed_error() {
    let result = run_in(&parse(&["--steps", "1"]), None);
    if driver_present() {
        // a GPU machine: it runs, or fails with a value (e.g. fewer than 2 GPUs)
        if let Err(e) = result {
            println!("on this machine: {e}");
        }
        return;
    }
    match result {
        Err(DapoGpuError::Cuda(CudaError::NoDriver)) => {}
        other => panic!("expected Cuda(NoDriver), got {other:?}"),
    }
}

/// The per-call comparison path's static batch samples what the continuous-batching scheduler
/// samples on the same decoder: the same requests, seeds and picks give the same tokens and
/// log-probabilities (on the CPU decoder, whose rows are computed alone, bit for bit), with a
/// stop token ending some samples early.
#[test]
fn static_slots_sample_what_the_scheduler_samples() {
    use lifecycle_decoder::{random_tensors, CpuDecoder, FinishReason, Request, SamplingParams};
    use lifecycle_decoder::{Scheduler, SlotDecoder};
    use lifecycle_host::{HostBackend, HostTrainState};

    use super::engine::StaticSlots;

    let config = lifecycle_decoder::ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 24, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0}"#,
    )
    .unwrap();
    let layout = config.rollout_layout(1).unwrap();
    let state = HostTrainState::from_tensors(1, random_tensors(&config, 4)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    let requests: Vec<Request> = (0..6u64)
        .map(|i| {
            let params = SamplingParams::new(7)
                .with_temperature(1.5)
                .with_stop_tokens(vec![3, 11])
                .with_seed(crate::dapo::sample_seed(9, i / 3, (i % 3) as usize));
            Request::new(vec![1 + (i / 3) as u32, 5, 2], params)
        })
        .collect();
    let mut decoder = CpuDecoder::new(&config, &layout, &group)
        .unwrap()
        .with_slots(6, 16);
    let want = Scheduler::new()
        .run(&mut decoder, requests.clone())
        .unwrap();
    let mut plain = CpuDecoder::new(&config, &layout, &group).unwrap();
    let mut slots = StaticSlots::new(&mut plain, requests.len(), 16);
    assert_eq!((slots.slots(), slots.slot_positions()), (6, 16));
    let got = Scheduler::new().run(&mut slots, requests.clone()).unwrap();
    assert_eq!(got, want);
    assert!(
        got.iter().any(|s| s.finish == FinishReason::Stop),
        "a stop token ends a sample early: {got:?}"
    );
    assert!(got.iter().all(|s| s.logprobs.len() == s.tokens.len()));
    // more requests than slots would need a second prefill: refused, naming the rule
    let mut plain = CpuDecoder::new(&config, &layout, &group).unwrap();
    let mut two = StaticSlots::new(&mut plain, 2, 16);
    let err = Scheduler::new().run(&mut two, requests).unwrap_err();
    assert!(err.to_string().contains("one prefill"), "{err}");
}
