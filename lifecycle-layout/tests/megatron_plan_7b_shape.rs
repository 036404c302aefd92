//! Plans for the 7.6B-shaped model of the GPU benchmark (Qwen2.5-7B: hidden 3584, 28 heads in 4
//! groups, ffn 18944, vocab 152064, 28 layers) on 2 ranks: every rollout byte is planned once,
//! and the remote bytes are what the layouts force.

use lifecycle_layout::megatron::{plan_megatron_to_tp, BucketConfig, MegatronLayout};
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{RolloutLayout, RolloutVocab};

#[test]
fn two_rank_plans_of_the_7b_shape() {
    let m = ModelSpec::qwen2_5_7b(28);
    let bf16_params: u64 = m
        .hf_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64 * 2)
        .sum();
    for (tp, pp) in [(2, 1), (1, 2)] {
        for t in [1, 2] {
            let train = MegatronLayout::new(m, tp, pp, 1).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded);
            let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
            let rollout_bytes: u64 = plan.tensors.iter().map(|s| s.numel() as u64 * 2).sum();
            for rp in &plan.ranks {
                // 152064 is a multiple of 128 · TP: no padding rows, every byte planned once.
                assert_eq!(rp.remote_bytes() + rp.local_bytes(), rollout_bytes);
                for k in 0..rp.buckets.len() {
                    assert!(rp.bucket_remote_bytes(k) <= plan.config.bucket_bytes);
                }
            }
            let remote = plan.remote_bytes();
            match (tp, pp, t) {
                (2, 1, 2) => assert_eq!(remote, 0),
                // T = 1: each rank fetches the peer's half of everything but the norms.
                (2, 1, 1) => assert!(remote < bf16_params && remote > bf16_params * 9 / 10),
                // PP = 2, T = 1: each rank fetches the whole other stage: every byte crosses once.
                (1, 2, 1) => assert_eq!(remote, bf16_params),
                // PP = 2, T = 2: each rank fetches its half of the other stage (norms whole).
                _ => assert!(remote > bf16_params / 2 && remote < bf16_params * 51 / 100),
            }
            eprintln!(
                "TP{tp} PP{pp} -> T{t}: remote {:.2} GB, local {:.2} GB, buckets/rank {}",
                remote as f64 / 1e9,
                plan.local_bytes() as f64 / 1e9,
                plan.ranks[0].buckets.len()
            );
        }
    }
}
