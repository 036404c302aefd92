//! GPU test: the GPU decoder with LoRA adapters applied unmerged (`GpuDecoder::new_lora`: each
//! adapted linear adds `s·(x·Aᵀ)·Bᵀ` to its base product) against the CPU decoder's
//! (`CpuDecoder::new_lora`, which `models/decoder/tests/lora.rs` checks against the merged model
//! at T = 1, 2, 4), on the same bf16 rollout (the FSDP backend's switch on the GPU, the host
//! executor's on the CPU), W = T = 1. The three ways the GPU runs a layer's branches are
//! covered: a group's in `lora_a` and `lora_b` at up to 8 rows (the decode steps of two
//! sequences, the greedy tokens), in `lora_a_tiles` and `lora_b_tiles` at up to 64 (the prefills of 43
//! and 16 rows), each branch in cuBLAS products at more ([`run_lora`]'s prefill of 96 rows); and
//! again with the `A` products riding the base products' launch (`GpuDecoder::set_lora_riders`:
//! the decode steps, whose bf16 products the tensor-core kernel takes). The
//! merged mode (`LoraMode::Merged`: a private copy of the rollout with `W + s·B·A` in each
//! adapted matrix) against the CPU decoder over the base with the adapters merged alike on the
//! host.
//!
//! ```text
//! cargo test --release -p lifecycle-decoder-gpu --test lora -- --ignored --nocapture
//! ```
//!
//! Tolerance: that of the bf16 GPU tests, `1e-3 + 1e-3 · max|logit|` per row (the GPU reads the
//! activations as two bf16 rows, its LoRA branch's `x·Aᵀ` too); greedy tokens equal. The
//! adapters must matter: the base alone moves the logits well past that bound.

use std::sync::Arc;

use lifecycle_core::Lifecycle;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{random_tensors, CpuDecoder, ModelConfig};
use lifecycle_decoder_gpu::{GpuDecoder, LoraMode};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::lora::{adapters, with_adapters, LoraConfig, LoraTarget};
use lifecycle_layout::{HostTensor, RolloutLayout};

mod common;

use common::{host_fp8, prompts, run, Outputs};
use lifecycle_decoder::{Decoder, PrefillLogits};

type Res = Result<(), Box<dyn std::error::Error>>;

/// A layout with adapters, the base tensors alone, and the base tensors with the adapters.
type LoraModel = (RolloutLayout, Vec<HostTensor>, Vec<HostTensor>);

/// The base tensors of `config` and the adapters of `lora` beside them (entries uniform in
/// ±0.1 from `seed`: B is not PEFT's zero start, so the adapters move the logits), with the
/// layout that holds both.
fn lora_model(
    config: &ModelConfig,
    lora: &LoraConfig,
    seed: u64,
) -> Result<LoraModel, Box<dyn std::error::Error>> {
    let base = random_tensors(config, seed);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
    };
    let mut all = base.clone();
    for a in adapters(&config.model, lora)? {
        for spec in [&a.a, &a.b] {
            let n: usize = spec.shape.iter().product();
            let values = (0..n).map(|_| next()).collect();
            all.push(HostTensor::f32(
                spec.name.clone(),
                spec.shape.clone(),
                values,
            ));
        }
    }
    let layout = with_adapters(&config.rollout_layout(1)?, &config.model, lora)?;
    Ok((layout, base, all))
}

/// The base tensors of `all` with each adapter of `lora` merged as the GPU's merged mode does:
/// `bf16(W + s·B·A)` of the bf16 `W`, `A` and `B`, the sum in f64.
fn merged_base(config: &ModelConfig, lora: &LoraConfig, all: &[HostTensor]) -> Vec<HostTensor> {
    let values = |name: &str| -> Vec<f32> {
        let t = all
            .iter()
            .find(|t| t.name == name)
            .expect("a tensor of the model");
        t.clone().bf16_rounded().data.to_f32().expect("float data")
    };
    let s = lora.scaling();
    let mut out: Vec<HostTensor> = all
        .iter()
        .filter(|t| !t.name.contains(".lora_"))
        .cloned()
        .collect();
    for a in adapters(&config.model, lora).expect("the adapters of the configuration") {
        let (am, bm) = (values(&a.a.name), values(&a.b.name));
        let (r, cols) = (a.a.shape[0], a.a.shape[1]);
        let rows = a.b.shape[0];
        let base = out.iter_mut().find(|t| t.name == a.base).expect("the base");
        let w = base
            .clone()
            .bf16_rounded()
            .data
            .to_f32()
            .expect("float data");
        let merged = (0..rows * cols)
            .map(|k| {
                let (i, j) = (k / cols, k % cols);
                let ba: f64 = (0..r)
                    .map(|c| f64::from(bm[i * r + c]) * f64::from(am[c * cols + j]))
                    .sum();
                half::bf16::from_f64(f64::from(w[k]) + s * ba).to_f32()
            })
            .collect();
        *base = HostTensor::f32(base.name.clone(), base.shape.clone(), merged);
    }
    out
}

/// [`run`], then the logits of every position of a prefill of 96 rows (two prompts of 60 and
/// 36 tokens: more than the LoRA kernels take, so the GPU runs each branch in cuBLAS products).
fn run_lora<D: Decoder>(dec: &mut D) -> Result<Outputs, Box<dyn std::error::Error>>
where
    D::Error: 'static,
{
    let (long, short) = prompts();
    let (mut logits, tokens) = run(dec, &long, &short)?;
    let many: Vec<Vec<u32>> = vec![
        (0..60).map(|i| (i * 53 + 7) % 300).collect(),
        (0..36).map(|i| (i * 29 + 3) % 300).collect(),
    ];
    logits.extend(dec.prefill(&many, PrefillLogits::All)?);
    Ok((logits, tokens))
}

/// The GPU decoder's outputs over the FSDP backend's rollout of `tensors` in `layout`, with
/// `lora`'s adapters (or the base alone).
fn gpu_outputs(
    config: &ModelConfig,
    layout: RolloutLayout,
    tensors: Vec<HostTensor>,
    lora: Option<&LoraConfig>,
) -> Result<Outputs, Box<dyn std::error::Error>> {
    gpu_outputs_as(config, layout, tensors, lora, (LoraMode::Unmerged, false)).map(|(o, _)| o)
}

/// [`gpu_outputs`] with the adapters applied as `mode` says (unmerged: with the `A` products
/// riding their base products' launch where `riders`), and the decoder's merge time.
fn gpu_outputs_as(
    config: &ModelConfig,
    layout: RolloutLayout,
    tensors: Vec<HostTensor>,
    lora: Option<&LoraConfig>,
    (mode, riders): (LoraMode, bool),
) -> Result<(Outputs, std::time::Duration), Box<dyn std::error::Error>> {
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout);
    let state = backend.state_from_tensors(tensors)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let mut gpu = match lora {
        Some(l) => GpuDecoder::new_lora_as(config, session.backend(), weights.get(), l, mode)?,
        None => GpuDecoder::new(config, session.backend(), weights.get())?,
    };
    gpu.set_lora_riders(riders);
    let merge = gpu.last_merge_time();
    Ok((run_lora(&mut gpu)?, merge))
}

/// Largest |a − b| over the rows against each row's largest |b|, and the largest |a − b|.
fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, f32) {
    let mut out = (0.0f32, 0.0f32);
    for (g, w) in got.iter().zip(want) {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        out.0 = out.0.max(err / (1.0 + scale));
        out.1 = out.1.max(err);
    }
    out
}

fn check(name: &str, config: &ModelConfig, lora: &LoraConfig, seed: u64) -> Res {
    let (layout, base, all) = lora_model(config, lora, seed)?;
    // the CPU decoder on the host executor's bf16 rollout
    let host = HostTrainState::from_tensors(1, all.clone())?;
    let mut cpu_lc = Lifecycle::new(HostBackend::new(layout.clone()), host);
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let mut cpu = CpuDecoder::new_lora(config, &layout, &group, lora)?;
    let (want, want_tokens) = run_lora(&mut cpu)?;
    // the GPU decoder on the FSDP backend's rollout, unmerged
    let (got, got_tokens) = gpu_outputs(config, layout.clone(), all.clone(), Some(lora))?;
    assert_eq!(got.len(), want.len(), "{name}: logits rows");
    let (rel, abs) = worst(&got, &want);
    assert!(
        rel <= 1e-3,
        "{name}: GPU vs CPU unmerged LoRA: max |Δ logit| {abs} ({rel} of 1 + the row's largest)"
    );
    assert_eq!(got_tokens, want_tokens, "{name}: greedy tokens");
    // the same with the A products riding the base products' launch (the decode steps' rows)
    let unmerged = (LoraMode::Unmerged, true);
    let ((got_r, got_r_tokens), _) =
        gpu_outputs_as(config, layout.clone(), all.clone(), Some(lora), unmerged)?;
    let (rel_r, abs_r) = worst(&got_r, &want);
    assert!(
        rel_r <= 1e-3,
        "{name}: GPU vs CPU unmerged LoRA, riders: max |Δ logit| {abs_r} ({rel_r} relative)"
    );
    assert_eq!(got_r_tokens, want_tokens, "{name}: greedy tokens, riders");
    // they ran: their sums, in another order than lora_a's, change some logits' bits (the
    // kernels give the same bits run to run)
    let bits =
        |rows: &[Vec<f32>]| -> Vec<u32> { rows.iter().flatten().map(|v| v.to_bits()).collect() };
    assert_ne!(
        bits(&got_r),
        bits(&got),
        "{name}: the riders changed no logit: did they run?"
    );
    // the adapters matter: the base alone is far from them
    let (base_logits, _) = gpu_outputs(config, config.rollout_layout(1)?, base, None)?;
    let (moved, _) = worst(&base_logits, &want);
    assert!(
        moved > 1e-2,
        "{name}: the adapters moved the logits by only {moved} of 1 + the row's largest"
    );
    // the merged mode against the CPU decoder over the base with the adapters merged alike
    let merged = merged_base(config, lora, &all);
    let host = HostTrainState::from_tensors(1, merged)?;
    let base_layout = config.rollout_layout(1)?;
    let mut merged_lc = Lifecycle::new(HostBackend::new(base_layout.clone()), host);
    let merged_session = merged_lc.rollout()?;
    let merged_weights = merged_session.weights();
    let group: Vec<_> = merged_weights.ranks.iter().collect();
    let mut cpu_merged = CpuDecoder::new(config, &base_layout, &group)?;
    let (want_m, want_m_tokens) = run_lora(&mut cpu_merged)?;
    let ((got_m, got_m_tokens), merge) = gpu_outputs_as(
        config,
        layout.clone(),
        all.clone(),
        Some(lora),
        (LoraMode::Merged, false),
    )?;
    let (rel_m, abs_m) = worst(&got_m, &want_m);
    assert!(
        rel_m <= 1e-3,
        "{name}: GPU merged vs CPU on the merged base: max |Δ logit| {abs_m} ({rel_m} relative)"
    );
    assert_eq!(got_m_tokens, want_m_tokens, "{name}: merged greedy tokens");
    assert!(merge > std::time::Duration::ZERO, "{name}: no merge timed");
    // a decoder not told of the adapters refuses them by name
    let refused = gpu_outputs(config, layout, all, None)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        refused.contains(".lora_A.weight") && refused.contains("new_lora"),
        "{name}: a decoder without the configuration: {refused:?}"
    );
    println!(
        "{name}: GPU vs CPU unmerged LoRA (r = {}, s = {}): max |Δ logit| {abs:.3e} \
         ({rel:.2e} relative), greedy equal; riders {abs_r:.3e} ({rel_r:.2e}); merged \
         {abs_m:.3e} ({rel_m:.2e}) against the CPU on the merged base, merged in {merge:?}; the \
         base alone {moved:.2e} away",
        lora.rank,
        lora.scaling()
    );
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_unmerged_lora_matches_the_cpu_decoder() -> Res {
    require_gpus(1)?;
    // dense Qwen2 with biases and 128-wide heads, every linear adapted (q / k / v and gate / up
    // in separate matrices of the unfused layout, each with its branch)
    let dense = common::qwen2_256()?;
    let all = LoraConfig::new(8, 16.0, LoraTarget::ALL.to_vec());
    check("qwen2, r = 8 on all seven", &dense, &all, 3)?;
    // Qwen3 (per-head q / k norms after the adapted products), some targets, rsLoRA
    let qwen3 = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3", "vocab_size": 300, "hidden_size": 128,
            "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1000000.0,
            "tie_word_embeddings": true}"#,
    )?;
    let some = LoraConfig::new(4, 8.0, vec![LoraTarget::Q, LoraTarget::V, LoraTarget::Down])
        .with_rslora(true);
    check("qwen3, r = 4 on q / v / down, rsLoRA", &qwen3, &some, 5)?;
    // Llama (no q / k / v biases) with v and up adapted alone: q / k / v and gate / up stay one
    // matrix each in the buffer, so the branches add to a joined product's column blocks
    let llama = ModelConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 300, "hidden_size": 128,
            "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?;
    let joined = LoraConfig::new(8, 16.0, vec![LoraTarget::V, LoraTarget::Up]);
    check(
        "llama, r = 8 on v / up (joined products)",
        &llama,
        &joined,
        9,
    )?;
    // Qwen3-MoE with a dense first layer: the attention adapted in every layer (MLP targets on
    // a layer of experts are refused by the layout)
    let moe = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 301, "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?;
    let attention = LoraConfig::new(8, 16.0, LoraTarget::ALL[..4].to_vec());
    check("qwen3-moe, r = 8 on q / k / v / o", &moe, &attention, 7)?;
    Ok(())
}

/// Adapters beside an fp8 base (the rollout's matrices block-scaled e4m3, the adapters bf16:
/// the FSDP backend's fp8 switch on the GPU, the host executor's on the CPU, bit-identical),
/// Qwen2 r = 8 on all seven. Weight-only: the bf16 tolerance above against the CPU decoder's
/// weight-only products, greedy equal. W8A8 (the activations quantised per token, each branch
/// on the bf16 activations beside): within the distance of the CPU decoder's two modes on
/// average, as the `fp8` test bounds W8A8 without adapters (quantising an activation is
/// discontinuous); and the adapters matter in both modes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_lora_beside_an_fp8_base_matches_the_cpu_decoder() -> Res {
    use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};
    use lifecycle_layout::settings::Configure;

    require_gpus(1)?;
    let config = common::qwen2_256()?;
    let lora = LoraConfig::new(8, 16.0, LoraTarget::ALL.to_vec());
    let (layout, base, all) = lora_model(&config, &lora, 11)?;
    let (long, short) = prompts();
    let mut cpu_lc = host_fp8(&layout, &all)?;
    let cpu_session = cpu_lc.rollout()?;
    let cpu_weights = cpu_session.weights();
    let group: Vec<_> = cpu_weights.ranks.iter().collect();
    let cpu = |compute| -> Result<Outputs, Box<dyn std::error::Error>> {
        let mut d =
            CpuDecoder::new_lora(&config, &layout, &group, &lora)?.with_fp8_compute(compute);
        run(&mut d, &long, &short)
    };
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout.clone()).with_rollout_dtype(RolloutDtype::Fp8);
    let state = backend.state_from_tensors(all)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let on_gpu = session.backend().download_rollout(weights.get())?;
    assert!(
        on_gpu.first_difference(cpu_weights.get()).is_none(),
        "the GPU fp8 switch with adapters differs from the CPU executor's"
    );
    let gpu = |compute| -> Result<Outputs, Box<dyn std::error::Error>> {
        let mut d = GpuDecoder::new_lora(&config, session.backend(), weights.get(), &lora)?;
        d.set_fp8_compute(compute)?;
        run(&mut d, &long, &short)
    };
    // the base alone, fp8 too: how far the adapters move the logits
    let base_layout = config.rollout_layout(1)?;
    let mut base_lc = host_fp8(&base_layout, &base)?;
    let base_session = base_lc.rollout()?;
    let base_weights = base_session.weights();
    let base_group: Vec<_> = base_weights.ranks.iter().collect();
    let (plain, _) = run(
        &mut CpuDecoder::new(&config, &base_layout, &base_group)?,
        &long,
        &short,
    )?;

    let (want, want_tokens) = cpu(Fp8Compute::WeightOnly)?;
    let (got, got_tokens) = gpu(Fp8Compute::WeightOnly)?;
    let (rel, abs) = worst(&got, &want);
    let (moved, _) = worst(&plain, &want);
    assert!(
        rel <= 1e-3,
        "weight-only: GPU vs CPU max |Δ logit| {abs} ({rel} relative)"
    );
    assert_eq!(got_tokens, want_tokens, "weight-only greedy tokens");
    assert!(moved > 1e-2, "the adapters move the logits only {moved}");

    let (want8, _) = cpu(Fp8Compute::W8A8)?;
    let (got8, _) = gpu(Fp8Compute::W8A8)?;
    let mean = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        let (mut sum, mut count) = (0.0f64, 0usize);
        for (x, y) in a.iter().zip(b) {
            for (p, q) in x.iter().zip(y) {
                sum += f64::from((p - q).abs());
                count += 1;
            }
        }
        sum / count.max(1) as f64
    };
    let (err8, modes) = (mean(&got8, &want8), mean(&want8, &want));
    let (moved8, _) = worst(&plain, &want8);
    assert!(
        err8 <= modes,
        "W8A8: GPU vs CPU mean |Δ logit| {err8:.3e}, the CPU's two modes {modes:.3e} apart"
    );
    assert!(
        moved8 > 1e-2,
        "W8A8: the adapters move the logits only {moved8}"
    );
    println!(
        "qwen2, r = 8 on all seven beside an fp8 base: weight-only GPU vs CPU max |Δ logit| \
         {abs:.3e} ({rel:.2e} relative), greedy equal; W8A8 mean {err8:.3e} (the CPU's modes \
         {modes:.3e} apart); the base alone {moved:.2e} away"
    );
    Ok(())
}

/// The engine's outputs of [`run`]'s calls, through a lifecycle over the FSDP backend's rollout
/// of `tensors` in `layout`, with `lora`'s adapters; with `shared`, the engine reads those base
/// tensors (bf16, each in its own device allocation, as a trainer's frozen parameters) in place
/// instead of from the rollout buffer, whose layout then holds the rest of `full`.
fn engine_outputs(
    config: &ModelConfig,
    (layout, full): (RolloutLayout, &RolloutLayout),
    tensors: Vec<HostTensor>,
    lora: &LoraConfig,
    shared: &[HostTensor],
) -> Result<(Outputs, u64), Box<dyn std::error::Error>> {
    use lifecycle_cuda::RankExecutor;
    use lifecycle_decoder::Sampling;
    use lifecycle_decoder_gpu::{EngineSettings, GpuEngine, SharedBase, SharedTensor};
    let (long, short) = prompts();
    let pool = Arc::new(ThreadRankPool::new(1)?);
    // the shared tensors' device copies, kept alive until the engine is dropped
    let mut uploads: Vec<Vec<lifecycle_cuda::cudarc::driver::CudaSlice<half::bf16>>> = vec![vec![]];
    let host: Vec<Vec<half::bf16>> = shared
        .iter()
        .map(|t| {
            let v = t.clone().bf16_rounded().data.to_f32().unwrap_or_default();
            v.into_iter().map(half::bf16::from_f32).collect()
        })
        .collect();
    let addresses = pool.run_each(&mut uploads, &|ctx, out| {
        let mut at = Vec::new();
        for h in &host {
            let d = ctx
                .compute
                .clone_htod(h)
                .map_err(ctx.drv("uploading a shared base tensor", 0))?;
            at.push(ctx.addr(&d));
            out.push(d);
        }
        ctx.compute
            .synchronize()
            .map_err(ctx.drv("synchronizing", 0))?;
        Ok(at)
    })?;
    let backend = FsdpBackend::new(pool, layout);
    let state = backend.state_from_tensors(tensors)?;
    let settings = EngineSettings::new(4, 128);
    let mut engine = GpuEngine::for_backend(&backend, config, settings)?.with_lora(lora.clone());
    let bytes = if shared.is_empty() {
        0
    } else {
        let tensors = shared
            .iter()
            .zip(&addresses[0])
            .map(|(t, &address)| SharedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                address,
            })
            .collect();
        // SAFETY: each address holds its tensor's bf16 elements (uploaded and synchronized
        // above), kept in `uploads` until the engine is dropped, never written.
        unsafe { engine.share_base(Some(SharedBase::new(full.clone(), tensors)?))? };
        2 * host.iter().map(Vec::len).sum::<usize>() as u64
    };
    let mut lc = Lifecycle::new(backend, state).with_engine(engine);
    let mut session = lc.rollout()?;
    let (weights, mut engine) = session.parts();
    let buffer_bytes = 2 * weights.get().len_per_rank() as u64;
    let mut logits = engine.prefill(weights, &long, PrefillLogits::All)?;
    logits.extend(engine.decode_step(weights, &[8, 77])?);
    logits.extend(engine.decode_step(weights, &[3, 1])?);
    logits.extend(engine.prefill(weights, &short, PrefillLogits::All)?);
    let tokens = engine.generate(weights, &short, &Sampling::greedy(6))?;
    session.finish()?;
    drop(lc);
    drop(uploads);
    println!("  rollout buffer {buffer_bytes} bytes, shared base {bytes} bytes");
    Ok(((logits, tokens), buffer_bytes))
}

/// A shared base (`GpuEngine::share_base`): the rollout buffer holds the adapters alone and the
/// engine reads the base matrices, norms, embedding and head where they are (separate device
/// allocations, as a trainer's frozen bf16 parameters), against the same engine over a rollout
/// buffer holding every tensor: the same logits and greedy tokens (the products may group
/// differently: matrices that lie one after the other in the buffer are one product there), and
/// the buffer is the adapters' bytes alone.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_shared_base_is_read_in_place() -> Res {
    require_gpus(1)?;
    let config = common::qwen2_256()?;
    let lora = LoraConfig::new(8, 16.0, LoraTarget::ALL.to_vec());
    let (layout, base, all) = lora_model(&config, &lora, 11)?;
    let (want, _) = engine_outputs(&config, (layout.clone(), &layout), all.clone(), &lora, &[])?;
    let adapters: Vec<HostTensor> = all
        .iter()
        .filter(|t| t.name.contains(".lora_"))
        .cloned()
        .collect();
    let specs = layout
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".lora_"))
        .cloned()
        .collect();
    let own = RolloutLayout::new(1, specs)?;
    let ((got, got_tokens), buffer) =
        engine_outputs(&config, (own, &layout), adapters.clone(), &lora, &base)?;
    let adapter_bytes: u64 = adapters
        .iter()
        .map(|t| 2 * t.shape.iter().product::<usize>() as u64)
        .sum();
    assert_eq!(
        buffer, adapter_bytes,
        "the rollout buffer holds the adapters alone"
    );
    assert_eq!(got.len(), want.0.len(), "logits rows");
    let (rel, abs) = worst(&got, &want.0);
    assert!(
        rel <= 1e-5,
        "shared base vs the whole rollout: max |Δ logit| {abs} ({rel} of 1 + the row's largest)"
    );
    assert_eq!(got_tokens, want.1, "greedy tokens");
    println!(
        "shared base vs the whole rollout: max |Δ logit| {abs:.3e} ({rel:.2e} relative), greedy \
         equal; the rollout buffer {buffer} bytes (the adapters)"
    );
    Ok(())
}
