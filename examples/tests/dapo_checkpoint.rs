//! DAPO on a Hugging Face checkpoint: rollouts through the Qwen2 / Llama decoder on the resharded
//! weights, the same dynamic sampling and update step as the toy policy.

use std::path::Path;

use lifecycle_core::{Lifecycle, Switching};
use lifecycle_decoder::{
    load_checkpoint, random_tensors, save_checkpoint, ConfigStyle, ModelConfig,
};
use lifecycle_examples::dapo::{DapoConfig, RewardRule, UpdateOutcome};
use lifecycle_examples::lm_policy::{generate_lm, run_checkpoint, LmJob};
use lifecycle_host::{HostBackend, HostTrainState};

fn small(world: usize, tp: usize) -> DapoConfig {
    DapoConfig {
        steps: 3,
        world,
        tp,
        prompts_per_batch: 2,
        group_size: 6,
        batch_groups: 4,
        max_gen_batches: 32,
        tokens: 8,
        ..DapoConfig::default()
    }
}

#[test]
fn checkpoint_dapo_lazy_one_switch_per_step_eager_one_per_gen_batch() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/decoder/fixtures/gqa_untied");
    let ckpt = load_checkpoint(&dir).unwrap();
    let config = small(2, 2);
    let lazy = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
    let eager = run_checkpoint(&config, &ckpt, Switching::Eager, |_| {}).unwrap();
    assert!(
        lazy.gen_batches() > config.steps,
        "dynamic sampling needed extra gen batches"
    );
    for s in &lazy.steps {
        assert_eq!((s.switches, s.exits), (1, 1), "lazy step {}", s.step);
        assert_eq!(s.kept, config.batch_groups);
    }
    for s in &eager.steps {
        assert_eq!(s.switches as usize, s.gen_batches);
    }
    // no backward pass for checkpoint models: the update says it is synthetic
    assert!(lazy
        .steps
        .iter()
        .all(|s| s.update == UpdateOutcome::Synthetic));
    assert_eq!(
        lazy.groups, eager.groups,
        "both policies must sample from the same weights"
    );
    for g in &lazy.groups {
        assert_eq!(g.samples.len(), config.group_size);
        assert!(g
            .samples
            .iter()
            .all(|s| s.len() == config.tokens && s.iter().all(|&t| t < 96)));
    }
}

#[test]
fn checkpoint_samples_follow_the_weights_on_two_replicas() {
    // a tied Llama with one kv head and an odd vocabulary: replicated embedding/head and kv heads
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 45, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "rope_theta": 10000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("lc-dapo-ckpt-{}", std::process::id()));
    save_checkpoint(&dir, &config, &random_tensors(&config, 3), ConfigStyle::V5).unwrap();
    let ckpt = load_checkpoint(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    for (world, tp) in [(4, 2), (2, 1)] {
        // a hot temperature: this random model is peaked, and groups need mixed rewards
        let config = DapoConfig {
            temperature: 3.0,
            ..small(world, tp)
        };
        let report = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
        eprintln!(
            "W={world} T={tp}: gen batches {} in {:?}",
            report.gen_batches(),
            report.total_time
        );
        assert_eq!(report.steps.len(), 3);
    }
    let layout = config.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(4, ckpt.tensors.clone()).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let job = LmJob {
        prompts: (0..4).collect(),
        group_size: 3,
        tokens: 6,
        temperature: 1.0,
        seed: 5,
        reward: RewardRule::new(4, 2, config.model.vocab),
        model: config.clone(),
        layout,
    };
    let first = generate_lm(&mut lc, &job).unwrap().unwrap();
    assert_eq!(first, generate_lm(&mut lc, &job).unwrap().unwrap());
    assert_eq!(lc.metrics().switches(), 1);
    lc.train()
        .unwrap()
        .state_mut()
        .for_each_shard_mut(|s| s.master.iter_mut().for_each(|w| *w *= -1.5))
        .unwrap();
    let after = generate_lm(&mut lc, &job).unwrap().unwrap();
    assert_ne!(first, after, "new weights must change the samples");
    assert_eq!(lc.metrics().switches(), 2);
}

/// `dapo --checkpoint models/decoder/fixtures/tied_vocab61` at its default options runs to its
/// end: the synthetic update drifts the tiny model's samples towards uniform groups, so some
/// steps run out of gen batches and train on the groups gathered, which the report says.
#[test]
fn the_documented_checkpoint_run_reaches_its_end_at_default_options() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/decoder/fixtures/tied_vocab61");
    let ckpt = load_checkpoint(&dir).unwrap();
    let config = DapoConfig::default();
    let report = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
    assert_eq!(report.steps.len(), config.steps);
    for s in &report.steps {
        assert!(s.kept > 0, "step {} trained on nothing", s.step);
        match s.short_of {
            Some(n) => assert!(n == config.batch_groups && s.kept < n, "step {}", s.step),
            None => assert_eq!(s.kept, config.batch_groups, "step {}", s.step),
        }
    }
    let short = report.steps.iter().filter(|s| s.short_of.is_some()).count();
    assert_eq!(report.short_steps().is_some(), short > 0);
}

#[test]
fn checkpoint_dapo_defaults_fill_their_batches_on_a_qwen2_vocabulary() {
    // Qwen2's 151 936-token vocabulary on a tiny random model: the default reward rule must fill
    // the batch, as it does on the toy policy's 64 tokens
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rope_theta": 10000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("lc-dapo-qwen-vocab-{}", std::process::id()));
    save_checkpoint(&dir, &config, &random_tensors(&config, 7), ConfigStyle::V5).unwrap();
    let ckpt = load_checkpoint(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    // the default reward rule, tokens and group size; fewer groups keep the test quick
    let dapo = DapoConfig {
        steps: 1,
        prompts_per_batch: 2,
        batch_groups: 2,
        ..DapoConfig::default()
    };
    let report = run_checkpoint(&dapo, &ckpt, Switching::Lazy, |_| {}).unwrap();
    for s in &report.steps {
        assert_eq!(s.kept, dapo.batch_groups, "step {}", s.step);
        assert!(
            s.mean_reward > 0.0 && s.mean_reward < 1.0,
            "{}",
            s.mean_reward
        );
    }
    assert!(report
        .groups
        .iter()
        .flat_map(|g| g.samples.iter().flatten())
        .any(|&t| t >= 1000));
}

#[test]
fn dapo_on_a_qwen3_moe_checkpoint_with_both_expert_placements() {
    use lifecycle_layout::ExpertPlacement;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/decoder/fixtures/moe/moe_e4_untied_v61");
    let ckpt = load_checkpoint(&dir).unwrap();
    assert!(ckpt.config.model.moe.is_some());
    let mut groups = Vec::new();
    for experts in [
        ExpertPlacement::TensorParallel,
        ExpertPlacement::Partitioned,
    ] {
        let config = DapoConfig {
            experts,
            ..small(2, 2)
        };
        let lazy = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
        let eager = run_checkpoint(&config, &ckpt, Switching::Eager, |_| {}).unwrap();
        for s in &lazy.steps {
            assert_eq!(
                (s.switches, s.exits),
                (1, 1),
                "{experts:?} lazy step {}",
                s.step
            );
        }
        assert_eq!(lazy.groups, eager.groups, "{experts:?}");
        assert!(lazy
            .groups
            .iter()
            .flat_map(|g| &g.samples)
            .all(|s| s.len() == config.tokens && s.iter().all(|&t| t < 61)));
        groups.push(lazy.groups);
    }
    // the placement changes where the experts live, not what the policy samples: only f32
    // summation order differs, far below what would move a sample here, and the log-probabilities
    // of the tokens agree to that order
    let tokens = |gs: &[lifecycle_examples::dapo::Group]| -> Vec<(Vec<Vec<usize>>, Vec<f32>)> {
        gs.iter()
            .map(|g| (g.samples.clone(), g.rewards.clone()))
            .collect()
    };
    assert_eq!(tokens(&groups[0]), tokens(&groups[1]));
    let logprobs = |gs: &[lifecycle_examples::dapo::Group]| -> Vec<f32> {
        gs.iter().flat_map(|g| g.logprobs.concat()).collect()
    };
    let (a, b) = (logprobs(&groups[0]), logprobs(&groups[1]));
    assert_eq!(a.len(), b.len());
    assert!(!a.is_empty(), "the rollout reports its log-probabilities");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{x} vs {y}");
    }
}

/// A Qwen3-MoE model whose matrices split into whole 128 x 128 fp8 blocks at T = 2.
fn blocky_moe() -> lifecycle_decoder::Checkpoint {
    let config = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 256,
            "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
            "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let tensors = random_tensors(&config, 5);
    lifecycle_decoder::Checkpoint { config, tensors }
}

#[test]
fn dapo_with_fp8_rollout_weights_on_a_qwen3_moe_model() {
    use lifecycle_layout::fp8::RolloutDtype;
    use lifecycle_layout::ExpertPlacement;
    let ckpt = blocky_moe();
    let run = |tp, experts, rollout_dtype, switching| {
        let config = DapoConfig {
            experts,
            rollout_dtype,
            steps: 1,
            batch_groups: 2,
            tokens: 4,
            reward_quota: 2,
            ..small(2, tp)
        };
        run_checkpoint(&config, &ckpt, switching, |_| {}).unwrap()
    };
    let moved = |r: &lifecycle_examples::dapo::RunReport| -> u64 {
        r.steps
            .iter()
            .map(|s| s.bytes.device_to_device + s.bytes.local)
            .sum()
    };
    for (tp, experts) in [
        (1, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::TensorParallel),
        (2, ExpertPlacement::Partitioned),
    ] {
        let lazy = run(tp, experts, RolloutDtype::Fp8, Switching::Lazy);
        let eager = run(tp, experts, RolloutDtype::Fp8, Switching::Eager);
        assert_eq!(lazy.groups, eager.groups, "T = {tp} {experts:?}");
        assert!(lazy.steps.iter().all(|s| s.switches == 1));
        let bf16 = run(tp, experts, RolloutDtype::Bf16, Switching::Lazy);
        // the matrices travel at one byte per element (plus a scale per block), the norms,
        // embeddings, head and routers in bf16
        let (f, b) = (moved(&lazy), moved(&bf16));
        assert!(
            f * 10 < b * 7 && f * 2 > b,
            "T = {tp} {experts:?}: fp8 moved {f} bytes, bf16 {b}"
        );
    }
}

/// W8A8 rollouts (`--fp8-compute w8a8`) on the same fp8 weights: the run completes, lazy and
/// eager sample the same groups, and the samples differ from the weight-only run's (the
/// activations' quantisation reaches the tokens), at T = 1 and 2.
#[test]
fn dapo_with_w8a8_rollouts_on_a_qwen3_moe_model() {
    use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};
    let ckpt = blocky_moe();
    let run = |tp, fp8_compute, switching| {
        let config = DapoConfig {
            rollout_dtype: RolloutDtype::Fp8,
            fp8_compute,
            steps: 1,
            batch_groups: 2,
            tokens: 4,
            reward_quota: 2,
            ..small(2, tp)
        };
        run_checkpoint(&config, &ckpt, switching, |_| {}).unwrap()
    };
    for tp in [1, 2] {
        let lazy = run(tp, Fp8Compute::W8A8, Switching::Lazy);
        let eager = run(tp, Fp8Compute::W8A8, Switching::Eager);
        assert_eq!(lazy.groups, eager.groups, "T = {tp}");
        let weight_only = run(tp, Fp8Compute::WeightOnly, Switching::Lazy);
        assert_ne!(
            lazy.groups, weight_only.groups,
            "T = {tp}: W8A8 sampled as weight-only"
        );
    }
}

/// `--sampling stream`: each step's groups come from one streamed rollout call (groups
/// submitted as the decoder's KV slots free up, scored as they finish), every kept group has
/// mixed rewards, the tail is aborted or carried as partial rollouts into the next step, and
/// lazy and eager sample the same.
#[test]
fn streamed_dynamic_sampling_fills_each_step_in_one_rollout_call() {
    use lifecycle_decoder::Leftovers;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/decoder/fixtures/gqa_untied");
    let ckpt = load_checkpoint(&dir).unwrap();
    for leftovers in [Leftovers::Abort, Leftovers::Partial { max_staleness: 1 }] {
        let config = DapoConfig {
            stream: Some(leftovers),
            ..small(2, 2)
        };
        let lazy = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
        let eager = run_checkpoint(&config, &ckpt, Switching::Eager, |_| {}).unwrap();
        let mut carried = 0;
        for s in &lazy.steps {
            assert_eq!(
                (s.gen_batches, s.switches, s.exits),
                (1, 1, 1),
                "step {}",
                s.step
            );
            assert_eq!(s.kept, config.batch_groups);
            assert!(s.groups >= s.kept);
            let f = s
                .streamed
                .as_ref()
                .expect("a streamed step reports its fill");
            assert_eq!(f.kept.len(), config.batch_groups);
            match leftovers {
                Leftovers::Abort => assert_eq!(f.carried, 0),
                Leftovers::Partial { .. } => assert_eq!(f.aborted, 0),
            }
            carried += f.carried;
        }
        if matches!(leftovers, Leftovers::Partial { .. }) {
            assert!(carried > 0, "no request was in flight at the end of a step");
        }
        assert!(lazy.groups.iter().all(|g| !g.uniform()));
        assert_eq!(lazy.groups, eager.groups, "{leftovers:?}");
    }
}

#[test]
fn lora_dapo_refreshes_move_the_adapters_alone_and_the_adapters_steer_the_samples() {
    use lifecycle_examples::lm_policy::{initial_adapters, lora_config};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/decoder/fixtures/gqa_untied");
    let ckpt = load_checkpoint(&dir).unwrap();
    let config = DapoConfig {
        lora: 4,
        ..small(1, 1)
    };
    let lazy = run_checkpoint(&config, &ckpt, Switching::Lazy, |_| {}).unwrap();
    let eager = run_checkpoint(&config, &ckpt, Switching::Eager, |_| {}).unwrap();
    assert_eq!(
        lazy.groups, eager.groups,
        "both policies must sample from the same weights"
    );
    // the first step casts the whole model, each later one the adapters alone (bytes in
    // proportion to elements: one rank, every byte local)
    let lora = lora_config(&config).unwrap();
    let adapters: usize = initial_adapters(&ckpt.config, &lora, config.seed)
        .unwrap()
        .iter()
        .map(|t| t.data.len())
        .sum();
    let base: usize = ckpt.tensors.iter().map(|t| t.data.len()).sum();
    let bytes: Vec<u64> = lazy.steps.iter().map(|s| s.bytes.local).collect();
    assert!(bytes.iter().all(|&b| b > 0), "{bytes:?}");
    for (i, &b) in bytes.iter().enumerate().skip(1) {
        assert_eq!(
            b as u128 * (base + adapters) as u128,
            bytes[0] as u128 * adapters as u128,
            "step {}: {b} bytes against the enter's {} ({adapters} adapter elements of {})",
            i + 1,
            bytes[0],
            base + adapters
        );
    }
    for s in &lazy.steps {
        assert_eq!((s.switches, s.exits), (1, 1), "lazy step {}", s.step);
    }
    // B starts at zero: the first step samples the base model; the updated adapters then move
    // the samples away from the base's under the same seeds
    let plain = run_checkpoint(&small(1, 1), &ckpt, Switching::Lazy, |_| {}).unwrap();
    assert_eq!(
        lazy.steps[0].mean_reward, plain.steps[0].mean_reward,
        "step 1 samples the base model"
    );
    assert_ne!(lazy.groups, plain.groups, "the adapters changed no sample");
    // a mixture-of-experts model: its experts take no adapters, its attention does
    let moe_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/decoder/fixtures/moe/moe_e4_untied_v61");
    let moe = load_checkpoint(&moe_dir).unwrap();
    let e = run_checkpoint(&config, &moe, Switching::Lazy, |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("experts") && e.contains("gate_proj"), "{e}");
    let attention = DapoConfig {
        lora_modules: lifecycle_examples::dapo::LoraModules::Attention,
        ..config
    };
    let lazy = run_checkpoint(&attention, &moe, Switching::Lazy, |_| {}).unwrap();
    let eager = run_checkpoint(&attention, &moe, Switching::Eager, |_| {}).unwrap();
    assert_eq!(lazy.groups, eager.groups, "MoE, attention adapters");
    // LoRA needs a decoder model in the FSDP layout
    let e = lifecycle_examples::dapo::run(&config, Switching::Lazy, |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("--lora") && e.contains("--checkpoint"), "{e}");
}
