//! GPU test: the GPU decoder on fp8 rollout weights (quantised by the FSDP backend's switch on
//! the GPU, W = T = 1) against the CPU decoder on the CPU executor's fp8 rollout of the same
//! masters, which `models/decoder/tests/fp8_rollout.rs` checks (bit-identical to bf16 on
//! exactly representable weights, within a measured bound of `transformers`).
//!
//! ```text
//! cargo test --release -p lifecycle-decoder-gpu --test fp8 -- --ignored --nocapture
//! ```
//!
//! Tolerance: the two decoders read identical fp8 weights (the switch is bit-identical on the
//! GPU and the CPU) and dequantise them to the same f32 values. The GPU splits activations into
//! two bf16 rows, and its prefill products read each dequantised weight as two bf16 values (to
//! about 2⁻¹⁷ relative) beyond 8 tokens; decode steps of up to 8 sequences read the e4m3 bytes
//! directly, with the activations joined back into f32. So the
//! bound is that of the bf16 GPU tests, `1e-3 + 1e-3 · max|logit|`; greedy tokens must be equal.

use std::sync::Arc;

use lifecycle_core::Lifecycle;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{
    random_tensors, CpuDecoder, Decoder, ModelConfig, PrefillLogits, Sampling,
};
use lifecycle_decoder_gpu::GpuDecoder;
use lifecycle_fsdp::FsdpBackend;
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::fp8::RolloutDtype;

type Res = Result<(), Box<dyn std::error::Error>>;

/// Logits rows and greedy tokens of one decoder.
type Outputs = (Vec<Vec<f32>>, Vec<Vec<u32>>);

/// Every path of the fp8 products: prefill logits of every position of `long` and of `short`
/// (more than 8 tokens: the dequantised GEMMs), two decode steps of 2 sequences (the e4m3
/// kernel), and 6 greedy tokens.
fn run<D: Decoder>(
    dec: &mut D,
    long: &[Vec<u32>],
    short: &[Vec<u32>],
) -> Result<Outputs, Box<dyn std::error::Error>>
where
    D::Error: 'static,
{
    let mut logits = dec.prefill(long, PrefillLogits::All)?;
    logits.extend(dec.decode_step(&[8, 77])?);
    logits.extend(dec.decode_step(&[3, 1])?);
    logits.extend(dec.prefill(short, PrefillLogits::All)?);
    let tokens = dec.generate(short, &Sampling::greedy(6))?;
    Ok((logits, tokens))
}

fn check(name: &str, config: &ModelConfig, seed: u64) -> Res {
    let tensors = random_tensors(config, seed);
    let short = vec![
        vec![3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
        vec![27, 18, 28, 18, 28, 4],
    ];
    let long = vec![
        (0..40).map(|i| (i * 37 + 11) % 300).collect(),
        vec![5, 6, 7],
    ];
    let layout = config.rollout_layout(1)?;
    // the CPU: the host executor's fp8 switch, the CPU decoder
    let host = HostTrainState::from_tensors(1, tensors.clone())?;
    let mut cpu_lc = Lifecycle::new(
        HostBackend::new(layout.clone()).with_rollout_dtype(RolloutDtype::Fp8),
        host,
    );
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let mut cpu = CpuDecoder::new(config, &layout, &group)?;
    let (want, want_tokens) = run(&mut cpu, &long, &short)?;
    // the GPU: the FSDP backend's fp8 switch, the GPU decoder
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_tensors(tensors)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let on_gpu = session.backend().download_rollout(weights.get())?;
    assert!(
        on_gpu.first_difference(cpu_weights.get()).is_none(),
        "{name}: the GPU fp8 switch differs from the CPU executor's"
    );
    let mut gpu = GpuDecoder::new(config, session.backend(), weights.get())?;
    let (got, got_tokens) = run(&mut gpu, &long, &short)?;
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-3 + 1e-3 * scale,
            "{name}: logits row {i}: max |error| {err} against logits up to {scale}"
        );
        worst = worst.max(err);
    }
    assert_eq!(got_tokens, want_tokens, "{name}: greedy tokens");
    println!("{name}: GPU fp8 decoder vs the CPU fp8 decoder: max |logit error| {worst:.3e}, greedy equal");
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_fp8_decoder_matches_the_cpu_fp8_decoder_w1() -> Res {
    require_gpus(1)?;
    // dense Qwen2 with biases and 128-wide heads; columns multiples of 16 (the vector path)
    let dense = ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 300, "hidden_size": 256,
            "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 10000.0,
            "tie_word_embeddings": false}"#,
    )?;
    check("qwen2 256-wide", &dense, 3)?;
    // Qwen3-MoE with a dense first layer; an odd width (200 = not a multiple of 16 nor of 128:
    // the scalar path and partial blocks)
    let moe = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 301, "hidden_size": 200,
            "intermediate_size": 520, "moe_intermediate_size": 136, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 50, "rope_theta": 10000.0, "tie_word_embeddings": true}"#,
    )?;
    check("qwen3-moe 200-wide", &moe, 4)
}

/// The fp8 experts of a decode step in one weight-streaming launch per product (24 sequences:
/// up to 24 routed rows per expert, pieces of at most eight) against one product per expert, on
/// a Qwen3-MoE shape with 16 experts of 256, top-4: decode-step logits within the decoder's
/// tolerance, greedy tokens equal (prefill, with more rows per expert, takes the per-expert path
/// either way).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_experts_in_one_launch_match_the_per_expert_path() -> Result<(), Box<dyn std::error::Error>> {
    require_gpus(1)?;
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 1024,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "norm_topk_prob": true}"#,
    )?;
    let layout = config.rollout_layout(1)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.synthetic_state(&config.tensor_shapes(), 5, 0.05)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let prompts: Vec<Vec<u32>> = (0..24u32)
        .map(|i| (0..9).map(|j| (i * 97 + j * 31 + 3) % 1024).collect())
        .collect();
    let run = |grouped: bool| -> Result<_, Box<dyn std::error::Error>> {
        let mut dec = GpuDecoder::new(&config, session.backend(), weights.get())?;
        dec.set_grouped_experts(grouped);
        let greedy = dec.generate(&prompts, &Sampling::greedy(6))?;
        dec.prefill(&prompts, PrefillLogits::Last)?;
        let mut steps = Vec::new();
        for k in 0..6 {
            let feed: Vec<u32> = greedy.iter().map(|g| g[k]).collect();
            steps.push(dec.decode_step(&feed)?);
        }
        Ok((greedy, steps))
    };
    let (gg, gs) = run(true)?;
    let (pg, ps) = run(false)?;
    let mut worst = 0.0f32;
    for (g, p) in gs.iter().flatten().zip(ps.iter().flatten()) {
        let scale = p.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = g
            .iter()
            .zip(p)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-3 + 1e-3 * scale,
            "one launch vs per expert: {err} (scale {scale})"
        );
        worst = worst.max(err);
    }
    assert_eq!(gg, pg, "greedy tokens");
    println!(
        "fp8 experts in one launch vs per expert: max |logit error| {worst:.3e}, greedy equal"
    );
    Ok(())
}
