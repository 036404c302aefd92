//! Decode steps replayed from CUDA graphs: a rank's forward pass of `n` sequences captured once
//! ([`StepGraphs`]) and launched as one graph per step, instead of the ~15 launches per layer it
//! queues (at batch 1 on an H200 the launches take a sizeable share of a step).
//!
//! A graph holds the addresses it was captured with: each one owns its pass's scratch (made for
//! its rows) and input buffers (the step's tokens and positions are copied into them before a
//! launch), and reads the bound weights, the KV cache, its page table (whose contents change
//! between launches: the host uploads a table before the pass that reads it) and the rank's
//! lazily grown scratch where they were at capture. So a graph is kept for one key (rows,
//! wanted rows, the cache's and its table's addresses and layout) and every graph is dropped when anything it read may have moved: other
//! weights bound, other fp8 settings, a W8A8 scratch grown ([`Ident`]).
//!
//! Only decode steps at `T = 1` (one rank, or data-parallel replicas) without forks are
//! captured, and only after the same key ran once eagerly (which grows the lazily sized scratch
//! to its shapes, and tells whether every mixture-of-experts layer was routed on the device: a
//! pass that routes on the host downloads the router's logits and is never captured). The
//! capture itself proves a step free of host synchronisation: a device→host copy, an upload
//! or a wait inside it ends the capture with an error.
//!
//! [`rank_forward`] runs one rank's pass: from a graph where [`StepGraphs`] takes it, else its
//! stages as they are queued ([`super::forward`]).

use lifecycle_cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use lifecycle_cuda::cudarc::driver::CudaGraph;
use lifecycle_cuda::{CudaError, RankCtx};
use lifecycle_decoder::KvDtype;
use lifecycle_layout::fp8::Fp8Compute;

use super::forward::{pick, run_stages, Capture, Scratch, Step, StepOut};
use super::rank::{Dims, RankState};
use crate::kernels::ptr;
use crate::w8a8::{MmaKernels, W8a8Limits};

/// One rank's forward pass of `step`: the stages in order (replayed from a captured graph
/// where `graphs` takes the step), then the pick.
pub(super) fn rank_forward(
    ctx: &RankCtx,
    st: &mut RankState,
    graphs: &mut StepGraphs,
    z: &Dims,
    step: &Step<'_>,
) -> Result<StepOut, CudaError> {
    if z.m > 0 && st.reports && graphs.takes(st, z, step) {
        let sc = graphs.run(ctx, st, z, step)?;
        return sc.logits().and_then(|l| pick(ctx, st, z, step.pick, l));
    }
    let mut sc = Scratch::new(ctx, st, z, step)?;
    sc.upload(ctx, step)?;
    run_stages(ctx, st, z, step, &mut sc, Capture::Eager)?;
    if z.m == 0 {
        return Ok(StepOut::Nothing);
    }
    if !st.reports {
        ctx.compute
            .synchronize()
            .map_err(ctx.drv("synchronizing", 0))?;
        return Ok(StepOut::Nothing);
    }
    pick(ctx, st, z, step.pick, sc.logits()?)
}

/// The most graphs a rank keeps (least recently used dropped first): the two caches a growing
/// decoder alternates between, for two batch sizes. Each owns its pass's scratch (at 7.6B
/// shapes about 150 MB for 64 sequences, most of it logits), so together they stay within
/// [`ROOM_MARGIN_BYTES`](crate::ROOM_MARGIN_BYTES).
pub(crate) const MAX_GRAPHS: usize = 4;

/// What one graph was captured for: the pass's sizes and where its cache was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    n: usize,
    m: usize,
    /// Pages of a cache block and of a table row, the cache's address and length, the page
    /// table's address.
    pages: usize,
    pps: usize,
    cache: u64,
    cache_len: usize,
    table: u64,
}

/// What every graph of a rank read besides its own buffers and the cache: when it changes, the
/// graphs are dropped.
#[derive(Debug, Clone, PartialEq)]
struct Ident {
    base: u64,
    x32: Option<u64>,
    dequant: Option<u64>,
    experts: Option<u64>,
    /// The W8A8 GEMM's identity and how often its scratch grew ([`W8a8Gemm::version`]).
    ///
    /// [`W8a8Gemm::version`]: crate::w8a8::W8a8Gemm::version
    w8a8: Option<(u64, u64)>,
    /// How often the bf16 tensor-core kernels' scratch grew, and up to which tokens they run.
    bf16_mma: (u64, usize),
    fp8_compute: Fp8Compute,
    limits: W8a8Limits,
    grouped: bool,
    lora_tile_rows: usize,
    device_routing: bool,
    kv: KvDtype,
}

impl Ident {
    fn of(ctx: &RankCtx, st: &RankState) -> Option<Self> {
        let s = &ctx.compute;
        let bind = st.bind.as_ref()?;
        Some(Ident {
            base: bind.base,
            x32: st.x32.as_ref().map(|b| ptr(b, s)),
            dequant: st.dequant.as_ref().map(|b| ptr(b, s)),
            experts: st.device_moe.as_ref().map(|d| d.table_at(s)),
            w8a8: st.w8a8.as_ref().map(|g| g.version()),
            bf16_mma: (
                st.bf16_mma.as_ref().map_or(0, MmaKernels::grown),
                st.bf16_mma_tokens,
            ),
            fp8_compute: st.fp8_compute,
            limits: st.w8a8_limits,
            grouped: st.grouped,
            lora_tile_rows: st.lora_tile_rows,
            device_routing: st.device_routing,
            kv: st.kv,
        })
    }
}

/// A captured graph, owned by one rank's [`StepGraphs`].
struct RankGraph(CudaGraph);

// SAFETY: a graph is used (launched, destroyed) only through the `StepGraphs` that holds it,
// which lives beside its rank's state in the decoder's per-rank slot, and the rank pool hands
// that slot to one thread at a time (`&mut`), so calls on it are serialised as
// CUDA requires of graph objects; the graph's context is made current by each call.
unsafe impl Send for RankGraph {}

/// One key's pass: its scratch, and its graph once captured.
struct Entry {
    key: Key,
    sc: Scratch,
    graph: Option<RankGraph>,
    /// Ran once eagerly (the next step of the key is captured).
    warm: bool,
    /// Routed a mixture-of-experts layer on the host: never captured.
    eager_only: bool,
    /// The step count at its last use.
    used: u64,
}

/// A rank's captured decode steps ([the module](self)); on by default
/// (`GpuDecoder::set_step_graphs`).
pub(crate) struct StepGraphs {
    pub(crate) enabled: bool,
    ident: Option<Ident>,
    entries: Vec<Entry>,
    clock: u64,
    /// Graphs captured and steps replayed from one, since the rank was made.
    pub(crate) captured: usize,
    pub(crate) replayed: usize,
}

impl Default for StepGraphs {
    fn default() -> Self {
        StepGraphs {
            enabled: true,
            ident: None,
            entries: Vec::new(),
            clock: 0,
            captured: 0,
            replayed: 0,
        }
    }
}

impl StepGraphs {
    /// Whether `step` goes through a graph: graphs on, a decode step without forks of one rank
    /// at `T = 1`, with its weights bound and its cache made.
    pub(super) fn takes(&self, st: &RankState, z: &Dims, step: &Step<'_>) -> bool {
        self.enabled
            && step.decode
            && step.copies.is_empty()
            && z.tp == 1
            && z.m > 0
            && st.bind.is_some()
            && st.cache.is_some()
    }

    /// Drops every graph and its scratch (stream-ordered frees: launches in flight finish).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.ident = None;
    }

    /// Runs `step` ([`StepGraphs::takes`] it): its inputs copied into its key's buffers, then
    /// its graph launched, or, for a new key, the stages run eagerly; the key's second step is
    /// captured and launched. The scratch whose head holds the logits comes back.
    pub(super) fn run(
        &mut self,
        ctx: &RankCtx,
        st: &RankState,
        z: &Dims,
        step: &Step<'_>,
    ) -> Result<&Scratch, CudaError> {
        let s = &ctx.compute;
        let ident = Ident::of(ctx, st);
        if ident != self.ident {
            self.entries.clear();
            self.ident = ident;
        }
        let cache = st
            .cache
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no KV cache: call prefill first".into()))?;
        let table = st
            .table
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no KV page table: call prefill first".into()))?;
        let key = Key {
            n: z.n,
            m: z.m,
            pages: step.pages,
            pps: step.pps,
            cache: ptr(cache, s),
            cache_len: cache.len(),
            table: ptr(table, s),
        };
        self.clock += 1;
        let i = match self.entries.iter().position(|e| e.key == key) {
            Some(i) => i,
            None => {
                if self.entries.len() >= MAX_GRAPHS {
                    let oldest = (0..self.entries.len())
                        .min_by_key(|&i| self.entries[i].used)
                        .unwrap_or(0);
                    self.entries.swap_remove(oldest);
                }
                self.entries.push(Entry {
                    key,
                    sc: Scratch::new(ctx, st, z, step)?,
                    graph: None,
                    warm: false,
                    eager_only: false,
                    used: 0,
                });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[i];
        e.used = self.clock;
        e.sc.upload(ctx, step)?;
        if let Some(RankGraph(g)) = &e.graph {
            g.launch()
                .map_err(ctx.drv("launching a decode step's graph", 0))?;
            self.replayed += 1;
            return Ok(&self.entries[i].sc);
        }
        if !e.warm || e.eager_only {
            let ran = run_stages(ctx, st, z, step, &mut e.sc, Capture::Eager)?;
            e.warm = true;
            e.eager_only |= ran.host_routed;
            return Ok(&self.entries[i].sc);
        }
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(ctx.drv("beginning a decode step's capture", 0))?;
        let staged = run_stages(ctx, st, z, step, &mut e.sc, Capture::Capturing);
        // the capture ends whatever the stages did, so the stream is usable again
        let ended = s.end_capture(CUgraphInstantiate_flags(0));
        staged?;
        let graph = ended
            .map_err(ctx.drv("capturing a decode step into a graph", 0))?
            .ok_or_else(|| CudaError::Invalid("a decode step captured no work".into()))?;
        graph
            .launch()
            .map_err(ctx.drv("launching a decode step's graph", 0))?;
        e.graph = Some(RankGraph(graph));
        self.captured += 1;
        Ok(&self.entries[i].sc)
    }
}
