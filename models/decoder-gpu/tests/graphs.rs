//! GPU test: decode steps replayed from CUDA graphs (`GpuDecoder::set_step_graphs`, on by
//! default) against the same steps queued eagerly, on one GPU (W = T = 1).
//!
//! ```text
//! cargo test --release -p lifecycle-decoder-gpu --test graphs -- --ignored --nocapture
//! ```
//!
//! A graph replays the launches its capture recorded with the same arguments, so its logits
//! and tokens must equal the eager ones bit for bit; every case checks that graphs were really
//! captured and replayed (or, where the pass routes experts on the host, that none was). The
//! capture of a mixture-of-experts step routed on the device is the check that such a step is
//! free of host synchronisation: a device→host copy, an upload or a wait inside a capture ends
//! it with an error.
//!
//! Cases: a dense Qwen2 in bf16 (f32 and bf16 KV caches); the same in fp8, weight-only and W8A8
//! at 1, 3, 12, 20 and 40 sequences (the weight-streaming, `mma.sync`, warpgroup and cuBLASLt
//! paths of the W8A8 products); a Qwen3-MoE in bf16 and fp8 routed on the device, and routed
//! on the host (never captured).

use lifecycle_layout::settings::Configure;
use std::sync::Arc;

use lifecycle_core::Lifecycle;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{Decoder, KvDtype, ModelConfig, PrefillLogits, Sampling};
use lifecycle_decoder_gpu::GpuDecoder;
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Greedy tokens of a generation and the logits of decode steps after a prefill.
type Outputs = (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>);

fn prompts(batch: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..batch as u32)
        .map(|i| {
            (0..5 + i % 4)
                .map(|j| (i * 97 + j * 31 + 3) % vocab)
                .collect()
        })
        .collect()
}

/// Twice over (so that the second round replays graphs captured in the first): 8 greedy
/// tokens of `prompts`, then a prefill and 4 decode steps fed those tokens, their logits.
fn outputs(
    dec: &mut GpuDecoder<'_>,
    prompts: &[Vec<u32>],
) -> Result<Outputs, Box<dyn std::error::Error>> {
    let mut out = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let greedy = dec.generate(prompts, &Sampling::greedy(8))?;
        dec.prefill(prompts, PrefillLogits::Last)?;
        let mut steps = Vec::new();
        for k in 0..4 {
            let feed: Vec<u32> = greedy.iter().map(|g| g[k]).collect();
            steps.push(dec.decode_step(&feed)?);
        }
        out = (greedy, steps);
    }
    Ok(out)
}

/// How one case sets up its decoder.
#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: RolloutDtype,
    compute: Fp8Compute,
    kv: KvDtype,
    device_routing: bool,
    /// Whether graphs must be captured (false: the passes route experts on the host).
    captures: bool,
}

fn check(name: &str, config: &ModelConfig, case: Case, batches: &[usize]) -> Res {
    let layout = config.rollout_layout(1)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, layout).with_rollout_dtype(case.dtype);
    let state = backend.synthetic_state(&config.tensor_shapes(), 5, 0.05)?;
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout()?;
    let weights = session.weights();
    let decoder = |graphs: bool| -> Result<GpuDecoder<'_>, Box<dyn std::error::Error>> {
        let mut dec = GpuDecoder::new(config, session.backend(), weights.get())?;
        dec.set_kv_dtype(case.kv)?;
        dec.set_device_routing(case.device_routing);
        if case.dtype == RolloutDtype::Fp8 {
            dec.set_fp8_compute(case.compute)?;
        }
        dec.set_step_graphs(graphs);
        Ok(dec)
    };
    for &batch in batches {
        let prompts = prompts(batch, config.model.vocab as u32);
        let mut eager = decoder(false)?;
        let want = outputs(&mut eager, &prompts)?;
        assert_eq!(eager.step_graphs(), (0, 0), "{name}: graphs while off");
        let mut graphed = decoder(true)?;
        let got = outputs(&mut graphed, &prompts)?;
        let (captured, replayed) = graphed.step_graphs();
        assert_eq!(got.0, want.0, "{name}, batch {batch}: greedy tokens");
        for (k, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
            for (s, (gr, wr)) in g.iter().zip(w).enumerate() {
                let same = gr.iter().zip(wr).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && gr.len() == wr.len(),
                    "{name}, batch {batch}: decode step {k}, sequence {s}: graph logits differ \
                     from eager ones"
                );
            }
        }
        if case.captures {
            assert!(
                captured > 0 && replayed > captured,
                "{name}, batch {batch}: {captured} graphs captured, {replayed} steps replayed"
            );
        } else {
            assert_eq!(
                (captured, replayed),
                (0, 0),
                "{name}, batch {batch}: steps routed on the host were captured"
            );
        }
        println!(
            "{name}, batch {batch}: graphs equal to eager bit for bit ({captured} captured, \
             {replayed} steps replayed)"
        );
    }
    Ok(())
}

fn dense() -> Result<ModelConfig, Box<dyn std::error::Error>> {
    Ok(ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 10000.0,
        "tie_word_embeddings": false}"#,
    )?)
}

fn moe() -> Result<ModelConfig, Box<dyn std::error::Error>> {
    Ok(ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 512,
        "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 16,
        "num_experts_per_tok": 4, "norm_topk_prob": true, "mlp_only_layers": [0],
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )?)
}

const BF16: Case = Case {
    dtype: RolloutDtype::Bf16,
    compute: Fp8Compute::WeightOnly,
    kv: KvDtype::F32,
    device_routing: true,
    captures: true,
};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graphed_decode_steps_equal_eager_ones_dense() -> Res {
    require_gpus(1)?;
    let config = dense()?;
    check("bf16, f32 cache", &config, BF16, &[1, 3, 40])?;
    let bf16_kv = Case {
        kv: KvDtype::Bf16,
        ..BF16
    };
    check("bf16, bf16 cache", &config, bf16_kv, &[3])?;
    let fp8 = Case {
        dtype: RolloutDtype::Fp8,
        ..BF16
    };
    check("fp8 weight-only", &config, fp8, &[1, 3, 12])?;
    let w8a8 = Case {
        compute: Fp8Compute::W8A8,
        kv: KvDtype::Bf16,
        ..fp8
    };
    check("fp8 W8A8", &config, w8a8, &[1, 3, 12, 20, 40])
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graphed_decode_steps_equal_eager_ones_moe() -> Res {
    require_gpus(1)?;
    let config = moe()?;
    check("MoE bf16 routed on the device", &config, BF16, &[1, 6, 40])?;
    let fp8 = Case {
        dtype: RolloutDtype::Fp8,
        ..BF16
    };
    check("MoE fp8 routed on the device", &config, fp8, &[1, 6])?;
    let w8a8 = Case {
        compute: Fp8Compute::W8A8,
        ..fp8
    };
    check("MoE fp8 W8A8 routed on the device", &config, w8a8, &[6, 20])?;
    let host = Case {
        device_routing: false,
        captures: false,
        ..BF16
    };
    check("MoE bf16 routed on the host", &config, host, &[6])
}
