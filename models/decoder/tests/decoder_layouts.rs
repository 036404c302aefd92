//! The decoder on random weights: every tensor-parallel degree gives the same logits, bad layouts
//! are clear errors, sampling is reproducible from its seed.

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{
    random_tensors, CpuDecoder, DecodeError, Decoder, ModelConfig, PrefillLogits, Sampling,
};
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

fn config(model_type: &str, vocab: usize, kv: usize) -> ModelConfig {
    ModelConfig::from_json_str(&format!(
        r#"{{"model_type": "{model_type}", "vocab_size": {vocab}, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": {kv}, "rope_theta": 10000.0}}"#
    ))
    .unwrap()
}

/// Prefill (all positions) then three decode steps, at degree `tp` with world `world`, using the
/// TP group of the last replica.
fn run(config: &ModelConfig, tp: usize, world: usize) -> Vec<Vec<f32>> {
    let layout = config.rollout_layout(tp).unwrap();
    let state = HostTrainState::from_tensors(world, random_tensors(config, 5)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks[world - tp..].iter().collect();
    let mut dec = CpuDecoder::new(config, &layout, &group).unwrap();
    let prompts = vec![vec![1, 2, 3, 4], vec![5], vec![7, 7]];
    let mut out = dec.prefill(&prompts, PrefillLogits::All).unwrap();
    for step in 0..3u32 {
        out.extend(dec.decode_step(&[step, step + 1, step + 2]).unwrap());
    }
    assert_eq!(dec.lengths(), vec![7, 4, 5]);
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn every_degree_gives_the_same_logits() {
    // Llama without biases, Qwen2 with; kv heads 4 (column), 2 (column at T=2, replicated at 4),
    // 1 (replicated); vocabularies divisible by 4 and odd.
    for (ty, vocab, kv) in [
        ("llama", 64, 4),
        ("qwen2", 61, 2),
        ("qwen2", 64, 1),
        ("llama", 30, 2),
    ] {
        let c = config(ty, vocab, kv);
        let base = run(&c, 1, 1);
        for (tp, world) in [(2, 2), (4, 4), (2, 4)] {
            let other = run(&c, tp, world);
            let d = max_diff(&base, &other);
            assert!(d < 1e-4, "{ty} vocab {vocab} kv {kv} T={tp} W={world}: {d}");
        }
    }
}

#[test]
fn sampling_is_reproducible_and_greedy_at_temperature_zero() {
    let c = config("qwen2", 64, 2);
    let layout = c.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(2, random_tensors(&c, 9)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    let mut dec = CpuDecoder::new(&c, &layout, &group).unwrap();
    let prompts = vec![vec![3, 1, 4], vec![1, 5]];
    let hot = |seed| Sampling {
        temperature: 1.0,
        max_new_tokens: 12,
        seed,
        stop_token: None,
    };
    let a = dec.generate(&prompts, &hot(1)).unwrap();
    assert_eq!(a, dec.generate(&prompts, &hot(1)).unwrap());
    assert_ne!(a, dec.generate(&prompts, &hot(2)).unwrap());
    // a sequence's samples do not depend on the rest of the batch
    let alone = dec.generate(&prompts[..1], &hot(1)).unwrap();
    assert_eq!(alone[0], a[0]);
    // temperature 0 is the argmax of the logits
    let greedy = dec.generate(&prompts, &Sampling::greedy(1)).unwrap();
    let last = dec.prefill(&prompts, PrefillLogits::Last).unwrap();
    for (g, l) in greedy.iter().zip(&last) {
        assert_eq!(g[0] as usize, lifecycle_decoder::argmax(l));
    }
    // a stop token ends a sequence
    let stop = Sampling {
        stop_token: Some(a[0][2]),
        ..hot(1)
    };
    let out = dec.generate(&prompts, &stop).unwrap();
    assert!(out[0].len() <= 3 && out[0].last() == Some(&a[0][2]));
}

#[test]
fn layouts_the_decoder_cannot_read_are_clear_errors() {
    let c = config("qwen2", 64, 1);
    // kv heads 1 < T = 2 but k/v marked column-parallel: a head would be cut in half
    let specs: Vec<TensorSpec> = c
        .tensor_shapes()
        .into_iter()
        .map(|(n, s)| {
            let p = Parallel::for_hf_name(&n);
            TensorSpec::new(n, s, p)
        })
        .collect();
    let layout = RolloutLayout::new(2, specs).unwrap();
    let state = HostTrainState::from_tensors(2, random_tensors(&c, 1)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    let err = CpuDecoder::new(&c, &layout, &group)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`model.layers.0.self_attn.k_proj.weight` is column-parallel")
            && err.contains("would cut a kv head"),
        "{err}"
    );
    // a group of the wrong size
    let err = CpuDecoder::new(&c, &layout, &group[..1]).unwrap_err();
    assert_eq!(err, DecodeError::GroupSize { tp: 2, found: 1 });
    // degrees the model cannot be split at
    let err = config("qwen2", 64, 2)
        .rollout_layout(3)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("num_attention_heads 4 is not divisible by T"),
        "{err}"
    );
    // tokens outside the vocabulary and decode before prefill
    let good = c.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(2, random_tensors(&c, 1)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(good.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    let mut dec = CpuDecoder::new(&c, &good, &group).unwrap();
    let err = dec
        .prefill(&[vec![1, 64]], PrefillLogits::Last)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "token 64 of sequence 0 is outside the vocabulary of 64"
    );
    let err = dec.decode_step(&[1]).unwrap_err().to_string();
    assert!(err.contains("call prefill first"), "{err}");
    // a layout for another model
    let other = config("qwen2", 32, 1).rollout_layout(2).unwrap();
    let err = CpuDecoder::new(&c, &other, &group).unwrap_err().to_string();
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
}
