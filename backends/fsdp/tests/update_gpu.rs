//! GPU tests of the in-place updates (synthetic gradients, Adam step) against the host backend,
//! bit for bit. Run on a machine with NVIDIA GPUs with
//! `cargo test --release -p lifecycle-fsdp --test update_gpu -- --ignored --test-threads=1`
//! (on the project's test machine also `export NCCL_NVLS_ENABLE=0`), or `scripts/gpu-suite.sh`.
//! In CI (no GPU) they are reported as ignored.
//!
//! Every test runs on one GPU: the W = 2 cases (each rank updates its own shard; switches use
//! peer copies) place both ranks on one GPU when the machine has only one ([`spread`]).

use std::sync::Arc;

use lifecycle_core::{
    Lifecycle, LifecycleConfig, MemoryPolicy, Metrics, PhaseRecorder, Reshard, SwitchContext,
    Switching,
};
use lifecycle_cuda::testing::{require_gpus, spread};
use lifecycle_cuda::ThreadRankPool;
use lifecycle_fsdp::{synthetic_grad_value, FsdpBackend, FsdpError, FsdpTrainState};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::{AdamParams, HostTensor};
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Dims not divisible by W = 2 (37, 9, 23, 1031, 5 rows); one tensor of ~4 MB.
fn specs(tp: usize) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("model.embed_tokens.weight", [37 * tp, 24], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [9 * tp, 24],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.bias",
            [9 * tp],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [23, 6 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.down_proj.weight",
            [1031, 1024 * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            [23],
            Parallel::Replicated,
        ),
        TensorSpec::new("model.norm.weight", [5], Parallel::Replicated),
    ]
}

fn host_tensors(specs: &[TensorSpec]) -> Vec<HostTensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let data = (0..s.numel())
                .map(|e| {
                    let x = ((i as u64 * 2_654_435_761 + e as u64 * 40_503) % 1_000_003) as f32;
                    (x - 500_000.0) * 1.234_567e-7 + 0.001_953_125 * (e % 5) as f32
                })
                .collect();
            HostTensor::f32(s.name.clone(), s.shape.clone(), data)
        })
        .collect()
}

/// `world` ranks over this machine's GPUs, sharing one where there are fewer GPUs than ranks.
fn pool(world: usize) -> Result<Arc<ThreadRankPool>, Box<dyn std::error::Error>> {
    Ok(Arc::new(ThreadRankPool::on_devices(
        spread(world)?.devices(),
    )?))
}

/// The host twin of `fill_synthetic_grads`.
fn host_grads(host: &mut HostTrainState, seed: u64, scale: f32) -> Res {
    host.for_each_shard_mut(|s| {
        let cols: usize = s.shape.iter().skip(1).product();
        let first = (s.rows.start * cols) as u64;
        for (j, g) in s.grad.iter_mut().enumerate() {
            *g = synthetic_grad_value(seed, s.tensor, first + j as u64, scale);
        }
    })?;
    Ok(())
}

/// Which buffer of a host snapshot entry (per rank, per tensor: master, grad, m, v).
#[derive(Clone, Copy, Debug)]
enum Which {
    Master = 0,
    Grad = 1,
    M = 2,
    V = 3,
}

/// Compares the GPU state's buffers with the host state's, bit for bit, per rank and tensor.
fn assert_same(
    backend: &FsdpBackend,
    state: &FsdpTrainState,
    host: &HostTrainState,
    what: &[Which],
    context: &str,
) -> Res {
    let dumps = backend.download_state(state)?;
    let snap = host.snapshot();
    let ntensors = host.layout().tensors().len();
    let shards = state.shard_layout();
    for (rank, d) in dumps.iter().enumerate() {
        for (i, slot) in shards.slots.iter().enumerate() {
            let n = shards.held_rows(i, rank).len() * slot.cols;
            let at = slot.offset as usize;
            for &w in what {
                let gpu: &[f32] = match w {
                    Which::Master => &d.master,
                    Which::Grad => d.grads.as_deref().ok_or("grads freed")?,
                    Which::M => &d.m,
                    Which::V => &d.v,
                };
                let want = &snap[(rank * ntensors + i) * 4 + w as usize];
                assert_eq!(
                    want.len(),
                    n,
                    "{context}: rank {rank} {} {w:?} length",
                    slot.name
                );
                let got: Vec<u32> = gpu[at..at + n].iter().map(|x| x.to_bits()).collect();
                if let Some(k) = (0..n).find(|&k| got[k] != want[k]) {
                    panic!(
                        "{context}: rank {rank} tensor {} {w:?} element {k}: GPU {} ({:#x}), \
                         host {} ({:#x})",
                        slot.name,
                        f32::from_bits(got[k]),
                        got[k],
                        f32::from_bits(want[k]),
                        want[k]
                    );
                }
            }
        }
    }
    Ok(())
}

/// Three in-place steps on the GPUs and on the host from the same weights and gradients:
/// gradients, master, m and v equal bit for bit after each.
fn adam_matches_host(world: usize) -> Res {
    let specs = specs(1);
    let mut host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
    let before = host.clone();
    let pool = pool(world)?;
    let backend = FsdpBackend::new(pool, RolloutLayout::new(1, specs)?);
    let mut state = backend.state_from_host(&host)?;
    let params = AdamParams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
    };
    // Gradients from ~1e-9 (below eps: the update depends on it) to ~1.
    for (step, scale) in [(1u64, 1.0f32), (2, 1e-3), (3, 1e-9)] {
        let seed = 0xDA90 + step;
        backend.fill_synthetic_grads(&mut state, seed, scale)?;
        host_grads(&mut host, seed, scale)?;
        assert_same(
            &backend,
            &state,
            &host,
            &[Which::Grad],
            &format!("W={world} step {step} grads"),
        )?;
        backend.adam_step(&mut state, params)?;
        host.adam_step(params)?;
        assert_eq!(state.adam_steps(), step);
        assert_same(
            &backend,
            &state,
            &host,
            &[Which::Master, Which::M, Which::V],
            &format!("W={world} after Adam step {step}"),
        )?;
    }
    // The weights moved: the test compares a real update.
    let name = "model.layers.0.mlp.down_proj.weight";
    let moved = backend
        .full_master(&state, name)?
        .iter()
        .zip(before.full_master(name)?)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        moved > 1_000_000,
        "only {moved} of 1 055 744 weights changed"
    );
    // A fresh optimizer: m, v, grads zero.
    backend.reset_optimizer(&mut state)?;
    assert_eq!(state.adam_steps(), 0);
    for d in backend.download_state(&state)? {
        let zero = |v: &[f32]| v.iter().all(|x| x.to_bits() == 0);
        assert!(zero(&d.m) && zero(&d.v) && d.grads.as_deref().is_some_and(zero));
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn adam_step_bit_identical_to_host_w1() -> Res {
    require_gpus(1)?;
    adam_matches_host(1)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn adam_step_bit_identical_to_host_w2() -> Res {
    require_gpus(1)?;
    adam_matches_host(2)
}

/// rollout → train (in-place step) → rollout, twice: each rollout equals `reference_rollout` of
/// the host state after the same steps; the pinned host buffers are allocated once.
fn cycle(world: usize, tp: usize, memory: MemoryPolicy) -> Res {
    let specs = specs(tp);
    let layout = RolloutLayout::new(tp, specs.clone())?;
    let mut host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
    let pool = pool(world)?;
    let backend = FsdpBackend::new(pool, layout.clone());
    let state = backend.state_from_host(&host)?;
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )?;
    let params = AdamParams::default();
    let mut pinned = None;
    for step in 0..=2u64 {
        if step > 0 {
            let seed = 77 * step;
            {
                let mut tr = lc.train()?;
                let (backend, state) = tr.backend_and_state_mut();
                backend.fill_synthetic_grads(state, seed, 0.1)?;
                backend.adam_step(state, params)?;
            }
            host_grads(&mut host, seed, 0.1)?;
            host.adam_step(params)?;
        }
        let session = lc.rollout()?;
        let got = session.backend().download_rollout(&session.weights())?;
        drop(session);
        let want = reference_rollout(&host, &layout)?;
        assert_eq!(
            got.first_difference(&want),
            None,
            "W={world} T={tp} {memory:?}: rollout after {step} in-place steps differs from \
             reference_rollout of the host's weights"
        );
        let bytes = lc.peek_state().pinned_host_bytes();
        match pinned {
            None => pinned = Some(bytes),
            Some(p) => assert_eq!(p, bytes, "pinned host memory changed"),
        }
    }
    let expect_pinned = memory.offload_params || memory.offload_optimizer;
    assert_eq!(pinned.is_some_and(|b| b > 0), expect_pinned);
    let m = lc.metrics();
    assert_eq!(m.switches(), 3);
    assert_eq!(m.enters, if memory.keep_rollout_resident { 1 } else { 3 });
    eprintln!("W={world} T={tp} {memory:?}: {}", m.summary_line());
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn lifecycle_cycle_with_in_place_step_w1() -> Res {
    require_gpus(1)?;
    cycle(1, 1, MemoryPolicy::default())?;
    cycle(
        1,
        1,
        MemoryPolicy {
            keep_rollout_resident: true,
            ..MemoryPolicy::resident()
        },
    )
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn lifecycle_cycle_with_in_place_step_w2() -> Res {
    require_gpus(1)?;
    cycle(2, 2, MemoryPolicy::default())?;
    cycle(2, 1, MemoryPolicy::default())?;
    cycle(
        2,
        2,
        MemoryPolicy {
            keep_rollout_resident: true,
            ..MemoryPolicy::resident()
        },
    )
}

/// Entering rollout mode by hand (the trait, no lifecycle) offloads master and moments and frees
/// the gradients: the updates are typed errors naming the buffer, and nothing changed.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn updates_on_an_offloaded_state_are_typed_errors() -> Res {
    require_gpus(1)?;
    for world in [1, 2] {
        offloaded_updates_refused(world)?;
    }
    Ok(())
}

fn offloaded_updates_refused(world: usize) -> Res {
    let specs = specs(1);
    let pool = pool(world)?;
    let mut backend = FsdpBackend::new(pool, RolloutLayout::new(1, specs.clone())?);
    let mut state = backend.state_from_tensors(host_tensors(&specs))?;
    backend.fill_synthetic_grads(&mut state, 1, 0.1)?;
    backend.adam_step(&mut state, AdamParams::default())?;
    for (memory, buffer) in [
        (MemoryPolicy::default(), "fp32 master weights"),
        (
            MemoryPolicy {
                offload_params: false,
                ..MemoryPolicy::default()
            },
            "Adam m",
        ),
    ] {
        let before = backend.download_state(&state)?;
        let plan = backend.plan(&state)?;
        let mut metrics = Metrics::default();
        let mut ctx = SwitchContext {
            memory,
            rec: PhaseRecorder::new(&mut metrics),
        };
        let rollout = backend.enter(&plan, &mut state, &mut ctx)?;
        match backend.adam_step(&mut state, AdamParams::default()) {
            Err(FsdpError::NotResident {
                buffer: b, rank: 0, ..
            }) => assert_eq!(b, buffer),
            other => panic!("expected NotResident({buffer}), got {other:?}"),
        }
        match backend.fill_synthetic_grads(&mut state, 2, 0.1) {
            Err(
                e @ FsdpError::NotResident {
                    buffer: "gradients",
                    ..
                },
            ) => assert!(e.to_string().contains("leave rollout mode"), "{e}"),
            other => panic!("expected NotResident(gradients), got {other:?}"),
        }
        assert_eq!(state.adam_steps(), 1);
        backend.exit(&mut state, Some(rollout), &mut ctx)?;
        let after = backend.download_state(&state)?;
        assert!(before.iter().zip(&after).all(|(a, b)| a.same_bits(b)));
    }
    // Bad parameters: typed errors before anything moves.
    let bad = AdamParams {
        beta2: 1.5,
        ..Default::default()
    };
    assert!(matches!(
        backend.adam_step(&mut state, bad),
        Err(FsdpError::AdamParam { name: "beta2", .. })
    ));
    let wrong = vec![HostTensor::f32("nope", [2], vec![0.0; 2])];
    assert!(matches!(
        backend.upload_master(&mut state, &wrong),
        Err(FsdpError::Tensor { .. })
    ));
    // Back in train mode the step works again, and upload_master restores the weights exactly.
    backend.adam_step(&mut state, AdamParams::default())?;
    assert_eq!(state.adam_steps(), 2);
    backend.upload_master(&mut state, &host_tensors(&specs))?;
    let fresh = backend.state_from_tensors(host_tensors(&specs))?;
    let (a, b) = (
        backend.download_state(&state)?,
        backend.download_state(&fresh)?,
    );
    assert!(a.iter().zip(&b).all(|(x, y)| x.master == y.master));
    // fill_synthetic_master gives synthetic_state's master weights.
    let shapes: Vec<(String, Vec<usize>)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    backend.fill_synthetic_master(&mut state, 99, 0.02)?;
    let synth = backend.synthetic_state(&shapes, 99, 0.02)?;
    let (a, b) = (
        backend.download_state(&state)?,
        backend.download_state(&synth)?,
    );
    assert!(a.iter().zip(&b).all(|(x, y)| x.master == y.master));
    Ok(())
}

/// A LoRA model's layout (`q` column-parallel, `o` row-parallel, each with its adapters under
/// PEFT's names): the base and its adapters' A and B split as the rollout splits them.
fn lora_specs(tp: usize) -> Vec<TensorSpec> {
    let (h, r) = (24, 4);
    let l = "model.layers.0.self_attn.";
    vec![
        TensorSpec::new("model.embed_tokens.weight", [37 * tp, h], Parallel::Column),
        TensorSpec::new(format!("{l}q_proj.weight"), [h * tp, h], Parallel::Column),
        TensorSpec::new(
            format!("{l}q_proj.lora_A.weight"),
            [r, h],
            Parallel::Replicated,
        ),
        TensorSpec::new(
            format!("{l}q_proj.lora_B.weight"),
            [h * tp, r],
            Parallel::Column,
        ),
        TensorSpec::new(format!("{l}o_proj.weight"), [h, h * tp], Parallel::Row),
        TensorSpec::new(
            format!("{l}o_proj.lora_A.weight"),
            [r, h * tp],
            Parallel::Row,
        ),
        TensorSpec::new(
            format!("{l}o_proj.lora_B.weight"),
            [h, r],
            Parallel::Replicated,
        ),
        TensorSpec::new("model.norm.weight", [h], Parallel::Replicated),
    ]
}

/// A frozen base (`with_frozen_base`): enter casts the whole model; after Adam steps (which
/// leave the frozen base as it is) a refresh of the resident rollout moves the adapters alone
/// (the transfer's bytes those of the adapters), and the rollout is the reference rollout of
/// the masters (bf16, or fp8: the base quantised once, the adapters bf16 beside it); writing a
/// master of the base while the rollout holds it is refused by name. W = 1, 2 (on one GPU if
/// need be), T = 1, W (fp8: T = 1, its 24-wide matrices one partial block each); the same with
/// a whole tensor trained beside the adapters (`with_trained`: the final norm, stepped and moved
/// with them), and a trained name the model lacks refused at plan.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_frozen_base_refreshes_the_adapters_alone() -> Res {
    use lifecycle_core::Phase;
    use lifecycle_layout::fp8::RolloutDtype;
    use lifecycle_layout::lora::Trained;
    use lifecycle_layout::settings::Configure;

    require_gpus(1)?;
    let bf16 = [(1, 1), (2, 1), (2, 2)].map(|wt| (wt, RolloutDtype::Bf16));
    let fp8 = [(1, 1), (2, 1)].map(|wt| (wt, RolloutDtype::Fp8));
    let cases = bf16.into_iter().chain(fp8).flat_map(|(wt, dtype)| {
        [
            (wt, dtype, Trained::default()),
            (wt, dtype, Trained::new(["model.norm.weight"])),
        ]
    });
    for ((world, tp), dtype, trained) in cases {
        let specs = lora_specs(tp);
        let layout = RolloutLayout::new(tp, specs.clone())?;
        let host = HostTrainState::from_tensors(world, host_tensors(&specs))?;
        let backend = FsdpBackend::new(pool(world)?, layout.clone())
            .with_frozen_base(true)
            .with_trained(trained.clone())
            .with_rollout_dtype(dtype);
        let state = backend.state_from_host(&host)?;
        let mut lc = Lifecycle::with_config(
            backend,
            state,
            LifecycleConfig {
                switching: Switching::Lazy,
                memory: MemoryPolicy {
                    keep_rollout_resident: true,
                    ..MemoryPolicy::resident()
                },
            },
        )?;
        let trained_bytes: u64 = layout
            .tensors()
            .iter()
            .filter(|s| trained.moves(&s.name))
            .map(|s| 2 * s.numel() as u64)
            .sum();
        let total = |b: lifecycle_core::LinkBytes| b.local + b.device_to_device;
        let mut enter_bytes = 0;
        for step in 0..3u64 {
            if step > 0 {
                let mut tr = lc.train()?;
                let (backend, state) = tr.backend_and_state_mut();
                backend.fill_synthetic_grads(state, 91 * step, 0.1)?;
                backend.adam_step(state, AdamParams::default())?;
                let err = backend
                    .upload_master(state, &host_tensors(&specs))
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("model.embed_tokens.weight") && err.contains("frozen"),
                    "{err}"
                );
            }
            let before = lc.metrics().phase(Phase::Transfer).bytes;
            let session = lc.rollout()?;
            let got = session.backend().download_rollout(&session.weights())?;
            drop(session);
            let (backend, state) = (lc.backend(), lc.peek_state());
            let masters = backend.full_masters(state)?;
            for (m, h) in masters.iter().zip(host_tensors(&specs)) {
                let same = m.data == h.data;
                assert_eq!(
                    same,
                    step == 0 || !trained.moves(&m.name),
                    "{dtype:?} W={world} T={tp} step {step}: {}",
                    m.name
                );
            }
            let masters = HostTrainState::from_tensors(world, masters)?;
            let want = match dtype {
                RolloutDtype::Bf16 => reference_rollout(&masters, &layout)?,
                RolloutDtype::Fp8 => lifecycle_host::fp8::fp8_switch(&masters, &layout)?,
            };
            assert_eq!(
                got.first_difference(&want),
                None,
                "{dtype:?} W={world} T={tp} step {step}"
            );
            let moved = total(lc.metrics().phase(Phase::Transfer).bytes) - total(before);
            eprintln!(
                "{dtype:?} W={world} T={tp} step {step}: {moved} bytes cast or copied into the rollout \
                 (the trained tensors: {trained_bytes} bytes a rollout replica)"
            );
            if step == 0 {
                enter_bytes = moved;
                assert!(moved > 0, "the transfer reports its bytes");
            } else {
                // (fp8: the quantised base's bytes count apart, so enter's are fewer here)
                let share = if dtype == RolloutDtype::Fp8 { 1 } else { 4 };
                assert!(
                    share * moved < enter_bytes,
                    "{dtype:?} W={world} T={tp}: the refresh moved {moved} bytes, enter \
                     {enter_bytes}"
                );
            }
        }
        let m = lc.metrics();
        assert_eq!(
            (m.enters, m.refreshes),
            (1, 2),
            "{dtype:?} W={world} T={tp}"
        );
        eprintln!("{dtype:?} W={world} T={tp}: {}", m.summary_line());
    }
    let typo = FsdpBackend::new(pool(1)?, RolloutLayout::new(1, lora_specs(1))?)
        .with_frozen_base(true)
        .with_trained(Trained::new(["model.norm.weights"]));
    let state = typo.state_from_host(&HostTrainState::from_tensors(
        1,
        host_tensors(&lora_specs(1)),
    )?)?;
    let err = Reshard::plan(&typo, &state).unwrap_err().to_string();
    assert!(err.contains("`model.norm.weights`"), "{err}");
    Ok(())
}
