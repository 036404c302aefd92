//! [`Core`]: what [`GpuDecoder`](super::GpuDecoder) and [`GpuEngine`](crate::GpuEngine) share: each
//! rank's state and captured steps, the weights binding, the KV cache, and the passes.

use std::cell::Cell;
use std::ops::Range;

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::RolloutBuffer;
use lifecycle_cuda::{alloc_zeros, CudaError, RankCtx, RankExecutor, ThreadRankPool};
use lifecycle_decoder::{DecodeError, KvDtype, ModelConfig, PrefillLogits, Sampling, SplitMix64};
use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::lora::LoraConfig;

use crate::error::GpuDecodeError;
use crate::fp8::{Fp8Kernels, GEMV_TOKENS};
use crate::kernels::{launch, ptr, Arg, DecoderKernels};
use crate::prefill::PrefillRows;
use crate::topology::{decode_topology, replica_rows, DecodeTopology};
use crate::w8a8::{MmaKernels, W8a8Gemm, W8a8Limits, BF16_MMA_DEFAULT_TOKENS};
use crate::weights::GroupOffsets;

use super::forward::{Pick, RowPick, Step, StepOut, LORA_TILE_ROWS_DEFAULT};
use super::graph::{rank_forward, StepGraphs};
use super::kv::{check_kv, kv_elements, kv_head_units};
use super::merge::{merge_rank, target_shapes, LoraMode};
use super::moe::table::DeviceExperts;
use super::pages::{PageTables, KV_PAGE_POSITIONS};
use super::rank::{Dims, RankBind, RankState};

/// Longest sequence (prompt + generated tokens) the attention kernels hold: their shared memory
/// keeps a score per position (132 KiB at 32 k positions, within a Hopper SM's 227 KiB opt-in; a
/// device with less holds fewer, [`GpuEngine::max_context`](crate::GpuEngine::max_context)). A cache of more than ~12 k positions
/// leaves room for one attention block per SM at a time.
pub const MAX_CONTEXT: usize = 32768;

/// Head counts and widths of the bound weights, per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub ffn_part: usize,
    pub vocab_parallel: bool,
    /// Embedding / head rows per rank (padding included).
    pub vocab_part: usize,
    pub fused: bool,
}

impl Geometry {
    fn of(plan: &GroupOffsets) -> Self {
        Geometry {
            q_heads: plan.q_heads,
            kv_heads: plan.ranks.first().map_or(0, |r| r.share.kv_heads),
            ffn_part: plan.ffn_part,
            vocab_parallel: plan.vocab_parallel,
            vocab_part: plan.vocab_part,
            fused: plan.fused,
        }
    }
}

/// How the KV cache is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KvMode {
    /// Allocated per prefill for the batch at hand and grown while decoding
    /// ([`GpuDecoder`](crate::GpuDecoder)).
    Grow,
    /// Allocated once for `slots` sequences per replica, each of up to the tables' positions,
    /// in a budget of pages ([`GpuEngine`]'s wake); a call that does not fit is an error.
    ///
    /// [`GpuEngine`]: crate::GpuEngine
    Fixed { slots: usize },
}

/// What [`GpuDecoder`](crate::GpuDecoder) and [`GpuEngine`](crate::GpuEngine) share: per-rank
/// handles, kernels and KV cache, the weights binding, and the passes. Every method that runs on
/// the ranks takes the pool the ranks were created on.
pub(crate) struct Core {
    pub config: ModelConfig,
    ranks: Vec<Rank>,
    pub topology: DecodeTopology,
    /// The sequences of the current batch each replica decodes (one range in a group).
    parts: Vec<Range<usize>>,
    pub tp: usize,
    /// Set while bound to weights.
    pub geo: Option<Geometry>,
    pub(super) lens: Vec<usize>,
    /// Where each sequence's positions lie in the cache ([`PageTables`]).
    pub(crate) pages: PageTables,
    /// Positions each sequence of the current static call holds in a fixed cache (its pages
    /// split evenly, [`PageTables::split`]).
    static_room: usize,
    pub kv: KvMode,
    /// Allocations of the KV cache (or of bind's scratch) whose stream waited for an
    /// overlapped offload's frees, summed over the ranks, since the decoder was built.
    pub room_waits: usize,
    /// The last `generate` call's wall time up to its first tokens on the host.
    pub last_prefill: std::time::Duration,
    /// The LoRA configuration of the adapters the bound rollout holds (`None`: it holds none).
    pub lora: Option<LoraConfig>,
    /// How the adapters are applied.
    pub lora_mode: LoraMode,
    /// The last bind's merge of the adapters (the merged mode; zero otherwise), the slowest
    /// rank's, synchronised.
    pub last_merge: std::time::Duration,
}

/// One rank of a decoder: what its passes read ([`RankState`]) and the decode steps captured over
/// it ([`StepGraphs`]; a graph holds addresses of the state's buffers, so the two go together).
struct Rank {
    st: RankState,
    graphs: StepGraphs,
}

/// Kept free beside the KV cache when it allocates into memory an overlapped offload frees: a
/// pass's activations and logits (tens of MB at 7.6B shapes), cuBLAS workspaces, pool rounding.
pub const ROOM_MARGIN_BYTES: u64 = 1 << 30;

impl Core {
    /// Per-rank handles and kernels on `pool` for a layout of degree `tp` (no weights yet).
    pub fn new(
        config: &ModelConfig,
        tp: usize,
        pool: &ThreadRankPool,
    ) -> Result<Self, GpuDecodeError> {
        let topology = decode_topology(pool.world(), tp, pool.local_ranks().len())?;
        crate::blas::require_cublas()?;
        let locals = pool.local_ranks().to_vec();
        let inv_freq: Vec<f32> = (0..config.model.head_dim / 2)
            .map(|i| {
                1.0 / (config
                    .rope_theta
                    .powf((2 * i) as f64 / config.model.head_dim as f64))
                    as f32
            })
            .collect();
        let mut items: Vec<Option<RankState>> = locals.iter().map(|_| None).collect();
        let freq = &inv_freq;
        pool.run_each(&mut items, &|ctx, slot| {
            let local = locals.iter().position(|&r| r == ctx.rank).ok_or_else(|| {
                CudaError::Invalid(format!("rank {} is not a local rank", ctx.rank))
            })?;
            let blas = crate::blas::handle(&ctx.compute, ctx.rank)?;
            let k = DecoderKernels::load(ctx)?;
            let inv = ctx
                .compute
                .clone_htod(freq.as_slice())
                .map_err(ctx.drv("uploading rotary frequencies", 0))?;
            let (replica, reports) = match topology {
                DecodeTopology::Group => (0, local == 0),
                DecodeTopology::Replicas(_) => (local, true),
            };
            *slot = Some(RankState {
                tp_rank: ctx.rank % tp,
                replica,
                reports,
                blas,
                k,
                bind: None,
                inv_freq: inv,
                cache: None,
                table: None,
                kv: KvDtype::F32,
                ev_compute: ctx.event()?,
                ev_nccl: ctx.event()?,
                downloads: Default::default(),
                fp8: None,
                fp8_compute: Fp8Compute::WeightOnly,
                w8a8: None,
                w8a8_limits: W8a8Limits::default(),
                dequant: None,
                x32: None,
                x32_joined: Cell::new(false),
                bf16_mma: None,
                bf16_mma_tokens: BF16_MMA_DEFAULT_TOKENS,
                grouped: true,
                lora_tile_rows: LORA_TILE_ROWS_DEFAULT,
                lora_riders: false,
                device_moe: None,
                device_routing: true,
                room: None,
                merged: None,
            });
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(())
        })?;
        let ranks: Vec<Rank> = items
            .into_iter()
            .flatten()
            .map(|st| Rank {
                st,
                graphs: StepGraphs::default(),
            })
            .collect();
        if ranks.len() != locals.len() {
            return Err(
                CudaError::Invalid("a rank did not set up its decoder state".into()).into(),
            );
        }
        Ok(Core {
            config: config.clone(),
            ranks,
            topology,
            parts: Vec::new(),
            tp,
            geo: None,
            lens: Vec::new(),
            pages: PageTables::default(),
            static_room: 0,
            kv: KvMode::Grow,
            room_waits: 0,
            last_prefill: std::time::Duration::ZERO,
            lora: None,
            lora_mode: LoraMode::Unmerged,
            last_merge: std::time::Duration::ZERO,
        })
    }

    /// The longest sequence every rank's attention kernels hold (at most [`MAX_CONTEXT`]).
    pub fn max_context(&self) -> usize {
        self.states()
            .map(|st| st.k.max_context)
            .min()
            .unwrap_or(0)
            .min(MAX_CONTEXT)
            / KV_PAGE_POSITIONS
            * KV_PAGE_POSITIONS
    }

    /// Every local rank's state, in local-rank order.
    fn states(&self) -> impl Iterator<Item = &RankState> {
        self.ranks.iter().map(|r| &r.st)
    }

    /// Every local rank's state, in local-rank order, to change a setting.
    pub(super) fn states_mut(&mut self) -> impl Iterator<Item = &mut RankState> {
        self.ranks.iter_mut().map(|r| &mut r.st)
    }

    /// Binds every rank to its buffer of `weights` at the offsets of `plan` (checked against the
    /// buffers' lengths first), counted from the buffer's address, or from `shared`'s where a
    /// shared base lies outside the buffer (the plan's offsets counted from there:
    /// [`SharedBase::entries`](crate::SharedBase::entries); the buffer's entries are checked by
    /// the buffer, the shared tensors by the caller of
    /// [`GpuEngine::share_base`](crate::GpuEngine::share_base)). Waits for the work queued on
    /// the weights (the switch) to finish: every stream of the rank's, but the copy stream when the switch overlaps its offload
    /// ([`RolloutBuffer::freeing`]): its copies go on beside the rollout, whose allocations then
    /// wait for the frees that make room for them.
    pub fn bind(
        &mut self,
        pool: &ThreadRankPool,
        plan: &GroupOffsets,
        weights: &RolloutBuffer,
        shared: Option<u64>,
    ) -> Result<(), GpuDecodeError> {
        // adapters: those of the configuration given, before anything is read
        plan.check_lora(&self.config, self.lora.as_ref())?;
        let lora_rank = plan.lora_rank();
        let lora = (
            self.lora.as_ref().map_or(1.0, |l| l.scaling() as f32),
            lora_rank,
        );
        let merge = (self.lora_mode == LoraMode::Merged && lora_rank > 0).then(|| {
            let geo = Geometry::of(plan);
            let m = &self.config.model;
            target_shapes(
                m.hidden,
                m.head_dim,
                (geo.q_heads, geo.kv_heads),
                geo.ffn_part,
            )
        });
        let locals = pool.local_ranks().to_vec();
        for (i, _) in locals.iter().enumerate() {
            let len = weights.rank_buffer(i).map_or(0, |b| b.len() as u64);
            if shared.is_none() && len < plan.min_len {
                return Err(DecodeError::Usage(format!(
                    "the rollout buffer of local rank {i} holds {len} elements, its entries need {}",
                    plan.min_len
                ))
                .into());
            }
        }
        let merged = pool.run_each(&mut self.ranks, &|ctx, r| {
            let local = locals.iter().position(|&r| r == ctx.rank).ok_or_else(|| {
                CudaError::Invalid(format!("rank {} is not a local rank", ctx.rank))
            })?;
            let st = &mut r.st;
            st.room = weights.freeing(local).cloned();
            if st.room.is_some() {
                let nccl = ctx.nccl_stream();
                let streams = [&*ctx.compute, &*ctx.aux, &*nccl];
                ctx.wait(&streams, "the switch's work on the rollout weights")?;
            } else {
                ctx.sync_all()?;
            }
            let buf = weights.rank_buffer(local).ok_or_else(|| {
                CudaError::Invalid(format!("no rollout buffer for local rank {local}"))
            })?;
            let w = plan
                .ranks
                .get(st.tp_rank)
                .ok_or_else(|| {
                    CudaError::Invalid(format!("no weight offsets for TP rank {}", st.tp_rank))
                })?
                .clone();
            if plan.fp8_max > 0 {
                if st.fp8.is_none() {
                    st.fp8 = Some(Fp8Kernels::load(ctx)?);
                }
                let need_x = GEMV_TOKENS * plan.fp8_max_cols as usize;
                let need = 2 * plan.fp8_max as usize;
                if let Some(room) = &st.room {
                    let bytes = 4 * need_x as u64 + 2 * need as u64;
                    room.order_for(ctx, &ctx.compute, bytes + ROOM_MARGIN_BYTES)?;
                }
                grow_scratch(ctx, &mut st.x32, need_x, "the fp8 activation scratch")?;
                grow_scratch(ctx, &mut st.dequant, need, "the fp8 dequantisation scratch")?;
                if st.fp8_compute == Fp8Compute::W8A8 && st.w8a8.is_none() {
                    st.w8a8 = Some(W8a8Gemm::new(ctx)?);
                }
            }
            if st.bf16_mma.is_none() {
                st.bf16_mma = MmaKernels::load(ctx).unwrap_or_else(|e| {
                    tracing::warn!(
                        rank = ctx.rank,
                        "the bf16 tensor-core kernels did not load ({e}); cuBLAS takes every \
                         bf16 product"
                    );
                    None
                });
            }
            let (base, w, lora, merged) = match merge {
                Some(_) if shared.is_some() => {
                    return Err(CudaError::Invalid(
                        "the merged LoRA mode copies the rollout buffer, and the base lies \
                         outside it (a shared base): use the unmerged mode"
                            .into(),
                    ))
                }
                Some(shapes) => {
                    // the merged mode: the decoder reads a private copy, adapters merged
                    let len = buf.len();
                    if let Some(room) = &st.room {
                        room.order_for(ctx, &ctx.compute, 2 * len as u64 + ROOM_MARGIN_BYTES)?;
                    }
                    let t = std::time::Instant::now();
                    let (base, w) = merge_rank(ctx, st, (buf, len), &w, shapes, lora.0)?;
                    ctx.compute
                        .synchronize()
                        .map_err(ctx.drv("synchronizing the LoRA merge", 0))?;
                    (base, w, (1.0, 0), t.elapsed())
                }
                None => {
                    st.merged = None;
                    let base = shared.unwrap_or_else(|| ptr(buf, &ctx.compute));
                    (base, w, lora, std::time::Duration::ZERO)
                }
            };
            st.device_moe = DeviceExperts::bind(ctx, &w, base)?;
            st.bind = Some(RankBind { base, w, lora });
            r.graphs.clear();
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(merged)
        })?;
        self.last_merge = merged.into_iter().max().unwrap_or_default();
        self.geo = Some(Geometry::of(plan));
        Ok(())
    }

    /// Whether the bound weights came from a switch whose offload still frees memory on some
    /// rank ([`RolloutBuffer::freeing`]).
    pub fn allocates_into_freeing(&self) -> bool {
        self.states().any(|st| st.room.is_some())
    }

    /// Sets how every rank's fp8 products compute; in W8A8 mode with fp8 weights bound, makes
    /// each rank's block-scaled GEMM first (all or none: an error changes nothing).
    pub fn set_fp8_compute(
        &mut self,
        pool: &ThreadRankPool,
        compute: Fp8Compute,
    ) -> Result<(), GpuDecodeError> {
        if compute == Fp8Compute::W8A8 {
            let mut made: Vec<Option<W8a8Gemm>> = self.ranks.iter().map(|_| None).collect();
            let need: Vec<bool> = self
                .states()
                .map(|st| st.fp8.is_some() && st.bind.is_some() && st.w8a8.is_none())
                .collect();
            let locals = pool.local_ranks().to_vec();
            pool.run_each(&mut made, &|ctx, slot| {
                let local = locals.iter().position(|&r| r == ctx.rank).ok_or_else(|| {
                    CudaError::Invalid(format!("rank {} is not a local rank", ctx.rank))
                })?;
                if need.get(local).copied().unwrap_or(false) {
                    *slot = Some(W8a8Gemm::new(ctx)?);
                }
                Ok(())
            })?;
            for (st, m) in self.states_mut().zip(made) {
                if m.is_some() {
                    st.w8a8 = m;
                }
            }
        }
        for st in self.states_mut() {
            st.fp8_compute = compute;
        }
        Ok(())
    }

    /// Forgets the weights and frees the KV cache (host side only: cannot fail). Frees are
    /// stream-ordered on each rank's compute stream.
    pub fn unbind(&mut self) {
        for r in &mut self.ranks {
            r.graphs.clear();
            let st = &mut r.st;
            st.bind = None;
            st.cache = None;
            st.table = None;
            st.dequant = None;
            st.x32 = None;
            st.w8a8 = None;
            st.device_moe = None;
            st.room = None;
        }
        self.geo = None;
        self.lens.clear();
        self.parts.clear();
        self.pages = PageTables::default();
    }

    /// Keeps K and V as `kv` says from the next cache on (f32, bf16 or fp8, [`check_kv`]): drops
    /// the cache and the sequences it holds (host side only).
    pub fn set_kv_dtype(&mut self, kv: KvDtype) -> Result<(), GpuDecodeError> {
        check_kv(kv, self.config.model.head_dim)?;
        for st in self.states_mut() {
            st.cache = None;
            st.table = None;
            st.kv = kv;
        }
        self.lens.clear();
        self.parts.clear();
        self.pages = PageTables::default();
        self.kv = KvMode::Grow;
        Ok(())
    }

    /// The element type of the KV cache.
    pub fn kv_dtype(&self) -> KvDtype {
        self.states().next().map_or(KvDtype::F32, |st| st.kv)
    }

    /// Positions one sequence holds: a row of the page tables.
    pub fn cap(&self) -> usize {
        self.pages.positions()
    }

    /// Allocates the KV cache of `budget` pages per replica (and the padding page) for `slots`
    /// sequences per replica of up to `positions` each on every rank (zeroed; needs the weights
    /// bound for the kv-head count), replacing any cache.
    pub fn alloc_fixed(
        &mut self,
        pool: &ThreadRankPool,
        slots: usize,
        positions: usize,
        budget: usize,
    ) -> Result<(), GpuDecodeError> {
        let geo = self.geometry()?;
        let pages = PageTables::fixed(self.topology.replicas(), slots, positions, budget);
        let len = kv_elements(
            self.config.model.layers,
            pages.pages,
            KV_PAGE_POSITIONS,
            geo.kv_heads * kv_head_units(self.kv_dtype(), self.config.model.head_dim),
        );
        self.lens.clear();
        self.parts.clear();
        let waits = pool.run_each(&mut self.ranks, &|ctx, r| {
            let st = &mut r.st;
            st.cache = None;
            // into memory an overlapped offload frees: after the frees that make room for it
            let mut waited = 0;
            if let Some(room) = &st.room {
                let need = 2 * len as u64 + ROOM_MARGIN_BYTES;
                waited = room.order_for(ctx, &ctx.compute, need)?.min(1);
            }
            st.cache = Some(alloc_zeros::<u16>(
                &ctx.compute,
                len,
                ctx.rank,
                "the KV cache",
            )?);
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(waited)
        })?;
        self.room_waits += waits.iter().sum::<usize>();
        self.kv = KvMode::Fixed { slots };
        self.pages = pages;
        Ok(())
    }

    /// Whether decode steps replay captured graphs (dropping every graph when off).
    pub fn set_step_graphs(&mut self, on: bool) {
        for r in &mut self.ranks {
            r.graphs.enabled = on;
            if !on {
                r.graphs.clear();
            }
        }
    }

    /// Graphs captured and decode steps replayed from one, summed over the ranks.
    pub fn graph_counts(&self) -> (usize, usize) {
        self.ranks.iter().fold((0, 0), |(c, p), r| {
            (c + r.graphs.captured, p + r.graphs.replayed)
        })
    }

    /// Downloads that waited for the device, summed over the ranks.
    pub fn host_waits(&self) -> usize {
        self.states().map(|st| st.downloads.waits()).sum()
    }

    /// The time the host spent in those waits, on the rank that waited longest.
    pub fn host_wait_time(&self) -> std::time::Duration {
        self.states()
            .map(|st| st.downloads.waited())
            .max()
            .unwrap_or_default()
    }

    /// Bytes of the KV cache on the rank that holds the most.
    pub fn kv_bytes(&self) -> u64 {
        self.states()
            .map(|st| st.cache.as_ref().map_or(0, |c| 2 * c.len() as u64))
            .max()
            .unwrap_or(0)
    }

    pub(super) fn geometry(&self) -> Result<Geometry, GpuDecodeError> {
        self.geo.ok_or_else(|| {
            DecodeError::Usage("the decoder is not bound to rollout weights".into()).into()
        })
    }

    /// Tokens in each sequence's cache.
    pub fn lengths(&self) -> Vec<usize> {
        self.lens.clone()
    }

    /// Makes room for `needed` positions per sequence of each replica's share of the batch
    /// (`self.parts`; `fresh`: a new batch, the old cache is dropped; otherwise the cache is
    /// grown, its contents kept). A fixed cache's pages are split over the batch at `fresh`
    /// ([`PageTables::split`]) and only checked after.
    fn reserve(
        &mut self,
        pool: &ThreadRankPool,
        needed: usize,
        fresh: bool,
    ) -> Result<(), GpuDecodeError> {
        let most = self.max_context();
        if needed > most {
            return Err(DecodeError::Usage(format!(
                "a sequence would hold {needed} tokens; the GPU decoder holds at most {most} on \
                 this device"
            ))
            .into());
        }
        if let KvMode::Fixed { slots } = self.kv {
            let counts: Vec<usize> = self.parts.iter().map(Range::len).collect();
            let widest = counts.iter().copied().max().unwrap_or(0);
            if fresh && widest <= slots {
                self.static_room = self.pages.split(&counts);
            }
            if needed > self.static_room || widest > slots {
                return Err(DecodeError::Usage(format!(
                    "the KV cache holds {slots} sequences per replica in {} pages of \
                     {KV_PAGE_POSITIONS} positions: {} positions each for this call's {widest}; \
                     it needs {needed}",
                    self.pages.budget(),
                    self.static_room
                ))
                .into());
            }
            return Ok(());
        }
        if !fresh && needed <= self.cap() {
            return Ok(());
        }
        let new_cap = if fresh {
            (needed + 128).min(most)
        } else {
            needed.max(self.cap() * 2).min(most)
        };
        let counts: Vec<usize> = self.parts.iter().map(Range::len).collect();
        let tables = PageTables::grow(&counts, new_cap);
        let layers = self.config.model.layers;
        // the width of a position of one layer's k (or v), in the cache's 2-byte units
        let w = (self.geometry()?.kv_heads
            * kv_head_units(self.kv_dtype(), self.config.model.head_dim)) as u64;
        let page = KV_PAGE_POSITIONS as u64 * w;
        let (old_block, new_block) = (self.pages.pages as u64 * page, tables.pages as u64 * page);
        let blocks = 2 * layers as u64;
        let len = (blocks * new_block) as usize;
        let waits = pool.run_each(&mut self.ranks, &|ctx, r| {
            let st = &mut r.st;
            // Into memory an overlapped offload frees: after the frees that make room for the
            // cache it will hold (the old one too while its rows are copied; bind's scratch).
            let mut waited = 0;
            if let Some(room) = &st.room {
                let held = |c: &Option<CudaSlice<u16>>| c.as_ref().map_or(0, |c| 2 * c.len());
                let scratch = st.x32.as_ref().map_or(0, |x| 4 * x.len())
                    + st.dequant.as_ref().map_or(0, |d| 2 * d.len());
                let old = if fresh { 0 } else { held(&st.cache) };
                let need = (old + 2 * len + scratch) as u64 + ROOM_MARGIN_BYTES;
                if fresh {
                    st.cache = None;
                }
                waited = room.order_for(ctx, &ctx.compute, need)?.min(1);
            }
            let new = alloc_zeros::<u16>(&ctx.compute, len, ctx.rank, "the KV cache")?;
            if let (false, true, Some(old)) = (fresh, old_block > 0, st.cache.as_ref()) {
                let args = [
                    Arg::U64(ptr(old, &ctx.compute)),
                    Arg::U64(ptr(&new, &ctx.compute)),
                    Arg::U64(blocks),
                    Arg::U64(old_block),
                    Arg::U64(new_block),
                ];
                let cfg = st.k.elementwise(blocks * old_block);
                // SAFETY: `old` holds blocks·old_block units and `new` blocks·new_block; both
                // live on this stream until the copy ran (the old one is freed on the same
                // stream after it). The grown tables keep every page where it was.
                unsafe {
                    launch(
                        &ctx.compute,
                        &st.k.grow_blocks,
                        cfg,
                        &args,
                        ctx.rank,
                        "grow_blocks",
                    )?
                };
            }
            st.cache = Some(new);
            Ok(waited)
        })?;
        self.room_waits += waits.iter().sum::<usize>();
        self.pages = tables;
        Ok(())
    }

    /// Runs one forward pass on every rank, `steps[r]` on the ranks of replica `r`; the logits
    /// (`[m × vocab]`) or tokens of the whole batch, in sequence order.
    pub(super) fn forward(
        &mut self,
        pool: &ThreadRankPool,
        mut steps: Vec<Step<'_>>,
    ) -> Result<StepOut, GpuDecodeError> {
        let geo = self.geometry()?;
        for (r, step) in steps.iter_mut().enumerate() {
            step.pages = self.pages.pages;
            step.pps = self.pages.pps;
            step.copies = self.pages.fork_copies(r, &step.forks);
        }
        // the tables the ranks hold are the host's after this pass's upload
        let tables = self.pages.dirty.then_some(&self.pages.tables);
        let steps = &steps;
        let c = &self.config;
        let dims: Vec<Dims> = steps
            .iter()
            .map(|step| Dims {
                n: step.tokens.len(),
                m: step.logit_rows.len(),
                h: c.model.hidden,
                d: c.model.head_dim,
                qh: geo.q_heads,
                kvh: geo.kv_heads,
                f: geo.ffn_part,
                vocab: c.model.vocab,
                part: geo.vocab_part,
                tp: self.tp,
                layers: c.model.layers,
                eps: c.rms_norm_eps as f32,
                group: c.model.heads / c.model.query_groups,
                vocab_parallel: geo.vocab_parallel,
                fused: geo.fused,
                top_k: c.model.moe.map_or(0, |m| m.top_k),
                norm_topk_prob: c.model.moe.is_some_and(|m| m.norm_topk_prob),
            })
            .collect();
        let outs = pool.run_each(&mut self.ranks, &|ctx, r| {
            let Rank { st, graphs } = r;
            if let Some(table) = tables.and_then(|t| t.get(st.replica)) {
                upload_table(ctx, st, table)?;
            }
            let (Some(step), Some(z)) = (steps.get(st.replica), dims.get(st.replica)) else {
                return Err(CudaError::Invalid(format!(
                    "no forward pass for replica {} ({} given)",
                    st.replica,
                    steps.len()
                )));
            };
            if step.tokens.is_empty() {
                // a replica with no sequences of this batch
                return Ok(StepOut::Nothing);
            }
            rank_forward(ctx, st, graphs, z, step)
        })?;
        self.pages.dirty = false;
        let wanted: usize = steps.iter().map(|s| s.logit_rows.len()).sum();
        let out = match self.topology {
            DecodeTopology::Group => outs
                .into_iter()
                .find(|o| !matches!(o, StepOut::Nothing))
                .unwrap_or(StepOut::Nothing),
            // replica order is sequence order: concatenate
            DecodeTopology::Replicas(_) => {
                outs.into_iter().try_fold(StepOut::Nothing, StepOut::then)?
            }
        };
        let got = out.len();
        if got != wanted && !matches!(out, StepOut::Nothing) {
            return Err(CudaError::Invalid(format!(
                "the forward pass brought back {got} rows for {wanted} wanted"
            ))
            .into());
        }
        Ok(out)
    }

    /// Sets the replicas' shares of a new batch of `batch` sequences.
    fn split_batch(&mut self, batch: usize) {
        let r = self.topology.replicas();
        self.parts = (0..r).map(|k| replica_rows(batch, r, k)).collect();
    }

    /// Prefill of `prompts` (a new batch); `fork`: prompts equal to an earlier one of the same
    /// replica are not run through the model but get a copy of its KV rows (only with
    /// [`PrefillLogits::Last`]).
    fn prefill_rows(
        &mut self,
        pool: &ThreadRankPool,
        prompts: &[Vec<u32>],
        which: PrefillLogits,
        pick: Pick<'_>,
        fork: bool,
    ) -> Result<StepOut, GpuDecodeError> {
        for (s, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(DecodeError::Usage(format!(
                    "prompt {s} is empty: every prompt needs at least one token"
                ))
                .into());
            }
            for &t in p {
                lifecycle_decoder::check_token(&self.config, s, t)?;
            }
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        self.lens.clear();
        self.split_batch(prompts.len());
        self.reserve(pool, longest, true)?;
        let mut steps = Vec::with_capacity(self.parts.len());
        let mut wanted = 0usize;
        for part in &self.parts {
            let rows = PrefillRows::new(&prompts[part.clone()], which == PrefillLogits::All, fork);
            let want = wanted..wanted + rows.logit_rows.len();
            wanted = want.end;
            steps.push(Step::new(
                (rows.tokens, rows.seqs, rows.poss),
                rows.logit_rows,
                rows.forks,
                pick.rows(want),
                false,
            ));
        }
        let out = self.forward(pool, steps)?;
        self.lens = prompts.iter().map(Vec::len).collect();
        Ok(out)
    }

    fn decode_rows(
        &mut self,
        pool: &ThreadRankPool,
        tokens: &[u32],
        pick: Pick<'_>,
    ) -> Result<StepOut, GpuDecodeError> {
        if tokens.len() != self.lens.len() || self.lens.is_empty() {
            return Err(DecodeError::Usage(format!(
                "decode_step got {} tokens for a batch of {} sequences (call prefill first)",
                tokens.len(),
                self.lens.len()
            ))
            .into());
        }
        for (s, &t) in tokens.iter().enumerate() {
            lifecycle_decoder::check_token(&self.config, s, t)?;
        }
        let longest = self.lens.iter().copied().max().unwrap_or(0);
        self.reserve(pool, longest + 1, false)?;
        let steps: Vec<Step<'_>> = self
            .parts
            .iter()
            .map(|part| {
                let seqs: Vec<u32> = (0..part.len() as u32).collect();
                let poss = self.lens[part.clone()].iter().map(|&l| l as u32).collect();
                Step::new(
                    (tokens[part.clone()].to_vec(), seqs.clone(), poss),
                    seqs,
                    Vec::new(),
                    pick.rows(part.clone()),
                    true,
                )
            })
            .collect();
        let out = self.forward(pool, steps)?;
        self.lens.iter_mut().for_each(|l| *l += 1);
        Ok(out)
    }

    fn logits(out: StepOut) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        match out {
            StepOut::Logits(l) => Ok(l),
            _ => Err(CudaError::Invalid("no rank returned logits".into()).into()),
        }
    }

    fn tokens(out: StepOut) -> Result<Vec<u32>, GpuDecodeError> {
        match out {
            StepOut::Tokens(t) => Ok(t),
            StepOut::Picked(p) => Ok(p.into_iter().map(|p| p.token).collect()),
            _ => Err(CudaError::Invalid("no rank returned tokens".into()).into()),
        }
    }

    /// [`Decoder::prefill`](lifecycle_decoder::Decoder::prefill).
    pub fn prefill(
        &mut self,
        pool: &ThreadRankPool,
        prompts: &[Vec<u32>],
        which: PrefillLogits,
    ) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        let mut rows =
            Self::logits(self.prefill_rows(pool, prompts, which, Pick::Logits, false)?)?
                .into_iter();
        match which {
            PrefillLogits::Last => Ok(rows.collect()),
            PrefillLogits::All => Ok(prompts
                .iter()
                .map(|p| rows.by_ref().take(p.len()).flatten().collect())
                .collect()),
        }
    }

    /// [`Decoder::decode_step`](lifecycle_decoder::Decoder::decode_step).
    pub fn decode_step(
        &mut self,
        pool: &ThreadRankPool,
        tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, GpuDecodeError> {
        Self::logits(self.decode_rows(pool, tokens, Pick::Logits)?)
    }

    /// [`Decoder::generate`](lifecycle_decoder::Decoder::generate) on the device (see
    /// [`GpuDecoder`](crate::GpuDecoder)'s), prefilling each distinct prompt of a replica once when
    /// `fork` is set.
    pub fn generate(
        &mut self,
        pool: &ThreadRankPool,
        prompts: &[Vec<u32>],
        sampling: &Sampling,
        fork: bool,
    ) -> Result<Vec<Vec<u32>>, GpuDecodeError> {
        let mut out: Vec<Vec<u32>> =
            vec![Vec::with_capacity(sampling.max_new_tokens); prompts.len()];
        if sampling.max_new_tokens == 0 || prompts.is_empty() {
            return Ok(out);
        }
        let greedy = sampling.temperature <= 0.0;
        let mut rngs: Vec<SplitMix64> = (0..prompts.len())
            .map(|i| SplitMix64::from_keys(&[sampling.seed, i as u64]))
            .collect();
        let temperature = sampling.temperature;
        let draw = |rngs: &mut [SplitMix64]| -> Vec<RowPick> {
            if greedy {
                Vec::new()
            } else {
                rngs.iter_mut()
                    .map(|g| RowPick {
                        temperature,
                        top_k: 0,
                        top_p: 1.0,
                        uniform: g.next_f32(),
                    })
                    .collect()
            }
        };
        fn pick(greedy: bool, rows: &[RowPick]) -> Pick<'_> {
            if greedy {
                Pick::Argmax
            } else {
                Pick::Rows(rows)
            }
        }
        let mut done = vec![false; prompts.len()];
        let u = draw(&mut rngs);
        let start = std::time::Instant::now();
        let mut next = Self::tokens(self.prefill_rows(
            pool,
            prompts,
            PrefillLogits::Last,
            pick(greedy, &u),
            fork,
        )?)?;
        self.last_prefill = start.elapsed();
        for step in 0..sampling.max_new_tokens {
            for ((o, d), &t) in out.iter_mut().zip(done.iter_mut()).zip(&next) {
                if !*d {
                    o.push(t);
                    *d = sampling.stop_token == Some(t);
                }
            }
            if step + 1 == sampling.max_new_tokens || done.iter().all(|&d| d) {
                break;
            }
            let u = draw(&mut rngs);
            next = Self::tokens(self.decode_rows(pool, &next, pick(greedy, &u))?)?;
        }
        Ok(out)
    }
}

/// Copies the host's page table into the rank's (made anew where its length changed), ordered
/// before the passes on the compute stream.
fn upload_table(ctx: &RankCtx, st: &mut RankState, table: &[u32]) -> Result<(), CudaError> {
    match st.table.as_mut() {
        Some(t) if t.len() == table.len() => ctx
            .compute
            .memcpy_htod(table, t)
            .map_err(ctx.drv("uploading the KV page table", 0)),
        _ => {
            st.table = Some(
                ctx.compute
                    .clone_htod(table)
                    .map_err(ctx.drv("uploading the KV page table", 0))?,
            );
            Ok(())
        }
    }
}

/// Makes `slot` a device scratch of at least `len` elements (kept when it is large enough).
fn grow_scratch<T: lifecycle_cuda::cudarc::driver::DeviceRepr>(
    ctx: &RankCtx,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    what: &str,
) -> Result<(), CudaError> {
    if slot.as_ref().is_none_or(|d| d.len() < len) {
        *slot = None;
        // SAFETY: a scratch: every kernel that reads it writes what it reads first (the join
        // kernel its activation rows, the dequantisation its hi / lo rows).
        *slot = Some(unsafe { lifecycle_cuda::alloc_device(&ctx.compute, len, ctx.rank, what)? });
    }
    Ok(())
}
