//! GPU test of Megatron switches over parameters the backend does not own: each rank's bf16
//! parameters in one device allocation made by the test, laid out as Megatron-Core's DDP buffer
//! lays them (reverse order of registration, each parameter's start padded to 64 elements), lent
//! by address with the test's own stream
//! ([`MegatronGpuBackend::lending`](lifecycle_megatron::MegatronGpuBackend::lending)). Run with
//! `cargo test --release -p lifecycle-megatron --test gpu_lent -- --ignored` or through
//! `scripts/gpu-suite.sh`; in CI (no GPU) it is reported as ignored.

#[path = "../../host/tests/common/megatron.rs"]
mod common;

use std::sync::Arc;

use half::bf16;
use lifecycle_core::Lifecycle;
use lifecycle_cuda::cudarc::driver::{result, CudaContext};
use lifecycle_cuda::driver::LentStream;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use lifecycle_host::megatron::{MegatronHostBackend, MegatronTrainState};
use lifecycle_layout::fp8::{Fp8Keep, RolloutDtype};
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::settings::Configure;
use lifecycle_layout::{HostRollout, ModelSpec, RolloutLayout, RolloutVocab};
use lifecycle_megatron::{LentMegatronParts, MegatronGpuBackend, MegatronGpuError};

type Res = Result<(), Box<dyn std::error::Error>>;

/// Megatron-Core's DDP buffer of one rank's parameters: the layout's slots in reverse order,
/// each starting on a multiple of 64 elements. Returns the buffer and each slot's start in it
/// (in the layout's order).
fn ddp_buffer(layout: &MegatronLayout, rank: usize, params: &[bf16]) -> (Vec<bf16>, Vec<usize>) {
    let slots = layout.stage_slots(layout.coords(rank).pp);
    let mut at = vec![0; slots.len()];
    let mut end = 0;
    for (i, s) in slots.iter().enumerate().rev() {
        at[i] = end;
        end = (end + s.numel()).div_ceil(64) * 64;
    }
    let mut buf = vec![bf16::from_f32(f32::NAN); end];
    for (s, &a) in slots.iter().zip(&at) {
        buf[a..a + s.numel()].copy_from_slice(&params[s.offset..s.offset + s.numel()]);
    }
    (buf, at)
}

fn upload(ctx: &Arc<CudaContext>, data: &[bf16]) -> Result<u64, Box<dyn std::error::Error>> {
    ctx.bind_to_thread()?;
    // SAFETY: a fresh allocation of the data's size, written right away.
    let p = unsafe { result::malloc_sync(data.len() * 2) }?;
    // SAFETY: `p` holds `data.len()` bf16.
    unsafe { result::memcpy_htod_sync(p, data) }?;
    Ok(p)
}

/// The CPU executor's rollout of `state` in `dtype`.
fn host_rollout(
    state: &MegatronTrainState,
    rollout: &RolloutLayout,
    dtype: RolloutDtype,
) -> HostRollout {
    let backend = MegatronHostBackend::new(rollout.clone())
        .with_rollout_dtype(dtype)
        .with_fp8_keep(Fp8Keep::default());
    let mut lc = Lifecycle::new(backend, state.clone());
    let session = lc.rollout().expect("the CPU executor's rollout");

    session.weights().get().clone()
}

/// One case: `model` in Megatron's (TP, PP, DP) on `pool`'s ranks (all on GPU 0) to a rollout of
/// T ranks in `dtype`: two cycles over the lent buffers, the second after the caller rewrote
/// them (other weights) on its own stream, each bit-identical to the CPU executor.
fn case(
    pool: &Arc<ThreadRankPool>,
    ctx: &Arc<CudaContext>,
    stream: u64,
    (name, model): (&str, ModelSpec),
    (tp, pp, dp, t): (usize, usize, usize, usize),
    dtype: RolloutDtype,
) -> Res {
    let layout = MegatronLayout::new(model, tp, pp, dp)?;
    // the vocabulary padded to a multiple of T (the models' odd vocabularies split no other way)
    let rollout = RolloutLayout::fused(t, RolloutVocab::PadToMultipleOf(1));
    let states = [5, 9]
        .map(|seed| MegatronTrainState::from_hf(layout.clone(), common::hf_tensors(&model, seed)));
    let [first, second] = states;
    let (first, second) = (first?, second?);
    let mut lent = Vec::new();
    let mut parts = Vec::new();
    let mut staged = Vec::new();
    for &rank in pool.local_ranks() {
        let p1 = first.params(rank).ok_or("rank params")?;
        let p2 = second.params(rank).ok_or("rank params")?;
        let (b1, at) = ddp_buffer(&layout, rank, p1);
        let (b2, _) = ddp_buffer(&layout, rank, p2);
        let base = upload(ctx, &b1)?;
        staged.push((upload(ctx, &b2)?, b2.len()));
        lent.push(base);
        let slots = layout.stage_slots(layout.coords(rank).pp);
        parts.push(LentMegatronParts {
            params: slots
                .iter()
                .zip(&at)
                .map(|(s, &a)| (base + 2 * a as u64, s.numel()))
                .collect(),
            offload: Vec::new(),
            stream: Some(LentStream(stream)),
        });
    }
    let backend = MegatronGpuBackend::new(pool.clone(), rollout.clone())?
        .with_rollout_dtype(dtype)
        .lending();
    // SAFETY: every address lies in a live allocation of the test on GPU 0 holding the slot's
    // elements, kept until the state is dropped; the stream is live.
    let state = unsafe { backend.lend(layout.clone(), parts)? };
    let mut lc = Lifecycle::new(backend, state);
    let label = format!("{name} TP{tp} PP{pp} DP{dp} -> T{t} {dtype:?}");
    for (cycle, host) in [&first, &second].into_iter().enumerate() {
        if cycle == 1 {
            // The caller rewrites its parameters on its own stream and does not wait: the
            // switch must.
            for (&dst, &(src, len)) in lent.iter().zip(&staged) {
                // SAFETY: both are the test's allocations of `len` bf16 on this device.
                unsafe { result::memcpy_dtod_async(dst, src, len * 2, stream as _) }?;
            }
            let mut t = lc.train()?;
            // the update happened outside the lifecycle: mark the weights changed
            let _ = t.state_mut();
        }
        let s = lc.rollout()?;
        let got = s.backend().download_rollout(&s.weights())?;
        let want = host_rollout(host, &rollout, dtype);
        assert_eq!(want.first_difference(&got), None, "{label} cycle {cycle}");
        drop(s);
        lc.train()?;
    }
    drop(lc);
    for p in lent.into_iter().chain(staged.into_iter().map(|s| s.0)) {
        // SAFETY: the test's allocations, no longer used.
        unsafe { result::free_sync(p) }?;
    }
    eprintln!("lent Megatron parameters: {label}: 2 cycles bit-identical to the CPU executor");
    Ok(())
}

/// Parameters lent in Megatron-Core's buffer order: bf16 and fp8 rollouts of dense and MoE
/// models at W = 1 and on two ranks sharing GPU 0 (TP = 2, PP = 2), bit-identical to the CPU
/// executor over the same weights, before and after the caller rewrote them.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_megatron_switch_reads_parameters_lent_in_megatron_order() -> Res {
    require_gpus(1)?;
    let ctx = CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)? as u64;
    let one = Arc::new(ThreadRankPool::new(1)?);
    let two = Arc::new(ThreadRankPool::on_devices(&[0, 0])?);
    let models = [
        ("dense", common::model(2, false)),
        ("moe", common::moe_model(true)),
        ("fp8-dense", common::fp8_dense()),
        ("fp8-moe", common::fp8_moe()),
    ];
    let mut n = 0;
    for m in models {
        let dtypes: &[RolloutDtype] = if m.0.starts_with("fp8") {
            &[RolloutDtype::Bf16, RolloutDtype::Fp8]
        } else {
            &[RolloutDtype::Bf16]
        };
        for &dtype in dtypes {
            case(&one, &ctx, stream, m, (1, 1, 1, 1), dtype)?;
            case(&two, &ctx, stream, m, (2, 1, 1, 2), dtype)?;
            case(&two, &ctx, stream, m, (1, 2, 1, 1), dtype)?;
            n += 3;
        }
    }
    // SAFETY: the test's stream, idle (every case synchronised).
    unsafe { result::stream::destroy(stream as _) }?;
    eprintln!("{n} lent Megatron cases bit-identical to the CPU executor");
    Ok(())
}

/// A lent parameter of the wrong size, and a missing one, are refused by name before anything
/// is read.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn lent_parameters_that_do_not_fit_the_layout_are_refused_by_name() -> Res {
    require_gpus(1)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let layout = MegatronLayout::new(common::model(2, false), 1, 1, 1)?;
    let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
    let backend = MegatronGpuBackend::new(pool, rollout)?.lending();
    let slots = layout.stage_slots(0);
    let mut params: Vec<(u64, usize)> = slots.iter().map(|s| (0x1000, s.numel())).collect();
    params[3].1 += 1;
    let parts = |params| {
        vec![LentMegatronParts {
            params,
            offload: Vec::new(),
            stream: None,
        }]
    };
    // SAFETY: refused before any address is used.
    let err = unsafe { backend.lend(layout.clone(), parts(params.clone())) }
        .err()
        .ok_or("a mis-sized parameter was accepted")?;
    assert!(
        matches!(&err, MegatronGpuError::Config(m) if m.contains(&slots[3].name)),
        "{err}"
    );
    params.pop();
    // SAFETY: as above.
    let err = unsafe { backend.lend(layout, parts(params)) }
        .err()
        .ok_or("a missing parameter was accepted")?;
    assert!(err.to_string().contains("one per parameter"), "{err}");
    eprintln!("refused: {err}");
    Ok(())
}
