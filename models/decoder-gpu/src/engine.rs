//! [`GpuEngine`]: the GPU decoder as a persistent rollout engine of a
//! [`Lifecycle`](lifecycle_core::Lifecycle). It is built once (cuBLAS handles, kernels, rotary
//! tables per rank); `wake` binds it to the resident rollout weights and allocates the KV cache,
//! `sleep` frees the cache and forgets the weights.

use std::sync::Arc;

use lifecycle_core::{EngineBytes, PhaseScope, RolloutEngine, RolloutView};
use lifecycle_cuda::{RankExecutor, RolloutBuffer, RolloutSource, ThreadRankPool};
use lifecycle_decoder::{DecodeError, KvDtype, ModelConfig, PrefillLogits, Sampling};
use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::{RolloutFormat, RolloutLayout};

use crate::decoder::{kv_elements, Core, KvMode, KV_PAGE_POSITIONS, MAX_CONTEXT};
use crate::error::GpuDecodeError;
use crate::topology::decode_topology;
use crate::weights::{detect_layout, GroupOffsets, LayoutKind};
use crate::{LoraMode, SharedBase};

/// Which tensor names a rollout layout of `format` has.
pub(crate) fn kind_of(layout: &RolloutLayout) -> LayoutKind {
    match layout.format() {
        RolloutFormat::Unfused => LayoutKind::Unfused,
        RolloutFormat::Fused => LayoutKind::Fused,
    }
}

/// The engine's capacity and prefill policy.
///
/// The KV cache is allocated at wake in pages of [`KV_PAGE_POSITIONS`] positions: `kv_tokens`
/// positions per replica (by default `⌈max_sequences / replicas⌉ · max_tokens`), for up to
/// `max_sequences` sequences at once (all replicas together) of up to `max_tokens` positions each
/// (prompt + generated tokens). Under continuous batching ([`GpuEngine::run`]) each request holds
/// the pages of its own length, reserved at admission, so a cache of `kv_tokens` positions serves
/// many short requests or a few long ones (see [`lifecycle_decoder::KvPages`]); a static call
/// splits the pages evenly over its sequences. A call that needs more is
/// [`GpuDecodeError::KvCapacity`], before any GPU work. Its size per rank is `2 · layers ·
/// (pages + 1) · KV_PAGE_POSITIONS · kv_heads_per_rank · head bytes`
/// ([`EngineSettings::kv_bytes_per_rank`]; one page takes the padding rows of decode steps).
///
/// ```
/// use lifecycle_decoder::Sampling;
/// use lifecycle_decoder_gpu::{EngineSettings, GpuDecodeError};
/// let s = EngineSettings::new(8, 64);
/// assert!(s.fork_prefill);
/// s.check_call(&vec![vec![1, 2, 3]; 8], &Sampling::greedy(61))?;
/// let e = s.check_call(&vec![vec![1, 2, 3]; 8], &Sampling::greedy(62)).unwrap_err();
/// assert!(matches!(e, GpuDecodeError::KvCapacity { tokens: 65, max_tokens: 64, .. }));
/// # Ok::<(), GpuDecodeError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSettings {
    /// Sequences one generate call may hold (all replicas together).
    pub max_sequences: usize,
    /// Tokens one sequence may hold: longest prompt + `max_new_tokens` (at most
    /// [`MAX_CONTEXT`]).
    pub max_tokens: usize,
    /// Positions the KV cache holds per replica, all sequences together (rounded up to whole
    /// pages); `None`: `⌈max_sequences / replicas⌉ · max_tokens`, every sequence at its longest.
    pub kv_tokens: Option<usize>,
    /// Prefix sharing: prefill each distinct prompt admitted together once and copy its KV rows
    /// to the other sequences with the same prompt (a group of samples), instead of prefilling
    /// every sequence. On by default. The prompt GEMMs then run on fewer rows, which cuBLAS may
    /// round differently, so a sample's tokens are the same as without sharing given equal
    /// logits, not bitwise (measured at Qwen2.5-7B shapes: some samples of a DAPO run differ),
    /// as under continuous batching, where the rows of a step change anyway; off, a static
    /// call's tokens are the same however it groups its prompts.
    pub fork_prefill: bool,
    /// How products with fp8 rollout weights compute ([`GpuDecoder::set_fp8_compute`](crate::GpuDecoder::set_fp8_compute)):
    /// W8A8 by default (the fast mode), or weight-only (the exact mode).
    pub fp8_compute: Fp8Compute,
    /// The element type of the KV cache: bf16 by default (as vLLM and SGLang keep it), or f32
    /// (the exact mode of [`GpuDecoder`](crate::GpuDecoder)'s default); fp8 is refused by
    /// [`EngineSettings::check`].
    pub kv_dtype: KvDtype,
    /// Decode steps replayed from CUDA graphs (on by default;
    /// [`GpuDecoder::set_step_graphs`](crate::GpuDecoder::set_step_graphs)).
    pub step_graphs: bool,
    /// How LoRA adapters the rollout holds are applied ([`GpuEngine::with_lora`]): unmerged
    /// by default, or merged into a private copy of the rollout weights at every wake.
    pub lora_mode: LoraMode,
}

impl EngineSettings {
    /// `max_sequences` sequences of `max_tokens` tokens, prefix sharing on, fp8 W8A8, a bf16 KV
    /// cache.
    pub fn new(max_sequences: usize, max_tokens: usize) -> Self {
        EngineSettings {
            max_sequences,
            max_tokens,
            kv_tokens: None,
            fork_prefill: true,
            fp8_compute: Fp8Compute::W8A8,
            kv_dtype: KvDtype::Bf16,
            step_graphs: true,
            lora_mode: LoraMode::Unmerged,
        }
    }

    /// The same settings with LoRA adapters applied as `mode` says.
    ///
    /// ```
    /// use lifecycle_decoder_gpu::{EngineSettings, LoraMode};
    /// let merged = EngineSettings::new(8, 64).with_lora_mode(LoraMode::Merged);
    /// assert_eq!(merged.lora_mode, LoraMode::Merged);
    /// ```
    pub fn with_lora_mode(mut self, mode: LoraMode) -> Self {
        self.lora_mode = mode;
        self
    }

    /// The same settings with the KV cache kept in `kv`.
    ///
    /// ```
    /// use lifecycle_decoder::KvDtype;
    /// use lifecycle_decoder_gpu::EngineSettings;
    /// assert_eq!(EngineSettings::new(8, 64).kv_dtype, KvDtype::Bf16);
    /// let exact = EngineSettings::new(8, 64).with_kv_dtype(KvDtype::F32);
    /// assert!(exact.check().is_ok());
    /// let fp8 = EngineSettings::new(8, 64).with_kv_dtype(KvDtype::Fp8);
    /// assert!(fp8.check().is_ok());
    /// ```
    pub fn with_kv_dtype(mut self, kv: KvDtype) -> Self {
        self.kv_dtype = kv;
        self
    }

    /// The same settings with a KV cache of `tokens` positions per replica (see
    /// [`EngineSettings::kv_tokens`]): more sequences than it could hold at their longest may
    /// then run at once, each holding the pages of its own length.
    ///
    /// ```
    /// use lifecycle_decoder_gpu::{EngineSettings, KV_PAGE_POSITIONS};
    /// // 256 sequences of up to 8192 tokens in the room of 64 at their longest
    /// let s = EngineSettings::new(256, 8192).with_kv_tokens(64 * 8192);
    /// assert_eq!(s.kv_pages(1), 64 * 8192 / KV_PAGE_POSITIONS);
    /// assert_eq!(EngineSettings::new(8, 100).kv_pages(2), 4 * 2); // 4 × 100 positions
    /// assert!(EngineSettings::new(8, 100).with_kv_tokens(99).check().is_err());
    /// ```
    pub fn with_kv_tokens(mut self, tokens: usize) -> Self {
        self.kv_tokens = Some(tokens);
        self
    }

    /// Pages of the KV cache per replica (the padding page not counted).
    pub fn kv_pages(&self, replicas: usize) -> usize {
        let tokens = self.kv_tokens.unwrap_or(
            self.slots_per_replica(replicas) * self.max_tokens.next_multiple_of(KV_PAGE_POSITIONS),
        );
        tokens.div_ceil(KV_PAGE_POSITIONS)
    }

    /// The same settings with forked prefill on or off.
    pub fn with_fork_prefill(mut self, on: bool) -> Self {
        self.fork_prefill = on;
        self
    }

    /// The same settings with fp8 products computed as `compute` says.
    ///
    /// ```
    /// use lifecycle_decoder_gpu::EngineSettings;
    /// use lifecycle_layout::fp8::Fp8Compute;
    /// let s = EngineSettings::new(8, 64).with_fp8_compute(Fp8Compute::W8A8);
    /// assert_eq!(s.fp8_compute, Fp8Compute::W8A8);
    /// assert_eq!(EngineSettings::new(8, 64).fp8_compute, Fp8Compute::W8A8);
    /// ```
    pub fn with_fp8_compute(mut self, compute: Fp8Compute) -> Self {
        self.fp8_compute = compute;
        self
    }

    /// The same settings with decode steps replayed from CUDA graphs (`true`) or queued as
    /// they are (`false`).
    ///
    /// ```
    /// use lifecycle_decoder_gpu::EngineSettings;
    /// assert!(EngineSettings::new(8, 64).step_graphs);
    /// assert!(!EngineSettings::new(8, 64).with_step_graphs(false).step_graphs);
    /// ```
    pub fn with_step_graphs(mut self, on: bool) -> Self {
        self.step_graphs = on;
        self
    }

    /// Checks the settings themselves.
    pub fn check(&self) -> Result<(), GpuDecodeError> {
        if self.max_sequences == 0 || self.max_tokens == 0 {
            return Err(GpuDecodeError::Settings(format!(
                "max_sequences ({}) and max_tokens ({}) must be at least 1",
                self.max_sequences, self.max_tokens
            )));
        }
        if self.max_tokens > MAX_CONTEXT {
            return Err(GpuDecodeError::Settings(format!(
                "max_tokens {} is more than the {MAX_CONTEXT} positions the attention kernel holds",
                self.max_tokens
            )));
        }
        if let Some(tokens) = self.kv_tokens.filter(|&t| t < self.max_tokens) {
            return Err(GpuDecodeError::Settings(format!(
                "kv_tokens {tokens} cannot hold one sequence of max_tokens {} (raise kv_tokens \
                 or lower max_tokens)",
                self.max_tokens
            )));
        }
        Ok(())
    }

    /// Checks that a call of `prompts` with `sampling` fits the KV cache.
    pub fn check_call(
        &self,
        prompts: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(), GpuDecodeError> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        self.check_fit(prompts.len(), longest + sampling.max_new_tokens)
    }

    fn check_fit(&self, sequences: usize, tokens: usize) -> Result<(), GpuDecodeError> {
        if sequences > self.max_sequences || tokens > self.max_tokens {
            return Err(GpuDecodeError::KvCapacity {
                sequences,
                tokens,
                max_sequences: self.max_sequences,
                max_tokens: self.max_tokens,
            });
        }
        Ok(())
    }

    /// Sequences of the KV cache per replica (the largest share [`replica_rows`] gives).
    ///
    /// [`replica_rows`]: crate::replica_rows
    pub fn slots_per_replica(&self, replicas: usize) -> usize {
        self.max_sequences.div_ceil(replicas.max(1))
    }

    /// Bytes of the KV cache on one rank that computes `kv_heads_per_rank` kv heads (keys and
    /// values in [`EngineSettings::kv_dtype`]: a head at a position takes
    /// [`KvDtype::head_bytes`], fp8's scale included).
    ///
    /// ```
    /// use lifecycle_decoder::ModelConfig;
    /// use lifecycle_decoder_gpu::EngineSettings;
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 32,
    ///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    ///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
    /// // 2 layers × (k, v) × (8 sequences of one 64-position page + the padding page) × 64
    /// // positions × 2 kv heads × head_dim 4 × 2 bytes
    /// let s = EngineSettings::new(8, 64);
    /// assert_eq!(s.kv_bytes_per_rank(&config, 2, 1), 2 * 2 * 9 * 64 * 2 * 4 * 2);
    /// let f32_cache = s.with_kv_dtype(lifecycle_decoder::KvDtype::F32);
    /// assert_eq!(f32_cache.kv_bytes_per_rank(&config, 2, 1), 2 * 2 * 9 * 64 * 2 * 4 * 4);
    /// // fp8: head_dim 4 e4m3 bytes and one f32 scale per head and position
    /// let fp8 = s.with_kv_dtype(lifecycle_decoder::KvDtype::Fp8);
    /// assert_eq!(fp8.kv_bytes_per_rank(&config, 2, 1), 2 * 2 * 9 * 64 * 2 * (4 + 4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn kv_bytes_per_rank(
        &self,
        config: &ModelConfig,
        kv_heads_per_rank: usize,
        replicas: usize,
    ) -> u64 {
        self.kv_dtype.head_bytes(config.model.head_dim) as u64
            * kv_elements(
                config.model.layers,
                self.kv_pages(replicas) + 1,
                KV_PAGE_POSITIONS,
                kv_heads_per_rank,
            ) as u64
    }
}

/// What the engine was woken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bound {
    version: u64,
    /// Address of the [`RolloutBuffer`] (identity only, never dereferenced).
    buffer: usize,
}

fn describe(buffer: usize) -> String {
    format!("rollout buffer at {buffer:#x}")
}

/// The GPU decoder as a persistent [`RolloutEngine`] of a lifecycle over a backend whose rollout
/// weights are a [`RolloutBuffer`] (`FsdpBackend`, `MegatronGpuBackend`).
///
/// - Built once from the rank pool, the model config and the rollout layout: every rank creates
///   its cuBLAS handle, loads the kernels and uploads its rotary tables here, for the engine's
///   lifetime.
/// - [`wake`](RolloutEngine::wake) (after the backend's enter, once per weight version under the
///   lazy policy) checks the buffer's tensors against the config and the layout (names, shapes,
///   fused or unfused), binds each rank to its buffer and allocates the KV cache for
///   [`EngineSettings`]; [`sleep`](RolloutEngine::sleep) (before the backend's exit) frees the
///   cache and forgets the weights. [`memory`](RolloutEngine::memory) reports the KV cache;
///   per-pass activations come from the stream-ordered pool and are freed after each pass.
/// - Weights from a switch that overlaps its offload ([`RolloutBuffer::freeing`]): wake does not
///   wait for the offload's copies, and the KV cache is not allocated whole but grows with the
///   calls (as [`GpuDecoder`](crate::GpuDecoder)'s does), each allocation ordered on the device
///   after the frees that make room for it ([`GpuEngine::kv_waits_for_frees`] counts those
///   that waited). The tokens are the same either way.
/// - [`generate`](GpuEngine::generate) takes the session's weights view and refuses a view of
///   another version or buffer than the one the engine was woken for, so it only ever reads the
///   weights it was bound to, while the session keeps them alive.
/// - Tokens are those of [`GpuDecoder`](crate::GpuDecoder)'s `generate` for the same prompts and
///   sampling (same kernels, seeding and sampling rule). With
///   [`fork_prefill`](EngineSettings::fork_prefill), sequences of one call with the same prompt
///   are prefilled once and get copies of its KV rows.
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_decoder::{random_tensors, ModelConfig, Sampling};
/// use lifecycle_decoder_gpu::{EngineSettings, GpuEngine};
/// use lifecycle_fsdp::FsdpBackend;
///
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 32,
///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
/// let pool = Arc::new(ThreadRankPool::new(1)?);
/// let backend = FsdpBackend::new(pool, config.rollout_layout(1)?);
/// let state = backend.state_from_tensors(random_tensors(&config, 1))?;
/// // 4 prompts × 8 samples, prompts of up to 16 tokens, 32 new tokens
/// let engine = GpuEngine::for_backend(&backend, &config, EngineSettings::new(32, 48))?;
/// let mut lc = Lifecycle::new(backend, state).with_engine(engine);
/// let prompts: Vec<Vec<u32>> = (0..4u32)
///     .flat_map(|p| std::iter::repeat_n(vec![p + 1; 16], 8))
///     .collect();
/// let mut session = lc.rollout()?; // enter, then wake: bind + KV cache
/// let (weights, mut engine) = session.parts();
/// let samples = engine.generate(weights, &prompts, &Sampling::greedy(32))?;
/// session.finish()?;
/// assert_eq!(samples.len(), 32);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GpuEngine {
    pub(crate) pool: Arc<ThreadRankPool>,
    pub(crate) core: Core,
    layout: RolloutLayout,
    pub(crate) settings: EngineSettings,
    bound: Option<Bound>,
    /// The base tensors read in place outside the rollout buffer ([`GpuEngine::share_base`]).
    shared: Option<SharedBase>,
}

impl std::fmt::Debug for GpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEngine")
            .field("layout", &self.layout)
            .field("settings", &self.settings)
            .field("topology", &self.core.topology)
            .field("awake_for_version", &self.bound.map(|b| b.version))
            .field("kv_bytes", &self.core.kv_bytes())
            .finish()
    }
}

impl GpuEngine {
    /// An engine on the ranks of `pool` for `config` in `layout` (the backend's rollout layout;
    /// a pool of `W = T` ranks, or `W` replicas at `T = 1`, see
    /// [`decode_topology`](crate::decode_topology)). Checks the settings and the topology, then
    /// creates the per-rank handles and kernels; no weights are read until wake.
    pub fn new(
        pool: Arc<ThreadRankPool>,
        config: &ModelConfig,
        layout: RolloutLayout,
        settings: EngineSettings,
    ) -> Result<Self, GpuDecodeError> {
        settings.check()?;
        decode_topology(pool.world(), layout.tp(), pool.local_ranks().len())?;
        if layout.format() == RolloutFormat::Fused {
            // shapes of the fused layout for this config: refused now, not at the first wake
            layout
                .fused_tensors(&config.model_spec(lifecycle_decoder::MEGATRON_VOCAB_MULTIPLE))
                .map_err(DecodeError::from)?;
        }
        let mut core = Core::new(config, layout.tp(), &pool)?;
        if settings.max_tokens > core.max_context() {
            return Err(GpuDecodeError::Settings(format!(
                "max_tokens {} is more than the {} positions the attention kernels hold on this \
                 device (its shared memory per block)",
                settings.max_tokens,
                core.max_context()
            )));
        }
        // nothing bound yet: sets the mode; bind makes the W8A8 GEMMs where fp8 weights come
        core.set_fp8_compute(&pool, settings.fp8_compute)?;
        core.set_step_graphs(settings.step_graphs);
        core.set_kv_dtype(settings.kv_dtype)?;
        core.lora_mode = settings.lora_mode;
        Ok(GpuEngine {
            pool,
            core,
            layout,
            settings,
            bound: None,
            shared: None,
        })
    }

    /// An engine for the rollouts of `backend` (any GPU backend: its pool and layout).
    pub fn for_backend(
        backend: &impl RolloutSource,
        config: &ModelConfig,
        settings: EngineSettings,
    ) -> Result<Self, GpuDecodeError> {
        Self::new(
            backend.rank_pool().clone(),
            config,
            backend.rollout_layout().clone(),
            settings,
        )
    }

    /// The engine for a rollout that holds the LoRA adapters of `lora` beside their bases: each
    /// adapted linear adds `s·(x·Aᵀ)·Bᵀ` to its base product, unmerged
    /// ([`GpuDecoder::new_lora`](crate::GpuDecoder::new_lora)), or merged into a private copy
    /// as [`EngineSettings::lora_mode`] says; the adapters are checked
    /// against `lora` by name when the engine wakes on the weights. Without it, a rollout that
    /// holds adapters is refused.
    ///
    /// ```no_run
    /// # fn demo(backend: &lifecycle_fsdp::FsdpBackend,
    /// #         config: &lifecycle_decoder::ModelConfig) -> Result<(), Box<dyn std::error::Error>> {
    /// use lifecycle_decoder_gpu::{EngineSettings, GpuEngine};
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let lora = LoraConfig::new(64, 128.0, LoraTarget::ALL.to_vec());
    /// let engine = GpuEngine::for_backend(backend, config, EngineSettings::new(64, 4096))?
    ///     .with_lora(lora);
    /// # Ok(()) }
    /// ```
    pub fn with_lora(mut self, lora: lifecycle_layout::lora::LoraConfig) -> Self {
        self.core.lora = Some(lora);
        self
    }

    /// Reads the tensors of `base` where they are (a trainer's frozen bf16 base) instead of
    /// from the rollout buffer, whose entries are then the rest of `base`'s layout (the
    /// adapters and whatever else the switch moves): from the next wake on, until it is
    /// called again (`None`: every tensor from the buffer). A shared base needs one rank
    /// (`W = T = 1`), the unfused layout and the unmerged LoRA mode; refused otherwise, the
    /// engine unchanged.
    ///
    /// ```no_run
    /// # fn demo(engine: &mut lifecycle_decoder_gpu::GpuEngine, layout: lifecycle_layout::RolloutLayout,
    /// #         address: u64) -> Result<(), Box<dyn std::error::Error>> {
    /// use lifecycle_decoder_gpu::{SharedBase, SharedTensor};
    /// let q = SharedTensor {
    ///     name: "model.layers.0.self_attn.q_proj.weight".into(),
    ///     shape: vec![3584, 3584],
    ///     address,
    /// };
    /// // SAFETY: `address` holds the trainer's bf16 q_proj, kept and not written while shared.
    /// unsafe { engine.share_base(Some(SharedBase::new(layout, vec![q])?))? };
    /// # Ok(()) }
    /// ```
    ///
    /// # Safety
    /// Each shared tensor's address must be device memory of the engine's GPU holding its
    /// elements (bf16, row-major), alive from the next wake until the engine sleeps or is
    /// dropped, and not written while a call of the engine runs (what the base holds when a
    /// call starts is what it reads).
    pub unsafe fn share_base(&mut self, base: Option<SharedBase>) -> Result<(), GpuDecodeError> {
        if let Some(b) = &base {
            let refuse = |why: String| -> GpuDecodeError {
                DecodeError::Usage(format!("a shared base: {why}")).into()
            };
            if self.pool.world() != 1 || self.pool.local_ranks().len() != 1 {
                return Err(refuse(format!(
                    "read in place on one GPU (W = 1), the engine has W = {}",
                    self.pool.world()
                )));
            }
            if self.layout.format() != RolloutFormat::Unfused {
                return Err(refuse("the rollout's layout is fused (Megatron's)".into()));
            }
            if self.settings.lora_mode == LoraMode::Merged {
                return Err(refuse(
                    "the merged LoRA mode writes a private copy of the base: use unmerged".into(),
                ));
            }
            let names: std::collections::HashSet<&str> = b
                .layout()
                .tensors()
                .iter()
                .map(|t| t.name.as_str())
                .collect();
            if let Some(t) = self
                .layout
                .tensors()
                .iter()
                .find(|t| !names.contains(t.name.as_str()))
            {
                return Err(refuse(format!(
                    "tensor `{}` of the rollout is not in the shared base's layout",
                    t.name
                )));
            }
        }
        self.shared = base;
        Ok(())
    }

    /// The settings.
    pub fn settings(&self) -> EngineSettings {
        self.settings
    }

    /// The longest sequence (prompt + generated tokens) the attention kernels hold on this
    /// engine's devices: [`MAX_CONTEXT`], or fewer on a device with less shared memory per
    /// block.
    pub fn max_context(&self) -> usize {
        self.core.max_context()
    }

    /// Turns prefix sharing ([`EngineSettings::fork_prefill`]) on or off from the next call.
    pub fn set_fork_prefill(&mut self, on: bool) {
        self.settings.fork_prefill = on;
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.core.config
    }

    /// The rollout layout.
    pub fn layout(&self) -> &RolloutLayout {
        &self.layout
    }

    /// The weight version the engine is awake for (`None` asleep).
    pub fn awake_for(&self) -> Option<u64> {
        self.bound.map(|b| b.version)
    }

    /// Checks that `weights` are the ones the engine was woken for.
    pub(crate) fn check_weights(
        &self,
        weights: &RolloutView<'_, RolloutBuffer>,
    ) -> Result<(), GpuDecodeError> {
        let bound = self.bound.ok_or(GpuDecodeError::Asleep)?;
        let buffer = weights.get() as *const RolloutBuffer as usize;
        if weights.version() != bound.version || buffer != bound.buffer {
            return Err(GpuDecodeError::OtherWeights {
                bound: bound.version,
                given: weights.version(),
                bound_buffer: describe(bound.buffer),
                given_buffer: describe(buffer),
            });
        }
        Ok(())
    }

    /// Generates up to `sampling.max_new_tokens` tokens for each prompt on the weights the
    /// engine was woken for; `weights` is the session's view (from `session.parts()`), checked
    /// to be those weights ([`GpuDecodeError::OtherWeights`]). Same tokens as
    /// [`GpuDecoder`](crate::GpuDecoder)'s `generate`: sequence `i` draws from
    /// `SplitMix64::from_keys(&[seed, i])`, greedy when `temperature <= 0`, a stop token ends a
    /// sequence. A call beyond the settings is [`GpuDecodeError::KvCapacity`].
    pub fn generate(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        prompts: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<Vec<Vec<u32>>, GpuDecodeError> {
        self.check_weights(&weights)?;
        self.settings.check_call(prompts, sampling)?;
        let fork = self.settings.fork_prefill;
        self.core.generate(&self.pool, prompts, sampling, fork)
    }

    /// The logits of a prefill of `prompts` (every sequence prefilled, no forking), as
    /// [`Decoder::prefill`](lifecycle_decoder::Decoder::prefill); decode on with
    /// [`decode_step`](GpuEngine::decode_step).
    pub fn prefill(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        prompts: &[Vec<u32>],
        which: PrefillLogits,
    ) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        self.check_weights(&weights)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        self.settings.check_fit(prompts.len(), longest)?;
        self.core.prefill(&self.pool, prompts, which)
    }

    /// The logits after feeding one token per sequence of the last prefill, as
    /// [`Decoder::decode_step`](lifecycle_decoder::Decoder::decode_step).
    pub fn decode_step(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        self.check_weights(&weights)?;
        let longest = self.core.lengths().into_iter().max().unwrap_or(0);
        self.settings.check_fit(tokens.len(), longest + 1)?;
        self.core.decode_step(&self.pool, tokens)
    }

    fn bind(&mut self, weights: &RolloutBuffer) -> Result<(), GpuDecodeError> {
        if let Some(shared) = &self.shared {
            let buffer = buffer_address(&self.pool, weights)?;
            let (at, entries) = shared.entries(buffer, weights.entries())?;
            let plan = GroupOffsets::new(&self.core.config, shared.layout(), &[&entries])?;
            self.core.bind(&self.pool, &plan, weights, Some(at))?;
            return self.after_bind();
        }
        let config = &self.core.config;
        let entries = weights.entries();
        let found = detect_layout(entries)?;
        let configured = kind_of(&self.layout);
        if found.is_some_and(|f| f != configured) {
            return Err(GpuDecodeError::LayoutMismatch {
                configured: configured.name(),
                found: found.map_or("unknown", LayoutKind::name),
            });
        }
        let plan = match self.layout.format() {
            RolloutFormat::Unfused => GroupOffsets::new(
                config,
                &self.layout,
                &crate::decoder::group_entries(weights, self.layout.tp())?,
            )?,
            RolloutFormat::Fused => GroupOffsets::fused(config, &self.layout, entries)?,
        };
        self.core.bind(&self.pool, &plan, weights, None)?;
        self.after_bind()
    }

    /// The KV cache once the weights are bound.
    fn after_bind(&mut self) -> Result<(), GpuDecodeError> {
        if self.core.allocates_into_freeing() {
            // The switch still frees training memory: the cache grows with the calls, each
            // allocation after the frees that make room for it (the settings still bound it).
            self.core.kv = KvMode::Grow;
            return Ok(());
        }
        self.alloc_fixed()
    }

    /// Allocates the settings' fixed, paged KV cache.
    pub(crate) fn alloc_fixed(&mut self) -> Result<(), GpuDecodeError> {
        let replicas = self.core.topology.replicas();
        let slots = self.settings.slots_per_replica(replicas);
        let pages = self.settings.kv_pages(replicas);
        self.core
            .alloc_fixed(&self.pool, slots, self.settings.max_tokens, pages)
    }

    /// How many allocations of the KV cache (summed over the ranks) waited, on the device, for
    /// an overlapped offload's frees since the engine was built: 0 when every call found room in the
    /// memory that was free when the switch returned (see [`RolloutBuffer::freeing`]).
    pub fn kv_waits_for_frees(&self) -> usize {
        self.core.room_waits
    }
}

/// The device address of the one local rank's rollout buffer (a shared base's engine drives
/// one rank).
fn buffer_address(pool: &ThreadRankPool, weights: &RolloutBuffer) -> Result<u64, GpuDecodeError> {
    let mut items: Vec<_> = weights.buffers().iter().collect();
    let at = pool.run_each(&mut items, &|ctx, b| {
        Ok(crate::kernels::ptr(*b, &ctx.compute))
    })?;
    at.first().copied().ok_or_else(|| {
        GpuDecodeError::from(DecodeError::Usage(
            "a shared base over a rollout of no local rank".into(),
        ))
    })
}

impl RolloutEngine<RolloutBuffer> for GpuEngine {
    type Error = GpuDecodeError;

    fn wake(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        scope: &mut PhaseScope,
    ) -> Result<(), GpuDecodeError> {
        // a wake after a failed one starts clean (the lifecycle has run sleep in between)
        self.core.unbind();
        self.bound = None;
        self.bind(weights.get())?;
        scope.alloc_extra(self.core.kv_bytes());
        self.bound = Some(Bound {
            version: weights.version(),
            buffer: weights.get() as *const RolloutBuffer as usize,
        });
        Ok(())
    }

    fn sleep(&mut self, _scope: &mut PhaseScope) -> Result<(), GpuDecodeError> {
        // idempotent; also undoes a wake that failed part way
        self.core.unbind();
        self.bound = None;
        Ok(())
    }

    fn memory(&self) -> EngineBytes {
        EngineBytes::device(self.core.kv_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 10000.0}"#,
        )
        .unwrap()
    }

    #[test]
    fn calls_beyond_the_kv_capacity_are_refused_with_both_numbers() {
        let s = EngineSettings::new(4, 10);
        let prompts = vec![vec![1u32; 6]; 4];
        assert!(s.check_call(&prompts, &Sampling::greedy(4)).is_ok());
        // one token too many
        let e = s.check_call(&prompts, &Sampling::greedy(5)).unwrap_err();
        match &e {
            GpuDecodeError::KvCapacity {
                sequences,
                tokens,
                max_sequences,
                max_tokens,
            } => assert_eq!(
                (*sequences, *tokens, *max_sequences, *max_tokens),
                (4, 11, 4, 10)
            ),
            other => panic!("expected KvCapacity, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("4 sequences of at most 10 tokens"), "{msg}");
        assert!(msg.contains("up to 11 tokens"), "{msg}");
        // one sequence too many
        let five = vec![vec![1u32; 2]; 5];
        let e = s.check_call(&five, &Sampling::greedy(1)).unwrap_err();
        assert!(
            matches!(e, GpuDecodeError::KvCapacity { sequences: 5, .. }),
            "{e:?}"
        );
        // an empty call always fits
        assert!(s.check_call(&[], &Sampling::greedy(3)).is_ok());
    }

    #[test]
    fn settings_are_checked() {
        assert!(EngineSettings::new(1, 1).check().is_ok());
        for bad in [EngineSettings::new(0, 8), EngineSettings::new(8, 0)] {
            let msg = bad.check().unwrap_err().to_string();
            assert!(msg.contains("at least 1"), "{msg}");
        }
        let msg = EngineSettings::new(1, MAX_CONTEXT + 1)
            .check()
            .unwrap_err()
            .to_string();
        assert!(msg.contains(&MAX_CONTEXT.to_string()), "{msg}");
        assert!(
            EngineSettings::new(1, 1)
                .with_fork_prefill(true)
                .fork_prefill
        );
    }

    #[test]
    fn kv_size_follows_the_replica_shares() {
        let c = config();
        let s = EngineSettings::new(7, 100);
        assert_eq!(s.slots_per_replica(1), 7);
        assert_eq!(s.slots_per_replica(2), 4);
        assert_eq!(s.slots_per_replica(3), 3);
        // 4 slots of 100 positions: 2 pages of 64 each, and the padding page
        let positions = (4 * 2 + 1) * KV_PAGE_POSITIONS;
        // 3 layers × (k, v) × positions × 1 kv head × head_dim 4 × 2 bytes (bf16)
        assert_eq!(
            s.kv_bytes_per_rank(&c, 1, 2),
            (3 * 2 * positions * 4 * 2) as u64
        );
        let f32_cache = s.with_kv_dtype(KvDtype::F32);
        assert_eq!(
            f32_cache.kv_bytes_per_rank(&c, 1, 2),
            (3 * 2 * positions * 4 * 4) as u64
        );
        // fp8: 4 bytes of e4m3 and a 4-byte scale per head
        let fp8_cache = s.with_kv_dtype(KvDtype::Fp8);
        assert_eq!(
            fp8_cache.kv_bytes_per_rank(&c, 1, 2),
            (3 * 2 * positions * (4 + 4)) as u64
        );
        // a cache of its own size: 300 positions, 5 pages
        let own = s.with_kv_tokens(300);
        assert_eq!(
            own.kv_bytes_per_rank(&c, 1, 2),
            (3 * 2 * 6 * KV_PAGE_POSITIONS * 4 * 2) as u64
        );
    }

    #[test]
    fn layouts_name_their_kind() {
        let c = config();
        let unfused = c.rollout_layout(2).unwrap();
        assert_eq!((unfused.tp(), kind_of(&unfused)), (2, LayoutKind::Unfused));
        let fused = RolloutLayout::fused(2, lifecycle_layout::RolloutVocab::PadToMultipleOf(8));
        assert_eq!((fused.tp(), kind_of(&fused)), (2, LayoutKind::Fused));
    }
}
