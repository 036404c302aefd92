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

use lifecycle_layout::settings::Configure;
use std::sync::Arc;

use lifecycle_core::Lifecycle;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{
    random_tensors, CpuDecoder, Decoder, MegatronConfig, ModelConfig, PrefillLogits, Sampling,
};
use lifecycle_decoder_gpu::GpuDecoder;
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::RolloutDtype;

mod common;

use common::{host_fp8, prompts, run};

type Res = Result<(), Box<dyn std::error::Error>>;

fn check(name: &str, config: &ModelConfig, seed: u64) -> Res {
    let tensors = random_tensors(config, seed);
    let (long, short) = prompts();
    let layout = config.rollout_layout(1)?;
    // the CPU: the host executor's fp8 switch, the CPU decoder
    let mut cpu_lc = host_fp8(&layout, &tensors)?;
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
    let dense = common::qwen2_256()?;
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

/// Largest |a − b| over the rows, and the largest |b|.
fn distance(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, f32) {
    let mut worst = (0.0f32, 0.0f32);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            worst.0 = worst.0.max((p - q).abs());
            worst.1 = worst.1.max(q.abs());
        }
    }
    worst
}

/// Mean |a − b| over every logit of the rows.
fn mean_distance(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut sum, mut count) = (0.0f64, 0usize);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            sum += f64::from((p - q).abs());
            count += 1;
        }
    }
    sum / count.max(1) as f64
}

/// Prefill of 8 tokens and decode steps of 2 sequences: every W8A8 product on the GPU takes
/// the weight-streaming kernel or the tensor-core kernel, as the caller sets them.
fn run_small<D: Decoder>(dec: &mut D) -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error>>
where
    D::Error: 'static,
{
    let mut logits = dec.prefill(&[vec![3, 1, 4, 1], vec![5, 9, 2, 6]], PrefillLogits::All)?;
    logits.extend(dec.decode_step(&[8, 77])?);
    logits.extend(dec.decode_step(&[3, 1])?);
    Ok(logits)
}

/// W8A8 on the GPU (activations quantised on the device; the weight-streaming kernel on the
/// dequantised activations, the tensor-core kernel, and cuBLASLt's block-scaled GEMM) against
/// the CPU decoder's W8A8 on the same fp8 weights.
///
/// W8A8 decoding is discontinuous: quantising an activation rounds it to an e4m3 step, so a
/// tiny difference upstream that moves one value across a rounding point changes it by a whole
/// step, and the change spreads to every later quantisation. On the CPU, a rotary base of
/// 10030 instead of 10000 moves this dense model's weight-only logits by 1.7e-4 and its W8A8
/// logits by 0.10 (its two modes differ by 0.23). The GPU's weight-only logits differ from the
/// CPU's by 3e-5 (split activations, other summation orders; the GEMM sums each 128-wide
/// group to about 1e-4 of the terms' magnitudes, the `w8a8` unit test), so the two W8A8
/// decoders agree only to the size of W8A8's own noise. The exact checks are the unit test's
/// (quantisation bit-identical, sums within 5e-4 of Σ|terms|); here: the GPU's W8A8 logits
/// within the distance between the CPU's W8A8 and weight-only ones, by each of the three
/// paths (for the 40-token prompts on average: there the flips spread until a few logits
/// differ by as much as the modes); W8A8 really in use (its logits at least
/// 1e-2 · max|logit| from weight-only); and weight-only again after W8A8 as before.
fn check_w8a8(name: &str, config: &ModelConfig, seed: u64) -> Res {
    use lifecycle_layout::fp8::Fp8Compute;
    let tensors = random_tensors(config, seed);
    let (long, short) = prompts();
    let layout = config.rollout_layout(1)?;
    let mut cpu_lc = host_fp8(&layout, &tensors)?;
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let mut cpu = CpuDecoder::new(config, &layout, &group)?;
    let (weight_only, _) = run(&mut cpu, &long, &short)?;
    let small_weight_only = run_small(&mut CpuDecoder::new(config, &layout, &group)?)?;
    let w8a8_cpu = || -> Result<CpuDecoder, Box<dyn std::error::Error>> {
        Ok(CpuDecoder::new(config, &layout, &group)?.with_fp8_compute(Fp8Compute::W8A8))
    };
    let (want, _) = run(&mut w8a8_cpu()?, &long, &short)?;
    let small_want = run_small(&mut w8a8_cpu()?)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout.clone()).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_tensors(tensors)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    // (weight-streaming tokens, mma.sync tokens, warpgroup tokens): cuBLASLt's GEMM beyond
    type Limits = (usize, usize, usize);
    let set = |gpu: &mut GpuDecoder, (gemv, mma, wgmma): Limits| {
        gpu.set_fp8_gemv_tokens(gemv);
        gpu.set_fp8_mma_tokens(mma);
        gpu.set_fp8_wgmma_tokens(wgmma);
    };
    let w8a8_gpu = |limits: Limits| -> Result<GpuDecoder, Box<dyn std::error::Error>> {
        let mut gpu = GpuDecoder::new(config, session.backend(), weights.get())?;
        gpu.set_fp8_compute(Fp8Compute::W8A8)?;
        set(&mut gpu, limits);
        Ok(gpu)
    };
    let (modes, _) = distance(&small_want, &small_weight_only);
    let mean_modes = mean_distance(&small_want, &small_weight_only);
    // (limits, path, whether its sums are exact in f32: the warpgroup kernel's are Hopper's
    // fp8 tensor cores', summed below f32's precision as cuBLASLt's, so its logits are held to
    // the mean error, as the long runs below)
    for (limits, path, exact) in [
        (
            (8, 0, 0),
            "the weight-streaming kernel up to 8 tokens",
            true,
        ),
        ((0, 64, 0), "the mma.sync kernel from 1 token", true),
        (
            (0, 0, 64),
            "the warpgroup kernel (where loaded) from 1 token",
            false,
        ),
    ] {
        let small = run_small(&mut w8a8_gpu(limits)?)?;
        let (err, scale) = distance(&small, &small_want);
        let mean = mean_distance(&small, &small_want);
        println!(
            "{name}: {path}, GPU W8A8 vs CPU W8A8: max |logit error| {err:.3e}, mean {mean:.3e} \
             (logits up to {scale:.3}; the CPU's two modes differ by {modes:.3e}, mean \
             {mean_modes:.3e})"
        );
        if exact {
            assert!(
                err <= modes,
                "{name}: W8A8 by {path} {err} from the CPU's, its modes {modes} apart (logits \
                 up to {scale})"
            );
        } else {
            assert!(
                mean <= mean_modes,
                "{name}: W8A8 by {path} {mean} from the CPU's on average, its modes \
                 {mean_modes} apart (logits up to {scale})"
            );
        }
    }
    let (modes, _) = distance(&want, &weight_only);
    let cpu_tokens = run(&mut w8a8_cpu()?, &long, &short)?.1;
    let mut gpu = w8a8_gpu((1, 0, 0))?;
    for (limits, path) in [
        ((1, 0, 0), "cuBLASLt's GEMM beyond one token"),
        (
            (1, 64, 0),
            "weight streaming for one token, the mma.sync kernel up to 64",
        ),
        (
            (1, 0, 64),
            "weight streaming for one token, the warpgroup kernel (where loaded) up to 64",
        ),
    ] {
        set(&mut gpu, limits);
        let (got, got_tokens) = run(&mut gpu, &long, &short)?;
        let (err, scale) = distance(&got, &want);
        let (off, _) = distance(&got, &weight_only);
        let (mean, mean_modes) = (
            mean_distance(&got, &want),
            mean_distance(&want, &weight_only),
        );
        println!(
            "{name}: {path}, GPU W8A8 vs CPU W8A8: max |logit error| {err:.3e}, mean \
             {mean:.3e} (logits up to {scale:.3}); vs CPU weight-only {off:.3e}; the CPU's two \
             modes differ by {modes:.3e}, mean {mean_modes:.3e}; greedy tokens {}",
            if got_tokens == cpu_tokens {
                "equal"
            } else {
                "differ"
            }
        );
        // over 40 positions the flips spread until a few logits differ as much as the modes
        // do (the maximum then decides nothing); the mean error stays below the modes' mean
        assert!(
            mean <= mean_modes,
            "{name}: GPU W8A8 by {path}: mean error {mean} from the CPU's, its modes {mean_modes} \
             apart on average"
        );
        assert!(
            off >= 1e-2 * scale,
            "{name}: GPU W8A8 by {path} only {off} from the weight-only logits (up to {scale}): \
             not in use?"
        );
    }
    // the same weights, weight-only again on the GPU: back to the weight-only logits
    gpu.set_fp8_compute(Fp8Compute::WeightOnly)?;
    let (back, _) = run(&mut gpu, &long, &short)?;
    let (err, scale) = distance(&back, &weight_only);
    assert!(
        err <= 1e-3 + 1e-3 * scale,
        "{name}: weight-only after W8A8: {err}"
    );
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_w8a8_decoder_matches_the_cpu_w8a8_decoder_w1() -> Res {
    require_gpus(1)?;
    // dense Qwen2 with biases; the down product's 640 inputs are 5 scale blocks
    let dense = common::qwen2_256()?;
    check_w8a8("qwen2 256-wide", &dense, 3)?;
    // Qwen3-MoE with a dense first layer and 16 experts of 256 (decode steps: the experts'
    // weight-streaming launches on quantised activations; prefill: per expert, the GEMM)
    let moe = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 512,
            "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 16,
            "num_experts_per_tok": 4, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?;
    check_w8a8("qwen3-moe 512-wide", &moe, 4)
}

/// The fused (Megatron) layout in fp8: the GPU Megatron backend's fp8 rollout (W = T = 1),
/// bit-identical to the CPU executor's (`MegatronHostBackend` with fp8), read by the GPU decoder
/// against the CPU decoder on the CPU executor's rollout: weight-only within the bf16 bound
/// with greedy tokens equal (one fp8 product over `[q; k; v]` and one over `[gate; up]`, each
/// expert a row range of its stack); W8A8 within the distance of the CPU's two modes on average.
fn check_fused(name: &str, config: &ModelConfig, seed: u64) -> Res {
    use lifecycle_decoder::MegatronParallel;
    use lifecycle_host::megatron::MegatronHostBackend;
    use lifecycle_layout::fp8::Fp8Compute;
    use lifecycle_layout::{RolloutLayout, RolloutVocab};
    use lifecycle_megatron::MegatronGpuBackend;
    let (long, short) = prompts();
    let layout = RolloutLayout::fused(1, RolloutVocab::PadToMultipleOf(64));
    let host =
        config.megatron_state(random_tensors(config, seed), MegatronParallel::new(1, 1, 1))?;
    let mut cpu_lc = Lifecycle::new(
        MegatronHostBackend::new(layout.clone()).with_rollout_dtype(RolloutDtype::Fp8),
        host.clone(),
    );
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let cpu_fused = || CpuDecoder::new_fused(config, &layout, &group);
    let (weight_only, want_tokens) = run(&mut cpu_fused()?, &long, &short)?;
    let (want_w8a8, _) = run(
        &mut cpu_fused()?.with_fp8_compute(Fp8Compute::W8A8),
        &long,
        &short,
    )?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = MegatronGpuBackend::new(pool.clone(), layout.clone())?
        .with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let on_gpu = session.backend().download_rollout(weights.get())?;
    assert!(
        on_gpu.first_difference(cpu_weights.get()).is_none(),
        "{name}: the GPU Megatron fp8 switch differs from the CPU executor's"
    );
    let fp8 = weights
        .get()
        .entries()
        .iter()
        .filter(|e| e.is_fp8())
        .count();
    assert!(fp8 > 0, "{name}: no fp8 tensor in the rollout");
    let mut gpu = GpuDecoder::with_fused_layout(config, &layout, &pool, weights.get())?;
    let (got, got_tokens) = run(&mut gpu, &long, &short)?;
    let (err, scale) = distance(&got, &weight_only);
    assert!(
        err <= 1e-3 + 1e-3 * scale,
        "{name}: fused fp8 weight-only: max |logit error| {err} against logits up to {scale}"
    );
    assert_eq!(got_tokens, want_tokens, "{name}: greedy tokens");
    gpu.set_fp8_compute(Fp8Compute::W8A8)?;
    let (got8, _) = run(&mut gpu, &long, &short)?;
    let (mean, mean_modes) = (
        mean_distance(&got8, &want_w8a8),
        mean_distance(&want_w8a8, &weight_only),
    );
    assert!(
        mean <= mean_modes,
        "{name}: fused fp8 W8A8: mean error {mean} from the CPU's, its modes {mean_modes} apart"
    );
    println!(
        "{name}: fused fp8 rollout ({fp8} fp8 tensors), bit-identical on GPU and CPU; GPU \
         decoder vs CPU decoder: weight-only max |logit error| {err:.3e} (logits up to \
         {scale:.3}), greedy equal; W8A8 mean error {mean:.3e} (the CPU's modes {mean_modes:.3e} \
         apart)"
    );
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_fp8_decoder_reads_the_fused_megatron_fp8_rollout() -> Res {
    require_gpus(1)?;
    // dense Qwen2 with biases and 128-wide heads: q, k, v and gate, up of whole 128-row blocks
    let dense = common::qwen2_256()?;
    check_fused("qwen2 256-wide", &dense, 3)?;
    // Qwen3-MoE with a dense first layer and 16 experts of 256 in their stacks
    let moe = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 512,
            "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 16,
            "num_experts_per_tok": 4, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?;
    check_fused("qwen3-moe 512-wide", &moe, 4)
}

/// A W8A8 MoE prefill longer than one device routing (two prompts, 600 rows: chunks of 256,
/// 256 and 88 rows routed on the device, the experts on the tensor cores) against the CPU
/// decoder's W8A8 and the host-routed GPU path (`set_device_routing(false)`): the logits of
/// every position within the distance of the CPU's two modes on average (a chunk reading or
/// writing the wrong rows would put every later position off by the logits' size), no host
/// wait per MoE layer where the device routes, one per MoE layer where the host does.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn w8a8_moe_prefill_beyond_one_routing_routes_on_the_device_in_chunks() -> Res {
    use lifecycle_layout::fp8::Fp8Compute;
    require_gpus(1)?;
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 512,
            "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 16,
            "num_experts_per_tok": 4, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?;
    let moe_layers = 2;
    let tensors = random_tensors(&config, 5);
    let prompts: Vec<Vec<u32>> = [310u32, 290]
        .iter()
        .enumerate()
        .map(|(s, &len)| {
            (0..len)
                .map(|i| (i * 37 + 11 + 101 * s as u32) % 300)
                .collect()
        })
        .collect();
    let rows: usize = prompts.iter().map(Vec::len).sum();
    assert!(rows > lifecycle_decoder_gpu::MOE_DEVICE_ROWS * 2);
    let layout = config.rollout_layout(1)?;
    let mut cpu_lc = host_fp8(&layout, &tensors)?;
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let weight_only =
        CpuDecoder::new(&config, &layout, &group)?.prefill(&prompts, PrefillLogits::All)?;
    let want = CpuDecoder::new(&config, &layout, &group)?
        .with_fp8_compute(Fp8Compute::W8A8)
        .prefill(&prompts, PrefillLogits::All)?;
    let mean_modes = mean_distance(&want, &weight_only);
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout.clone()).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_tensors(tensors)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let mut waits = Vec::new();
    let mut got = Vec::new();
    for device in [true, false] {
        let mut gpu = GpuDecoder::new(&config, session.backend(), weights.get())?;
        gpu.set_fp8_compute(Fp8Compute::W8A8)?;
        gpu.set_device_routing(device);
        let before = gpu.host_waits();
        let logits = gpu.prefill(&prompts, PrefillLogits::All)?;
        waits.push(gpu.host_waits() - before);
        let mean = mean_distance(&logits, &want);
        let (err, scale) = distance(&logits, &want);
        println!(
            "{rows} prefill rows, device routing {device}: GPU W8A8 vs CPU W8A8 mean |logit \
             error| {mean:.3e}, max {err:.3e} (logits up to {scale:.3}; the CPU's two modes \
             {mean_modes:.3e} apart on average); host waits {}",
            waits[waits.len() - 1]
        );
        assert!(
            mean <= mean_modes,
            "device routing {device}: W8A8 prefill of {rows} rows {mean} from the CPU's on \
             average, its modes {mean_modes} apart"
        );
        got.push(logits);
    }
    assert_eq!(
        waits[0] + moe_layers,
        waits[1],
        "host waits of the prefill routed on the device and on the host"
    );
    let between = mean_distance(&got[0], &got[1]);
    assert!(
        between <= mean_modes,
        "the device-routed and host-routed W8A8 prefills {between} apart on average, the CPU's \
         modes {mean_modes}"
    );
    Ok(())
}
