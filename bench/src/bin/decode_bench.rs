//! Decode throughput of the GPU decoder on bf16 and on fp8 rollout weights (W = T = 1), from one
//! FSDP training state switched once per dtype, against the weight-streaming floor: a decode
//! step reads every rollout weight but the (untied) embedding once, so at small batches its time
//! is at least those bytes over the device's read rate (half the copy rate, which counts both
//! directions). With `--moe` the model is Qwen3-30B-A3B-shaped and the bf16 experts run both as
//! grouped GEMMs and one GEMM per expert; its floor counts every expert, so at small batches,
//! where a step reads only the routed experts, it is not a bound.
//!
//! ```text
//! decode_bench --layers 4 --batches 1,8,32 --new-tokens 64
//! decode_bench --moe --layers 4 --batches 1,8,32,64 --new-tokens 32
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_bench::ceilings::{device_copy, Timing};
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Switching};
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{Decoder, ModelConfig, Sampling};
use lifecycle_decoder_gpu::GpuDecoder;
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::RolloutDtype;

const GB: f64 = 1e9;

/// Decode throughput, bf16 against fp8 rollout weights, on one GPU.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Decoder layers of the Qwen2.5-7B shape (hidden 3584, 28 heads / 4 kv, ffn 18944,
    /// vocabulary 152064), or of the Qwen3-30B-A3B one with --moe.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// The Qwen3-30B-A3B shape (hidden 2048, 32 heads / 4 kv of 128, 128 experts of 768,
    /// top-8, vocabulary 151936): grouped and per-expert bf16 experts, and fp8.
    #[arg(long)]
    moe: bool,
    /// Batch sizes (sequences decoded together), comma-separated.
    #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 32)]
    prompt: usize,
    /// Tokens generated per sequence (greedy, on the device).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
}

fn config(layers: usize, moe: bool) -> Result<ModelConfig, Box<dyn Error>> {
    if moe {
        return Ok(ModelConfig::from_json_str(&format!(
            r#"{{"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                "intermediate_size": 6144, "num_hidden_layers": {layers},
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": true}}"#
        ))?);
    }
    Ok(ModelConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": {layers},
            "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false}}"#
    ))?)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    if args.new_tokens < 2 || args.batches.is_empty() {
        return Err("--new-tokens must be at least 2 and --batches not empty".into());
    }
    let config = config(args.layers, args.moe)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let copy = device_copy(&*pool, 1 << 30, Timing::after_idle(1, 5))?;
    println!(
        "{} shape, {} layers; device copy rate {:.0} GB/s (read + write)",
        if args.moe {
            "Qwen3-30B-A3B"
        } else {
            "Qwen2.5-7B"
        },
        args.layers,
        copy / GB
    );
    // (dtype, grouped experts): the MoE shape runs its bf16 experts both ways
    let variants: &[(RolloutDtype, bool)] = if args.moe {
        &[
            (RolloutDtype::Bf16, true),
            (RolloutDtype::Bf16, false),
            (RolloutDtype::Fp8, true),
        ]
    } else {
        &[(RolloutDtype::Bf16, true), (RolloutDtype::Fp8, true)]
    };
    let shapes = config.tensor_shapes();
    let mut state = FsdpBackend::new(pool.clone(), config.rollout_layout(1)?)
        .synthetic_state(&shapes, 7, 0.02)?;
    let mut rates: Vec<(RolloutDtype, bool, usize, f64)> = Vec::new();
    for &(dtype, grouped) in variants {
        let backend =
            FsdpBackend::new(pool.clone(), config.rollout_layout(1)?).with_rollout_dtype(dtype);
        let lc_config = LifecycleConfig {
            switching: Switching::Lazy,
            memory: MemoryPolicy::resident(),
        };
        let mut lc = Lifecycle::with_config(backend, state, lc_config)?;
        {
            let session = lc.rollout()?;
            let weights = session.weights();
            let held: u64 = weights.get().entries().iter().map(|e| e.bytes()).sum();
            // a decode step streams every weight but the embedding (whose rows it gathers)
            // once: at the read half of the copy rate
            let embed = weights
                .get()
                .entries()
                .iter()
                .find(|e| e.name() == "model.embed_tokens.weight")
                .map_or(0, |e| e.bytes());
            let floor = (held - embed) as f64 / (copy / 2.0);
            let mut dec = GpuDecoder::new(&config, session.backend(), weights.get())?;
            let grouped = dec.set_grouped_experts(grouped);
            let how = match (args.moe, grouped, dtype) {
                (false, ..) => "",
                // fp8 experts always take the per-expert path
                (true, _, RolloutDtype::Fp8) => ", one GEMM per expert (fp8 experts)",
                (true, true, _) => ", experts in blocks of one batched GEMM per product",
                (true, false, _) => ", one GEMM per expert",
            };
            println!(
                "\n{dtype}{how}: rollout weights {:.3} GB ({:.3} GB streamed per step); floor {:.3} ms per step",
                held as f64 / GB,
                (held - embed) as f64 / GB,
                floor * 1e3
            );
            for &batch in &args.batches {
                let prompts: Vec<Vec<u32>> = (0..batch)
                    .map(|i| {
                        (0..args.prompt)
                            .map(|j| ((i * 7919 + j * 104729) % config.model.vocab) as u32)
                            .collect()
                    })
                    .collect();
                // warm-up, then the prefill alone (one token) and the whole generation
                dec.generate(&prompts, &Sampling::greedy(4))?;
                let t = Instant::now();
                dec.generate(&prompts, &Sampling::greedy(1))?;
                let prefill = t.elapsed().as_secs_f64();
                let t = Instant::now();
                dec.generate(&prompts, &Sampling::greedy(args.new_tokens))?;
                let total = t.elapsed().as_secs_f64();
                let step = (total - prefill).max(1e-9) / (args.new_tokens - 1) as f64;
                let rate = batch as f64 / step;
                println!(
                    "  batch {batch:>3}: prefill {:.2} ms, decode {:.3} ms/step ({:.2}x the \
                     floor), {rate:.0} tokens/s",
                    prefill * 1e3,
                    step * 1e3,
                    step / floor
                );
                rates.push((dtype, grouped, batch, rate));
            }
        }
        state = lc.into_parts()?.1;
    }
    println!("\nfp8 against bf16, decode tokens/s:");
    for &batch in &args.batches {
        let of = |d, g| {
            rates
                .iter()
                .find(|r| r.0 == d && r.1 == g && r.2 == batch)
                .map_or(0.0, |r| r.3)
        };
        let (b, f) = (of(RolloutDtype::Bf16, true), of(RolloutDtype::Fp8, true));
        let f = if f > 0.0 {
            f
        } else {
            of(RolloutDtype::Fp8, false)
        };
        let per_expert = of(RolloutDtype::Bf16, false);
        let grouped = if per_expert > 0.0 {
            format!(
                "; bf16 one GEMM per expert {per_expert:.0} (grouped {:.2}x that)",
                b / per_expert
            )
        } else {
            String::new()
        };
        println!(
            "  batch {batch:>3}: bf16 {b:.0}, fp8 {f:.0} ({:.2}x){grouped}",
            f / b.max(1e-9)
        );
    }
    Ok(())
}
