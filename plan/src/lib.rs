//! What a switch will move and cost, before launch: the transfer plan per rank of a training
//! layout (`fsdp:W` or `megatron:tp=…,pp=…,dp=…`) to a rollout TP degree, for a model given by its
//! Hugging Face `config.json`, and a predicted switch time from link bandwidths.
//!
//! The plans are the backends' own planners ([`lifecycle_layout::plan_fsdp_to_tp`] with the
//! FSDP backend's buckets, [`lifecycle_layout::megatron::plan_megatron_to_tp`]); nothing is
//! allocated. The prediction model:
//!
//! - transfer = max(bytes received from peers ÷ device↔device rate, local copy/cast traffic ÷
//!   device memory rate) — the floor the FSDP benchmark measures against;
//! - enter = max(transfer, offloaded bytes ÷ device→host rate): offload copies overlap the
//!   transfer on their own stream;
//! - exit = reloaded bytes ÷ host→device rate; a full switch is enter + exit;
//! - the job's figure is the slowest rank's.
//!
//! ```
//! use lifecycle_plan::{plan_fsdp, LinkRates, Offload};
//! use lifecycle_layout::ModelConfig;
//! let config = ModelConfig::from_json_str(include_str!("../configs/qwen2.5-7b.json"))?;
//! let ranks = plan_fsdp(&config, 2, 2, 256 << 20, 2, Offload::ALL)?;
//! // W = T = 2: a rank receives only the peer's quarter of each row-parallel tensor
//! assert!((ranks[0].recv_bytes as f64 / 1e9 - 1.131).abs() < 0.01);
//! let p = ranks[0].predict(&LinkRates::default());
//! assert!(p.enter_s > p.transfer_s); // the 45.7 GB offload dominates
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

mod rates;
mod train_arg;

use lifecycle_layout::fsdp::{build_plan, ShardLayout};
use lifecycle_layout::fsdp::{BucketConfig as FsdpBuckets, GatherMode};
use lifecycle_layout::megatron::{
    plan_megatron_to_tp, BucketConfig as MegatronBuckets, MegatronLayout,
};
use lifecycle_layout::ModelConfig;
use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout};
use lifecycle_layout::{ExpertPlacement, RolloutLayout, RolloutVocab};

pub use rates::{LinkRates, RatesSource};
pub use train_arg::TrainLayout;

/// Why a plan could not be made; each names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The model config or the rollout degree does not fit, or the FSDP layouts are
    /// inconsistent.
    #[error(transparent)]
    Layout(#[from] lifecycle_layout::LayoutError),
    /// The Megatron layouts are inconsistent.
    #[error(transparent)]
    Megatron(#[from] lifecycle_layout::megatron::MegatronLayoutError),
    /// A command-line value is malformed.
    #[error("{0}")]
    Arg(String),
}

/// What is offloaded during rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offload {
    /// Master weights (FSDP) / bf16 params and fp32 main params (Megatron).
    pub params: bool,
    /// Adam m and v.
    pub optimizer: bool,
}

impl Offload {
    /// Nothing offloaded.
    pub const NONE: Offload = Offload {
        params: false,
        optimizer: false,
    };
    /// Parameters and optimizer state offloaded.
    pub const ALL: Offload = Offload {
        params: true,
        optimizer: true,
    };
}

/// What one rank does in a switch.
#[derive(Debug, Clone, PartialEq)]
pub struct RankCost {
    /// The rank.
    pub rank: usize,
    /// Bytes of its rollout weights.
    pub rollout_bytes: u64,
    /// Bytes it receives from peers (device↔device).
    pub recv_bytes: u64,
    /// Bytes of device-memory traffic of its local casts and copies (reads + writes).
    pub local_traffic_bytes: u64,
    /// Buckets of its transfer.
    pub buckets: usize,
    /// Peak extra device memory above its rollout weights (staging).
    pub peak_extra_bytes: u64,
    /// Bytes it copies to host memory at enter.
    pub offload_bytes: u64,
    /// Bytes it copies back at exit.
    pub reload_bytes: u64,
    /// Bytes of its training state (weights and optimizer state, gradients freed) on the
    /// device while nothing is offloaded.
    pub train_state_bytes: u64,
}

/// One rank's device memory during rollout: what stays of its training state, its rollout
/// weights and transfer staging, and the room left for the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutMemory {
    /// The device's memory.
    pub device_bytes: u64,
    /// Training state left on the device by the offload policy.
    pub train_resident_bytes: u64,
    /// Rollout weights.
    pub rollout_bytes: u64,
    /// Transfer staging (freed after enter, but its peak must fit).
    pub staging_bytes: u64,
    /// KV cache bytes per token of one sequence on this rank (every layer's K and V of the
    /// rank's kv heads, in the [`KvDtype`] asked for).
    pub kv_bytes_per_token: u64,
}

/// The element type of the rollout engine's KV cache, for the memory accounting.
pub use lifecycle_layout::KvDtype;

impl RolloutMemory {
    /// Bytes left for the KV cache (0 when the rest does not fit).
    pub fn kv_room(&self) -> u64 {
        self.device_bytes
            .saturating_sub(self.train_resident_bytes + self.rollout_bytes)
    }

    /// Tokens of KV cache (summed over the sequences) that fit in [`RolloutMemory::kv_room`].
    pub fn kv_tokens(&self) -> u64 {
        self.kv_room() / self.kv_bytes_per_token.max(1)
    }
}

/// The rollout memory of `cost`'s rank holding `rollout_bytes` of weights (bf16, or an fp8
/// rollout's), on a device of `device_bytes`, for `config` at rollout degree `tp` with a KV
/// cache of `kv`.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_plan::{plan_fsdp, rollout_memory, KvDtype, Offload};
/// let config = ModelConfig::from_file("configs/qwen2.5-7b.json".as_ref())?;
/// let ranks = plan_fsdp(&config, 2, 2, 256 << 20, 2, Offload::ALL)?;
/// let r = &ranks[0];
/// let m = rollout_memory(&config, 2, r, r.rollout_bytes, 139 << 30, KvDtype::Bf16);
/// // 28 layers x (k + v) x 2 kv heads x 128 x 2 bytes
/// assert_eq!((m.train_resident_bytes, m.kv_bytes_per_token), (0, 28 * 2 * 2 * 128 * 2));
/// assert!(m.kv_tokens() > 300_000);
/// // fp8: a byte per element and an f32 scale per kv head
/// let fp8 = rollout_memory(&config, 2, r, r.rollout_bytes, 139 << 30, KvDtype::Fp8);
/// assert_eq!(fp8.kv_bytes_per_token, 28 * 2 * 2 * (128 + 4));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rollout_memory(
    config: &ModelConfig,
    tp: usize,
    cost: &RankCost,
    rollout_bytes: u64,
    device_bytes: u64,
    kv: KvDtype,
) -> RolloutMemory {
    let kv_heads = if config.model.query_groups >= tp {
        config.model.query_groups / tp.max(1)
    } else {
        1
    };
    RolloutMemory {
        device_bytes,
        train_resident_bytes: cost.train_state_bytes.saturating_sub(cost.offload_bytes),
        rollout_bytes,
        staging_bytes: cost.peak_extra_bytes,
        kv_bytes_per_token: (config.model.layers
            * 2
            * kv_heads
            * kv.head_bytes(config.model.head_dim)) as u64,
    }
}

/// Predicted times of one rank's switch, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// The transfer phase.
    pub transfer_s: f64,
    /// The offload copies.
    pub offload_s: f64,
    /// Enter (transfer and offload overlapped).
    pub enter_s: f64,
    /// Exit (reload).
    pub exit_s: f64,
}

impl Prediction {
    /// Enter + exit.
    pub fn switch_s(&self) -> f64 {
        self.enter_s + self.exit_s
    }
}

impl RankCost {
    /// The predicted times at `rates`.
    pub fn predict(&self, rates: &LinkRates) -> Prediction {
        let secs = |bytes: u64, gbps: f64| bytes as f64 / (gbps * 1e9);
        let transfer_s = secs(self.recv_bytes, rates.nvlink_gbps)
            .max(secs(self.local_traffic_bytes, rates.hbm_gbps));
        let offload_s = secs(self.offload_bytes, rates.d2h_gbps);
        Prediction {
            transfer_s,
            offload_s,
            enter_s: transfer_s.max(offload_s),
            exit_s: secs(self.reload_bytes, rates.h2d_gbps),
        }
    }
}

/// The slowest rank's prediction (per field).
pub fn job_prediction(ranks: &[RankCost], rates: &LinkRates) -> Prediction {
    ranks.iter().map(|r| r.predict(rates)).fold(
        Prediction {
            transfer_s: 0.0,
            offload_s: 0.0,
            enter_s: 0.0,
            exit_s: 0.0,
        },
        |a, b| Prediction {
            transfer_s: a.transfer_s.max(b.transfer_s),
            offload_s: a.offload_s.max(b.offload_s),
            enter_s: a.enter_s.max(b.enter_s),
            exit_s: a.exit_s.max(b.exit_s),
        },
    )
}

/// The FSDP backend's plan for `world` ranks to rollout degree `tp`, with its bucket settings
/// (T = 1 uses the all-gather mode, as the benchmark's fastest T = 1 configuration); the experts
/// of a mixture-of-experts model split by TP inside every expert ([`plan_fsdp_experts`] chooses).
pub fn plan_fsdp(
    config: &ModelConfig,
    world: usize,
    tp: usize,
    bucket_bytes: u64,
    in_flight: usize,
    offload: Offload,
) -> Result<Vec<RankCost>, PlanError> {
    plan_fsdp_experts(
        config,
        world,
        tp,
        bucket_bytes,
        in_flight,
        offload,
        ExpertPlacement::TensorParallel,
    )
}

/// [`plan_fsdp`] with the experts placed by `experts`: with [`ExpertPlacement::Partitioned`]
/// each rollout rank receives only its own experts' bytes.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_layout::ExpertPlacement;
/// use lifecycle_plan::{full_gather_bytes, plan_fsdp_experts, Offload};
/// let config = ModelConfig::from_json_str(include_str!("../configs/qwen3-30b-a3b.json"))?;
/// let ep = plan_fsdp_experts(&config, 8, 8, 256 << 20, 2, Offload::NONE, ExpertPlacement::Partitioned)?;
/// // every rank holds 16 of the 128 experts: far less than the whole model a full gather moves
/// assert!(ep[0].rollout_bytes * 5 < full_gather_bytes(&config));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan_fsdp_experts(
    config: &ModelConfig,
    world: usize,
    tp: usize,
    bucket_bytes: u64,
    in_flight: usize,
    offload: Offload,
    experts: ExpertPlacement,
) -> Result<Vec<RankCost>, PlanError> {
    let train = FsdpLayout::new(world, config.tensor_shapes())?;
    let rollout = config.rollout_layout_with(tp, experts)?;
    let core = plan_fsdp_to_tp(&train, &rollout)?;
    let mode = if tp == 1 && world > 1 {
        GatherMode::AllGather
    } else {
        GatherMode::SendRecv
    };
    let plan = build_plan(
        core,
        &train,
        FsdpBuckets {
            bucket_bytes,
            in_flight: in_flight.max(2),
            mode,
        },
    );
    let shard = ShardLayout::new(&train).rank_len;
    let state_bytes = shard * 4 * (u64::from(offload.params) + 2 * u64::from(offload.optimizer));
    Ok((0..world)
        .map(|r| RankCost {
            rank: r,
            rollout_bytes: plan.core.ranks[r].total_elements() as u64 * 2,
            recv_bytes: plan.recv_bytes(r),
            // each cast element reads 4 bytes of fp32 and writes 2 of bf16
            local_traffic_bytes: plan.cast_bytes(r) * 3,
            buckets: plan.buckets(),
            peak_extra_bytes: (plan.staging_slots(r) as u64 * plan.slot_elems
                + plan.recv_staging_slots(r) as u64 * plan.recv_slot_elems)
                * 2,
            offload_bytes: state_bytes,
            reload_bytes: state_bytes,
            // fp32 master, Adam m and v
            train_state_bytes: shard * 12,
        })
        .collect())
}

/// What an fp8 rollout (block-scaled e4m3, [`lifecycle_layout::fp8`]) would hold and receive
/// per rank for the FSDP plan of `world` ranks to degree `tp`, against bf16: one entry per rank.
/// Blocks that cut a TP slice are an error naming the tensor.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_layout::ExpertPlacement;
/// use lifecycle_plan::plan_fsdp_fp8;
/// let config = ModelConfig::from_json_str(include_str!("../configs/qwen2.5-7b.json"))?;
/// let ranks = plan_fsdp_fp8(&config, 2, 2, ExpertPlacement::TensorParallel, Default::default())?;
/// // the projections halve; the embedding and head (1.09 B of the 7.6 B) stay bf16
/// let r = ranks[0];
/// assert!(r.rollout_bytes * 10 < r.rollout_bytes_bf16 * 6);
/// // what crosses the link halves too, plus one 4-byte scale per 128 x 128 block
/// assert!(r.recv_bytes * 2 < r.recv_bytes_bf16 * 101 / 100);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan_fsdp_fp8(
    config: &ModelConfig,
    world: usize,
    tp: usize,
    experts: ExpertPlacement,
    keep: lifecycle_layout::fp8::Fp8Keep,
) -> Result<Vec<lifecycle_layout::fp8::Fp8Traffic>, PlanError> {
    let train = FsdpLayout::new(world, config.tensor_shapes())?;
    let rollout = config.rollout_layout_with(tp, experts)?;
    let core = plan_fsdp_to_tp(&train, &rollout)?;
    lifecycle_layout::fp8::check_fp8_plan(&core, keep)?;
    (0..world)
        .map(|r| Ok(lifecycle_layout::fp8::fp8_rank_traffic(&core, r, keep)?))
        .collect()
}

/// The bf16 bytes of the whole model: what each rank would hold after a full gather of every
/// tensor (the unsharded approach, which materialises the full model on every rank and then
/// slices it).
pub fn full_gather_bytes(config: &ModelConfig) -> u64 {
    config.params() as u64 * 2
}

/// The Megatron planner's plan for TP × PP × DP to rollout degree `t` (vocabulary unpadded when
/// `t` divides it, padded to a multiple of 64 × `t` otherwise). A mixture-of-experts model gets
/// Megatron's default expert layout, EP 1 and expert TP = TP, and its experts split by TP in
/// the rollout ([`plan_megatron_moe`] chooses both).
#[allow(clippy::too_many_arguments)]
pub fn plan_megatron(
    config: &ModelConfig,
    tp: usize,
    pp: usize,
    dp: usize,
    t: usize,
    make_vocab_size_divisible_by: usize,
    bucket_bytes: u64,
    offload: Offload,
) -> Result<Vec<RankCost>, PlanError> {
    plan_megatron_moe(
        config,
        (tp, pp, dp),
        (1, tp),
        (t, ExpertPlacement::TensorParallel),
        make_vocab_size_divisible_by,
        bucket_bytes,
        offload,
    )
}

/// Bytes one rank holds of an fp8 rollout of the fused layout at degree `t` (each fused matrix
/// quantised in its own 128 × 128 grid, the tensors `keep` chooses and the exemptions bf16),
/// and of the same rollout in bf16; refused as the Megatron host backend refuses it
/// ([`check_fused_fp8`](lifecycle_layout::megatron::check_fused_fp8)).
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_layout::ExpertPlacement;
/// use lifecycle_plan::megatron_fp8_bytes;
/// let config = ModelConfig::from_file("configs/qwen2.5-7b.json".as_ref())?;
/// let (fp8, bf16) = megatron_fp8_bytes(&config, 2, ExpertPlacement::TensorParallel, Default::default(), 128)?;
/// assert!(fp8 * 10 < bf16 * 6 && fp8 * 2 > bf16);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn megatron_fp8_bytes(
    config: &ModelConfig,
    t: usize,
    placement: ExpertPlacement,
    keep: lifecycle_layout::fp8::Fp8Keep,
    make_vocab_size_divisible_by: usize,
) -> Result<(u64, u64), PlanError> {
    let model = config.model_spec(make_vocab_size_divisible_by);
    let vocab = if t > 0 && config.model.vocab.is_multiple_of(t) {
        RolloutVocab::Unpadded
    } else {
        RolloutVocab::PadToMultipleOf(64)
    };
    let specs = RolloutLayout::fused(t, vocab)
        .with_expert_placement(placement)
        .fused_tensors(&model)?;
    lifecycle_layout::megatron::check_fused_fp8(&specs, &model, t, keep)?;
    let block = lifecycle_layout::fp8::FP8_BLOCK as u64;
    let (mut fp8, mut bf16) = (0u64, 0u64);
    for s in &specs {
        let n = s.numel() as u64;
        bf16 += 2 * n;
        fp8 += if keep.keeps_bf16(&s.name, &s.shape) {
            2 * n
        } else {
            // a matrix, or a stack of expert matrices in its (experts · rows) × cols view
            let cols = s.shape.last().copied().unwrap_or(1).max(1) as u64;
            let rows = n / cols;
            n + 4 * rows.div_ceil(block) * cols.div_ceil(block)
        };
    }
    Ok((fp8, bf16))
}

/// The planner's plan from the Megatron layout `(tp, pp, dp)` with experts `(ep, etp)` to the
/// fused rollout at degree `t` (the vocabulary padded to 64 rows where `t` does not divide it).
fn megatron_plan(
    config: &ModelConfig,
    (tp, pp, dp): (usize, usize, usize),
    (ep, etp): (usize, usize),
    (t, placement): (usize, ExpertPlacement),
    make_vocab_size_divisible_by: usize,
    bucket_bytes: u64,
) -> Result<lifecycle_layout::megatron::MegatronPlan, PlanError> {
    let model = config.model_spec(make_vocab_size_divisible_by);
    let train = MegatronLayout::new_moe(model, tp, pp, dp, ep, etp)?;
    let vocab = if t > 0 && config.model.vocab.is_multiple_of(t) {
        RolloutVocab::Unpadded
    } else {
        RolloutVocab::PadToMultipleOf(64)
    };
    let rollout = RolloutLayout::fused(t, vocab).with_expert_placement(placement);
    Ok(plan_megatron_to_tp(
        &train,
        &rollout,
        MegatronBuckets { bucket_bytes },
    )?)
}

/// How the GPU Megatron backend writes an fp8 rollout of a layout ([`megatron_fp8_switch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MegatronFp8Switch {
    /// Quantised straight from every rank's bf16 parameters
    /// ([`fp8_one_read`](lifecycle_layout::megatron::fp8_one_read)): no staging buffer.
    OneRead,
    /// The bf16 rollout staged first, then quantised: `staging_bytes` per rank beside the fp8
    /// rollout during a switch (freed after it).
    Staged {
        /// Bytes of the bf16 staging buffer per rank.
        staging_bytes: u64,
    },
}

/// Whether the GPU Megatron backend's fp8 switch of the Megatron layout `(tp, pp, dp)` with
/// experts `(ep, etp)`, rolled out at degree `t` with the experts placed by `placement`, reads
/// the parameters once or stages the bf16 rollout first (and how much); refused as the
/// backends refuse the layout.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_layout::ExpertPlacement;
/// use lifecycle_plan::{megatron_fp8_switch, MegatronFp8Switch};
/// let config = ModelConfig::from_file("configs/qwen2.5-7b.json".as_ref())?;
/// let tp = ExpertPlacement::TensorParallel;
/// let switch = |train, t| megatron_fp8_switch(&config, train, (1, train.0), (t, tp), Default::default(), 128, 256 << 20);
/// // every rank holds its rows: one read
/// assert_eq!(switch((1, 1, 2), 2)?, MegatronFp8Switch::OneRead);
/// // T = 1 from TP = 2: half of every row comes from the peer, staged
/// assert!(matches!(switch((2, 1, 1), 1)?, MegatronFp8Switch::Staged { staging_bytes } if staging_bytes > 15_000_000_000));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn megatron_fp8_switch(
    config: &ModelConfig,
    (tp, pp, dp): (usize, usize, usize),
    (ep, etp): (usize, usize),
    (t, placement): (usize, ExpertPlacement),
    keep: lifecycle_layout::fp8::Fp8Keep,
    make_vocab_size_divisible_by: usize,
    bucket_bytes: u64,
) -> Result<MegatronFp8Switch, PlanError> {
    use lifecycle_layout::megatron::{check_fused_fp8, fp8_one_read, fp8_rollout};
    let plan = megatron_plan(
        config,
        (tp, pp, dp),
        (ep, etp),
        (t, placement),
        make_vocab_size_divisible_by,
        bucket_bytes,
    )?;
    let model = *plan.train.model();
    check_fused_fp8(&plan.tensors, &model, t, keep)?;
    let (offsets, _) = lifecycle_layout::megatron::schedule::rollout_offsets(&plan);
    let f = fp8_rollout(&plan.tensors, &offsets, keep);
    Ok(match fp8_one_read(&plan, &f) {
        Some(_) => MegatronFp8Switch::OneRead,
        None => MegatronFp8Switch::Staged {
            staging_bytes: 2 * f.staging_len as u64,
        },
    })
}

/// [`plan_megatron`] for a mixture-of-experts model trained with expert parallelism `ep` and
/// expert TP `etp` (Megatron-Core's ETP × EP × EDP × PP expert ranks), rolled out at degree `t`
/// with the experts placed by `placement`. Each rank receives only the expert bytes of its
/// rollout slice that it does not train itself.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// use lifecycle_layout::ExpertPlacement;
/// use lifecycle_plan::{plan_megatron_moe, Offload};
/// let config = ModelConfig::from_file("configs/qwen3-30b-a3b.json".as_ref())?;
/// let plan = |placement| {
///     // W = 8 (TP 1, DP 8), EP 8: each rank trains 16 of the 128 experts of every layer
///     plan_megatron_moe(&config, (1, 1, 8), (8, 1), (8, placement), 128, 256 << 20, Offload::NONE)
/// };
/// let ep = plan(ExpertPlacement::Partitioned)?;
/// let tp = plan(ExpertPlacement::TensorParallel)?;
/// // rolled out at T = 8 with the experts partitioned, a rank receives only attention and
/// // embedding slices; split by TP inside every expert, 7/8 of its experts come from peers
/// assert!(ep[0].recv_bytes * 20 < tp[0].recv_bytes);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan_megatron_moe(
    config: &ModelConfig,
    (tp, pp, dp): (usize, usize, usize),
    (ep, etp): (usize, usize),
    (t, placement): (usize, ExpertPlacement),
    make_vocab_size_divisible_by: usize,
    bucket_bytes: u64,
    offload: Offload,
) -> Result<Vec<RankCost>, PlanError> {
    let plan = megatron_plan(
        config,
        (tp, pp, dp),
        (ep, etp),
        (t, placement),
        make_vocab_size_divisible_by,
        bucket_bytes,
    )?;
    let train = &plan.train;
    let rollout_bytes: u64 = plan.tensors.iter().map(|s| s.numel() as u64 * 2).sum();
    Ok(plan
        .ranks
        .iter()
        .map(|r| {
            let c = train.coords(r.rank);
            let params = train.stage_len(c.pp) as u64;
            let shard = train.optimizer_shard(r.rank).len() as u64;
            let state = u64::from(offload.params) * (2 * params + 4 * shard)
                + u64::from(offload.optimizer) * 8 * shard;
            RankCost {
                rank: r.rank,
                rollout_bytes,
                recv_bytes: r.remote_bytes(),
                // bf16 copies: read and write
                local_traffic_bytes: r.local_bytes() * 2,
                buckets: r.buckets.len(),
                peak_extra_bytes: (0..r.buckets.len())
                    .map(|k| r.bucket_remote_bytes(k))
                    .max()
                    .unwrap_or(0),
                offload_bytes: state,
                reload_bytes: state,
                // bf16 params, fp32 main params of the optimizer shard, Adam m and v
                train_state_bytes: 2 * params + 12 * shard,
            }
        })
        .collect())
}
