//! Property: for random model shapes and degrees, the executor equals the reference and a
//! round trip (enter, exit) leaves the training state bit-identical.

use crate::common;

use lifecycle_core::{MemoryPolicy, Metrics, PhaseRecorder, Reshard, SwitchContext};
use lifecycle_host::megatron::{reference_rollout, MegatronHostBackend, MegatronTrainState};
use lifecycle_layout::megatron::{BucketConfig, MegatronLayout};
use lifecycle_layout::HostTensor;
use lifecycle_layout::ModelSpec;
use lifecycle_layout::{RolloutLayout, RolloutVocab};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    model: ModelSpec,
    tp: usize,
    pp: usize,
    dp: usize,
    t: usize,
    pad: usize,
    budget: u64,
    offload: bool,
    extra_vocab_rows: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (0usize..3, 1usize..4, 1usize..4, 0usize..4, 1usize..3),
        (0usize..4, 1usize..3, 1usize..4, 1usize..6, 1usize..60),
        (
            0usize..3,
            1usize..5,
            1usize..5,
            2u64..300,
            any::<(bool, bool, bool)>(),
        ),
        0usize..3,
    )
        .prop_map(
            |(
                (tp_log, pp, dp, t_pick, heads_k),
                (groups_log, head_dim, hidden, ffn_k, vocab),
                (extra_layers, pad, divisible_by, budget, (bias, tied, offload)),
                extra_vocab_rows,
            )| {
                let tp = 1 << tp_log;
                let world = tp * pp * dp;
                let heads = 8 * heads_k;
                let ts: Vec<usize> = [1, 2, 4, 8]
                    .into_iter()
                    .filter(|t| world % t == 0)
                    .collect();
                let t = ts[t_pick % ts.len()];
                Case {
                    model: ModelSpec {
                        hidden,
                        heads,
                        query_groups: 1 << groups_log,
                        // even head sizes: Megatron-Core needs TP to divide the fused
                        // linear_qkv's rows, and a rank's chunk may end inside a head
                        head_dim: 2 * head_dim,
                        ffn: 8 * ffn_k,
                        vocab,
                        layers: pp + extra_layers,
                        qkv_bias: bias,
                        tied_embeddings: tied,
                        make_vocab_size_divisible_by: divisible_by,
                        qk_norm: false,
                        moe: None,
                    },
                    tp,
                    pp,
                    dp,
                    t,
                    pad,
                    budget,
                    offload,
                    extra_vocab_rows,
                }
            },
        )
}

fn tensors(model: &ModelSpec) -> Vec<HostTensor> {
    common::hf_tensors(model, 42)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn executor_equals_reference(c in case()) {
        // Megatron's padded vocabulary, sometimes with extra rows (a checkpoint's override).
        let padded = MegatronLayout::new(c.model, c.tp, c.pp, c.dp).unwrap().padded_vocab()
            + c.extra_vocab_rows * c.tp;
        let layout = MegatronLayout::with_padded_vocab(c.model, c.tp, c.pp, c.dp, padded).unwrap();
        let mut state = MegatronTrainState::from_hf(layout, tensors(&c.model)).unwrap();
        let before = state.snapshot();
        let rollout = RolloutLayout::fused(c.t, RolloutVocab::PadToMultipleOf(c.pad));
        let mut backend = MegatronHostBackend::new(rollout.clone())
            .with_config(BucketConfig { bucket_bytes: c.budget })
            .unwrap();
        let plan = backend.plan(&state).unwrap();
        let mut metrics = Metrics::default();
        let memory = if c.offload { MemoryPolicy::default() } else { MemoryPolicy::resident() };
        let mut ctx = SwitchContext { memory, rec: PhaseRecorder::new(&mut metrics) };
        let got = backend.enter(&plan, &mut state, &mut ctx).unwrap();
        let want = reference_rollout(&state, &rollout).unwrap();
        prop_assert_eq!(got.first_difference(&want), None);
        backend.exit(&mut state, Some(got), &mut ctx).unwrap();
        prop_assert!(state.snapshot() == before, "round trip changed the training state");
    }
}
