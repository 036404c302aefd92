//! A LoRA model switched with a frozen base (`with_frozen_base`): enter casts the base once, a
//! refresh moves the adapters alone (bytes reported), and a base written since enter is refused
//! by name before anything moves; whole tensors trained beside the adapters (`with_trained`:
//! PEFT's `modules_to_save`, trainable biases) move with them at every refresh.

use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy};
use lifecycle_host::megatron::MegatronHostBackend;
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::lora::{
    adapters, is_adapter, with_adapters, LoraConfig, LoraTarget, Trained,
};
use lifecycle_layout::settings::Configure;
use lifecycle_layout::{HostTensor, ModelSpec, RolloutLayout, RolloutVocab};

fn model() -> ModelSpec {
    ModelSpec {
        vocab: 38,
        ..ModelSpec::tiny()
    }
}

/// The model's tensors and the adapters of `lora` (rank 2), with distinct values.
fn tensors(lora: &LoraConfig) -> Vec<HostTensor> {
    let m = model();
    let mut out: Vec<HostTensor> = m
        .hf_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            HostTensor::f32(
                name,
                shape,
                (0..n).map(|j| ((i * 7 + j) % 13) as f32 / 16.0).collect(),
            )
        })
        .collect();
    for a in adapters(&m, lora).unwrap() {
        for spec in [a.a, a.b] {
            let n = spec.numel();
            out.push(HostTensor::f32(spec.name, spec.shape, vec![0.25; n]));
        }
    }
    out
}

fn resident() -> LifecycleConfig {
    LifecycleConfig {
        memory: MemoryPolicy {
            keep_rollout_resident: true,
            ..MemoryPolicy::resident()
        },
        ..Default::default()
    }
}

/// The bytes a lifecycle's switches cast or copied so far.
fn moved(lc: &Lifecycle<HostBackend>) -> u64 {
    let b = lc.metrics().bytes();
    b.local + b.device_to_device
}

/// Writes the first master element of each tensor `written` names, then checks that the next
/// rollout is refused naming `refused` as frozen, with nothing moved.
fn write_is_refused(lc: &mut Lifecycle<HostBackend>, written: &[&str], refused: &str) {
    {
        let mut t = lc.train().unwrap();
        t.state_mut()
            .for_each_shard_mut(|s| {
                if written.contains(&s.name) {
                    s.master[0] += 1.0;
                }
            })
            .unwrap();
    }
    let before = moved(lc);
    let e = lc.rollout().unwrap_err().to_string();
    assert!(e.contains(refused) && e.contains("frozen"), "{e}");
    assert_eq!(moved(lc), before);
}

#[test]
fn a_refresh_moves_the_adapters_alone_and_a_written_base_is_refused() {
    let m = model();
    let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q, LoraTarget::Down]);
    let base = RolloutLayout::from_hf_names(2, m.hf_tensors()).unwrap();
    let layout = with_adapters(&base, &m, &lora).unwrap();
    let state = HostTrainState::from_tensors(2, tensors(&lora)).unwrap();
    let backend = HostBackend::new(layout.clone()).with_frozen_base(true);
    let mut lc = Lifecycle::with_config(backend, state, resident()).unwrap();
    // enter: everything, once
    let q_before = {
        let s = lc.rollout().unwrap();
        let w = s.weights();
        let q = w.ranks[0].tensor("model.layers.0.self_attn.q_proj.weight");
        q.unwrap().data.clone()
    };
    let enter_bytes = moved(&lc);
    // bf16 bytes every rank receives (a replicated tensor once per rank)
    let bytes = |t: &lifecycle_layout::TensorSpec| {
        let copies = if t.parallel == lifecycle_layout::Parallel::Replicated {
            2
        } else {
            1
        };
        2 * copies * t.numel() as u64
    };
    let all: u64 = layout.tensors().iter().map(bytes).sum();
    assert_eq!(enter_bytes, all);
    // an adapter update: the refresh moves the adapters' bytes alone
    let adapter_bytes: u64 = layout
        .tensors()
        .iter()
        .filter(|t| is_adapter(&t.name))
        .map(bytes)
        .sum();
    {
        let mut t = lc.train().unwrap();
        t.state_mut()
            .for_each_shard_mut(|s| {
                if is_adapter(s.name) {
                    s.master.iter_mut().for_each(|v| *v = 0.5);
                }
            })
            .unwrap();
    }
    let before = moved(&lc);
    {
        let s = lc.rollout().unwrap();
        let w = s.weights();
        let r0 = &w.ranks[0];
        let b = r0
            .tensor("model.layers.1.mlp.down_proj.lora_B.weight")
            .unwrap();
        assert!(
            b.data.iter().all(|v| v.to_f32() == 0.5),
            "the adapter refreshed"
        );
        let q = &r0
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .data;
        assert_eq!(q, &q_before, "the base as enter cast it");
    }
    assert_eq!(lc.metrics().refreshes, 1);
    assert_eq!(moved(&lc) - before, adapter_bytes);
    assert!(adapter_bytes * 4 < all);
    // a write to the frozen base: refused by name, nothing moved
    let down = "model.layers.1.mlp.down_proj.weight";
    write_is_refused(&mut lc, &[down], down);
}

/// The model's Megatron training state at TP = PP = DP = 1, every weight zero.
fn megatron_state(m: ModelSpec) -> lifecycle_host::megatron::MegatronTrainState {
    lifecycle_host::megatron::MegatronTrainState::from_hf(
        lifecycle_layout::megatron::MegatronLayout::new(m, 1, 1, 1).unwrap(),
        m.hf_tensors()
            .into_iter()
            .map(|(n, s)| {
                let k = s.iter().product();
                HostTensor::f32(n, s, vec![0.0; k])
            })
            .collect(),
    )
    .unwrap()
}

#[test]
fn a_frozen_base_is_refused_where_the_backend_lacks_it() {
    let m = model();
    let state = megatron_state(m);
    let backend = MegatronHostBackend::new(RolloutLayout::fused(1, RolloutVocab::Unpadded))
        .with_frozen_base(true);
    let mut lc = Lifecycle::new(backend, state);
    let e = lc.rollout().unwrap_err().to_string();
    assert!(
        e.contains("frozen base") && e.contains("Megatron host backend"),
        "{e}"
    );
}

/// bf16 bytes every rank of `layout` (T = 2) receives of tensor `t` (a replicated one once per
/// rank).
fn rank_bytes(t: &lifecycle_layout::TensorSpec) -> u64 {
    let copies = if t.parallel == lifecycle_layout::Parallel::Replicated {
        2
    } else {
        1
    };
    2 * copies * t.numel() as u64
}

const HEAD: &str = "lm_head.weight";
const Q_BIAS: &str = "model.layers.0.self_attn.q_proj.bias";

#[test]
fn whole_tensors_trained_beside_the_adapters_move_with_them_and_nothing_else() {
    let m = model();
    let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q, LoraTarget::Down]);
    let base = RolloutLayout::from_hf_names(2, m.hf_tensors()).unwrap();
    let layout = with_adapters(&base, &m, &lora).unwrap();
    let state = HostTrainState::from_tensors(2, tensors(&lora)).unwrap();
    // PEFT's modules_to_save = ["lm_head"] and the bias of an adapted module (bias="lora_only")
    let trained = Trained::new([HEAD, Q_BIAS]);
    let backend = HostBackend::new(layout.clone())
        .with_frozen_base(true)
        .with_trained(trained.clone());
    let mut lc = Lifecycle::with_config(backend, state, resident()).unwrap();
    let frozen_before = {
        let s = lc.rollout().unwrap();
        let w = s.weights();
        let n = w.ranks[1].tensor("model.layers.1.mlp.down_proj.weight");
        n.unwrap().data.clone()
    };
    // an update of every trained tensor: the adapters, the head and the bias
    {
        let mut t = lc.train().unwrap();
        t.state_mut()
            .for_each_shard_mut(|s| {
                if trained.moves(s.name) {
                    s.master.iter_mut().for_each(|v| *v = 0.75);
                }
            })
            .unwrap();
    }
    let want: u64 = layout
        .tensors()
        .iter()
        .filter(|t| is_adapter(&t.name) || t.name == HEAD || t.name == Q_BIAS)
        .map(rank_bytes)
        .sum();
    let adapters_alone: u64 = layout
        .tensors()
        .iter()
        .filter(|t| is_adapter(&t.name))
        .map(rank_bytes)
        .sum();
    assert!(want > adapters_alone);
    let before = moved(&lc);
    {
        let s = lc.rollout().unwrap();
        let w = s.weights();
        for (rank, r) in w.ranks.iter().enumerate() {
            for name in [
                HEAD,
                Q_BIAS,
                "model.layers.0.self_attn.q_proj.lora_A.weight",
            ] {
                let t = r.tensor(name).unwrap();
                assert!(
                    t.data.iter().all(|v| v.to_f32() == 0.75),
                    "{name} refreshed on rank {rank}"
                );
            }
        }
        let down = &w.ranks[1]
            .tensor("model.layers.1.mlp.down_proj.weight")
            .unwrap()
            .data;
        assert_eq!(down, &frozen_before, "the frozen base as enter cast it");
    }
    assert_eq!(lc.metrics().refreshes, 1);
    // the trained tensors' bytes, and nothing else
    assert_eq!(moved(&lc) - before, want);
    // a write to a frozen tensor beside them: still refused by name, nothing moved
    let bias = "model.layers.1.self_attn.q_proj.bias";
    write_is_refused(&mut lc, &[HEAD, bias], &format!("`{bias}`"));
}

#[test]
fn trained_names_the_model_lacks_or_adapters_are_refused_by_name_before_anything_moves() {
    let m = model();
    let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q]);
    let base = RolloutLayout::from_hf_names(2, m.hf_tensors()).unwrap();
    let layout = with_adapters(&base, &m, &lora).unwrap();
    for (bad, why) in [
        ("lm_head.bias", "no such tensor"),
        (
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "LoRA matrix",
        ),
    ] {
        let state = HostTrainState::from_tensors(2, tensors(&lora)).unwrap();
        let backend = HostBackend::new(layout.clone())
            .with_frozen_base(true)
            .with_trained(Trained::new([HEAD, bad]));
        let mut lc = Lifecycle::with_config(backend, state, resident()).unwrap();
        let e = lc.rollout().unwrap_err().to_string();
        assert!(e.contains(&format!("`{bad}`")) && e.contains(why), "{e}");
        let b = lc.metrics().bytes();
        assert_eq!(b.local + b.device_to_device, 0, "nothing moved");
    }
    // an fp8 rollout (T = 1: no slice cuts a block) quantises a trained matrix: a frozen base
    // refreshes bf16 alone
    let q = "model.layers.1.self_attn.q_proj.weight";
    let whole = RolloutLayout::from_hf_names(1, m.hf_tensors()).unwrap();
    let layout = with_adapters(&whole, &m, &lora).unwrap();
    let state = HostTrainState::from_tensors(2, tensors(&lora)).unwrap();
    let backend = HostBackend::new(layout)
        .with_frozen_base(true)
        .with_rollout_dtype(lifecycle_layout::fp8::RolloutDtype::Fp8)
        .with_trained(Trained::new([q]));
    let mut lc = Lifecycle::with_config(backend, state, resident()).unwrap();
    let e = lc.rollout().unwrap_err().to_string();
    assert!(e.contains(q) && e.contains("fp8"), "{e}");
}

#[test]
fn trained_tensors_are_refused_where_the_backend_has_no_frozen_base() {
    let m = model();
    let state = megatron_state(m);
    let backend = MegatronHostBackend::new(RolloutLayout::fused(1, RolloutVocab::Unpadded))
        .with_trained(Trained::new([HEAD]));
    let mut lc = Lifecycle::new(backend, state);
    let e = lc.rollout().unwrap_err().to_string();
    assert!(
        e.contains("with_trained") && e.contains("Megatron host backend"),
        "{e}"
    );
}
