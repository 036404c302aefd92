//! GPU test of FSDP switches over training buffers the backend does not own: device memory
//! allocated by the test with the CUDA driver (as PyTorch's allocator would hold it), lent to
//! the backend by address with the test's own stream
//! ([`FsdpBackend::lending`](lifecycle_fsdp::FsdpBackend::lending)). Run with
//! `cargo test --release -p lifecycle-fsdp --test gpu_lent -- --ignored` or through
//! `scripts/gpu-suite.sh`; in CI (no GPU) it is reported as ignored.

use lifecycle_layout::settings::Configure;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy};
use lifecycle_cuda::cudarc::driver::{result, CudaContext};
use lifecycle_cuda::driver::{BufferClass, LentMemory, LentOffload, LentStream};
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{CudaError, RankExecutor, ThreadRankPool};
use lifecycle_fsdp::{FsdpBackend, LentMaster, LentParts};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_layout::{FsdpLayout, HostTensor, Parallel, RolloutLayout, TensorSpec};

type Res = Result<(), Box<dyn std::error::Error>>;

fn specs(tp: usize) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("model.embed_tokens.weight", [37 * tp, 24], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [9 * tp, 24],
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
    ]
}

fn tensors(specs: &[TensorSpec], salt: u64) -> Vec<HostTensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let data = (0..s.numel())
                .map(|e| {
                    let x =
                        ((i as u64 * 2_654_435_761 + e as u64 * 40_503 + salt) % 1_000_003) as f32;
                    (x - 500_000.0) * 1.234_567e-4
                })
                .collect();
            HostTensor::f32(s.name.clone(), s.shape.clone(), data)
        })
        .collect()
}

/// Rank `rank`'s flat master buffer in the padded shard layout, as a caller lays it out.
fn flat_master(shards: &ShardLayout, tensors: &[HostTensor], rank: usize) -> Vec<f32> {
    let mut flat = vec![0.0f32; shards.rank_len as usize];
    for (i, t) in tensors.iter().enumerate() {
        let slot = &shards.slots[i];
        let full = t.data.to_f32().unwrap_or_default();
        let held = shards.held_rows(i, rank);
        let src = &full[held.start * slot.cols..held.end * slot.cols];
        let at = slot.offset as usize;
        flat[at..at + src.len()].copy_from_slice(src);
    }
    flat
}

/// Device memory owned by the test: freed when the backend releases it, allocated anew (at
/// another address, as a caching allocator may) when it restores it.
struct Owner {
    ctx: Arc<CudaContext>,
    released: Arc<AtomicUsize>,
    restored: Arc<AtomicUsize>,
}

impl LentMemory for Owner {
    fn release(&mut self, rank: usize, ptr: u64) -> Result<(), CudaError> {
        let drv = |e| CudaError::driver(rank, "freeing lent memory", 0, e);
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `ptr` came from `malloc_sync` below or in the test and is no longer used: the
        // backend asks only after its copy of it finished.
        unsafe { result::free_sync(ptr) }.map_err(drv)?;
        self.released.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn restore(&mut self, rank: usize, bytes: usize) -> Result<u64, CudaError> {
        let drv = |e| CudaError::driver(rank, "allocating lent memory", bytes as u64, e);
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: a plain allocation; the backend fills it before anyone reads it.
        let p = unsafe { result::malloc_sync(bytes) }.map_err(drv)?;
        self.restored.fetch_add(1, Ordering::SeqCst);
        Ok(p)
    }
}

fn upload(ctx: &Arc<CudaContext>, data: &[f32]) -> Result<u64, Box<dyn std::error::Error>> {
    ctx.bind_to_thread()?;
    // SAFETY: a fresh allocation of the data's size, written right away.
    let p = unsafe { result::malloc_sync(data.len() * 4) }?;
    // SAFETY: `p` holds `data.len()` f32.
    unsafe { result::memcpy_htod_sync(p, data) }?;
    Ok(p)
}

fn download(
    ctx: &Arc<CudaContext>,
    p: u64,
    len: usize,
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    ctx.bind_to_thread()?;
    let mut out = vec![0.0f32; len];
    // SAFETY: `p` holds `len` f32 (the test's allocation or the backend's restored copy).
    unsafe { result::memcpy_dtoh_sync(&mut out, p) }?;
    Ok(out)
}

/// One W = 1 switch cycle over lent buffers, twice, with the master rewritten on the caller's
/// stream in between: rollouts bit-identical to the CPU reference of the same weights, Adam
/// state offloaded (its memory released to the owner) and reloaded bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_fsdp_switch_over_buffers_allocated_outside_the_backend() -> Res {
    require_gpus(1)?;
    let (world, tp) = (1, 1);
    let specs = specs(tp);
    let first = tensors(&specs, 0);
    let second = tensors(&specs, 77);
    let layout = RolloutLayout::new(tp, specs.clone())?;
    let train = FsdpLayout::new(
        world,
        specs.iter().map(|s| (s.name.clone(), s.shape.clone())),
    )?;
    let shards = ShardLayout::new(&train);
    let len = shards.rank_len as usize;

    let ctx = CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
    let master = upload(&ctx, &vec![0.0; len])?;
    let staged = upload(&ctx, &flat_master(&shards, &first, 0))?;
    let staged2 = upload(&ctx, &flat_master(&shards, &second, 0))?;
    let m0: Vec<f32> = (0..len).map(|i| (i % 97) as f32 * 0.5).collect();
    let v0: Vec<f32> = (0..len).map(|i| (i % 89) as f32 * 0.25 + 1.0).collect();
    let (m, v) = (upload(&ctx, &m0)?, upload(&ctx, &v0)?);

    let released = Arc::new(AtomicUsize::new(0));
    let restored = Arc::new(AtomicUsize::new(0));
    let owner = || -> Box<dyn LentMemory> {
        Box::new(Owner {
            ctx: ctx.clone(),
            released: released.clone(),
            restored: restored.clone(),
        })
    };
    let pool = Arc::new(ThreadRankPool::new(world)?);
    assert_eq!(pool.local_ranks(), &[0]);
    let backend = FsdpBackend::new(pool, layout.clone()).lending()?;
    let parts = vec![LentParts {
        master: LentMaster::Flat { ptr: master, len },
        offload: vec![
            LentOffload::new("adam_m", BufferClass::Optimizer, m, len * 4, owner()),
            LentOffload::new("adam_v", BufferClass::Optimizer, v, len * 4, owner()),
        ],
        stream: Some(LentStream(stream as u64)),
    }];
    // SAFETY: every address is a live allocation of the stated size on GPU 0, kept until the
    // state is dropped (or released through `Owner`); the stream is live.
    let state = unsafe { backend.lend(train.clone(), parts)? };
    let memory = MemoryPolicy {
        offload_params: false,
        offload_optimizer: true,
        keep_rollout_resident: false,
    };
    let config = LifecycleConfig {
        memory,
        ..Default::default()
    };
    let mut lc = Lifecycle::with_config(backend, state, config)?;
    let addresses = Mutex::new(Vec::new());
    for (cycle, (staged, host)) in [(staged, &first), (staged2, &second)]
        .into_iter()
        .enumerate()
    {
        // The caller writes the weights on its own stream and does not wait: the switch must.
        // SAFETY: both are allocations of `len` f32 on this device; the stream is live.
        unsafe { result::memcpy_dtod_async(master, staged, len * 4, stream) }?;
        {
            let mut t = lc.train()?;
            // Mark the weights changed (the caller's update happened outside the lifecycle).
            let _ = t.state_mut();
        }
        let s = lc.rollout()?;
        let got = s.backend().download_rollout(&s.weights())?;
        let want = reference_rollout(&HostTrainState::from_tensors(world, host.clone())?, &layout)?;
        assert_eq!(
            want.first_difference(&got),
            None,
            "cycle {cycle}: rollout differs"
        );
        drop(s);
        let t = lc.train()?;
        let r = &t.state().ranks()[0];
        let now: Vec<u64> = r.offload().iter().filter_map(|o| o.device_ptr()).collect();
        assert_eq!(now.len(), 2, "cycle {cycle}: Adam state back on the device");
        addresses.lock().map_err(|_| "poisoned")?.push(now);
    }
    assert_eq!(
        released.load(Ordering::SeqCst),
        4,
        "m and v released at each enter"
    );
    assert_eq!(
        restored.load(Ordering::SeqCst),
        4,
        "m and v restored at each exit"
    );
    let (_backend, state) = lc.into_parts()?;
    let r = &state.ranks()[0];
    let back: Vec<u64> = r.offload().iter().filter_map(|o| o.device_ptr()).collect();
    assert_eq!(
        download(&ctx, back[0], len)?,
        m0,
        "Adam m after two offload cycles"
    );
    assert_eq!(
        download(&ctx, back[1], len)?,
        v0,
        "Adam v after two offload cycles"
    );
    eprintln!(
        "lent FSDP switch: 2 cycles bit-identical to the reference, Adam state released and \
         restored 4 times (addresses {:?})",
        addresses.lock().map_err(|_| "poisoned")?
    );
    drop(state);
    for p in [master, staged, staged2, back[0], back[1]] {
        // SAFETY: the test's allocations, no longer used.
        unsafe { result::free_sync(p) }?;
    }
    // SAFETY: the test's stream, idle (everything above synchronised).
    unsafe { result::stream::destroy(stream) }?;
    Ok(())
}

/// FSDP2's layout: one allocation per parameter shard (made in reverse order, so the addresses
/// are neither in training order nor adjacent), lent by address and read in place: bf16 and fp8
/// rollouts bit-identical to the CPU executor's; a shard of the wrong size is refused by name
/// before anything moves.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_fsdp_switch_reads_per_parameter_shards_in_place() -> Res {
    use lifecycle_layout::fp8::RolloutDtype;
    require_gpus(1)?;
    let (world, tp) = (1, 1);
    let mut specs = specs(tp);
    // a matrix of whole 128 x 128 blocks for the fp8 rollout as well
    specs.push(TensorSpec::new(
        "model.layers.0.mlp.up_proj.weight",
        [256, 128],
        Parallel::Column,
    ));
    let host = tensors(&specs, 5);
    let layout = RolloutLayout::new(tp, specs.clone())?;
    let train = FsdpLayout::new(
        world,
        specs.iter().map(|s| (s.name.clone(), s.shape.clone())),
    )?;
    let ctx = CudaContext::new(0)?;
    let mut allocations = Vec::new();
    let mut shards = vec![(0u64, 0usize); host.len()];
    for (i, t) in host.iter().enumerate().rev() {
        let data = t.data.to_f32().unwrap_or_default();
        let p = upload(&ctx, &data)?;
        allocations.push(p);
        shards[i] = (p, data.len());
    }
    let reference = HostTrainState::from_tensors(world, host.clone())?;
    for dtype in [RolloutDtype::Bf16, RolloutDtype::Fp8] {
        let pool = Arc::new(ThreadRankPool::new(world)?);
        let backend = FsdpBackend::new(pool, layout.clone())
            .with_rollout_dtype(dtype)
            .lending()?;
        let parts = vec![LentParts {
            master: LentMaster::Shards(shards.clone()),
            offload: Vec::new(),
            stream: None,
        }];
        // SAFETY: every shard is a live allocation of its stated size on GPU 0, kept until the
        // end of the test.
        let state = unsafe { backend.lend(train.clone(), parts)? };
        let mut lc = Lifecycle::new(backend, state);
        let s = lc.rollout()?;
        let got = s.backend().download_rollout(&s.weights())?;
        let want = match dtype {
            RolloutDtype::Bf16 => reference_rollout(&reference, &layout)?,
            RolloutDtype::Fp8 => lifecycle_host::fp8::fp8_switch(&reference, &layout)?,
        };
        assert_eq!(
            want.first_difference(&got),
            None,
            "{dtype:?}: rollout differs"
        );
        drop(s);
        eprintln!("per-parameter shards, {dtype:?}: bit-identical to the CPU executor");
    }
    // a shard one element short, refused naming its tensor
    let pool = Arc::new(ThreadRankPool::new(world)?);
    let backend = FsdpBackend::new(pool, layout.clone()).lending()?;
    let mut short = shards.clone();
    short[1].1 -= 1;
    let parts = vec![LentParts {
        master: LentMaster::Shards(short),
        offload: Vec::new(),
        stream: None,
    }];
    // SAFETY: as above (refused before anything is read).
    let err = unsafe { backend.lend(train.clone(), parts) }
        .err()
        .ok_or("a short shard must be refused")?
        .to_string();
    assert!(err.contains(&specs[1].name), "{err}");
    for p in allocations {
        // SAFETY: the test's allocations, no longer used.
        unsafe { result::free_sync(p) }?;
    }
    Ok(())
}
