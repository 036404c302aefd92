//! DAPO with the Megatron training layout on the host (`--backend host --train megatron`): the
//! CPU Megatron executor's fused rollout read by the CPU decoder, end to end, lazy against eager.

use lifecycle_core::Switching;
use lifecycle_examples::dapo::megatron::run_megatron;
use lifecycle_examples::dapo::{DapoConfig, DapoError, HostTrain, UpdateOutcome};

fn small(tp: usize, pp: usize) -> DapoConfig {
    DapoConfig {
        steps: 2,
        world: 2,
        tp: 2,
        prompts_per_batch: 2,
        group_size: 6,
        batch_groups: 2,
        tokens: 6,
        reward_quota: 2,
        train: HostTrain::Megatron {
            tp,
            pp,
            ep: 1,
            etp: tp,
        },
        ..DapoConfig::default()
    }
}

#[test]
fn megatron_on_the_host_runs_end_to_end_and_lazy_matches_eager() {
    for (tp, pp) in [(1, 2), (2, 1)] {
        let config = small(tp, pp);
        let lazy = run_megatron(&config, None, Switching::Lazy, |_| {}).unwrap();
        let eager = run_megatron(&config, None, Switching::Eager, |_| {}).unwrap();
        assert_eq!(lazy.steps.len(), 2);
        for s in &lazy.steps {
            assert_eq!(s.switches, 1, "TP {tp} PP {pp} step {}", s.step);
            assert!(matches!(s.update, UpdateOutcome::Synthetic));
        }
        for s in &eager.steps {
            assert_eq!(s.switches as usize, s.gen_batches);
        }
        assert_eq!(lazy.groups, eager.groups, "TP {tp} PP {pp}: same samples");
        assert!(eager.metrics.bytes().moved() >= lazy.metrics.bytes().moved());
        // the update changes the weights: the samples of step 2 differ from a run without it
        assert!(lazy
            .groups
            .iter()
            .all(|g| g.samples.iter().all(|s| s.len() == 6)));
    }
}

#[test]
fn megatron_degrees_that_do_not_divide_the_world_are_refused() {
    let config = DapoConfig {
        world: 3,
        tp: 1,
        ..small(2, 1)
    };
    let err = run_megatron(&config, None, Switching::Lazy, |_| {}).unwrap_err();
    assert!(matches!(err, DapoError::Config(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("--train-tp 2 x --pp 1 must divide --world 3"),
        "{err}"
    );
}

/// Qwen3 (q/k head norms) trained in the Megatron layout: the checkpoint's norms reach the
/// fused rollout, lazy and eager sample alike, and fp8 is refused by name (its fused parts are
/// far smaller than a 128-row block).
#[test]
fn megatron_trains_a_qwen3_checkpoint_and_refuses_fp8() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/decoder/fixtures/moe/qwen3_dense");
    let ckpt = lifecycle_decoder::load_checkpoint(&dir).unwrap();
    assert!(ckpt.config.model.qk_norm);
    for (tp, pp) in [(2, 1), (1, 2)] {
        let config = small(tp, pp);
        let lazy = run_megatron(&config, Some(&ckpt), Switching::Lazy, |_| {}).unwrap();
        let eager = run_megatron(&config, Some(&ckpt), Switching::Eager, |_| {}).unwrap();
        assert_eq!(lazy.groups, eager.groups, "TP {tp} PP {pp}");
        assert!(lazy.steps.iter().all(|s| s.switches == 1));
    }
    let fp8 = DapoConfig {
        rollout_dtype: lifecycle_layout::fp8::RolloutDtype::Fp8,
        ..small(2, 1)
    };
    let err = run_megatron(&fp8, Some(&ckpt), Switching::Lazy, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("qkv_proj") && err.contains("128-row"), "{err}");
}

/// An fp8 rollout of the Megatron layout (a model whose fused parts keep whole 128-row blocks):
/// the run completes, lazy and eager sample alike, and the samples are not the bf16 run's (the
/// quantised weights reach the tokens), weight-only and W8A8.
#[test]
fn megatron_dapo_with_fp8_rollout_weights() {
    let config = lifecycle_decoder::ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 256, "hidden_size": 512,
        "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let tensors = lifecycle_decoder::random_tensors(&config, 3);
    let ckpt = lifecycle_decoder::Checkpoint { config, tensors };
    let bf16 = DapoConfig {
        steps: 1,
        tokens: 4,
        ..small(2, 1)
    };
    let bf16 = run_megatron(&bf16, Some(&ckpt), Switching::Lazy, |_| {}).unwrap();
    for compute in [
        lifecycle_layout::fp8::Fp8Compute::WeightOnly,
        lifecycle_layout::fp8::Fp8Compute::W8A8,
    ] {
        let dapo = DapoConfig {
            rollout_dtype: lifecycle_layout::fp8::RolloutDtype::Fp8,
            fp8_compute: compute,
            steps: 1,
            tokens: 4,
            ..small(2, 1)
        };
        let lazy = run_megatron(&dapo, Some(&ckpt), Switching::Lazy, |_| {}).unwrap();
        let eager = run_megatron(&dapo, Some(&ckpt), Switching::Eager, |_| {}).unwrap();
        assert_eq!(lazy.groups, eager.groups, "{compute}");
        assert_ne!(lazy.groups, bf16.groups, "{compute}: fp8 sampled as bf16");
    }
}

/// Qwen3-MoE trained in Megatron-Core's expert layouts (EP × ETP beside TP × PP × DP), rolled
/// out with its experts split by TP or partitioned: lazy equals eager, one switch per step, and
/// a bad expert degree is refused by name before anything moves.
#[test]
fn megatron_trains_a_mixture_of_experts_checkpoint_in_expert_parallel_layouts() {
    use lifecycle_layout::ExpertPlacement;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/decoder/fixtures/moe/moe_e4_untied_v61");
    let ckpt = lifecycle_decoder::load_checkpoint(&dir).unwrap();
    assert!(ckpt.config.model.moe.is_some());
    // (TP, PP, EP, ETP, world, T, placement)
    for (tp, pp, ep, etp, world, t, experts) in [
        (1, 1, 2, 1, 2, 2, ExpertPlacement::Partitioned),
        (2, 1, 1, 2, 2, 1, ExpertPlacement::TensorParallel),
        (1, 2, 2, 1, 4, 2, ExpertPlacement::TensorParallel),
        (2, 1, 4, 1, 4, 4, ExpertPlacement::Partitioned),
    ] {
        let config = DapoConfig {
            world,
            tp: t,
            experts,
            train: HostTrain::Megatron { tp, pp, ep, etp },
            ..small(tp, pp)
        };
        let what = format!("TP {tp} PP {pp} EP {ep} ETP {etp} W {world} T {t} {experts:?}");
        let lazy = run_megatron(&config, Some(&ckpt), Switching::Lazy, |_| {}).unwrap();
        let eager = run_megatron(&config, Some(&ckpt), Switching::Eager, |_| {}).unwrap();
        assert_eq!(lazy.groups, eager.groups, "{what}");
        assert!(lazy.steps.iter().all(|s| s.switches == 1), "{what}");
        assert!(eager.metrics.bytes().moved() >= lazy.metrics.bytes().moved());
    }
    // Qwen2-MoE: the shared expert and its gate through EP 2 and the partitioned rollout
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/decoder/fixtures/moe/qwen2moe_shared_e4");
    let shared = lifecycle_decoder::load_checkpoint(&dir).unwrap();
    assert!(shared.config.model.moe.is_some_and(|m| m.shared_ffn > 0));
    let config = DapoConfig {
        world: 2,
        tp: 2,
        experts: ExpertPlacement::Partitioned,
        train: HostTrain::Megatron {
            tp: 1,
            pp: 1,
            ep: 2,
            etp: 1,
        },
        ..small(1, 1)
    };
    let lazy = run_megatron(&config, Some(&shared), Switching::Lazy, |_| {}).unwrap();
    let eager = run_megatron(&config, Some(&shared), Switching::Eager, |_| {}).unwrap();
    assert_eq!(lazy.groups, eager.groups, "qwen2_moe");
    let bad = DapoConfig {
        world: 2,
        tp: 1,
        train: HostTrain::Megatron {
            tp: 1,
            pp: 1,
            ep: 3,
            etp: 1,
        },
        ..small(1, 1)
    };
    let err = run_megatron(&bad, Some(&ckpt), Switching::Lazy, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("EP") && err.contains("3"), "{err}");
}
