//! The decoder on Megatron-resharded weights: Hugging Face checkpoints (the fixtures) become
//! Megatron training states at TP ∈ {1, 2, 4} × PP ∈ {1, 2} × DP ∈ {1, 2}; the Megatron backend
//! reshards them into the fused rollout layout of degree T ∈ {1, 2, 4} (T | W), with the
//! vocabulary unpadded or padded (to 8 or 64 rows per rank); `CpuDecoder::new_fused` decodes
//! from it.
//!
//! Cases: each fixture model runs all 12 training layouts with one T each, rotating, so the three
//! models together cover all 31 (layout, T) pairs; a Llama model without biases runs all 31.
//! Per case the last replica's TP group is decoded (every other replica is checked to hold the
//! same bits), and compared:
//! - its logits (prefill of every position, then decode steps fed with the Hugging Face greedy
//!   tokens) **bit for bit** with those of `CpuDecoder::new` on the host (FSDP-style) backend's
//!   unfused rollout of the same checkpoint at the same T: both hold the same bf16 weights (fp32
//!   rounded to nearest even) and the fused reader views them as the same q, k, v, gate, up and
//!   vocabulary rows, so the same arithmetic runs in the same order; on the largest layout
//!   (TP 4, PP 2, DP 2) the free-running greedy generation too;
//! - (fixtures) with Hugging Face `transformers` (fixtures/references.json) within the oracle's
//!   tolerance `1e-4 + 1e-4 · max|logit|`, and the greedy tokens the logits imply (and, where
//!   run, the generated ones) equal to transformers'.
//!
//! The fixtures cover GQA with kv heads split (gqa_untied: 2 kv heads, T ≤ 2) and replicated
//! (gqa_untied at T = 4; kv1_headdim16: 1 kv head), tied (tied_vocab61, kv1_headdim16) and
//! untied heads, and a vocabulary not divisible by T (61). Padding rows are shown never to be
//! read by poisoning them with NaN.

use lifecycle_layout::settings::Configure;

use crate::common::{fixtures, floats, moe_references, references, tokens};

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{
    argmax, load_checkpoint, random_tensors, CpuDecoder, DecodeError, Decoder, MegatronConfig,
    MegatronParallel, ModelConfig, PrefillLogits, Sampling,
};
use lifecycle_host::megatron::MegatronHostBackend;
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::HostTensor;
use lifecycle_layout::{ExpertPlacement, RolloutLayout, RolloutVocab};
use lifecycle_layout::{HostRollout, RankRollout};

const MODELS: [&str; 3] = ["gqa_untied", "tied_vocab61", "kv1_headdim16"];

/// What one decoder run produced.
#[derive(Debug, PartialEq)]
struct Trace {
    /// Prefill logits (every position) of each prompt, then each decode step's logits per prompt.
    logits: Vec<Vec<f32>>,
    /// Free-running greedy continuation (empty when not asked for).
    greedy: Vec<Vec<u32>>,
}

impl Trace {
    fn bits(&self) -> Vec<Vec<u32>> {
        self.logits
            .iter()
            .map(|l| l.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// The greedy tokens the logits imply when the decode steps were fed `feed`: the argmax of
    /// each prompt's last prefill position, then of each decode step but the last.
    fn argmax_tokens(
        &self,
        prompts: &[Vec<u32>],
        feed: &[Vec<u32>],
        vocab: usize,
    ) -> Vec<Vec<u32>> {
        let n = prompts.len();
        (0..n)
            .map(|i| {
                let last = &self.logits[i][(prompts[i].len() - 1) * vocab..];
                let mut out = vec![argmax(last) as u32];
                for k in 0..feed[i].len() - 1 {
                    out.push(argmax(&self.logits[n + k * n + i]) as u32);
                }
                out
            })
            .collect()
    }
}

/// Prefill (all positions), decode steps fed with `feed[i][k]`, then (when `free_running`)
/// greedy generation of as many tokens.
fn run(
    dec: &mut CpuDecoder<'_>,
    prompts: &[Vec<u32>],
    feed: &[Vec<u32>],
    free_running: bool,
) -> Trace {
    let mut logits = dec.prefill(prompts, PrefillLogits::All).unwrap();
    let steps = feed[0].len();
    for k in 0..steps {
        let next: Vec<u32> = feed.iter().map(|f| f[k]).collect();
        logits.extend(dec.decode_step(&next).unwrap());
    }
    let greedy = if free_running {
        dec.generate(prompts, &Sampling::greedy(steps)).unwrap()
    } else {
        Vec::new()
    };
    Trace { logits, greedy }
}

/// Whether two ranks hold bit-identical rollout tensors.
fn same_bits(a: &RankRollout, b: &RankRollout) -> bool {
    a.tensors.len() == b.tensors.len()
        && a.tensors.iter().zip(&b.tensors).all(|(x, y)| {
            x.name == y.name
                && x.shape == y.shape
                && x.data.len() == y.data.len()
                && x.data
                    .iter()
                    .zip(&y.data)
                    .all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// The decoder on the host backend's unfused rollout of `tensors` at degree `t`.
fn unfused_trace(
    config: &ModelConfig,
    tensors: &[HostTensor],
    t: usize,
    prompts: &[Vec<u32>],
    feed: &[Vec<u32>],
) -> Trace {
    unfused_trace_with(
        config,
        tensors,
        t,
        ExpertPlacement::TensorParallel,
        prompts,
        feed,
    )
}

/// [`unfused_trace`] with the experts placed by `experts`.
fn unfused_trace_with(
    config: &ModelConfig,
    tensors: &[HostTensor],
    t: usize,
    experts: ExpertPlacement,
    prompts: &[Vec<u32>],
    feed: &[Vec<u32>],
) -> Trace {
    let layout = config.rollout_layout_with(t, experts).unwrap();
    let state = HostTrainState::from_tensors(t, tensors.to_vec()).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<&RankRollout> = weights.ranks.iter().collect();
    let mut dec = CpuDecoder::new(config, &layout, &group).unwrap();
    run(&mut dec, prompts, feed, true)
}

/// The Megatron backend's fused rollout of degree `rollout.tp` from a training state of
/// `parallel` built from `tensors`.
fn megatron_rollout(
    config: &ModelConfig,
    tensors: &[HostTensor],
    parallel: MegatronParallel,
    rollout: RolloutLayout,
) -> HostRollout {
    let state = config.megatron_state(tensors.to_vec(), parallel).unwrap();
    let mut lc = Lifecycle::new(MegatronHostBackend::new(rollout), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights().get().clone();
    session.finish().unwrap();
    weights
}

/// Largest |a − b| after checking it is within the oracle's tolerance.
fn oracle_error(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tol = 1e-4 + 1e-4 * scale;
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= tol, "{what}: max |error| {err} > tolerance {tol}");
    err
}

/// Every training layout of the matrix with rollout degrees T dividing its world: all of them
/// (`rotation` `None`), or one per layout (`Some(m)`: the `(j + m)`-th valid T of layout `j`, so
/// three rotations cover every (layout, T) pair). Each case gets a vocabulary sizing in turn:
/// unpadded (when T divides the vocabulary), padded to a multiple of 64 or of 8 per rank.
/// `make_vocab_size_divisible_by` alternates between Megatron's 128 and 8 so the training-side
/// padding varies too.
fn matrix(vocab: usize, rotation: Option<usize>) -> Vec<(MegatronParallel, RolloutLayout)> {
    let mut out = Vec::new();
    let mut case = 0usize;
    let mut j = 0usize;
    for tp in [1, 2, 4] {
        for pp in [1, 2] {
            for dp in [1, 2] {
                let parallel = MegatronParallel {
                    make_vocab_size_divisible_by: if j.is_multiple_of(2) { 128 } else { 8 },
                    ..MegatronParallel::new(tp, pp, dp)
                };
                let valid: Vec<usize> = [1, 2, 4]
                    .into_iter()
                    .filter(|t| parallel.world().is_multiple_of(*t))
                    .collect();
                let ts = match rotation {
                    None => valid,
                    Some(m) => vec![valid[(j + m) % valid.len()]],
                };
                for t in ts {
                    let sizing = match case % 3 {
                        0 if vocab.is_multiple_of(t) => RolloutVocab::Unpadded,
                        1 => RolloutVocab::PadToMultipleOf(64),
                        _ => RolloutVocab::PadToMultipleOf(8),
                    };
                    out.push((parallel, RolloutLayout::fused(t, sizing)));
                    case += 1;
                }
                j += 1;
            }
        }
    }
    out
}

#[test]
fn the_matrix_covers_every_layout_and_degree() {
    let all = matrix(61, None);
    assert_eq!(all.len(), 31);
    let mut rotated: Vec<_> = (0..3).flat_map(|m| matrix(61, Some(m))).collect();
    assert_eq!(rotated.len(), 36);
    let key = |(p, r): &(MegatronParallel, RolloutLayout)| (p.tp, p.pp, p.dp, r.tp());
    rotated.sort_by_key(key);
    rotated.dedup_by_key(|c| key(c));
    assert_eq!(rotated.len(), 31);
    for pad in [
        RolloutVocab::PadToMultipleOf(8),
        RolloutVocab::PadToMultipleOf(64),
    ] {
        assert!(all.iter().any(|(_, r)| r.vocab() == pad && r.tp() > 1));
    }
    assert!(matrix(96, None)
        .iter()
        .any(|(_, r)| r.vocab() == RolloutVocab::Unpadded && r.tp() == 4));
}

/// Decodes the last replica of every case of `matrix(vocab, rotation)` (and checks every other
/// replica holds the same bits) against the unfused trace of its T; the free-running greedy
/// generation runs on the largest training layout (TP 4, PP 2, DP 2). `also` sees each trace.
/// Returns how many cases were decoded.
fn check_matrix(
    name: &str,
    rotation: Option<usize>,
    config: &ModelConfig,
    tensors: &[HostTensor],
    prompts: &[Vec<u32>],
    feed: &[Vec<u32>],
    mut also: impl FnMut(&str, &Trace),
) -> usize {
    let unfused: Vec<Trace> = [1, 2, 4]
        .iter()
        .map(|&t| unfused_trace(config, tensors, t, prompts, feed))
        .collect();
    let mut checked = 0;
    for (parallel, rollout) in matrix(config.model.vocab, rotation) {
        let t = rollout.tp();
        let want = &unfused[t.trailing_zeros() as usize];
        let weights = megatron_rollout(config, tensors, parallel, rollout.clone());
        let what = format!(
            "{name} TP={} PP={} DP={} T={t} {:?}",
            parallel.tp,
            parallel.pp,
            parallel.dp,
            rollout.vocab()
        );
        let last = parallel.world() / t - 1;
        for (rank, r) in weights.ranks.iter().enumerate() {
            assert!(
                same_bits(r, &weights.ranks[last * t + rank % t]),
                "{what}: rank {rank} differs from its TP peer in replica {last}"
            );
        }
        let group: Vec<&RankRollout> = weights.ranks[last * t..].iter().collect();
        let mut dec = CpuDecoder::new_fused(config, &rollout, &group).unwrap();
        let free_running = parallel.world() == 16;
        let got = run(&mut dec, prompts, feed, free_running);
        assert!(
            got.bits() == want.bits(),
            "{what}: logits differ from the unfused decoder's"
        );
        if free_running {
            assert_eq!(got.greedy, want.greedy, "{what}: greedy tokens");
        }
        also(&what, &got);
        checked += 1;
    }
    checked
}

/// A fixture model's prompts, greedy tokens and logits.
type Oracle = (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<Vec<f32>>);

/// A fixture model's prompts, greedy tokens and logits (prefill of every position, then each
/// decode step fed the greedy tokens: the order `run` produces them).
fn oracle(model: &serde_json::Value) -> Oracle {
    let cases = model["cases"].as_array().unwrap();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
    let greedy: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["greedy_tokens"])).collect();
    let mut want: Vec<Vec<f32>> = cases.iter().map(|c| floats(&c["prefill_logits"])).collect();
    for k in 0..greedy[0].len() {
        want.extend(cases.iter().map(|c| floats(&c["decode_logits"][k])));
    }
    (prompts, greedy, want)
}

#[test]
fn fused_megatron_rollout_decodes_like_the_unfused_one_and_like_transformers() {
    let refs = references();
    let mut worst = 0.0f32;
    let mut checked = 0;
    for (m, name) in MODELS.into_iter().enumerate() {
        let model = &refs["models"][name];
        let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
        let (prompts, greedy, want) = oracle(model);
        let vocab = ckpt.config.model.vocab;
        checked += check_matrix(
            name,
            Some(m),
            &ckpt.config,
            &ckpt.tensors,
            &prompts,
            &greedy,
            |what, got| {
                let tokens = got.argmax_tokens(&prompts, &greedy, vocab);
                assert_eq!(tokens, greedy, "{what}: greedy tokens vs transformers");
                if !got.greedy.is_empty() {
                    assert_eq!(
                        got.greedy, greedy,
                        "{what}: generated tokens vs transformers"
                    );
                }
                for (i, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                    let e = oracle_error(&format!("{what} logits row {i}"), g, w);
                    worst = worst.max(e);
                }
            },
        );
    }
    // 12 training layouts per model, one T each; together every (layout, T) pair
    assert_eq!(checked, 3 * 12);
    println!("{checked} Megatron-resharded decodes; max |logit error| vs transformers {worst:e}");
}

/// Qwen3 dense (q/k head norms) through every Megatron layout of one rotation, against the
/// unfused decoder bit for bit and against transformers 5.17 (`fixtures/moe/qwen3_dense`).
#[test]
fn qwen3_with_head_norms_decodes_through_the_megatron_layouts() {
    let refs = moe_references();
    let model = &refs["models"]["qwen3_dense"];
    let ckpt = load_checkpoint(&fixtures().join("moe/qwen3_dense")).unwrap();
    assert!(ckpt.config.model.qk_norm);
    let (prompts, greedy, want) = oracle(model);
    let vocab = ckpt.config.model.vocab;
    let mut worst = 0.0f32;
    let checked = check_matrix(
        "qwen3_dense",
        Some(1),
        &ckpt.config,
        &ckpt.tensors,
        &prompts,
        &greedy,
        |what, got| {
            let tokens = got.argmax_tokens(&prompts, &greedy, vocab);
            assert_eq!(tokens, greedy, "{what}: greedy tokens vs transformers");
            for (i, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                worst = worst.max(oracle_error(&format!("{what} logits row {i}"), g, w));
            }
        },
    );
    assert_eq!(checked, 12);
    println!("qwen3_dense through {checked} Megatron layouts: max |logit error| {worst:e}");
}

/// Training degrees and rollout of one expert case: (TP, PP, DP, EP, ETP, T, placement).
type ExpertCase = (usize, usize, usize, usize, usize, usize, ExpertPlacement);

/// Qwen3-MoE (`fixtures/moe`) trained in Megatron-Core's expert layouts (EP × ETP × TP × PP ×
/// DP) and resharded into the fused rollout with its experts split by TP or partitioned, at
/// T ∈ {1, 2, 4}: bit for bit the unfused decoder on the same placement, and within the oracle's
/// tolerance of transformers 5.17 with the same greedy tokens.
#[test]
fn qwen3_moe_decodes_through_the_megatron_expert_layouts() {
    use ExpertPlacement::{Partitioned as Ep, TensorParallel as Tp};
    let refs = moe_references();
    let mut worst = 0.0f32;
    let mut checked = 0;
    let grid: [(&str, &[ExpertCase]); 3] = [
        (
            // 4 experts of 24, 2 kv heads, 2 MoE layers, untied, vocab 61
            "moe_e4_untied_v61",
            &[
                (1, 1, 1, 1, 1, 1, Tp),
                (2, 1, 1, 2, 1, 2, Ep),
                (2, 1, 2, 4, 1, 2, Tp),
                (1, 2, 2, 2, 1, 2, Ep),
                (2, 2, 1, 1, 2, 1, Tp),
                (4, 1, 1, 2, 2, 4, Ep),
                (2, 1, 2, 2, 2, 4, Tp),
            ],
        ),
        (
            // 6 experts of 16, 1 kv head, layer 0 dense, tied
            "moe_e6_tied_dense0",
            &[
                (1, 1, 2, 2, 1, 2, Ep),
                (2, 1, 1, 1, 2, 2, Tp),
                (1, 3, 2, 2, 1, 2, Tp),
                (2, 1, 3, 3, 1, 2, Tp),
                (1, 1, 4, 2, 2, 4, Tp),
                (2, 1, 3, 6, 1, 2, Ep),
            ],
        ),
        (
            // Qwen2-MoE: 4 experts of 16 and a shared expert of 24 with its sigmoid gate,
            // q/k/v biases
            "qwen2moe_shared_e4",
            &[
                (1, 1, 1, 1, 1, 1, Tp),
                (2, 1, 2, 4, 1, 2, Ep),
                (2, 2, 1, 1, 2, 2, Tp),
                (1, 1, 4, 2, 2, 4, Tp),
            ],
        ),
    ];
    for (name, cases) in grid {
        let model = &refs["models"][name];
        let ckpt = load_checkpoint(&fixtures().join("moe").join(name)).unwrap();
        let config = &ckpt.config;
        assert!(config.model.moe.is_some(), "{name}");
        let (prompts, greedy, want) = oracle(model);
        for (i, &(tp, pp, dp, ep, etp, t, placement)) in cases.iter().enumerate() {
            let parallel = MegatronParallel {
                make_vocab_size_divisible_by: if i % 2 == 0 { 128 } else { 8 },
                ..MegatronParallel::new(tp, pp, dp).with_experts(ep, etp)
            };
            let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(8))
                .with_expert_placement(placement);
            let what = format!(
                "{name} TP={tp} PP={pp} DP={dp} EP={ep} ETP={etp} T={t} experts {}",
                placement.name()
            );
            let weights = megatron_rollout(config, &ckpt.tensors, parallel, rollout.clone());
            let last = parallel.world() / t - 1;
            let group: Vec<&RankRollout> = weights.ranks[last * t..].iter().collect();
            let mut dec = CpuDecoder::new_fused(config, &rollout, &group).unwrap();
            let got = run(&mut dec, &prompts, &greedy, false);
            let unfused =
                unfused_trace_with(config, &ckpt.tensors, t, placement, &prompts, &greedy);
            assert!(
                got.bits() == unfused.bits(),
                "{what}: logits differ from the unfused decoder's"
            );
            let tokens = got.argmax_tokens(&prompts, &greedy, config.model.vocab);
            assert_eq!(tokens, greedy, "{what}: greedy tokens vs transformers");
            for (row, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                worst = worst.max(oracle_error(&format!("{what} logits row {row}"), g, w));
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 17);
    println!("Qwen3-MoE through {checked} Megatron expert layouts: max |logit error| {worst:e}");
}

#[test]
fn llama_without_biases_decodes_like_the_unfused_one() {
    // 8 heads in 4 groups: k/v split at T = 2 and 4; untied; vocabulary 30 (not divisible by 4)
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 30, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "rope_theta": 10000.0}"#,
    )
    .unwrap();
    assert!(!config.model.qkv_bias && !config.model.tied_embeddings);
    let tensors = random_tensors(&config, 11);
    let prompts = vec![vec![1, 2, 3, 4], vec![5], vec![29, 0]];
    let feed = vec![vec![3, 4, 5], vec![6, 7, 8], vec![9, 10, 11]];
    let checked = check_matrix("llama", None, &config, &tensors, &prompts, &feed, |_, _| {});
    assert_eq!(checked, 31);
}

#[test]
fn padding_rows_of_the_fused_vocabulary_are_never_read() {
    for (name, t) in [("tied_vocab61", 2), ("gqa_untied", 4)] {
        let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
        let (config, tensors) = (&ckpt.config, &ckpt.tensors);
        // 61 → 128 rows (64 per rank); 96 → 256 rows (64 per rank, ranks 2 and 3 all padding)
        let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(64));
        let parallel = MegatronParallel::new(2, 1, 2);
        let clean = megatron_rollout(config, tensors, parallel, rollout.clone());
        let mut poisoned = clean.clone();
        let h = config.model.hidden;
        let mut padding = 0;
        for (rank, r) in poisoned.ranks.iter_mut().enumerate() {
            let tp_rank = rank % t;
            for tensor in &mut r.tensors {
                if tensor.name == "model.embed_tokens.weight" || tensor.name == "lm_head.weight" {
                    let rows = tensor.shape[0];
                    let first_pad = config.model.vocab.saturating_sub(tp_rank * rows).min(rows);
                    for v in &mut tensor.data[first_pad * h..] {
                        *v = half::bf16::NAN;
                        padding += 1;
                    }
                }
            }
        }
        assert!(padding > 0, "{name}: no padding rows to poison");
        let prompts = vec![vec![1, 2, 3], vec![config.model.vocab as u32 - 1]];
        let feed = vec![vec![0, 5], vec![7, config.model.vocab as u32 - 1]];
        let trace = |w: &HostRollout| {
            let group: Vec<&RankRollout> = w.ranks[..t].iter().collect();
            let mut dec = CpuDecoder::new_fused(config, &rollout, &group).unwrap();
            run(&mut dec, &prompts, &feed, true)
        };
        let (a, b) = (trace(&clean), trace(&poisoned));
        assert!(b.logits.iter().flatten().all(|x| x.is_finite()), "{name}");
        assert!(
            a.bits() == b.bits(),
            "{name}: padding rows changed the logits"
        );
        assert_eq!(a.greedy, b.greedy, "{name}");
    }
}

#[test]
fn fused_weights_the_decoder_cannot_read_are_clear_errors() {
    let ckpt = load_checkpoint(&fixtures().join("gqa_untied")).unwrap();
    let (config, tensors) = (&ckpt.config, &ckpt.tensors);
    let layout = RolloutLayout::fused(2, RolloutVocab::Unpadded);
    let weights = megatron_rollout(
        config,
        tensors,
        MegatronParallel::new(2, 1, 1),
        layout.clone(),
    );
    let group: Vec<&RankRollout> = weights.ranks.iter().collect();
    let err_of = |c: &ModelConfig, l: &RolloutLayout, g: &[&RankRollout]| {
        CpuDecoder::new_fused(c, l, g).unwrap_err()
    };
    // a group of the wrong size
    assert_eq!(
        err_of(config, &layout, &group[..1]),
        DecodeError::GroupSize { tp: 2, found: 1 }
    );
    // weights of another degree: T = 4 slices read as T = 2
    let wide = RolloutLayout::fused(4, RolloutVocab::Unpadded);
    let four = megatron_rollout(config, tensors, MegatronParallel::new(2, 1, 2), wide);
    let four_group: Vec<&RankRollout> = four.ranks[..2].iter().collect();
    let err = err_of(config, &layout, &four_group).to_string();
    assert_eq!(
        err,
        "rollout tensor `model.embed_tokens.weight` on TP rank 0 has shape [24, 32]; config and layout imply [48, 32]"
    );
    // weights of another model (intermediate size 32 instead of 64)
    let mut other = config.clone();
    other.model.ffn = 32;
    let err = err_of(&other, &layout, &group).to_string();
    assert!(
        err.contains("`model.layers.0.mlp.gate_up_proj.weight` on TP rank 0 has shape [64, 32]"),
        "{err}"
    );
    // a vocabulary T does not divide, unpadded
    let tied = load_checkpoint(&fixtures().join("tied_vocab61")).unwrap();
    let err = err_of(&tied.config, &layout, &group).to_string();
    assert!(
        err.contains("vocab size 61 of `model.embed_tokens.weight` is not divisible")
            && err.contains("RolloutVocab::PadToMultipleOf"),
        "{err}"
    );
    // the unfused (host backend) layout handed to the fused reader
    let unfused_layout = config.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(2, tensors.clone()).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(unfused_layout), state);
    let session = lc.rollout().unwrap();
    let unfused = session.weights();
    let unfused_group: Vec<&RankRollout> = unfused.ranks.iter().collect();
    assert_eq!(
        err_of(config, &layout, &unfused_group),
        DecodeError::MissingTensor {
            name: "model.layers.0.self_attn.qkv_proj.weight".into(),
            rank: 0
        }
    );
    // a T the model cannot be split at
    let three: Vec<&RankRollout> = four.ranks[..3].iter().collect();
    let err = err_of(
        config,
        &RolloutLayout::fused(3, RolloutVocab::Unpadded),
        &three,
    )
    .to_string();
    assert!(
        err.contains(
            "attention heads = 4 is not divisible by the rollout T tensor-parallel degree 3"
        ),
        "{err}"
    );
}

/// The fp8 rollouts of `tensors` (bf16-exact) at degree `t` with the experts placed by
/// `placement`: the FSDP-style backend's unfused one and the Megatron backend's fused one, each
/// decoded (prefill, then two decode steps) weight-only and W8A8; the fused logits must equal the
/// unfused ones bit for bit. Returns the fused rollout for further checks.
fn fp8_fused_decodes_like_unfused(
    config: &ModelConfig,
    tensors: &[HostTensor],
    t: usize,
    placement: ExpertPlacement,
) -> HostRollout {
    use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};
    let prompts: Vec<Vec<u32>> = vec![vec![3, 17, 101, 7], vec![250, 1, 9]];
    let feed: Vec<Vec<u32>> = vec![vec![5, 6], vec![40, 41]];
    let layout = config.rollout_layout_with(t, placement).unwrap();
    let state = HostTrainState::from_tensors(t, tensors.to_vec()).unwrap();
    let backend = HostBackend::new(layout.clone()).with_rollout_dtype(RolloutDtype::Fp8);
    let unfused = Lifecycle::new(backend, state)
        .rollout()
        .unwrap()
        .weights()
        .get()
        .clone();
    let state = config
        .megatron_state(tensors.to_vec(), MegatronParallel::new(t, 1, 1))
        .unwrap();
    let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded).with_expert_placement(placement);
    let backend = MegatronHostBackend::new(rollout.clone()).with_rollout_dtype(RolloutDtype::Fp8);
    let fused = Lifecycle::new(backend, state)
        .rollout()
        .unwrap()
        .weights()
        .get()
        .clone();
    let a: Vec<&RankRollout> = unfused.ranks.iter().collect();
    let b: Vec<&RankRollout> = fused.ranks.iter().collect();
    for compute in [Fp8Compute::WeightOnly, Fp8Compute::W8A8] {
        let mut dec = CpuDecoder::new(config, &layout, &a)
            .unwrap()
            .with_fp8_compute(compute);
        let want = run(&mut dec, &prompts, &feed, false);
        let mut dec = CpuDecoder::new_fused(config, &rollout, &b)
            .unwrap()
            .with_fp8_compute(compute);
        let got = run(&mut dec, &prompts, &feed, false);
        assert_eq!(
            got.bits(),
            want.bits(),
            "T = {t} {placement:?} {compute}: fused fp8 logits"
        );
    }
    fused
}

/// fp8 rollouts: the Megatron backend's fused one (each fused matrix quantised in its own block
/// grid) decodes bit for bit like the FSDP-style backend's unfused one of the same bf16-exact
/// weights, weight-only and W8A8, at T ∈ {1, 2}: the fused reader views the same e4m3 rows and
/// block scales as q, k, v, gate and up.
#[test]
fn fused_fp8_rollout_decodes_like_the_unfused_fp8_one() {
    // head_dim 128, 2 kv heads, ffn 512: every fused part keeps whole 128-row blocks at T ≤ 2
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 256, "hidden_size": 512,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let tensors: Vec<HostTensor> = random_tensors(&config, 9)
        .into_iter()
        .map(HostTensor::bf16_rounded)
        .collect();
    for t in [1usize, 2] {
        let fused =
            fp8_fused_decodes_like_unfused(&config, &tensors, t, ExpertPlacement::TensorParallel);
        assert!(
            fused.ranks[0].tensors.iter().any(|x| x.fp8.is_some()),
            "T = {t}: no fp8 tensor in the fused rollout"
        );
    }
}

/// fp8 Qwen3-MoE rollouts: the Megatron backend's stacked experts quantised in their
/// `(experts · rows) × cols` views (each expert in blocks of its own) decode bit for bit like the
/// FSDP-style backend's per-expert fp8 tensors of the same bf16-exact weights, experts split by
/// TP or partitioned, weight-only and W8A8.
#[test]
fn fused_fp8_experts_decode_like_the_unfused_fp8_ones() {
    // head_dim 128, 2 heads in 2 groups, experts of 256: every part keeps whole blocks at T ≤ 2
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": true, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let tensors: Vec<HostTensor> = random_tensors(&config, 4)
        .into_iter()
        .map(HostTensor::bf16_rounded)
        .collect();
    for (t, placement) in [
        (1, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::Partitioned),
    ] {
        let fused = fp8_fused_decodes_like_unfused(&config, &tensors, t, placement);
        let stacked = fused.ranks[0]
            .tensors
            .iter()
            .filter(|x| x.name.contains("experts") && x.fp8.is_some())
            .count();
        assert_eq!(
            stacked, 4,
            "T = {t} {placement:?}: w13 and w2 of 2 layers in fp8"
        );
    }
}
