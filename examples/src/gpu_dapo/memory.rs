//! What the GPU runs offload during rollout: by need (the default: the least that makes room
//! for the rollout weights and the engine's KV cache beside the training state, decided before
//! anything moves), always both master weights and Adam moments (verl's `param_offload` +
//! `optimizer_offload`), or nothing.

use lifecycle_core::{MemoryDecision, MemoryPolicy, RoomRequest};
use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use lifecycle_decoder::ModelConfig;
use lifecycle_decoder_gpu::EngineSettings;
use lifecycle_layout::fp8::{fp8_rank_traffic, Fp8Keep, RolloutDtype};
use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, RolloutFormat, RolloutLayout};

use super::DapoGpuError;

/// How the run chooses its memory policy (`--memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MemoryChoice {
    /// Offload the least that makes room for the rollout (nothing, when it fits).
    #[default]
    ByNeed,
    /// Offload master weights and Adam moments at every enter.
    Offload,
    /// Offload nothing (the rollout weights are refreshed in place).
    Resident,
}

/// Kept free beside the rollout: allocator rounding, cuBLAS and NCCL workspaces.
pub const MARGIN_BYTES: u64 = 2 << 30;

/// Bytes of rank `t`'s rollout weights in bf16 (an upper bound for an fp8 rollout,
/// [`held_rollout_bytes`] is exact): from the
/// layout's tensors, or, for a fused layout, the model's parameters over `T`.
pub fn rollout_bytes(config: &ModelConfig, layout: &RolloutLayout, t: usize) -> u64 {
    if layout.format() == RolloutFormat::Fused {
        return 2 * (config.params() as u64).div_ceil(layout.tp() as u64);
    }
    layout
        .tensors()
        .iter()
        .filter(|s| s.held_by(t))
        .map(|s| 2 * s.slice_shape(layout.tp()).iter().product::<usize>() as u64)
        .sum()
}

/// The most bytes a rank's rollout weights take in `dtype` (`keep` choosing an fp8 rollout's
/// bf16 tensors) with `world` training ranks: [`rollout_bytes`] for bf16 (an upper bound for a
/// fused layout); for a fused fp8 rollout the peak of the GPU Megatron switch, its bf16 staging
/// buffer beside the fp8 rollout; an unfused fp8 rollout's exact fp8 bytes and scales otherwise
/// ([`fp8_rank_traffic`]: 8.71 GB instead of 15.23 GB at 7.6B, T = 1).
///
/// ```
/// use lifecycle_decoder::ModelConfig;
/// use lifecycle_examples::gpu_dapo::memory::{held_rollout_bytes, rollout_bytes};
/// use lifecycle_layout::fp8::RolloutDtype;
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 512,
///     "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
///     "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
///     "tie_word_embeddings": false}"#)?;
/// let layout = config.rollout_layout(1)?;
/// let bf16 = held_rollout_bytes(&config, &layout, 1, (RolloutDtype::Bf16, Default::default()))?;
/// assert_eq!(bf16, rollout_bytes(&config, &layout, 0));
/// let fp8 = held_rollout_bytes(&config, &layout, 1, (RolloutDtype::Fp8, Default::default()))?;
/// assert!(fp8 < bf16 && fp8 > bf16 / 2);
/// // a fused fp8 rollout: the GPU switch's bf16 staging beside the fp8 buffer
/// let fused = lifecycle_layout::RolloutLayout::fused(1, lifecycle_layout::RolloutVocab::Unpadded);
/// let peak = held_rollout_bytes(&config, &fused, 1, (RolloutDtype::Fp8, Default::default()))?;
/// let fused_bf16 = held_rollout_bytes(&config, &fused, 1, (RolloutDtype::Bf16, Default::default()))?;
/// assert!(peak > fused_bf16 && peak < 2 * fused_bf16);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn held_rollout_bytes(
    config: &ModelConfig,
    layout: &RolloutLayout,
    world: usize,
    (dtype, keep): (RolloutDtype, Fp8Keep),
) -> Result<u64, DapoGpuError> {
    let bf16 = || {
        (0..layout.tp())
            .map(|t| rollout_bytes(config, layout, t))
            .max()
            .unwrap_or(0)
    };
    if dtype == RolloutDtype::Bf16 {
        return Ok(bf16());
    }
    let usage_m =
        |e: lifecycle_layout::megatron::MegatronLayoutError| DapoGpuError::Usage(e.to_string());
    if layout.format() == RolloutFormat::Fused {
        // the GPU Megatron switch's peak: the bf16 staging buffer beside the fp8 rollout
        let model = config.model_spec(lifecycle_decoder::MEGATRON_VOCAB_MULTIPLE);
        let specs = layout.fused_tensors(&model).map_err(usage_m)?;
        let offsets: Vec<usize> = specs
            .iter()
            .scan(0, |at, s| {
                let o = *at;
                *at += s.numel();
                Some(o)
            })
            .collect();
        let f = lifecycle_layout::megatron::fp8_rollout(&specs, &offsets, keep);
        return Ok(2 * (f.staging_len + f.len) as u64);
    }
    let usage = |e: lifecycle_layout::LayoutError| DapoGpuError::Usage(e.to_string());
    let train = FsdpLayout::new(world, config.tensor_shapes()).map_err(usage)?;
    let plan = plan_fsdp_to_tp(&train, layout).map_err(usage)?;
    let mut most = 0;
    for r in 0..world {
        most = most.max(
            fp8_rank_traffic(&plan, r, keep)
                .map_err(usage)?
                .rollout_bytes,
        );
    }
    Ok(most)
}

/// The policy of `choice`; for [`MemoryChoice::ByNeed`], decided from each local rank's free
/// memory (the training state built), its rollout weights (in `rollout`'s dtype,
/// [`held_rollout_bytes`]) and the KV cache of the engine `settings` over `replicas`, with the fp32 master weights and Adam moments
/// a rank holds (`W` = the pool's world) as what an offload may move.
pub fn resolve(
    choice: MemoryChoice,
    pool: &ThreadRankPool,
    config: &ModelConfig,
    layout: &RolloutLayout,
    settings: &EngineSettings,
    replicas: usize,
    rollout: (RolloutDtype, Fp8Keep),
) -> Result<(MemoryPolicy, Option<MemoryDecision>), DapoGpuError> {
    match choice {
        MemoryChoice::Offload => return Ok((MemoryPolicy::default(), None)),
        MemoryChoice::Resident => {
            let keep = MemoryPolicy {
                keep_rollout_resident: true,
                ..MemoryPolicy::resident()
            };
            return Ok((keep, None));
        }
        MemoryChoice::ByNeed => {}
    }
    let free = pool.run(&|ctx| ctx.device_memory())?;
    let free = free.iter().map(|&(f, _)| f).min().unwrap_or(0);
    let tp = layout.tp();
    let kv_heads = if config.model.query_groups >= tp {
        config.model.query_groups / tp.max(1)
    } else {
        1
    };
    let engine = settings.kv_bytes_per_rank(config, kv_heads, replicas);
    let rollout = held_rollout_bytes(config, layout, pool.world(), rollout)?;
    let per_rank = 4 * (config.params() as u64).div_ceil(pool.world() as u64);
    let request = RoomRequest {
        free,
        rollout,
        staging: 0,
        engine,
        margin: MARGIN_BYTES,
        grads: 0,
        optimizer: 2 * per_rank,
        params: per_rank,
    };
    let decision = MemoryPolicy::by_need(&request).map_err(DapoGpuError::Usage)?;
    Ok((decision.policy, Some(decision)))
}
