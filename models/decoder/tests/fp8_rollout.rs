//! The CPU decoder on fp8 rollout weights (block-scaled e4m3 made by the host backend's switch
//! from the fp32 masters).
//!
//! - **Exact plumbing.** On weights that bf16 and e4m3 both hold exactly (every block's scale a
//!   power of two, every value an e4m3 value times it), the fp8 decoder is bit-identical to the
//!   bf16 one, at T = 1 and T = 2 with both expert placements: blocks, scales, slices and
//!   sub-row views are read right.
//! - **Independent of T.** The quantisation blocks are the full tensor's whatever the
//!   tensor-parallel degree, so the fp8 weights dequantise to the same values at T = 1 and 2 and
//!   the decoders agree to the bf16 tolerance of `oracle.rs` (summation order only).
//! - **What fp8 costs.** e4m3 keeps three mantissa bits: a weight moves by up to 1/16 of itself
//!   (1/512 in bf16). Against the `transformers` references of the seven decoder fixtures (bf16
//!   weights) the fp8 logits move by up to 8.6e-2 of the largest logit, and on a random 256-wide
//!   Qwen3-MoE by 2.1e-1 against its bf16 rollout (both printed by the tests); the bound
//!   asserted, `0.05 + 0.25 · max|logit|`, leaves room for that and none for a wrong scale.
//!   Greedy agreement with the references is reported, not asserted (near-ties may flip):
//!   104 of 108 tokens up to the first difference.

use lifecycle_layout::settings::Configure;

use crate::common::{fixtures, floats, json, tokens};

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{
    load_checkpoint, random_tensors, CpuDecoder, Decoder, ModelConfig, PrefillLogits, Sampling,
};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::fp8::{e4m3_from_f32, e4m3_to_f32, keeps_bf16, RolloutDtype, FP8_BLOCK};
use lifecycle_layout::{ExpertPlacement, HostTensor, RolloutLayout, TensorData};

/// Max |a − b| over max |b|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    err / scale.max(1e-6)
}

fn assert_fp8_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= 0.05 + 0.25 * scale,
        "{what}: max |error| {err} against logits up to {scale}"
    );
    relative_error(got, want)
}

/// Runs `f` on a decoder over the rollout of `tensors` in `layout`, switched in `dtype`.
fn with_decoder<T>(
    config: &ModelConfig,
    layout: &RolloutLayout,
    tensors: Vec<HostTensor>,
    dtype: RolloutDtype,
    f: impl FnOnce(&mut CpuDecoder<'_>) -> T,
) -> T {
    let state = HostTrainState::from_tensors(layout.tp(), tensors).unwrap();
    let backend = HostBackend::new(layout.clone()).with_rollout_dtype(dtype);
    let mut lc = Lifecycle::new(backend, state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    if dtype == RolloutDtype::Fp8 {
        let quantised = weights.ranks[0]
            .tensors
            .iter()
            .filter(|t| t.fp8.is_some())
            .count();
        assert!(quantised > 0, "the fp8 rollout holds no fp8 tensor");
    }
    let group: Vec<_> = weights.ranks.iter().collect();
    let mut dec = CpuDecoder::new(config, layout, &group).unwrap();
    f(&mut dec)
}

#[test]
fn fp8_logits_stay_near_the_transformers_references_on_every_fixture() {
    let dense = json("references.json");
    let moe = json("moe/moe_references.json");
    let models = [
        ("gqa_untied", fixtures().join("gqa_untied"), &dense),
        ("tied_vocab61", fixtures().join("tied_vocab61"), &dense),
        ("kv1_headdim16", fixtures().join("kv1_headdim16"), &dense),
        ("qwen3_dense", fixtures().join("moe/qwen3_dense"), &moe),
        (
            "moe_e4_untied_v61",
            fixtures().join("moe/moe_e4_untied_v61"),
            &moe,
        ),
        (
            "moe_e6_tied_dense0",
            fixtures().join("moe/moe_e6_tied_dense0"),
            &moe,
        ),
        // the shared expert's matrices in fp8, its gate kept bf16
        (
            "qwen2moe_shared_e4",
            fixtures().join("moe/qwen2moe_shared_e4"),
            &moe,
        ),
    ];
    let (mut worst, mut agree, mut total) = (0.0f32, 0usize, 0usize);
    for (name, dir, refs) in models {
        let ckpt = load_checkpoint(&dir).unwrap();
        let cases = refs["models"][name]["cases"].as_array().unwrap();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        let greedy: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["greedy_tokens"])).collect();
        // every tensor of these tiny models is one partial 128 x 128 block: T = 1
        let layout = ckpt.config.rollout_layout(1).unwrap();
        with_decoder(
            &ckpt.config,
            &layout,
            ckpt.tensors.clone(),
            RolloutDtype::Fp8,
            |dec| {
                let prefill = dec.prefill(&prompts, PrefillLogits::All).unwrap();
                for (i, c) in cases.iter().enumerate() {
                    let what = format!("{name} prompt {i} prefill");
                    let want = floats(&c["prefill_logits"]);
                    worst = worst.max(assert_fp8_close(&what, &prefill[i], &want));
                }
                for k in 0..greedy[0].len() {
                    let feed: Vec<u32> = greedy.iter().map(|g| g[k]).collect();
                    let logits = dec.decode_step(&feed).unwrap();
                    for (i, c) in cases.iter().enumerate() {
                        let what = format!("{name} prompt {i} decode step {k}");
                        let want = floats(&c["decode_logits"][k]);
                        worst = worst.max(assert_fp8_close(&what, &logits[i], &want));
                    }
                }
            },
        );
        let out = with_decoder(
            &ckpt.config,
            &layout,
            ckpt.tensors.clone(),
            RolloutDtype::Fp8,
            |dec| {
                dec.generate(&prompts, &Sampling::greedy(greedy[0].len()))
                    .unwrap()
            },
        );
        for (o, g) in out.iter().zip(&greedy) {
            // tokens up to the first difference (after it the continuations differ anyway)
            agree += o.iter().zip(g).take_while(|(a, b)| a == b).count();
            total += g.len();
        }
    }
    println!(
        "fp8 vs transformers (bf16 weights), 7 fixtures at T = 1: max |logit error| / max|logit| \
         = {worst:.3e}; greedy tokens agreeing up to the first difference: {agree}/{total}"
    );
}

/// A Qwen3-MoE config with shapes that give whole 128 x 128 blocks at T = 2: hidden 256, 4
/// heads of 128 with 2 kv heads, a dense first layer and 4 experts of 256.
fn blocky_moe() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 256,
            "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [0],
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false}"#,
    )
    .unwrap()
}

#[test]
fn fp8_decoding_is_the_same_at_t1_and_t2_and_near_bf16() {
    let config = blocky_moe();
    let tensors = random_tensors(&config, 7);
    let prompts = vec![vec![1, 5, 9, 200, 7], vec![299, 3]];
    let run = |tp: usize, placement: ExpertPlacement, dtype: RolloutDtype| {
        let layout = config.rollout_layout_with(tp, placement).unwrap();
        with_decoder(&config, &layout, tensors.clone(), dtype, |dec| {
            let mut logits = dec.prefill(&prompts, PrefillLogits::Last).unwrap();
            logits.extend(dec.decode_step(&[17, 42]).unwrap());
            logits.concat()
        })
    };
    let bf16 = run(1, ExpertPlacement::TensorParallel, RolloutDtype::Bf16);
    let fp8 = run(1, ExpertPlacement::TensorParallel, RolloutDtype::Fp8);
    let scale = fp8.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for placement in [
        ExpertPlacement::TensorParallel,
        ExpertPlacement::Partitioned,
    ] {
        let t2 = run(2, placement, RolloutDtype::Fp8);
        let err = t2
            .iter()
            .zip(&fp8)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-4 + 1e-4 * scale,
            "fp8 at T = 2 ({}) differs from T = 1 by {err}",
            placement.name()
        );
    }
    let rel = assert_fp8_close("fp8 vs bf16 rollout", &fp8, &bf16);
    assert!(
        rel > 0.0,
        "the fp8 logits equal the bf16 ones: nothing was quantised"
    );
    println!("fp8 vs bf16 rollout weights (random 256-wide Qwen3-MoE): {rel:.3e} of max|logit| = {scale:.3e}");
}

#[test]
fn an_fp8_split_that_cuts_a_block_is_refused_before_anything_moves() {
    let ckpt = load_checkpoint(&fixtures().join("gqa_untied")).unwrap();
    // 128 query rows at T = 2: 16 per rank, inside one 128-row block
    let layout = ckpt.config.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(2, ckpt.tensors.clone()).unwrap();
    let backend = HostBackend::new(layout).with_rollout_dtype(RolloutDtype::Fp8);
    let mut lc = Lifecycle::new(backend, state);
    let err = lc.rollout().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("model.") && err.contains("128"), "{err}");
    // nothing moved: the training state is still there, a bf16 lifecycle over it works
    let state = lc.into_parts().unwrap().1;
    assert_eq!(state.world(), 2);
}

/// `tensors` moved onto values that both bf16 and block-scaled e4m3 hold exactly: in every
/// 128 × 128 block of a quantised matrix the largest magnitude becomes `448 · 2^k` (the
/// smallest such at or above it) and every other value the nearest `e4m3 · 2^k`, so the block's
/// `scale_inv` is exactly `2^k` and every element quantises without error.
fn exactly_representable(tensors: &mut [HostTensor]) {
    for t in tensors.iter_mut() {
        if keeps_bf16(&t.name, &t.shape) {
            continue;
        }
        let cols: usize = t.shape[1..].iter().product();
        let rows = t.shape[0];
        let TensorData::F32(v) = &mut t.data else {
            panic!("{} is not f32", t.name)
        };
        for br in (0..rows).step_by(FP8_BLOCK) {
            for bc in (0..cols).step_by(FP8_BLOCK) {
                let cells: Vec<usize> = (br..(br + FP8_BLOCK).min(rows))
                    .flat_map(|r| (bc..(bc + FP8_BLOCK).min(cols)).map(move |c| r * cols + c))
                    .collect();
                let top = *cells
                    .iter()
                    .max_by(|&&a, &&b| v[a].abs().total_cmp(&v[b].abs()))
                    .unwrap();
                let amax = v[top].abs();
                let scale = (amax.max(1e-30) / 448.0).log2().ceil().exp2();
                for &i in &cells {
                    v[i] = e4m3_to_f32(e4m3_from_f32(v[i] / scale)) * scale;
                }
                v[top] = 448.0 * scale * v[top].signum();
            }
        }
    }
}

#[test]
fn on_weights_both_formats_hold_exactly_fp8_decoding_is_bit_identical_to_bf16() {
    let config = blocky_moe();
    let mut tensors = random_tensors(&config, 11);
    exactly_representable(&mut tensors);
    let prompts = vec![vec![3, 1, 4, 1, 5, 9, 2, 6], vec![299]];
    for (tp, placement) in [
        (1, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::Partitioned),
    ] {
        let layout = config.rollout_layout_with(tp, placement).unwrap();
        let run = |dtype| {
            with_decoder(&config, &layout, tensors.clone(), dtype, |dec| {
                let mut logits = dec.prefill(&prompts, PrefillLogits::All).unwrap();
                logits.extend(dec.decode_step(&[8, 77]).unwrap());
                let tokens = dec.generate(&[vec![10, 20]], &Sampling::greedy(6)).unwrap();
                (logits, tokens)
            })
        };
        let (bf16, fp8) = (run(RolloutDtype::Bf16), run(RolloutDtype::Fp8));
        let bits =
            |l: &[Vec<f32>]| -> Vec<u32> { l.concat().iter().map(|x| x.to_bits()).collect() };
        assert!(
            bits(&bf16.0) == bits(&fp8.0) && bf16.1 == fp8.1,
            "T = {tp}, experts {}: fp8 and bf16 decoding differ on exactly representable weights",
            placement.name()
        );
    }
}

/// W8A8 (activations quantised per token in 1 × 128 groups as well) on the same fp8 rollouts:
/// every prefill logit within the bound of the weight-only test of the transformers references,
/// and the move from the weight-only logits printed (the activations' quantisation is the only
/// difference).
#[test]
fn w8a8_logits_stay_near_the_transformers_references() {
    use lifecycle_layout::fp8::Fp8Compute;
    let dense = json("references.json");
    let moe = json("moe/moe_references.json");
    let models = [
        ("gqa_untied", fixtures().join("gqa_untied"), &dense),
        ("kv1_headdim16", fixtures().join("kv1_headdim16"), &dense),
        ("qwen3_dense", fixtures().join("moe/qwen3_dense"), &moe),
        (
            "moe_e4_untied_v61",
            fixtures().join("moe/moe_e4_untied_v61"),
            &moe,
        ),
    ];
    for (name, dir, refs) in models {
        let ckpt = load_checkpoint(&dir).unwrap();
        let cases = refs["models"][name]["cases"].as_array().unwrap();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        let layout = ckpt.config.rollout_layout(1).unwrap();
        let (worst, moved) = with_decoder(
            &ckpt.config,
            &layout,
            ckpt.tensors.clone(),
            RolloutDtype::Fp8,
            |dec| {
                let weight_only = dec.prefill(&prompts, PrefillLogits::All).unwrap();
                dec.set_fp8_compute(Fp8Compute::W8A8);
                let w8a8 = dec.prefill(&prompts, PrefillLogits::All).unwrap();
                let (mut worst, mut moved) = (0.0f32, 0.0f32);
                for (i, c) in cases.iter().enumerate() {
                    let what = format!("{name} prompt {i} W8A8 prefill");
                    let want = floats(&c["prefill_logits"]);
                    worst = worst.max(assert_fp8_close(&what, &w8a8[i], &want));
                    moved = moved.max(relative_error(&w8a8[i], &weight_only[i]));
                }
                (worst, moved)
            },
        );
        println!(
            "{name}: W8A8 prefill logits within {worst:.2e} of the transformers references \
             (relative to the largest), {moved:.2e} from the weight-only ones"
        );
        assert!(moved > 0.0, "{name}: W8A8 gave the weight-only logits");
    }
}
