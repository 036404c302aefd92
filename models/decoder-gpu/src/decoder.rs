//! [`GpuDecoder`]: the decoder on the GPUs of a backend's rank pool, reading the resident
//! rollout weights in place. What it shares with the persistent [`GpuEngine`](crate::GpuEngine)
//! is the `core` module's `Core`: each rank's state, the weights binding, the KV cache, the passes.

use std::marker::PhantomData;

use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use lifecycle_cuda::{RolloutBuffer, RolloutSource};
use lifecycle_decoder::{DecodeError, Decoder, KvDtype, ModelConfig, PrefillLogits, Sampling};
use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::{RolloutEntry, RolloutLayout};

use crate::error::GpuDecodeError;
use crate::fp8::GEMV_TOKENS;
use crate::topology::decode_topology;
use crate::w8a8::{BF16_MMA_TOKENS, MMA_TOKENS};
use crate::weights::GroupOffsets;

mod core;
mod forward;
mod graph;
mod kv;
mod merge;
mod moe;
mod pages;
mod rank;
mod slots;

pub(crate) use self::core::{Core, KvMode};
pub use self::core::{MAX_CONTEXT, ROOM_MARGIN_BYTES};
pub(crate) use forward::RowPick;
pub(crate) use kv::kv_elements;
pub use merge::LoraMode;
pub use moe::DEVICE_ROWS as MOE_DEVICE_ROWS;
pub use pages::KV_PAGE_POSITIONS;

/// The Qwen2 / Llama decoder on NVIDIA GPUs: one tensor-parallel group of `T` ranks (the whole
/// [`ThreadRankPool`] of a GPU backend ([`RolloutSource`]), `W = T`), reading the backend's
/// resident bf16 rollout weights ([`RolloutBuffer`]) in place.
///
/// - Topology ([`decode_topology`]): a group of `W = T` ranks (threads of this process, or one
///   process per rank: every process gets the full logits after the all-gather and picks the
///   same tokens, sampling being seeded); or, at `T = 1` with every rank in this process, `W`
///   data-parallel replicas: each GPU decodes a contiguous share of the batch
///   ([`replica_rows`](crate::replica_rows)) on its own copy of the weights, with no collective.
///   Sampling draws per sequence, not per replica, so the tokens do not depend on which replica
///   decodes a row. `W > T` with `T > 1`, and replicas across processes, are
///   [`GpuDecodeError::Topology`].
/// - Column-parallel q/k/v/gate/up, row-parallel o/down followed by an NCCL all-reduce (sum) over
///   the group; kv heads replicated when there are fewer than `T` (each rank reads the rows of the
///   kv heads its query heads use); embedding and head vocabulary-parallel or replicated as the
///   layout says (a vocabulary-parallel embedding gathers by an all-reduce of zero-padded rows,
///   the head's logits by an NCCL all-gather).
/// - Matrix products: cuBLAS `GemmEx`, bf16 weights × bf16 activations, f32 accumulation and
///   output. f32 activations are split into `hi = bf16(x)`, `lo = bf16(x − hi)` rows of one GEMM
///   (the weights are read once), so products see ~16-bit activations (see `kernels`).
/// - Small kernels (RMSNorm, RoPE, attention over an f32 or bf16 KV cache, SwiGLU, embedding gather,
///   residual adds) compiled at run time with NVRTC.
/// - Sampling with the CPU decoder's seeding and rule: `prefill` / `decode_step` return logits
///   on the host; `generate` picks greedy or temperature-sampled tokens on the device and
///   downloads only them.
///
/// - Both rollout layouts: the FSDP backends' unfused one ([`GpuDecoder::new`],
///   [`GpuDecoder::with_pool`]) and the Megatron backends' fused one
///   ([`GpuDecoder::with_fused_layout`]: one GEMM for `qkv_proj`, one for `gate_up_proj`; padded
///   vocabulary rows are dropped from the logits, so they are never sampled).
///
/// Building it checks every weight and creates cuBLAS handles and kernels (about a millisecond);
/// a rollout loop that calls it often keeps a [`GpuEngine`](crate::GpuEngine) attached to the
/// lifecycle instead, which does that once and keeps its KV cache across the calls of one weight
/// version.
///
/// Built from a rollout session of a [`Lifecycle`](lifecycle_core::Lifecycle) of a GPU backend
/// (here the FSDP one), so it cannot outlive the weights it reads:
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_decoder::{load_checkpoint, Decoder, Sampling};
/// use lifecycle_decoder_gpu::GpuDecoder;
/// use lifecycle_fsdp::FsdpBackend;
///
/// let ckpt = load_checkpoint("path/to/checkpoint".as_ref())?;
/// let pool = Arc::new(ThreadRankPool::new(2)?);
/// let backend = FsdpBackend::new(pool, ckpt.config.rollout_layout(2)?);
/// let state = backend.state_from_tensors(ckpt.tensors)?;
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let mut decoder = GpuDecoder::new(&ckpt.config, session.backend(), session.weights().get())?;
/// let out = decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(8))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GpuDecoder<'w> {
    core: Core,
    pool: &'w ThreadRankPool,
    _weights: PhantomData<&'w RolloutBuffer>,
}

impl std::fmt::Debug for GpuDecoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("tp", &self.core.tp)
            .field("topology", &self.core.topology)
            .field("geometry", &self.core.geo)
            .field("sequences", &self.core.lens.len())
            .field("cache_capacity", &self.core.cap())
            .finish()
    }
}

impl<'w> GpuDecoder<'w> {
    /// A decoder over the rollout weights `weights` of `backend` (its rank pool is the TP group,
    /// `W = T`, or `W` replicas at `T = 1`; see [`decode_topology`]). Every tensor is checked
    /// against `config` and the backend's layout here; each rank creates its cuBLAS handle and
    /// compiles the kernels.
    pub fn new(
        config: &ModelConfig,
        backend: &'w impl RolloutSource,
        weights: &'w RolloutBuffer,
    ) -> Result<Self, GpuDecodeError> {
        Self::with_pool(
            config,
            backend.rollout_layout(),
            backend.rank_pool(),
            weights,
        )
    }

    /// As [`GpuDecoder::new`] with the layout and pool given separately.
    pub fn with_pool(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &'w ThreadRankPool,
        weights: &'w RolloutBuffer,
    ) -> Result<Self, GpuDecodeError> {
        let tp = layout.tp();
        decode_topology(pool.world(), tp, pool.local_ranks().len())?;
        let plan = GroupOffsets::new(config, layout, &group_entries(weights, tp)?)?;
        Self::build(config, tp, &plan, pool, weights)
    }

    /// A decoder (as [`GpuDecoder::new`]) over a rollout that holds the LoRA adapters of `lora`
    /// beside their bases (`lifecycle_layout::lora::with_adapters`): every adapted linear adds
    /// `s·(x·Aᵀ)·Bᵀ` to its base product, unmerged, `s` the configuration's scaling (as
    /// `lifecycle_decoder::CpuDecoder::new_lora`). Refused by name: an adapter of another rank
    /// `r`, a target the configuration lists that the rollout lacks or one it holds that the
    /// configuration does not list, an fp8 rollout.
    ///
    /// ```no_run
    /// # fn demo(config: &lifecycle_decoder::ModelConfig,
    /// #         backend: &lifecycle_fsdp::FsdpBackend,
    /// #         weights: &lifecycle_cuda::RolloutBuffer) -> Result<(), Box<dyn std::error::Error>> {
    /// use lifecycle_decoder::{Decoder, Sampling};
    /// use lifecycle_decoder_gpu::GpuDecoder;
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let lora = LoraConfig::new(64, 128.0, LoraTarget::ALL.to_vec());
    /// let mut decoder = GpuDecoder::new_lora(config, backend, weights, &lora)?;
    /// let out = decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(8))?;
    /// # Ok(()) }
    /// ```
    pub fn new_lora(
        config: &ModelConfig,
        backend: &'w impl RolloutSource,
        weights: &'w RolloutBuffer,
        lora: &lifecycle_layout::lora::LoraConfig,
    ) -> Result<Self, GpuDecodeError> {
        Self::new_lora_as(config, backend, weights, lora, LoraMode::Unmerged)
    }

    /// A decoder (as [`GpuDecoder::new_lora`]) that applies the adapters as `mode` says: with
    /// [`LoraMode::Merged`] it reads a private bf16 copy of the rollout weights in which every
    /// adapted matrix holds `W + s·B·A` (made here; [`GpuDecoder::last_merge_time`] says how
    /// long that took). Refused by name as [`GpuDecoder::new_lora`].
    ///
    /// ```no_run
    /// # fn demo(config: &lifecycle_decoder::ModelConfig,
    /// #         backend: &lifecycle_fsdp::FsdpBackend,
    /// #         weights: &lifecycle_cuda::RolloutBuffer) -> Result<(), Box<dyn std::error::Error>> {
    /// use lifecycle_decoder_gpu::{GpuDecoder, LoraMode};
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let lora = LoraConfig::new(64, 128.0, LoraTarget::ALL.to_vec());
    /// let decoder = GpuDecoder::new_lora_as(config, backend, weights, &lora, LoraMode::Merged)?;
    /// println!("merged in {:?}", decoder.last_merge_time());
    /// # Ok(()) }
    /// ```
    pub fn new_lora_as(
        config: &ModelConfig,
        backend: &'w impl RolloutSource,
        weights: &'w RolloutBuffer,
        lora: &lifecycle_layout::lora::LoraConfig,
        mode: LoraMode,
    ) -> Result<Self, GpuDecodeError> {
        let (layout, pool) = (backend.rollout_layout(), backend.rank_pool());
        let tp = layout.tp();
        decode_topology(pool.world(), tp, pool.local_ranks().len())?;
        let plan = GroupOffsets::new(config, layout, &group_entries(weights, tp)?)?;
        let mut core = Core::new(config, tp, pool)?;
        core.lora = Some(lora.clone());
        core.lora_mode = mode;
        core.bind(pool, &plan, weights, None)?;
        Ok(GpuDecoder {
            core,
            pool,
            _weights: PhantomData,
        })
    }

    /// A decoder over rollout weights in the Megatron backends' fused layout `layout`
    /// (`MegatronGpuBackend::rollout_layout`): per rank `qkv_proj` = `[q; k; v]` and
    /// `gate_up_proj` = `[gate; up]`, each one GEMM; a vocabulary-parallel embedding and head
    /// whose padding rows are never read or sampled.
    ///
    /// ```no_run
    /// # fn demo(config: &lifecycle_decoder::ModelConfig,
    /// #         layout: &lifecycle_layout::RolloutLayout,
    /// #         pool: &lifecycle_cuda::ThreadRankPool,
    /// #         weights: &lifecycle_cuda::RolloutBuffer) -> Result<(), Box<dyn std::error::Error>> {
    /// use lifecycle_decoder::{Decoder, Sampling};
    /// use lifecycle_decoder_gpu::GpuDecoder;
    /// let mut decoder = GpuDecoder::with_fused_layout(config, layout, pool, weights)?;
    /// let out = decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(8))?;
    /// # Ok(()) }
    /// ```
    pub fn with_fused_layout(
        config: &ModelConfig,
        layout: &lifecycle_layout::RolloutLayout,
        pool: &'w ThreadRankPool,
        weights: &'w RolloutBuffer,
    ) -> Result<Self, GpuDecodeError> {
        decode_topology(pool.world(), layout.tp(), pool.local_ranks().len())?;
        let plan = GroupOffsets::fused(config, layout, weights.entries())?;
        Self::build(config, layout.tp(), &plan, pool, weights)
    }

    fn build(
        config: &ModelConfig,
        tp: usize,
        plan: &GroupOffsets,
        pool: &'w ThreadRankPool,
        weights: &'w RolloutBuffer,
    ) -> Result<Self, GpuDecodeError> {
        let mut core = Core::new(config, tp, pool)?;
        core.bind(pool, plan, weights, None)?;
        Ok(GpuDecoder {
            core,
            pool,
            _weights: PhantomData,
        })
    }

    /// Tokens in each sequence's cache.
    pub fn lengths(&self) -> Vec<usize> {
        self.core.lengths()
    }

    /// How the products with fp8 rollout weights compute ([`Fp8Compute`]): weight-only (the
    /// default: e4m3 weights against the activations in f32) or W8A8 (the activations quantised
    /// per token in 1 × 128 groups on the device, once per input, then the decoder's
    /// tensor-core kernel up to [`GpuDecoder::set_fp8_mma_tokens`] tokens and cuBLASLt's
    /// block-scaled fp8 GEMM beyond, or the weight-streaming kernel up to
    /// [`GpuDecoder::set_fp8_gemv_tokens`] tokens), as the CPU
    /// decoder's [`set_fp8_compute`](lifecycle_decoder::CpuDecoder::set_fp8_compute). bf16
    /// weights are not affected. Fails, changing nothing, when W8A8 is asked for and cuBLASLt
    /// cannot be loaded.
    pub fn set_fp8_compute(&mut self, compute: Fp8Compute) -> Result<(), GpuDecodeError> {
        self.core.set_fp8_compute(self.pool, compute)
    }

    /// Keeps the KV cache of the next prefill in `kv`: f32 (the default: the exact mode in which
    /// the decoder matches the transformers oracles), bf16 (half the bytes, each element
    /// rounded to nearest even when stored, as vLLM and SGLang keep it) or fp8 (e4m3 with one
    /// f32 scale per position and kv head, [`KvDtype::store_head`]: `(head_dim + 4) / (4 ·
    /// head_dim)` of f32's bytes; for `head_dim` a multiple of 4 up to 256). The CPU decoder's
    /// [`set_kv_dtype`](lifecycle_decoder::CpuDecoder::set_kv_dtype) is the reference of both
    /// (`tests/gpu.rs` checks them against it on the GPU). Drops the sequences the cache holds;
    /// a dtype refused changes nothing.
    ///
    /// ```no_run
    /// use lifecycle_decoder::KvDtype;
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn bf16_cache(decoder: &mut GpuDecoder<'_>) -> Result<(), lifecycle_decoder_gpu::GpuDecodeError> {
    ///     decoder.set_kv_dtype(KvDtype::Bf16)?;
    ///     assert_eq!(decoder.kv_dtype(), KvDtype::Bf16);
    ///     Ok(())
    /// }
    /// ```
    pub fn set_kv_dtype(&mut self, kv: KvDtype) -> Result<(), GpuDecodeError> {
        self.core.set_kv_dtype(kv)
    }

    /// The element type of the KV cache ([`GpuDecoder::set_kv_dtype`]).
    pub fn kv_dtype(&self) -> KvDtype {
        self.core.kv_dtype()
    }

    /// Bytes of the KV cache on the rank that holds the most (0 before the first prefill).
    pub fn kv_bytes(&self) -> u64 {
        self.core.kv_bytes()
    }

    /// Tokens (0 to 8, default 0) up to which a W8A8 product runs the fp8 weight-streaming
    /// kernel on the dequantised activations instead of the tensor-core products: the two
    /// compute the same products (the kernel's f32 sums exact, the tensor cores' within about
    /// 1e-7 of Σ|terms|); both read each weight byte once (BENCHMARKS.md has the timings on an
    /// H200). A single token the tensor-core kernel cannot read goes to this kernel whatever
    /// the setting. Returns the setting (clamped).
    pub fn set_fp8_gemv_tokens(&mut self, tokens: usize) -> usize {
        let tokens = tokens.min(GEMV_TOKENS);
        for r in self.core.states_mut() {
            r.w8a8_limits.gemv = tokens;
        }
        tokens
    }

    /// Tokens (0 to 64, default 8) up to which a W8A8 product beyond the weight-streaming
    /// kernel's tokens runs the decoder's own `mma.sync` tensor-core kernel (e4m3, each weight
    /// byte read once); 0 leaves such products to the warpgroup kernel
    /// ([`GpuDecoder::set_fp8_wgmma_tokens`]) or cuBLASLt's block-scaled GEMM. Devices below
    /// compute capability 8.9 always use cuBLASLt. Returns the setting (clamped).
    ///
    /// ```no_run
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn cublaslt_only(decoder: &mut GpuDecoder<'_>) {
    ///     assert_eq!(decoder.set_fp8_mma_tokens(0), 0);
    ///     assert_eq!(decoder.set_fp8_wgmma_tokens(0), 0);
    ///     assert_eq!(decoder.set_fp8_mma_tokens(1000), 64);
    /// }
    /// ```
    pub fn set_fp8_mma_tokens(&mut self, tokens: usize) -> usize {
        let tokens = tokens.min(MMA_TOKENS);
        for r in self.core.states_mut() {
            r.w8a8_limits.mma = tokens;
        }
        tokens
    }

    /// Tokens (0 to 64, default 64) up to which a W8A8 product beyond the `mma.sync` kernel's
    /// tokens ([`GpuDecoder::set_fp8_mma_tokens`]) runs the decoder's warpgroup kernel (Hopper's
    /// `wgmma`, the weights streamed once into registers, every token's activations read from
    /// shared memory) instead of cuBLASLt's block-scaled GEMM; weights of at most 16 Mi
    /// elements (q, k, v and o at 7.6B shapes) take it up to 64 tokens whenever the setting is
    /// not 0. Only on devices whose kernels compile for an architecture-specific target
    /// (sm_90a); elsewhere the setting changes nothing. Returns the setting (clamped).
    ///
    /// ```no_run
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn warpgroup_to_32(decoder: &mut GpuDecoder<'_>) {
    ///     assert_eq!(decoder.set_fp8_wgmma_tokens(32), 32);
    ///     assert_eq!(decoder.set_fp8_wgmma_tokens(1000), 64);
    /// }
    /// ```
    pub fn set_fp8_wgmma_tokens(&mut self, tokens: usize) -> usize {
        let tokens = tokens.min(MMA_TOKENS);
        for r in self.core.states_mut() {
            r.w8a8_limits.wgmma = tokens;
        }
        tokens
    }

    /// Tokens (0 to 32, default 8) up to which a bf16 product runs the decoder's own
    /// `mma.sync` tensor-core kernel (each weight byte read once, the split activations' hi and
    /// lo sums added in the kernel, the bias and residual written by it) instead of cuBLAS; 0
    /// leaves every bf16 product to cuBLAS. Devices below compute capability 8.9 always use
    /// cuBLAS. Returns the setting (clamped).
    ///
    /// ```no_run
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn cublas_only(decoder: &mut GpuDecoder<'_>) {
    ///     assert_eq!(decoder.set_bf16_mma_tokens(0), 0);
    ///     assert_eq!(decoder.set_bf16_mma_tokens(1000), 32);
    /// }
    /// ```
    pub fn set_bf16_mma_tokens(&mut self, tokens: usize) -> usize {
        let tokens = tokens.min(BF16_MMA_TOKENS);
        for r in self.core.states_mut() {
            r.bf16_mma_tokens = tokens;
        }
        tokens
    }

    /// Rows from which a pass runs a LoRA group's `A` and `B` products on tensor cores
    /// (`lora_a_tiles` and `lora_b_tiles`, up to 64 rows) rather than in `lora_a` and `lora_b`
    /// (default 9: those up to 8 rows); more than 64 leaves them to `lora_a` and `lora_b` up to
    /// 64 rows. Only where tensor cores are there (compute capability 8.0 on); for comparisons.
    /// Returns the setting (at least 1).
    ///
    /// ```no_run
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn tiles_from_three_rows(decoder: &mut GpuDecoder<'_>) {
    ///     assert_eq!(decoder.set_lora_tile_rows(3), 3);
    ///     assert_eq!(decoder.set_lora_tile_rows(0), 1);
    /// }
    /// ```
    pub fn set_lora_tile_rows(&mut self, rows: usize) -> usize {
        let rows = rows.max(1);
        for r in self.core.states_mut() {
            r.lora_tile_rows = rows;
        }
        rows
    }

    /// Whether a LoRA group's `A` products (`x·Aᵀ` of the targets that read one input: q / k /
    /// v, o, gate / up, down) ride the launch of their base products as more products of the
    /// same input, where the bf16 tensor-core kernel takes that launch (a decode step of up to
    /// [`GpuDecoder::set_bf16_mma_tokens`] sequences, every matrix readable by it), rather than
    /// run in a kernel of their own before it (off, the default). Either way the `B` products
    /// follow in `lora_b`. Returns the setting.
    ///
    /// ```no_run
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn riders_on(decoder: &mut GpuDecoder<'_>) {
    ///     assert!(decoder.set_lora_riders(true));
    /// }
    /// ```
    pub fn set_lora_riders(&mut self, on: bool) -> bool {
        for r in self.core.states_mut() {
            r.lora_riders = on;
        }
        on
    }

    /// Whether the bf16 experts of mixture-of-experts layers run in blocks, one batched GEMM per
    /// product over every expert of a block (`true`, the default), or one GEMM per expert
    /// (`false`; for comparisons). Returns the setting.
    pub fn set_grouped_experts(&mut self, on: bool) -> bool {
        for r in self.core.states_mut() {
            r.grouped = on;
        }
        on
    }

    /// Whether passes of at most 256 rows (decode steps of up to 256 sequences per replica) route
    /// their mixture-of-experts layers on the device (on, the default: the router's top-k, the
    /// experts' row lists and the product table computed by one kernel, the experts' products
    /// by weight-streaming kernels over that table, no host synchronisation inside the pass)
    /// or on the host (off: the router's logits downloaded per layer, the rows uploaded). Both
    /// pick the experts by the CPU decoder's rule; a layer the device cannot route (held experts
    /// of different widths or dtypes, or the per-expert path of
    /// [`GpuDecoder::set_grouped_experts`]) is routed on the host. Returns the setting.
    pub fn set_device_routing(&mut self, on: bool) -> bool {
        for r in self.core.states_mut() {
            r.device_routing = on;
        }
        on
    }

    /// Whether decode steps are replayed from CUDA graphs (on, the default): a decode step of
    /// `n` sequences at `T = 1` (one GPU, or data-parallel replicas) is captured into a graph
    /// the second time a step of that size runs on the same cache, and then launched as one
    /// graph per step instead of its ~15 launches per layer; the tokens and logits are the
    /// same bit for bit. Steps at `T > 1`, prefills, and steps whose mixture-of-experts layers
    /// are routed on the host run as they are queued. Each graph owns its step's scratch (a
    /// few MB at 7.6B shapes, about 150 MB at 64 sequences); at most 4 are kept per rank, and
    /// they are dropped whenever the weights are bound again or an fp8 setting changes. Off
    /// drops them.
    ///
    /// ```no_run
    /// use lifecycle_decoder::{Decoder, Sampling};
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn eager(decoder: &mut GpuDecoder<'_>) -> Result<Vec<Vec<u32>>, Box<dyn std::error::Error>> {
    ///     decoder.set_step_graphs(false);
    ///     let out = decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(8))?;
    ///     assert_eq!(decoder.step_graphs(), (0, 0));
    ///     Ok(out)
    /// }
    /// ```
    pub fn set_step_graphs(&mut self, on: bool) -> bool {
        self.core.set_step_graphs(on);
        on
    }

    /// Graphs captured and decode steps replayed from one so far, summed over this process's
    /// ranks ([`GpuDecoder::set_step_graphs`]).
    pub fn step_graphs(&self) -> (usize, usize) {
        self.core.graph_counts()
    }

    /// Downloads so far that waited for the device, summed over this process's ranks: the
    /// host synchronisations of the passes (one per pass for its logits or tokens, plus one per
    /// MoE layer routed on the host).
    ///
    /// ```no_run
    /// use lifecycle_decoder::Decoder;
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn waits_per_step(dec: &mut GpuDecoder<'_>, feed: &[u32]) -> Result<usize, Box<dyn std::error::Error>> {
    ///     let before = dec.host_waits();
    ///     dec.decode_step(feed)?;
    ///     Ok(dec.host_waits() - before)
    /// }
    /// ```
    pub fn host_waits(&self) -> usize {
        self.core.host_waits()
    }

    /// The time the host spent waiting for the device in those downloads (on the rank that
    /// waited longest): a pass's wall time less this is the time its host side took to queue
    /// the work. A step whose wait is near zero is bound by the host's launches, not by the
    /// device.
    ///
    /// ```no_run
    /// use std::time::Instant;
    /// use lifecycle_decoder::Decoder;
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn host_side(dec: &mut GpuDecoder<'_>, feed: &[u32]) -> Result<f64, Box<dyn std::error::Error>> {
    ///     let (t, waited) = (Instant::now(), dec.host_wait_time());
    ///     dec.decode_step(feed)?;
    ///     Ok((t.elapsed() - (dec.host_wait_time() - waited)).as_secs_f64())
    /// }
    /// ```
    pub fn host_wait_time(&self) -> std::time::Duration {
        self.core.host_wait_time()
    }

    /// The wall time of the last `generate` call up to its first tokens on the host (its
    /// prefill, which the host waits for): the rest of the call is its decode steps, timed
    /// without a second prefill's noise (at long prompts a prefill's run-to-run spread exceeds
    /// many decode steps).
    ///
    /// ```no_run
    /// use std::time::Instant;
    /// use lifecycle_decoder::{Decoder, Sampling};
    /// use lifecycle_decoder_gpu::GpuDecoder;
    ///
    /// fn step_ms(dec: &mut GpuDecoder<'_>, prompts: &[Vec<u32>]) -> Result<f64, Box<dyn std::error::Error>> {
    ///     let t = Instant::now();
    ///     dec.generate(prompts, &Sampling::greedy(65))?;
    ///     Ok((t.elapsed() - dec.last_prefill_time()).as_secs_f64() * 1e3 / 64.0)
    /// }
    /// ```
    pub fn last_prefill_time(&self) -> std::time::Duration {
        self.core.last_prefill
    }

    /// How long the last bind took to merge the adapters ([`LoraMode::Merged`]: the copy of the
    /// rollout weights and a product per adapted matrix, the slowest rank's, waited for); zero
    /// in the unmerged mode.
    ///
    /// ```no_run
    /// # fn demo(d: &lifecycle_decoder_gpu::GpuDecoder<'_>) {
    /// assert!(d.last_merge_time() < std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn last_merge_time(&self) -> std::time::Duration {
        self.core.last_merge
    }
}

/// The rollout entries of TP ranks `0..tp` for [`GroupOffsets::new`]: one list when every rank
/// holds the same tensors; each rank's own when they differ (partitioned experts), which needs
/// this process to drive the group's ranks.
pub(crate) fn group_entries(
    weights: &RolloutBuffer,
    tp: usize,
) -> Result<Vec<&[RolloutEntry]>, GpuDecodeError> {
    if weights.uniform() {
        return Ok(vec![weights.entries()]);
    }
    let locals = weights.local_ranks();
    if locals.len() < tp || (0..tp).any(|t| locals[t] != t) {
        return Err(DecodeError::Usage(format!(
            "the ranks hold different tensors (experts partitioned over the ranks), and this \
             process drives ranks {locals:?}: decoding such weights needs one process driving \
             ranks 0..{tp}"
        ))
        .into());
    }
    Ok((0..tp).map(|t| weights.rank_entries(t)).collect())
}

impl Decoder for GpuDecoder<'_> {
    type Error = GpuDecodeError;

    fn vocab_size(&self) -> usize {
        self.core.config.model.vocab
    }

    fn prefill(
        &mut self,
        prompts: &[Vec<u32>],
        which: PrefillLogits,
    ) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        self.core.prefill(self.pool, prompts, which)
    }

    fn decode_step(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        self.core.decode_step(self.pool, tokens)
    }

    /// As the trait's default (same seeding: sequence `i` draws one uniform per token from
    /// `SplitMix64::from_keys(&[seed, i])`, as [`sample_token`](lifecycle_decoder::sample_token)
    /// does), but tokens are picked on the device and only they are downloaded: greedy
    /// (`temperature <= 0`) is the argmax, first index on ties; otherwise the CPU sampler's rule
    /// on the device's logits (its running sums are added in another order, which can move a
    /// draw that lands within float rounding of a boundary).
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<Vec<Vec<u32>>, GpuDecodeError> {
        self.core.generate(self.pool, prompts, sampling, false)
    }
}
