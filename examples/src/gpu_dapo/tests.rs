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
