//! The decoder's small kernels, compiled at run time with NVRTC (no headers: bf16 conversions
//! are integer arithmetic, round to nearest even as `half` does).
//!
//! Activations are f32. Before a matrix product they are split into two bf16 rows, `hi =
//! bf16(v)` and `lo = bf16(v − hi)` (rows `0..n` and `n..2n` of the product's input), so one
//! cuBLAS bf16 × bf16 → f32 GEMM over `2n` rows reads every weight once and `combine` adds the
//! two halves: the product then sees the activations to about 16 significant bits instead of 8.

use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use lifecycle_cuda::{CudaError, KernelSet, RankCtx};

/// The device address of `s` for work on `stream` (the kernels' and GEMMs' arguments).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// CUDA C source of the decoder kernels.
pub const DECODER_KERNEL_SRC: &str = include_str!("../../../kernels/decoder.cu");

/// [`DECODER_KERNEL_SRC`] as a kernel set; no contraction into FMAs, so the element-wise kernels
/// round like the CPU decoder.
pub const DECODER_KERNELS: KernelSet =
    KernelSet::new("lifecycle_decoder_gpu kernels", DECODER_KERNEL_SRC).exact();

/// The decoder kernels loaded into one rank's context.
#[derive(Debug, Clone)]
pub(crate) struct DecoderKernels {
    pub embed: CudaFunction,
    pub rms_norm_split: CudaFunction,
    /// `rms_norm_split` and the W8A8 quantisation of its output in one launch.
    pub rms_norm_quant: CudaFunction,
    pub combine: CudaFunction,
    pub combine_cols: CudaFunction,
    /// A LoRA branch's `s·(x·Aᵀ)` joined and split for its `B` product.
    pub lora_mid: CudaFunction,
    /// A group of LoRA branches at few rows: the `A` products, then the `B` products added in
    /// place (`decoder::forward::lora`).
    pub lora_a: CudaFunction,
    /// `lora_a` on tensor cores, for more rows (compute capability 8.0 on: [`Self::tensor_cores`]).
    pub lora_a_tiles: CudaFunction,
    pub lora_b: CudaFunction,
    /// `lora_b` on tensor cores, for more rows (as [`Self::lora_a_tiles`]).
    pub lora_b_tiles: CudaFunction,
    /// An adapter merged into its base matrix, `W + s·B·A` rounded to bf16 once (the merged
    /// mode, `decoder::merge`).
    pub lora_merge: CudaFunction,
    pub swiglu_split: CudaFunction,
    /// `swiglu_split` and the W8A8 quantisation of its output in one launch.
    pub swiglu_quant: CudaFunction,
    pub swiglu_fused_split: CudaFunction,
    pub gather_vocab: CudaFunction,
    /// Pages of the paged KV cache copied in every layer block (a fork's unshared pages).
    pub copy_pages: CudaFunction,
    pub rope_store: CudaFunction,
    pub rope_store_bf16: CudaFunction,
    pub attention: CudaFunction,
    pub attention_bf16: CudaFunction,
    pub rope_store_fp8: CudaFunction,
    pub attention_fp8: CudaFunction,
    /// A prefill's attention in tiles of rows (`attention_tiled*`: f32, bf16 and fp8 caches).
    pub attention_tiled: CudaFunction,
    pub attention_tiled_bf16: CudaFunction,
    pub attention_tiled_fp8: CudaFunction,
    /// A decode step's attention in chunks of the cache ([`SplitAttention`]).
    pub attention_split: CudaFunction,
    pub attention_split_bf16: CudaFunction,
    pub attention_split_fp8: CudaFunction,
    /// The chunks of `attention_split*` joined.
    pub attention_join: CudaFunction,
    pub grow_blocks: CudaFunction,
    pub argmax_rows: CudaFunction,
    pub unshard: CudaFunction,
    /// The token pick with log-probabilities (`lifecycle_decoder::pick`'s rules).
    pub pick_rows: CudaFunction,
    pub head_norm: CudaFunction,
    pub gather_split_rows: CudaFunction,
    pub scatter_add_rows: CudaFunction,
    pub scatter_add_grouped: CudaFunction,
    pub add_gated_rows: CudaFunction,
    pub add_rows: CudaFunction,
    pub copy_words: CudaFunction,
    pub sm_count: u32,
    /// The device has bf16 tensor cores (`mma.sync` of bf16: compute capability 8.0 on).
    pub tensor_cores: bool,
    /// Positions the attention kernels hold on this device (their dynamic shared memory holds
    /// one score per position beside [`ATTENTION_THREADS`] floats; [`MAX_CONTEXT`] where the
    /// device's opt-in shared memory per block allows it).
    ///
    /// [`MAX_CONTEXT`]: crate::MAX_CONTEXT
    pub max_context: usize,
    /// The W8A8 quantisations (`rms_norm_quant`, `swiglu_quant`, `fp8_quant_*`) are launched
    /// early ([`LaunchHow::early`]; [`launches_early`]).
    pub early: bool,
}

/// Threads of an attention block (a block per row and query head).
pub(crate) const ATTENTION_THREADS: usize = 256;

/// Dynamic shared memory of an attention launch over a cache of `cap` positions (a multiple of
/// the page) with heads of `head_dim`: the larger of the head and the block's threads, the
/// sequence's page-table row, and a float per position.
pub(crate) fn attention_shared_bytes(cap: usize, head_dim: usize) -> usize {
    let pages = cap.div_ceil(crate::KV_PAGE_POSITIONS);
    (head_dim.max(ATTENTION_THREADS) + pages + cap) * 4
}

/// Rows an `attention_tiled*` block takes at most (`TILE_ROWS` in `kernels/decoder.cu`).
pub(crate) const TILE_ROWS: usize = 16;

/// The widest head `attention_tiled*` take (their output sums: 8 a thread of 256).
pub(crate) const TILED_MAX_HEAD: usize = 128;

/// Dynamic shared memory of an `attention_tiled*` launch over a cache of `cap` positions with
/// heads of `head_dim`: the page-table row, the tile's queries, one page of K or V (rows padded
/// by one float), the page's scores, and three floats per row.
pub(crate) fn tile_shared_bytes(cap: usize, head_dim: usize) -> usize {
    let (page, pages) = (
        crate::KV_PAGE_POSITIONS,
        cap.div_ceil(crate::KV_PAGE_POSITIONS),
    );
    (pages + TILE_ROWS * head_dim + page * (head_dim + 1) + TILE_ROWS * page + 3 * TILE_ROWS) * 4
}

/// How a decode step's attention is split over the cache (flash-decoding): `attention_split*`
/// take each row's cache in chunks of `chunk` positions, a block per (row, kv head, up to
/// [`SPLIT_HEADS`] of its query heads, chunk), every K / V row read once for all the query heads
/// that share it; `attention_join` joins a row's chunks in order. The chunk is fixed by the
/// cache's capacity alone, so a row's attention does not depend on the other rows of its step.
///
/// ```
/// # use lifecycle_decoder_gpu::SplitAttention;
/// let plan = SplitAttention::for_cache(32768, 128).unwrap();
/// assert_eq!((plan.chunk, plan.splits), (512, 64));
/// assert!(SplitAttention::for_cache(4096, 130).is_none()); // head_dim not a multiple of 4
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitAttention {
    /// Positions a block takes.
    pub chunk: usize,
    /// Chunks of a full cache: the partial sums kept per (row, query head).
    pub splits: usize,
}

/// Query heads of one kv head a split attention block takes (the kernels' `SPLIT_HEADS`).
pub const SPLIT_HEADS: usize = 8;
/// Threads of a split attention block (the kernels' `SPLIT_THREADS`).
const SPLIT_THREADS: usize = 128;
/// The most chunks of a cache (so the partial sums stay small at long contexts).
const MAX_SPLITS: usize = 64;
/// The fewest positions of a chunk (so a short context is a few chunks, each a few steps of a
/// block's warps, not one chunk of many idle ones).
const MIN_CHUNK: usize = 128;

impl SplitAttention {
    /// The split of a cache of `cap` positions with heads of `head_dim`: chunks of 128
    /// positions, larger from 8 k positions on (at most 64 chunks), at most 1024 (the scores'
    /// shared memory). `None` where the kernels do not take the heads (`head_dim` not a multiple
    /// of 4 or over 256) or the cache is longer than 64 k positions.
    pub fn for_cache(cap: usize, head_dim: usize) -> Option<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(4) || head_dim > 256 || cap == 0 {
            return None;
        }
        let chunk = cap.div_ceil(MAX_SPLITS).next_multiple_of(64).max(MIN_CHUNK);
        if chunk > 1024 {
            return None;
        }
        Some(SplitAttention {
            chunk,
            splits: cap.div_ceil(chunk),
        })
    }

    /// The split block's dynamic shared memory: the block's queries, then its scores or its
    /// warps' output sums.
    pub(crate) fn shared_bytes(&self, head_dim: usize) -> usize {
        let warps = SPLIT_THREADS / 32;
        (SPLIT_HEADS * head_dim + (SPLIT_HEADS * self.chunk).max(warps * SPLIT_HEADS * head_dim))
            * 4
    }

    /// The split kernel's launch for `rows` rows of `kvh` kv heads of `group` query heads each
    /// on a device of `sms` multiprocessors: blocks (row, kv head, `heads` of its query heads)
    /// × chunks, and `heads` (the kernels' last argument). A block takes up to [`SPLIT_HEADS`]
    /// query heads (each K / V row it reads serves them all), fewer where the blocks of one
    /// chunk would not reach one per multiprocessor (a decode step of a few rows: its latency is
    /// then a block's share of heads, not the read). A head's sums are the same however many
    /// share its block, so the choice never changes a row's attention. The kernel is also given
    /// `sms`: a row long enough that its chunks alone give every multiprocessor a block takes
    /// [`SPLIT_HEADS`] heads a block again (each K / V row read once for them).
    pub(crate) fn split_launch(
        &self,
        rows: usize,
        kvh: usize,
        group: usize,
        d: usize,
        sms: usize,
    ) -> (LaunchConfig, u32) {
        let group = group.max(1);
        let mut per = group.div_ceil(SPLIT_HEADS);
        while per < group && rows * kvh * per < sms {
            per += 1;
        }
        let heads = group.div_ceil(per);
        let per = group.div_ceil(heads);
        let cfg = LaunchConfig {
            grid_dim: ((rows * kvh * per).max(1) as u32, self.splits as u32, 1),
            block_dim: (SPLIT_THREADS as u32, 1, 1),
            shared_mem_bytes: self.shared_bytes(d) as u32,
        };
        (cfg, heads as u32)
    }
}

/// One kernel argument (device pointers are passed as `u64`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address or a 64-bit count.
    U64(u64),
    /// A 32-bit count.
    U32(u32),
    /// A float.
    F32(f32),
}

impl DecoderKernels {
    /// Loads [`DECODER_KERNELS`] into this rank's context (compiled once per process, loaded
    /// once per context).
    pub fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&DECODER_KERNELS)?;
        DecoderKernels {
            embed: m.function("embed")?,
            rms_norm_split: m.function("rms_norm_split")?,
            rms_norm_quant: m.function("rms_norm_quant")?,
            combine: m.function("combine")?,
            combine_cols: m.function("combine_cols")?,
            lora_mid: m.function("lora_mid")?,
            lora_a: m.function("lora_a")?,
            lora_a_tiles: m.function("lora_a_tiles")?,
            lora_b: m.function("lora_b")?,
            lora_b_tiles: m.function("lora_b_tiles")?,
            lora_merge: m.function("lora_merge")?,
            swiglu_split: m.function("swiglu_split")?,
            swiglu_quant: m.function("swiglu_quant")?,
            swiglu_fused_split: m.function("swiglu_fused_split")?,
            gather_vocab: m.function("gather_vocab")?,
            copy_pages: m.function("copy_pages")?,
            rope_store: m.function("rope_store")?,
            rope_store_bf16: m.function("rope_store_bf16")?,
            attention: m.function("attention")?,
            attention_bf16: m.function("attention_bf16")?,
            rope_store_fp8: m.function("rope_store_fp8")?,
            attention_fp8: m.function("attention_fp8")?,
            attention_tiled: m.function("attention_tiled")?,
            attention_tiled_bf16: m.function("attention_tiled_bf16")?,
            attention_tiled_fp8: m.function("attention_tiled_fp8")?,
            attention_split: m.function("attention_split")?,
            attention_split_bf16: m.function("attention_split_bf16")?,
            attention_split_fp8: m.function("attention_split_fp8")?,
            attention_join: m.function("attention_join")?,
            grow_blocks: m.function("grow_blocks")?,
            argmax_rows: m.function("argmax_rows")?,
            unshard: m.function("unshard")?,
            pick_rows: m.function("pick_rows")?,
            head_norm: m.function("head_norm")?,
            gather_split_rows: m.function("gather_split_rows")?,
            scatter_add_rows: m.function("scatter_add_rows")?,
            scatter_add_grouped: m.function("scatter_add_grouped")?,
            add_gated_rows: m.function("add_gated_rows")?,
            add_rows: m.function("add_rows")?,
            copy_words: m.function("copy_words")?,
            sm_count: m.sm_count(),
            tensor_cores: ctx
                .ctx
                .compute_capability()
                .map_err(|e| CudaError::driver(ctx.rank, "reading the compute capability", 0, e))?
                .0
                >= 8,
            max_context: 0,
            early: launches_early(ctx, &DECODER_KERNELS)?,
        }
        .allow_long_contexts(ctx)
    }

    /// Lets the attention kernels take the dynamic shared memory of [`MAX_CONTEXT`]
    /// positions, or of as many as the device's opt-in limit per block holds
    /// ([`DecoderKernels::max_context`]). Only launches over a cache of more than ~12 k
    /// positions take more than the default 48 KiB.
    ///
    /// [`MAX_CONTEXT`]: crate::MAX_CONTEXT
    fn allow_long_contexts(mut self, ctx: &RankCtx) -> Result<Self, CudaError> {
        use lifecycle_cuda::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
        let optin = ctx
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| {
                CudaError::driver(ctx.rank, "reading the shared memory per block", 0, e)
            })?;
        let optin = optin.max(0) as usize;
        let bytes = attention_shared_bytes(crate::MAX_CONTEXT, 0).min(optin);
        let tiled = tile_shared_bytes(crate::MAX_CONTEXT, TILED_MAX_HEAD).min(optin);
        for (f, name, bytes) in [
            (&self.attention, "attention", bytes),
            (&self.attention_bf16, "attention_bf16", bytes),
            (&self.attention_fp8, "attention_fp8", bytes),
            (&self.attention_tiled, "attention_tiled", tiled),
            (&self.attention_tiled_bf16, "attention_tiled_bf16", tiled),
            (&self.attention_tiled_fp8, "attention_tiled_fp8", tiled),
        ] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                CudaError::driver(
                    ctx.rank,
                    format!("{name}: allowing {bytes} bytes of shared memory"),
                    0,
                    e,
                )
            })?;
        }
        // positions p with p + p / page (its page-table row) beside the threads' floats
        let page = crate::KV_PAGE_POSITIONS;
        self.max_context = (bytes / 4).saturating_sub(ATTENTION_THREADS) * page / (page + 1);
        Ok(self)
    }

    /// A grid-stride launch shape for `units` elements.
    pub fn elementwise(&self, units: u64) -> LaunchConfig {
        let blocks = units.div_ceil(256).clamp(1, self.sm_count as u64 * 8) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Launches `func` with `args` on `stream`.
///
/// # Safety
/// `args` must match the kernel's parameter list in order and type, and every device address in
/// it must be valid for what the kernel reads and writes, alive until the stream ran the kernel.
pub(crate) unsafe fn launch(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
    rank: usize,
    what: &str,
) -> Result<(), CudaError> {
    // SAFETY: forwarded to the caller.
    unsafe { launch_after(stream, func, cfg, None::<&u32>, args, rank, what) }
}

/// As [`launch`], with `lead` (a value of the kernel's first parameter's type, such as a
/// struct passed by value) before `args` where given.
///
/// # Safety
/// As [`launch`]: `lead` and `args` must match the kernel's parameter list in order and type
/// (`lead`'s layout the kernel's struct, field for field).
pub(crate) unsafe fn launch_after<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    cfg: LaunchConfig,
    lead: Option<&T>,
    args: &[Arg],
    rank: usize,
    what: &str,
) -> Result<(), CudaError> {
    let how = LaunchHow {
        early: false,
        cluster: 1,
    };
    // SAFETY: forwarded to the caller.
    unsafe { launch_how(stream, func, cfg, lead, args, rank, what, how) }
}

/// Whether kernels of `set` that wait for the grid before them may be launched early
/// ([`LaunchHow::early`]) on this rank's device: compute capability 9.0 or later, the set's code as
/// compiled for it executes `griddepcontrol.wait` (not where `$LIFECYCLE_CUDA_ARCH` chose an
/// older target, which compiles the wait away), and `$LIFECYCLE_W8A8_NO_EARLY` is not set.
pub(crate) fn launches_early(ctx: &RankCtx, set: &KernelSet) -> Result<bool, CudaError> {
    if std::env::var_os("LIFECYCLE_W8A8_NO_EARLY").is_some() {
        return Ok(false);
    }
    let (major, minor) = ctx
        .ctx
        .compute_capability()
        .map_err(|e| CudaError::driver(ctx.rank, "reading the compute capability", 0, e))?;
    if major < 9 {
        return Ok(false);
    }
    // compiled once per process (cached), as the module was
    let ptx = lifecycle_cuda::compile(set, major, minor)?;
    Ok(ptx.to_src().contains("griddepcontrol.wait"))
}

/// [`launch`], early ([`LaunchHow::early`]) where `early`.
///
/// # Safety
/// As [`launch_how`].
pub(crate) unsafe fn launch_maybe_early(
    early: bool,
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
    rank: usize,
    what: &str,
) -> Result<(), CudaError> {
    let how = LaunchHow { early, cluster: 1 };
    // SAFETY: forwarded to the caller.
    unsafe { launch_how(stream, func, cfg, None::<&u32>, args, rank, what, how) }
}

/// How [`launch_how`] launches a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaunchHow {
    /// With programmatic stream serialization (compute capability 9.0 and later): the kernel's
    /// blocks may start before the kernel queued before it on the stream has finished (once
    /// that one's blocks all ran `griddepcontrol.launch_dependents` or exited), and within a
    /// captured graph the edge between them is programmatic. The kernel must execute
    /// `griddepcontrol.wait` before it touches memory the kernels before it write (the W8A8
    /// products request only their weights before it: `kernels/w8a8_mma.cu`).
    pub early: bool,
    /// Blocks of a cluster along the grid's x (1: no clusters; compute capability 9.0 or later
    /// beyond): the grid's x a multiple of it.
    pub cluster: u32,
}

/// As [`launch_after`], launched `how` says: early ([`LaunchHow::early`]) and in clusters of
/// `how.cluster` blocks along x (whose blocks may read each other's shared memory, all resident
/// at once).
///
/// # Safety
/// As [`launch_after`]; where `how.early`, the kernel waits as [`LaunchHow::early`] says and the
/// device's compute capability is 9.0 or later; where `how.cluster` > 1, the
/// kernel is written for clusters of that many blocks and the device has them (compute
/// capability 9.0 or later).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_how<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    cfg: LaunchConfig,
    lead: Option<&T>,
    args: &[Arg],
    rank: usize,
    what: &str,
    how: LaunchHow,
) -> Result<(), CudaError> {
    use lifecycle_cuda::cudarc::driver::sys;
    use std::ffi::c_void;
    if how.cluster == 0 || !cfg.grid_dim.0.is_multiple_of(how.cluster) {
        return Err(CudaError::Invalid(format!(
            "kernel {what}: a grid of {} blocks along x in clusters of {}",
            cfg.grid_dim.0, how.cluster
        )));
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| CudaError::driver(rank, format!("launching kernel {what}"), 0, e))?;
    // the parameters' values stay where `args` and `lead` hold them until the launch returned,
    // which copies them
    let mut params: Vec<*mut c_void> = Vec::with_capacity(args.len() + 1);
    if let Some(v) = lead {
        params.push(v as *const T as *mut c_void);
    }
    for a in args {
        params.push(match a {
            Arg::U64(v) => v as *const u64 as *mut c_void,
            Arg::U32(v) => v as *const u32 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
        });
    }
    let mut attrs = Vec::with_capacity(2);
    if how.early {
        attrs.push(sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        });
    }
    if how.cluster > 1 {
        attrs.push(cluster_attribute(how.cluster));
    }
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    };
    // SAFETY: `config` and `attrs` live across the call; `params` holds one pointer per kernel
    // parameter in order, each to a value of the parameter's type (the caller's promise), alive
    // until the call returned; the function belongs to the stream's context, current above.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| CudaError::driver(rank, format!("launching kernel {what}"), 0, e))
}

/// The launch attribute of clusters of `blocks` blocks along x.
pub(crate) fn cluster_attribute(
    blocks: u32,
) -> lifecycle_cuda::cudarc::driver::sys::CUlaunchAttribute {
    use lifecycle_cuda::cudarc::driver::sys;
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                x: blocks,
                y: 1,
                z: 1,
            },
        },
    }
}

/// An error when `stream` is capturing a graph: `what` would allocate (a lazily grown scratch)
/// inside the capture, where the memory would belong to the graph. Captured passes run only
/// after the same pass ran eagerly, which grew every such scratch to its shapes.
pub(crate) fn refuse_in_capture(
    stream: &CudaStream,
    rank: usize,
    what: &str,
) -> Result<(), CudaError> {
    use lifecycle_cuda::cudarc::driver::sys::CUstreamCaptureStatus;
    let status = stream
        .capture_status()
        .map_err(|e| CudaError::driver(rank, "reading the stream's capture status", 0, e))?;
    if status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "{what} would allocate inside a graph capture (a captured pass must first run \
             eagerly with the same shapes)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::{SplitAttention, SPLIT_HEADS};

    /// The split launch takes fewer heads a block only where few rows leave the device idle,
    /// and its blocks always cover every query head of every kv head.
    #[test]
    fn split_blocks_take_fewer_heads_where_rows_are_few() {
        let plan = SplitAttention::for_cache(4096, 128).unwrap();
        let heads = |rows, kvh, group, sms| {
            let (cfg, heads) = plan.split_launch(rows, kvh, group, 128, sms);
            (cfg.grid_dim.0 as usize, heads as usize)
        };
        // Qwen2.5-7B (4 kv heads of 7) on 132 multiprocessors
        assert_eq!(heads(1, 4, 7, 132), (28, 1));
        assert_eq!(heads(8, 4, 7, 132), (128, 2));
        assert_eq!(heads(64, 4, 7, 132), (256, 7));
        // one multiprocessor: as many heads a block as the kernels take
        assert_eq!(heads(1, 1, 16, 1), (2, 8));
        for rows in [1, 3, 16, 33] {
            for (kvh, group) in [(4, 7), (2, 2), (1, 16), (8, 1), (1, 40)] {
                let (blocks, h) = heads(rows, kvh, group, 132);
                assert!((1..=SPLIT_HEADS).contains(&h), "{rows} {kvh} {group}: {h}");
                assert_eq!(blocks, rows * kvh * group.div_ceil(h));
            }
        }
    }

    /// Chunks of 128 positions from the shortest cache, larger where 64 would not hold it.
    #[test]
    fn chunks_are_fixed_by_the_cache_alone() {
        let of = |cap| SplitAttention::for_cache(cap, 128).map(|p| (p.chunk, p.splits));
        assert_eq!(of(96), Some((128, 1)));
        assert_eq!(of(8192), Some((128, 64)));
        assert_eq!(of(12288), Some((192, 64)));
        assert_eq!(of(32768), Some((512, 64)));
        assert_eq!(of(70000), None);
    }
}
