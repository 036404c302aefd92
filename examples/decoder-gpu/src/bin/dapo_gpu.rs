//! DAPO end to end on GPUs (FSDP training state, GPU decoder rollouts, lazy vs eager
//! lifecycles): the command line of [`lifecycle_decoder_gpu::dapo`]. The `dapo` example runs the
//! same loop with `--backend fsdp`.
//!
//! ```text
//! dapo_gpu --gpus 2 --tp 2 --synthetic 7b --lifecycle both    # Qwen2.5-7B shapes, random weights
//! dapo_gpu --gpus 2 --tp 1 --synthetic 7b                      # 2 data-parallel decoder replicas
//! dapo_gpu --gpus 2 --tp 2 --checkpoint path/to/hf-model       # config.json + model.safetensors
//! lifecycle-launch --nproc-per-node 2 -- dapo_gpu --gpus 2 --tp 2   # one process per GPU
//! dapo_gpu --help                                              # every option
//! ```

use std::process::ExitCode;

use clap::Parser;
use lifecycle_decoder_gpu::dapo::{run_cli, Options};

/// DAPO on NVIDIA GPUs: FSDP training state, GPU decoder rollouts, lazy vs eager lifecycles.
#[derive(Debug, Parser)]
#[command(name = "dapo_gpu")]
struct Cli {
    #[command(flatten)]
    options: Options,
}

fn main() -> ExitCode {
    run_cli(&Cli::parse().options)
}
