//! Throughput of the CPU decoder on a random Qwen2-shaped model through the host backend.
//!
//! ```text
//! cargo run --release -p lifecycle-decoder --example cpu_decode_bench -- [batch] [tp] [new_tokens]
//! ```

use std::time::Instant;

use clap::Parser;
use lifecycle_core::Lifecycle;
use lifecycle_decoder::{random_tensors, CpuDecoder, Decoder, ModelConfig, Sampling};
use lifecycle_host::{HostBackend, HostTrainState};

/// Throughput of the CPU decoder on a random Qwen2-shaped model through the host backend.
#[derive(Debug, Parser)]
#[command(name = "cpu_decode_bench")]
struct Cli {
    /// Prompts decoded together.
    #[arg(default_value_t = 16)]
    batch: usize,
    /// Rollout tensor-parallel degree (also the ranks of the training state).
    #[arg(default_value_t = 1)]
    tp: usize,
    /// Tokens generated per prompt.
    #[arg(default_value_t = 32)]
    new_tokens: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        batch,
        tp,
        new_tokens,
    } = Cli::parse();
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512,
        "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "tie_word_embeddings": true}"#,
    )?;
    let layout = config.rollout_layout(tp)?;
    let state = HostTrainState::from_tensors(tp, random_tensors(&config, 1))?;
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    let mut dec = CpuDecoder::new(&config, &layout, &group)?;
    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| (0..32).map(|i| (b * 131 + i * 17) % 8192).collect())
        .collect();
    let sampling = Sampling {
        temperature: 1.0,
        max_new_tokens: new_tokens,
        seed: 1,
        stop_token: None,
    };
    let start = Instant::now();
    let out = dec.generate(&prompts, &sampling)?;
    let secs = start.elapsed().as_secs_f64();
    let tokens: usize = out.iter().map(Vec::len).sum();
    println!(
        "{} params, T = {tp}, batch {batch}, prompt 32, {new_tokens} new tokens: {:.3} s, {:.0} generated tokens/s",
        config.params(),
        secs,
        tokens as f64 / secs
    );
    Ok(())
}
