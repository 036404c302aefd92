//! DAPO with dynamic sampling: several rollout calls per training step, one update that changes
//! every weight. Runs the lazy and the eager lifecycle on the same seed and compares them, on the
//! CPU reference backend (`--backend host`, the default) or on NVIDIA GPUs (`--backend fsdp`).
//! On the host backend the report starts with what a newcomer looks for: switches per step,
//! bytes moved and switch time of each lifecycle (measured), the learning curve, and whether
//! lazy and eager agree (they must: a difference is an error); then one line per step;
//! `--verbose` adds the per-phase detail.
//!
//! ```text
//! cargo run --release --example dapo                 # host backend: lazy vs eager, default sizes
//! cargo run --release --example dapo -- --help       # every option
//! cargo run --release --example dapo -- --checkpoint models/decoder/fixtures/gqa_untied
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --steps 1
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --synthetic 7b
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --checkpoint path/to/hf-model
//! ```
//!
//! `--backend host`: ranks are threads, the policy is a toy MLP (`--vocab`, `--hidden`, `--ffn`,
//! `--layers`) trained by a real DAPO step (verl's objective by default, `--objective`: the
//! token-mean clipped loss with clip-higher and the dual clip, group-normalised advantages,
//! and verl's truncated importance sampling between the rollout's and the trainer's log-probs,
//! `--tis-cap 2` by default, `--tis-cap 0` off; gradients by backpropagation, Adam on the FSDP
//! shards: `lifecycle_examples::dapo::update`; the per-step table shows the rollout / trainer
//! mismatch),
//! or with `--checkpoint DIR` (a Hugging Face `config.json` + safetensors, Qwen2, Llama, Qwen3
//! or Qwen3-MoE) the training state is the checkpoint's weights and every rollout runs the Qwen2
//! / Llama decoder (`lifecycle-decoder`) on the resharded bf16 tensor-parallel slices and the
//! update is a synthetic stand-in (no backward pass for checkpoint models); the toy-policy size
//! options are then ignored. The reward (token classes, `lifecycle_examples::dapo::reward`) hits
//! as often on any vocabulary.
//!
//! `--backend fsdp`: the FSDP backend on `--gpus` GPUs, rollouts by the GPU decoder, an in-place
//! Adam step on synthetic gradients between steps (`lifecycle_examples::gpu_dapo`).
//! `--synthetic 7b|small` picks a model with random weights when there is no
//! `--checkpoint`. Without a GPU it stops with an error saying what is missing.
//!
//! The loop options (`--lifecycle`, `--steps`, `--tp`, `--seed`, `--checkpoint`, ...) apply to
//! both backends, each with its own defaults; an option of one backend only is an error with the
//! other (e.g. `--vocab` with `--backend fsdp`, `--gpus` with `--backend host`).

mod cli;
mod host;
mod report;
#[cfg(test)]
mod tests;

use std::process::ExitCode;

use lifecycle_examples::gpu_dapo;

use cli::{Args, Plan};
use host::run_host;

fn main() -> ExitCode {
    let (args, matches) = match Args::parse_command_line() {
        Ok(parsed) => parsed,
        Err(e) => e.exit(),
    };
    match args.plan(&matches) {
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Ok(Plan::Host {
            config,
            lifecycle,
            checkpoint,
            trace,
            verbose,
        }) => run_host(config, lifecycle, checkpoint, trace, verbose),
        Ok(Plan::Gpu(options)) => gpu_dapo::run_cli(&options),
    }
}
