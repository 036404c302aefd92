//! W8A8 block-fp8 products of up to [`MMA_TOKENS`] tokens by tensor-core kernels of ours
//! (`kernels/w8a8_mma.cu`): the e4m3 weights streamed from device memory once into registers
//! and multiplied with the quantised activations staged in shared memory, each 128-wide input
//! group summed into a fresh f32 fragment and then scaled by its weight block's and its token
//! group's scales. Two instruction families do the sums:
//!
//! - `mma.sync.m16n8k32.e4m3` (compute capability 8.9 and later), 8 tokens per instruction and
//!   warp: as fast as the weights stream up to about 8 tokens, then bound by the instruction
//!   (slow on sm_90);
//! - Hopper's warpgroup `wgmma.m64nNk32.e4m3` (the kernels compiled for `sm_90a` only), the
//!   weights from the warps' registers and every token (N = 8 to 64) from shared memory, two
//!   warpgroups (128 rows) per block sharing the staged activations, which the quantisation
//!   lays out as the `wgmma` reads them ([`ActLayout::Tiles`]) and bulk copies bring in, the
//!   next chunk of input groups while the block multiplies the current one.
//!
//! A product split over input slices writes partial sums, added in the slices' order: up to
//! [`REDUCE_IN_KERNEL_TOKENS`] tokens by the last block of each row range to finish, beyond by a
//! second kernel (`w8a8_reduce`), every output by its own thread. The warpgroup kernel's products
//! whose row blocks all split are launched, where the device keeps all of them resident at once,
//! in clusters of a row range's slices ([`ClusterRoom`]): the slices are then added through the
//! blocks' shared memory, in the same order, with no partials in device memory and no second
//! launch.
//!
//! cuBLASLt's block-scaled GEMM ([`crate::w8a8`]) reads the weights of these products at about
//! half the device's rate at these token counts; these kernels are built for them.
//!
//! The launch shape ([`MmaShape::of_products`]) depends on the products' rows and inputs, the kernel
//! family and the device's SM count, not on its tokens: within a family a row's sum is split over
//! the same input slices, and added in the same order, whatever the batch.

use std::sync::{Arc, Mutex};

use lifecycle_cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use lifecycle_cuda::{
    alloc_device, alloc_zeros, arch_specific_target, CudaError, KernelSet, RankCtx,
};

use super::quant::{wgmma_tiles, ActLayout, MMA_TOKENS};
use crate::fp8::Fp8Weight;
use crate::kernels::{cluster_attribute, launch, launch_how, refuse_in_capture, Arg, LaunchHow};

/// CUDA C source of the tensor-core W8A8 kernels (no headers).
pub const W8A8_MMA_KERNEL_SRC: &str = include_str!("../../../../kernels/w8a8_mma.cu");

/// [`W8A8_MMA_KERNEL_SRC`] as a kernel set.
pub const W8A8_MMA_KERNELS: KernelSet = KernelSet::new(
    "lifecycle_decoder_gpu W8A8 mma kernels",
    W8A8_MMA_KERNEL_SRC,
);

/// [`W8A8_MMA_KERNEL_SRC`] compiled for the architecture-specific target (`sm_90a`), where its
/// warpgroup kernels `w8a8_wgmma_N` exist.
pub const W8A8_WGMMA_KERNELS: KernelSet = KernelSet::new(
    "lifecycle_decoder_gpu W8A8 wgmma kernels",
    W8A8_MMA_KERNEL_SRC,
)
.arch_specific();

/// Token tiles of 8 the warpgroup kernels are built for (`w8a8_wgmma_N`, N = 8 · tiles).
const WGMMA_TILES: [usize; 4] = [1, 2, 4, 8];

/// The most blocks of a cluster of the warpgroup kernel (the portable cluster size: every
/// slice of a row range is one block of its cluster).
pub(crate) const MAX_CLUSTER: usize = 8;

/// Clusters of the warpgroup kernel the device keeps resident at once, by their blocks (index 2
/// ..= [`MAX_CLUSTER`]; 0 where it cannot launch them, the default): a product whose row blocks
/// all split is launched in clusters of its slices only where every cluster fits at once (a
/// cluster's blocks wait for each other). Counted for the kernel of 64 tokens at its most
/// shared memory, so that the launch shape is the same at every token count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClusterRoom(pub [usize; MAX_CLUSTER + 1]);

impl ClusterRoom {
    /// The most blocks of a cluster, at most `most`, of which `row_blocks` clusters fit at once.
    fn largest(&self, row_blocks: usize, most: usize) -> Option<usize> {
        (2..=most.min(MAX_CLUSTER))
            .rev()
            .find(|&c| row_blocks <= self.0[c])
    }

    /// What the device `func` runs on keeps resident of `func` (256 threads a block, `shared`
    /// bytes of dynamic shared memory) in clusters of 2 ..= [`MAX_CLUSTER`] blocks; none with
    /// `$LIFECYCLE_W8A8_NO_CLUSTER` set, or where the driver cannot say.
    fn of(func: &CudaFunction, shared: usize, rank: usize) -> Self {
        use lifecycle_cuda::cudarc::driver::sys;
        let mut room = ClusterRoom::default();
        if std::env::var_os("LIFECYCLE_W8A8_NO_CLUSTER").is_some() {
            return room;
        }
        for c in 2..=MAX_CLUSTER {
            let mut attr = cluster_attribute(c as u32);
            let config = sys::CUlaunchConfig {
                gridDimX: (c * 64) as u32,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: (WGMMA_BLOCK_ROWS / 16 * 32) as u32,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shared as u32,
                hStream: std::ptr::null_mut(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            let mut n: std::ffi::c_int = 0;
            // SAFETY: `config` and `attr` live across the call, which writes `n` only; the
            // function belongs to the context current on this thread (its module was just
            // loaded here).
            let r =
                unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) };
            match r.result() {
                Ok(()) => room.0[c] = usize::try_from(n).unwrap_or(0),
                Err(e) => {
                    tracing::debug!(
                        rank,
                        "clusters of {c} blocks of the warpgroup W8A8 kernel: {e}"
                    );
                    break;
                }
            }
        }
        room
    }
}

/// The most rows of one piece of the experts kernel (`MOE_PIECE` of kernels/decoder_moe.cu,
/// which cuts each expert's rows into pieces of at most this many).
pub(crate) const EXPERT_PIECE_ROWS: usize = 8;

/// Rows of one block of the `mma.sync` kernel (4 warps of the mma's 16).
const BLOCK_ROWS: usize = 64;

/// Rows of one block of the warpgroup kernel (2 warpgroups of 64).
const WGMMA_BLOCK_ROWS: usize = 128;

/// Bytes of activations a block stages in shared memory at a time (a chunk of input groups of
/// every token; the `mma.sync` kernel's rows padded, counted as 256 bytes a group).
const STAGE_BYTES: usize = 32 << 10;

/// Bytes of activations in each of the two buffers of a block of the warpgroup kernel of `nt`
/// token tiles (one chunk of input groups multiplied while the next one is copied in). With the
/// weight ring, a block of up to 32 tokens then takes under 75 KiB: three blocks an SM
/// (`w8a8_wgmma_N`'s launch bounds; the launch shape counts two at every token count, so that
/// its split does not depend on the tokens, and the third holds blocks of the split rows). At 64
/// tokens (two blocks an SM) a buffer holds three groups: with one (12 KiB) each
/// group's copy had only the group before it to land in, and gate and up streamed at about half
/// the device's rate.
const fn wgmma_stage_bytes(nt: usize) -> usize {
    if nt >= 8 {
        3 * 8 * 8 * 128
    } else {
        12 << 10
    }
}

/// Groups of 128 inputs of its rows' weights each warp of the warpgroup kernel has in flight or
/// landed in its ring of shared memory (`W_STAGES` of kernels/w8a8_mma.cu, which must agree).
const WEIGHT_STAGES: usize = 3;

/// The weight ring of a block of `block_rows` rows: [`WEIGHT_STAGES`] slots of 16 rows × 128
/// bytes per warp.
const fn ring_bytes(block_rows: usize) -> usize {
    WEIGHT_STAGES * block_rows * 128
}

/// The most dynamic shared memory a launch of the kernel of `nt` token tiles takes (its
/// activation chunk at the most groups; the attribute is set to it where it passes the default
/// 48 KiB).
fn most_shared(nt: usize, wgmma: bool) -> usize {
    let block_rows = if wgmma { WGMMA_BLOCK_ROWS } else { BLOCK_ROWS };
    let chunk = if wgmma {
        wgmma_stage_bytes(nt) / (8 * nt * 128)
    } else {
        STAGE_BYTES / (8 * nt * 256)
    }
    .max(1);
    MmaShape {
        nt,
        wgmma,
        block_rows,
        row_blocks: 1,
        whole: 0,
        splits: 1,
        slice: chunk,
        chunk,
        cluster: false,
    }
    .shared_bytes()
}

/// The warpgroup kernels (one per [`WGMMA_TILES`] entry) allowed the dynamic shared memory their
/// largest launch takes ([`most_shared`]) where it passes the default 48 KiB, and the SM's
/// largest shared-memory carveout (the blocks their launch bounds ask for resident at once).
fn allow_shared(kernels: Vec<CudaFunction>, rank: usize) -> Result<Vec<CudaFunction>, CudaError> {
    use lifecycle_cuda::cudarc::driver::sys::CUfunction_attribute;
    for (k, &nt) in kernels.iter().zip(WGMMA_TILES.iter()) {
        let bytes = most_shared(nt, true);
        let set = |attr, value: i32, what: &str| {
            k.set_attribute(attr, value).map_err(|e| {
                CudaError::driver(rank, format!("w8a8_wgmma_{nt}: setting {what}"), 0, e)
            })
        };
        if bytes > 48 << 10 {
            set(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
                &format!("{bytes} bytes of dynamic shared memory"),
            )?;
        }
        set(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
            "the largest shared-memory carveout",
        )?;
    }
    Ok(kernels)
}

/// Tokens up to which a split product's last block of a row range adds its slices (at most 512
/// values a block, as before `w8a8_reduce` existed: its launch per split product cost W8A8
/// decode at 1–8 sequences about 5 % on an H200, BENCHMARKS.md); beyond, `w8a8_reduce` does
/// (at 64 tokens one block adding 28 slices took ~44 µs).
pub(crate) const REDUCE_IN_KERNEL_TOKENS: usize = 8;

/// Blocks of 64 rows per SM the split of the inputs aims at (enough weight loads in flight to
/// stream at the device's rate).
const BLOCKS_PER_SM: usize = 4;

/// How one product is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmaShape {
    /// Token tiles of 8: 1 to 8 (a power of two for the warpgroup kernels).
    pub nt: usize,
    /// The warpgroup kernel (`w8a8_wgmma_N`) rather than the `mma.sync` one.
    pub wgmma: bool,
    /// Rows of a block ([`BLOCK_ROWS`], or [`WGMMA_BLOCK_ROWS`] for the warpgroup kernel).
    pub block_rows: usize,
    /// Blocks of `block_rows` rows.
    pub row_blocks: usize,
    /// The first row blocks, each one block over every input (the warpgroup kernel's, where its
    /// row blocks pass the blocks resident at once; else 0): the `splits` apply to the rest.
    pub whole: usize,
    /// Slices of the input groups, one block each per row block after the `whole` ones (added
    /// in order).
    pub splits: usize,
    /// Input groups (of 128) per slice.
    pub slice: usize,
    /// Groups staged in shared memory at a time.
    pub chunk: usize,
    /// Launched in clusters of the `splits` slices of each row block (the warpgroup kernel's
    /// products whose row blocks all split, where [`ClusterRoom`] holds them): the slices added
    /// through the blocks' shared memory.
    pub cluster: bool,
}

impl MmaShape {
    /// The shape of `out × tokens × inp` (`inp` a multiple of 128, 1 ≤ `tokens` ≤
    /// [`MMA_TOKENS`]) on a device of `sms` SMs: the inputs split over slices (at most one per
    /// group) until the blocks fill [`BLOCKS_PER_SM`] blocks of 64 rows per SM (the `mma.sync`
    /// kernel), or into as many as fit in them (the warpgroup kernel: `wgmma`, whose blocks
    /// count twice and whose token tiles come in powers of two).
    #[cfg(test)]
    pub(crate) fn of(out: usize, tokens: usize, inp: usize, sms: usize, wgmma: bool) -> Self {
        Self::of_products(&[out], tokens, inp, sms, wgmma, ClusterRoom::default())
    }

    /// The shape of one launch of products of `outs` rows each over the same `tokens × inp`
    /// activations ([`MmaProduct`]): as [`MmaShape::of`] for their row blocks together (each
    /// product's rows rounded up to whole blocks), so that products of whole blocks launched
    /// together are split, and their rows summed, as the product of their rows stacked. The
    /// warpgroup kernel's products whose row blocks all split take clusters where `room` holds
    /// them (their slices then as many as the largest cluster that fits, at most as many as
    /// without).
    pub(crate) fn of_products(
        outs: &[usize],
        tokens: usize,
        inp: usize,
        sms: usize,
        wgmma: bool,
        room: ClusterRoom,
    ) -> Self {
        let groups = (inp / 128).max(1);
        let nt = if wgmma {
            wgmma_tiles(tokens.min(MMA_TOKENS))
        } else {
            tokens.div_ceil(8).clamp(1, MMA_TOKENS / 8)
        };
        let block_rows = if wgmma { WGMMA_BLOCK_ROWS } else { BLOCK_ROWS };
        let row_blocks = outs
            .iter()
            .map(|o| o.div_ceil(block_rows))
            .sum::<usize>()
            .max(1);
        let slots = BLOCKS_PER_SM * sms.max(1) * BLOCK_ROWS / block_rows;
        // the warpgroup kernel's row blocks beyond those resident at once: the whole waves run
        // unsplit, the row blocks left over split into as many slices as the SMs hold blocks of
        // them, so that they run after the whole ones at about the time of one wave's share
        // (unsplit, the few blocks of a last wave took as long as a full one: each block's rate
        // is bound by its own loop, not by the device's)
        let tail = row_blocks % slots;
        let (whole, rest) = if wgmma && row_blocks > slots && tail > 0 {
            (row_blocks - tail, tail)
        } else {
            (0, row_blocks)
        };
        let want = if wgmma {
            // as many slices as keep every block resident at once: no second wave, whose few
            // blocks would stream alone (its weights come through a ring deep enough to stream
            // from fewer blocks)
            slots / rest
        } else {
            // at least the blocks that fill the SMs: more loads in flight (each warp requests
            // one group ahead), a short second wave included
            slots.div_ceil(row_blocks)
        };
        let mut slice = groups.div_ceil(want.clamp(1, groups));
        let mut splits = groups.div_ceil(slice);
        let whole = if splits > 1 { whole } else { 0 };
        let mut cluster = false;
        if wgmma && splits > 1 && whole == 0 {
            // clusters of the slices of every row block, all resident at once: the largest
            // that fits, its slices as even as the groups allow
            if let Some(c) = room.largest(row_blocks, splits) {
                slice = groups.div_ceil(c);
                splits = groups.div_ceil(slice);
                cluster = splits > 1;
            }
        }
        let chunk = if wgmma {
            wgmma_stage_bytes(nt) / (8 * nt * 128)
        } else {
            STAGE_BYTES / (8 * nt * 256)
        }
        .clamp(1, slice);
        MmaShape {
            nt,
            wgmma,
            block_rows,
            row_blocks,
            whole,
            splits,
            slice,
            chunk,
            cluster,
        }
    }

    /// Row blocks split over the `splits` slices (those after the `whole` ones).
    pub(crate) fn split_blocks(&self) -> usize {
        if self.splits == 1 {
            0
        } else {
            self.row_blocks - self.whole
        }
    }

    /// Blocks of the launch: the warpgroup kernel's grid (one dimension: the whole row blocks,
    /// then each split row block's slices in order), the `mma.sync` kernel's `row_blocks ×
    /// splits` (two).
    pub(crate) fn blocks(&self) -> usize {
        self.whole + (self.row_blocks - self.whole) * self.splits
    }

    /// Dynamic shared memory of a block: the staged activations (the `mma.sync` kernel's token
    /// rows padded by 16 bytes; the warpgroup kernel's in its core matrices, twice) and their
    /// scales; the warpgroup kernel's weight ring ([`ring_bytes`]) after them.
    pub(crate) fn shared_bytes(&self) -> usize {
        let tokens = 8 * self.nt;
        let acts = if self.wgmma {
            2 * (tokens * self.chunk * 128 + tokens * self.chunk * 4)
        } else {
            tokens * (self.chunk * 128 + 16) + tokens * self.chunk * 4
        };
        if self.wgmma {
            acts + ring_bytes(self.block_rows)
        } else {
            acts
        }
    }

    /// f32 partial sums of a split product in device memory (none unsplit or in clusters).
    pub(crate) fn partials(&self) -> usize {
        if self.splits == 1 || self.cluster {
            return 0;
        }
        self.split_blocks() * self.splits * self.block_rows * 8 * self.nt
    }
}

/// Whether the kernel can read `w` over `inp` inputs: whole 128-wide input groups, rows from a
/// multiple of 16 (a warp's 16 rows share a block of scales) and 16-byte aligned bytes.
pub(crate) fn mma_reads(w: &Fp8Weight, inp: usize) -> bool {
    w.cols == inp as u64
        && inp.is_multiple_of(128)
        && inp > 0
        && w.row0.is_multiple_of(16)
        && w.data.is_multiple_of(16)
        && w.scales.is_multiple_of(4)
}

/// The most tokens of a bf16 product on the tensor-core kernel ([`MmaKernels::bf16`]): its
/// split rows (twice the tokens) fill the kernels' 8 tiles of 8 columns.
pub(crate) const BF16_MMA_TOKENS: usize = MMA_TOKENS / 2;

/// Tokens up to which a bf16 product runs the tensor-core kernel by default
/// ([`GpuDecoder::set_bf16_mma_tokens`](crate::GpuDecoder::set_bf16_mma_tokens)).
pub(crate) const BF16_MMA_DEFAULT_TOKENS: usize = 8;

/// Whether the bf16 kernel can read `w` over `inp` inputs: rows of whole 128-byte groups (a
/// multiple of 64 inputs), 16-byte aligned.
pub(crate) fn bf16_mma_reads(w: &Fp8Weight, inp: usize) -> bool {
    w.cols == inp as u64 && inp.is_multiple_of(64) && inp > 0 && w.data.is_multiple_of(16)
}

/// Refuses a launch of no products or of more than [`MAX_PRODUCTS`] (`kind`: the kernels').
fn launch_count(prods: &[MmaProduct], kind: &str) -> Result<(), CudaError> {
    if prods.is_empty() || prods.len() > MAX_PRODUCTS {
        return Err(CudaError::Invalid(format!(
            "a launch of the tensor-core {kind} kernels takes 1 to {MAX_PRODUCTS} products: \
             given {}",
            prods.len()
        )));
    }
    Ok(())
}

/// `v` as a kernel's u32 argument, or an error naming it.
fn u32a(v: u64, what: &str) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Invalid(format!("mma product {what} {v} > u32")))
}

/// Products one launch of the tensor-core kernels takes at most ([`MmaKernels::gemm`]; the
/// kernels' `MAX_PRODS`): the three of q / k / v and, in a bf16 launch, the `A` matrices of
/// their LoRA adapters riding beside them.
pub(crate) const MAX_PRODUCTS: usize = 6;

/// One product of a launch of the tensor-core kernels ([`MmaKernels::gemm`]): `y[tokens × out]`
/// = the activations · rows `w.row0 .. w.row0 + out` of `w`, each output written as (sum +
/// `bias`) + `res` (`bias` bf16 per output column, `res` f32 of `y`'s shape, which may be `y`
/// itself; 0 for none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MmaProduct {
    pub w: Fp8Weight,
    pub out: usize,
    pub y: u64,
    pub bias: u64,
    pub res: u64,
}

/// The kernels' `Prod` (kernels/w8a8_mma.cu), field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ProdArg {
    w: u64,
    wsc: u64,
    y: u64,
    bias: u64,
    res: u64,
    row0: u32,
    out: u32,
    blocks: u32,
    pad: u32,
}

/// The kernels' `Prods`: the products of one launch, their row blocks one after the other.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ProdsArg {
    p: [ProdArg; MAX_PRODUCTS],
    count: u32,
    pad: u32,
}

// SAFETY: plain integers in the layout of the kernels' `Prods` (repr(C): five 8-byte addresses
// then four u32 per product, then two u32), passed by value as a kernel parameter.
unsafe impl DeviceRepr for ProdsArg {}

/// The split products' scratch: partial sums and a counter per row block (zero between
/// launches: the last block of a row block resets it).
#[derive(Default)]
struct Scratch {
    partials: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
    /// How often either grew.
    grown: u64,
}

/// One rank's tensor-core W8A8 kernels and their scratch.
pub(crate) struct MmaKernels {
    /// `w8a8_mma_N` for N = 1 ..= 8 token tiles of 8.
    kernels: Vec<CudaFunction>,
    /// `bf16_mma_N` for N = 1 ..= 8 tiles of 4 tokens (8 split rows).
    bf16: Vec<CudaFunction>,
    /// `w8a8_reduce`: a split product's partial sums added.
    reduce: CudaFunction,
    /// `w8a8_mma_experts`: the experts of a layer routed on the device.
    experts: CudaFunction,
    /// `w8a8_wgmma_N` for N in [`WGMMA_TILES`], on devices of an architecture-specific target
    /// (sm_90a) whose NVRTC compiled them.
    wgmma: Option<Vec<CudaFunction>>,
    /// The products are launched early ([`LaunchHow::early`]): every kernel above comes from the
    /// sm_90a module, which executes the wait that launch needs.
    early: bool,
    sms: usize,
    /// The warpgroup kernel's clusters resident at once (none without it).
    room: ClusterRoom,
    scratch: Mutex<Scratch>,
}

impl MmaKernels {
    /// The kernels in this rank's context, or `None` on a device without e4m3 tensor-core
    /// instructions (compute capability below 8.9), where cuBLASLt's GEMM takes their products.
    pub(crate) fn load(ctx: &RankCtx) -> Result<Option<Self>, CudaError> {
        let (major, minor) = ctx
            .ctx
            .compute_capability()
            .map_err(|e| CudaError::driver(ctx.rank, "reading the compute capability", 0, e))?;
        if (major, minor) < (8, 9) {
            return Ok(None);
        }
        // the architecture-specific module first: where it loads, every kernel comes from it
        // and the generic one is never compiled (NVRTC takes seconds for each)
        let mut specific = None;
        let wgmma = if arch_specific_target(major, minor).is_some() {
            let loaded = ctx.module(&W8A8_WGMMA_KERNELS).and_then(|w| {
                let k = WGMMA_TILES
                    .iter()
                    .map(|nt| w.function(&format!("w8a8_wgmma_{nt}")))
                    .collect::<Result<Vec<_>, _>>()?;
                specific = Some(w);
                Ok(k)
            });
            match loaded {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        rank = ctx.rank,
                        "the warpgroup W8A8 kernels did not load ({e}); W8A8 products of more \
                         than 8 tokens take cuBLASLt's GEMM or the mma.sync kernel"
                    );
                    None
                }
            }
        } else {
            None
        };
        let wgmma = match wgmma.map(|k| allow_shared(k, ctx.rank)) {
            Some(Ok(k)) => Some(k),
            Some(Err(e)) => {
                tracing::warn!(
                    rank = ctx.rank,
                    "the warpgroup W8A8 kernels cannot take their shared memory ({e}); W8A8 \
                     products of more than 8 tokens take cuBLASLt's GEMM or the mma.sync kernel"
                );
                None
            }
            None => None,
        };
        // with the sm_90a module loaded every kernel comes from it (the same source), so that
        // each executes griddepcontrol.wait, which the products' early launch needs
        let m = match (&wgmma, specific) {
            (Some(_), Some(m)) => m,
            _ => ctx.module(&W8A8_MMA_KERNELS)?,
        };
        let early = wgmma.is_some() && std::env::var_os("LIFECYCLE_W8A8_NO_EARLY").is_none();
        let room = match wgmma.as_ref().and_then(|k| k.last()) {
            Some(k) => ClusterRoom::of(k, most_shared(MMA_TOKENS / 8, true), ctx.rank),
            None => ClusterRoom::default(),
        };
        Ok(Some(MmaKernels {
            kernels: (1..=MMA_TOKENS / 8)
                .map(|nt| m.function(&format!("w8a8_mma_{nt}")))
                .collect::<Result<_, _>>()?,
            bf16: (1..=MMA_TOKENS / 8)
                .map(|nt| m.function(&format!("bf16_mma_{nt}")))
                .collect::<Result<_, _>>()?,
            reduce: m.function("w8a8_reduce")?,
            experts: m.function("w8a8_mma_experts")?,
            wgmma,
            early,
            sms: m.sm_count() as usize,
            room,
            scratch: Mutex::new(Scratch::default()),
        }))
    }

    /// How often the split products' scratch grew (`u64::MAX` when its lock was poisoned, so
    /// that no graph trusts it).
    pub(crate) fn grown(&self) -> u64 {
        self.scratch.lock().map_or(u64::MAX, |s| s.grown)
    }

    /// `y[tokens × out] = dequant(xq) · dequant(w)ᵀ` in f32 for 1 to [`MMA_TOKENS`] tokens, for
    /// each of 1 to [`MAX_PRODUCTS`] products of the same activations in one launch
    /// ([`MmaProduct`]; shaped by [`MmaShape::of_products`]): `xq` the e4m3 activations and
    /// `xsc` their scales in `layout` (for [`ActLayout::Rows`] the `mma.sync` kernel, for
    /// [`ActLayout::Tiles`] of [`wgmma_tiles`]`(tokens)` the warpgroup one, which must be loaded:
    /// [`MmaKernels::has_wgmma`]), each weight's rows a block-scaled e4m3 matrix's
    /// ([`mma_reads`] must hold). With `zero_lo` the `tokens` rows after each `y`'s (the lo rows
    /// of a split product) are written 0.
    ///
    /// # Safety
    /// The addresses must be device memory of this context: each weight its matrix and scales,
    /// `xq` and `xsc` the layout's bytes and scales of `layout.padded(tokens)` tokens, each `y`
    /// `tokens · out` f32 (twice that with `zero_lo`), `bias` `out` bf16 and `res` `tokens · out`
    /// f32 where not 0, alive until the stream ran the products.
    pub(crate) unsafe fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        prods: &[MmaProduct],
        (xq, xsc, layout): (u64, u64, ActLayout),
        zero_lo: bool,
        (tokens, inp): (usize, usize),
        rank: usize,
    ) -> Result<(), CudaError> {
        launch_count(prods, "W8A8")?;
        if let Some(p) = prods
            .iter()
            .find(|p| tokens == 0 || tokens > MMA_TOKENS || !mma_reads(&p.w, inp) || p.out == 0)
        {
            return Err(CudaError::Invalid(format!(
                "the tensor-core W8A8 kernel multiplies 1 to {MMA_TOKENS} tokens over whole \
                 128-wide groups of inputs, rows from a multiple of 16, 16-byte aligned: asked \
                 for {tokens} tokens × {inp} inputs, {} rows (matrix of {} columns, rows from {})",
                p.out, p.w.cols, p.w.row0
            )));
        }
        let wg = match layout {
            ActLayout::Rows => None,
            ActLayout::Tiles(tiles) => {
                if tiles != wgmma_tiles(tokens) {
                    return Err(CudaError::Invalid(format!(
                        "the warpgroup W8A8 kernel multiplies {tokens} tokens from a layout of \
                         {} token tiles: given one of {tiles}",
                        wgmma_tiles(tokens)
                    )));
                }
                Some(self.wgmma.as_ref().ok_or_else(|| {
                    CudaError::Invalid(
                        "activations laid out for the warpgroup W8A8 kernel, which is not \
                         loaded on this device"
                            .into(),
                    )
                })?)
            }
        };
        let xs_grp = layout.padded(tokens);
        let outs: Vec<usize> = prods.iter().map(|p| p.out).collect();
        let shape = MmaShape::of_products(&outs, tokens, inp, self.sms, wg.is_some(), self.room);
        let kernel = match wg {
            Some(k) => WGMMA_TILES
                .iter()
                .position(|&t| t == shape.nt)
                .and_then(|i| k.get(i)),
            None => self.kernels.get(shape.nt - 1),
        }
        .ok_or_else(|| {
            CudaError::Invalid(format!("no W8A8 mma kernel for {} token tiles", shape.nt))
        })?;
        let name = if wg.is_some() {
            "w8a8_wgmma"
        } else {
            "w8a8_mma"
        };
        let lead = [
            Arg::U32(u32a(inp as u64, "inputs")?),
            Arg::U64(xq),
            Arg::U64(xsc),
            Arg::U32(u32a(xs_grp as u64, "scale stride")?),
        ];
        // SAFETY: per the caller; w8a8_mma_N and w8a8_wgmma_N take these leading arguments
        // (8 N ≥ tokens), 8 tokens a tile.
        unsafe {
            self.run(
                stream,
                prods,
                &shape,
                (kernel, name),
                &lead,
                (zero_lo, tokens, 8 * shape.nt),
                rank,
            )
        }
    }

    /// `y[tokens × out] = x · wᵀ` in f32 for bf16 weights (each product's `w.data` the
    /// address of its first row, `w.cols` = `inp`; scales and `row0` unused) and split bf16
    /// activations `x` (`tokens` hi rows, then as many lo rows, of `inp`: x = hi + lo), 1 to
    /// [`BF16_MMA_TOKENS`] tokens, each output (Σ hi + Σ lo + `bias`) + `res`: the same launch,
    /// split and order of sums as the W8A8 products of the same rows and bytes
    /// ([`MmaShape::of_products`] of 2 `tokens` columns and `2 inp` bytes a row), on the bf16
    /// `mma.sync` kernel. [`bf16_mma_reads`] must hold for every weight. With `zero_lo` the
    /// `tokens` rows after each `y`'s are written 0 (the split layout the decoder's combine
    /// reads).
    ///
    /// # Safety
    /// The addresses must be device memory of this context: each weight `out · inp` bf16, `x`
    /// `2 · tokens · inp` bf16, each `y` `tokens · out` f32 (twice that with `zero_lo`), `bias`
    /// `out` bf16 and `res` `tokens · out` f32 where not 0, alive until the stream ran the
    /// products.
    pub(crate) unsafe fn bf16(
        &self,
        stream: &Arc<CudaStream>,
        prods: &[MmaProduct],
        x: u64,
        zero_lo: bool,
        (tokens, inp): (usize, usize),
        rank: usize,
    ) -> Result<(), CudaError> {
        launch_count(prods, "bf16")?;
        if let Some(p) = prods.iter().find(|p| {
            tokens == 0 || tokens > BF16_MMA_TOKENS || !bf16_mma_reads(&p.w, inp) || p.out == 0
        }) {
            return Err(CudaError::Invalid(format!(
                "the tensor-core bf16 kernel multiplies 1 to {BF16_MMA_TOKENS} tokens over rows \
                 of a multiple of 64 inputs, 16-byte aligned: asked for {tokens} tokens × {inp} \
                 inputs, {} rows (matrix of {} columns at {:#x})",
                p.out, p.w.cols, p.w.data
            )));
        }
        let outs: Vec<usize> = prods.iter().map(|p| p.out).collect();
        let shape = MmaShape::of_products(&outs, 2 * tokens, 2 * inp, self.sms, false, self.room);
        let kernel = self.bf16.get(shape.nt - 1).ok_or_else(|| {
            CudaError::Invalid(format!("no bf16 mma kernel for {} token tiles", shape.nt))
        })?;
        let lead = [Arg::U32(u32a((2 * inp) as u64, "row bytes")?), Arg::U64(x)];
        // SAFETY: per the caller; bf16_mma_N takes these leading arguments (4 N ≥ tokens), 4
        // tokens a tile.
        unsafe {
            self.run(
                stream,
                prods,
                &shape,
                (kernel, "bf16_mma"),
                &lead,
                (zero_lo, tokens, 4 * shape.nt),
                rank,
            )
        }
    }

    /// One launch of `kernel` over `prods` in `shape` (its arguments: the products' table,
    /// `lead`, then the tokens, slice, chunk, `zero_lo`, the partials and the counters, and the
    /// warpgroup kernel's three more), then the sums of its split products by `w8a8_reduce` where
    /// the kernel does not add them itself (`tile_tokens` tokens a tile of its partials).
    ///
    /// # Safety
    /// `kernel` must take these arguments and `shape`'s grid, its products' addresses as
    /// [`MmaKernels::gemm`] or [`MmaKernels::bf16`] state them.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        stream: &Arc<CudaStream>,
        prods: &[MmaProduct],
        shape: &MmaShape,
        (kernel, name): (&CudaFunction, &str),
        lead: &[Arg],
        (zero_lo, tokens, tile_tokens): (bool, usize, usize),
        rank: usize,
    ) -> Result<(), CudaError> {
        let mut table = ProdsArg {
            count: prods.len() as u32,
            ..ProdsArg::default()
        };
        for (slot, p) in table.p.iter_mut().zip(prods) {
            *slot = ProdArg {
                w: p.w.data,
                wsc: p.w.scales,
                y: p.y,
                bias: p.bias,
                res: p.res,
                row0: u32a(p.w.row0, "first row")?,
                out: u32a(p.out as u64, "rows")?,
                blocks: u32a(p.out.div_ceil(shape.block_rows) as u64, "row blocks")?,
                pad: 0,
            };
        }
        let in_kernel = tokens <= REDUCE_IN_KERNEL_TOKENS;
        let (part, counters) = if shape.cluster {
            (0, 0)
        } else {
            self.split_scratch(stream, shape, in_kernel, rank)?
        };
        let cfg = LaunchConfig {
            grid_dim: if shape.wgmma {
                (u32a(shape.blocks() as u64, "blocks")?, 1, 1)
            } else {
                (
                    u32a(shape.row_blocks as u64, "row blocks")?,
                    u32a(shape.splits as u64, "splits")?,
                    1,
                )
            },
            block_dim: ((shape.block_rows / 16 * 32) as u32, 1, 1),
            shared_mem_bytes: u32a(shape.shared_bytes() as u64, "shared memory")?,
        };
        let mut args = lead.to_vec();
        args.extend([
            Arg::U32(tokens as u32),
            Arg::U32(shape.slice as u32),
            Arg::U32(shape.chunk as u32),
            Arg::U32(u32::from(zero_lo)),
            Arg::U64(part),
            Arg::U64(counters),
        ]);
        if shape.wgmma {
            args.push(Arg::U32(u32a(shape.whole as u64, "whole row blocks")?));
            args.push(Arg::U32(u32a(shape.splits as u64, "splits")?));
            args.push(Arg::U32(u32::from(shape.cluster)));
        }
        // clusters of a row block's slices (the grid's blocks `splits` a row block, none whole)
        let how = LaunchHow {
            early: self.early,
            cluster: if shape.cluster {
                u32a(shape.splits as u64, "blocks of a cluster")?
            } else {
                1
            },
        };
        // SAFETY: the table and argument list match w8a8_mma_N and w8a8_wgmma_N (8 N ≥ tokens;
        // the products' row blocks those of the grid, laid out as its kernel reads it); the
        // partials and counters hold the shape's sizes (the counters zero: the kernel leaves
        // them so) and live in the scratch, whose buffers are freed in stream order; in
        // clusters (the warpgroup kernel on sm_90a) the grid is the clusters of every row
        // block's slices in order, which the kernel adds through their shared memory; the rest
        // per the caller.
        unsafe { launch_how(stream, kernel, cfg, Some(&table), &args, rank, name, how)? };
        if shape.splits == 1 || in_kernel || shape.cluster {
            return Ok(());
        }
        let outputs = (shape.split_blocks() * shape.block_rows * tokens) as u64;
        let cfg = LaunchConfig {
            grid_dim: (u32a(outputs.div_ceil(256), "reduce blocks")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::U64(part),
            Arg::U32(u32a(shape.splits as u64, "splits")?),
            Arg::U32(shape.block_rows as u32),
            Arg::U32(tile_tokens as u32),
            Arg::U32(tokens as u32),
            Arg::U32(u32::from(zero_lo)),
            Arg::U32(u32a(shape.whole as u64, "whole row blocks")?),
        ];
        let how = LaunchHow {
            early: self.early,
            cluster: 1,
        };
        // SAFETY: the table and argument list match w8a8_reduce; it reads the partials the
        // products above wrote (every split row block and slice, the first `tokens` of 8 · nt
        // tokens) and writes each y as its product would have (tokens · out f32, twice with
        // zero_lo; bias and res read as the product would have).
        unsafe {
            launch_how(
                stream,
                &self.reduce,
                cfg,
                Some(&table),
                &args,
                rank,
                "w8a8_reduce",
                how,
            )
        }
    }

    /// The products of a mixture-of-experts layer's experts routed on the device (one launch of
    /// `w8a8_mma_experts`): the `pieces` of `table` (moe_route's product table,
    /// kernels/decoder_moe.cu: each piece at most [`EXPERT_PIECE_ROWS`] rows of one expert, `out
    /// × inp` rows of its weight, which [`mma_reads`] must read; pieces of no rows skipped), each
    /// writing its rows of `y` and 0 to its lo rows. Their activations: the e4m3 token rows `xq`
    /// and scales `xsc` of [`ActLayout::Rows`] for `xs_tokens` tokens, a piece's row `t` being
    /// row `idx[o + t]` (`idx` not 0: the slots' tokens) or `o + t`, `o` its first slot (the
    /// table's input address `x32 + 4 · o · inp`). Shaped as the products of `out` rows each of
    /// [`MmaShape::of_products`] for 8 tokens: the pieces' inputs split over the same slices
    /// whatever the routing.
    ///
    /// # Safety
    /// The table must be moe_route's for these `out` and `inp`, its weights, inputs and outputs
    /// device memory of this context as it states them, every row it reaches through `idx` within
    /// `xq` (`inp` bytes a row) and `xsc` (`xs_tokens` scales a group), all alive until the
    /// stream ran the products.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn experts(
        &self,
        stream: &Arc<CudaStream>,
        (table, pieces, x32): (u64, usize, u64),
        (xq, xsc, xs_tokens, idx): (u64, u64, usize, u64),
        (out, inp): (usize, usize),
        rank: usize,
    ) -> Result<(), CudaError> {
        if pieces == 0 || out == 0 || inp == 0 || !inp.is_multiple_of(128) {
            return Err(CudaError::Invalid(format!(
                "the tensor-core W8A8 experts kernel multiplies whole 128-wide groups of inputs \
                 by at least one row of at least one piece: asked for {pieces} pieces of {out} \
                 rows × {inp} inputs"
            )));
        }
        let u32a = |v: usize, what: &str| {
            u32::try_from(v)
                .map_err(|_| CudaError::Invalid(format!("W8A8 experts {what} {v} > u32")))
        };
        let shape = MmaShape::of_products(
            &vec![out; pieces],
            EXPERT_PIECE_ROWS,
            inp,
            self.sms,
            false,
            ClusterRoom::default(),
        );
        let (part, counters) = self.split_scratch(stream, &shape, true, rank)?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32a(shape.row_blocks, "row blocks")?,
                u32a(shape.splits, "splits")?,
                1,
            ),
            block_dim: ((shape.block_rows / 16 * 32) as u32, 1, 1),
            shared_mem_bytes: u32a(shape.shared_bytes(), "shared memory")?,
        };
        let args = [
            Arg::U64(table),
            Arg::U32(u32a(
                out.div_ceil(shape.block_rows),
                "row blocks per piece",
            )?),
            Arg::U32(u32a(out, "rows")?),
            Arg::U64(x32),
            Arg::U64(xq),
            Arg::U64(xsc),
            Arg::U32(u32a(xs_tokens, "scale stride")?),
            Arg::U64(idx),
            Arg::U32(u32a(shape.slice, "slice")?),
            Arg::U32(u32a(shape.chunk, "chunk")?),
            Arg::U64(part),
            Arg::U64(counters),
        ];
        // SAFETY: the argument list matches w8a8_mma_experts (one token tile: pieces of at most
        // 8 rows); the grid covers every piece's row blocks; the partials and counters hold the
        // shape's sizes (the counters zero: the kernel leaves them so) and live in the scratch,
        // whose buffers are freed in stream order; the rest per the caller.
        unsafe { launch(stream, &self.experts, cfg, &args, rank, "w8a8_mma_experts") }
    }

    /// The partial sums and (`in_kernel`: the last block of a row range adds them) counters a
    /// launch of `shape` works through, grown where they are short (refused while the stream
    /// captures a graph): their addresses, 0 for an unsplit launch.
    fn split_scratch(
        &self,
        stream: &Arc<CudaStream>,
        shape: &MmaShape,
        in_kernel: bool,
        rank: usize,
    ) -> Result<(u64, u64), CudaError> {
        if shape.splits == 1 {
            return Ok((0, 0));
        }
        let mut scratch = self
            .scratch
            .lock()
            .map_err(|_| CudaError::Invalid("the W8A8 mma scratch was poisoned".into()))?;
        let need = shape.partials();
        if scratch.partials.as_ref().is_none_or(|p| p.len() < need) {
            refuse_in_capture(stream, rank, "growing the W8A8 mma partials")?;
            scratch.grown += 1;
            // SAFETY: every partial the sums read (those of the product's tokens) is written by
            // the product first (in stream order for w8a8_reduce).
            scratch.partials =
                Some(unsafe { alloc_device::<f32>(stream, need, rank, "W8A8 mma partials")? });
        }
        if in_kernel
            && scratch
                .counters
                .as_ref()
                .is_none_or(|c| c.len() < shape.split_blocks())
        {
            refuse_in_capture(stream, rank, "growing the W8A8 mma counters")?;
            scratch.grown += 1;
            scratch.counters = Some(alloc_zeros::<u32>(
                stream,
                shape.split_blocks(),
                rank,
                "W8A8 mma counters",
            )?);
        }
        let part = scratch
            .partials
            .as_ref()
            .map_or(0, |s| s.device_ptr(stream).0);
        let counters = match &scratch.counters {
            Some(c) if in_kernel => c.device_ptr(stream).0,
            _ => 0,
        };
        Ok((part, counters))
    }

    /// Whether the warpgroup kernels are loaded (an sm_90a device whose NVRTC compiled them).
    pub(crate) fn has_wgmma(&self) -> bool {
        self.wgmma.is_some()
    }

    /// The warpgroup kernel's clusters resident at once, as its launches count them.
    #[cfg(test)]
    pub(crate) fn clusters(&self) -> ClusterRoom {
        self.room
    }

    /// Launches from here on count `room` as the clusters resident at once (`ClusterRoom::
    /// default()`: none, the split sums through device memory).
    #[cfg(test)]
    pub(crate) fn set_clusters(&mut self, room: ClusterRoom) {
        self.room = room;
    }

    /// The launch shape of `outs` rows over `tokens × inp` on this device (the warpgroup
    /// kernel's with `wgmma`).
    #[cfg(test)]
    pub(crate) fn shape(&self, outs: &[usize], tokens: usize, inp: usize, wgmma: bool) -> MmaShape {
        MmaShape::of_products(outs, tokens, inp, self.sms, wgmma, self.room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_depends_on_rows_and_inputs_not_on_tokens() {
        // 7.6B shapes on an H200 (132 SMs)
        for (out, inp) in [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)] {
            let one = MmaShape::of(out, 1, inp, 132, false);
            let wg_one = MmaShape::of(out, 1, inp, 132, true);
            for tokens in [2, 8, 9, 33, 64] {
                let s = MmaShape::of(out, tokens, inp, 132, false);
                assert_eq!((s.splits, s.slice), (one.splits, one.slice), "{out}x{inp}");
                assert!(s.nt * 8 >= tokens && s.nt * 8 < tokens + 8);
                assert!(s.shared_bytes() <= most_shared(s.nt, false), "{s:?}");
                assert!(most_shared(s.nt, false) <= 48 << 10, "{s:?}");
                let w = MmaShape::of(out, tokens, inp, 132, true);
                assert_eq!(
                    (w.splits, w.slice),
                    (wg_one.splits, wg_one.slice),
                    "{out}x{inp}"
                );
                assert!(WGMMA_TILES.contains(&w.nt) && w.nt * 8 >= tokens, "{w:?}");
                assert!(w.nt * 4 < tokens + 8, "{w:?}: more than twice the tiles");
                assert!(w.shared_bytes() <= most_shared(w.nt, true), "{w:?}");
                // two blocks an SM within an H100's or H200's 228 KiB (1 KiB of each block's
                // reserved), three up to 32 tokens (the kernels' launch bounds)
                let blocks = if w.nt <= 4 { 3 } else { 2 };
                assert!(
                    blocks * (most_shared(w.nt, true) + 1024) <= 228 << 10,
                    "{w:?}"
                );
            }
            assert!(one.splits * one.slice >= inp / 128);
            assert!(
                (one.splits - 1) * one.slice < inp / 128,
                "an empty slice: {one:?}"
            );
        }
        // many rows: no split; few: split until the blocks fill the device (mma.sync), or as
        // far as every block stays resident (warpgroup)
        assert_eq!(MmaShape::of(37888, 8, 3584, 132, false).splits, 1);
        let s = MmaShape::of(3584, 8, 3584, 132, false);
        assert!(s.row_blocks * s.splits >= 4 * 132 - s.row_blocks, "{s:?}");
        assert_eq!(MmaShape::of(18944, 16, 3584, 132, true).splits, 1);
        for (out, inp) in [(3584, 3584), (3584, 18944), (512, 3584)] {
            let s = MmaShape::of(out, 16, inp, 132, true);
            let blocks = s.row_blocks * s.splits;
            assert!(blocks <= 2 * 132, "{s:?}: a second wave");
            assert!(
                blocks > 132 || s.slice == 1,
                "{s:?}: fewer than half the blocks that fit"
            );
        }
        assert_eq!(MmaShape::of(256, 64, 128, 132, true).splits, 1);
    }

    #[test]
    fn the_warpgroup_rows_past_a_wave_split_after_the_whole_ones() {
        // gate and up at 7.6B shapes on 132 SMs: 296 row blocks, 264 resident at once
        let s = MmaShape::of_products(&[18944, 18944], 64, 3584, 132, true, ClusterRoom::default());
        assert_eq!(
            (s.row_blocks, s.whole, s.splits, s.slice),
            (296, 264, 7, 4),
            "{s:?}"
        );
        assert_eq!(s.split_blocks(), 32);
        assert_eq!(s.blocks(), 264 + 32 * 7);
        assert!(s.split_blocks() * s.splits <= 2 * 132, "{s:?}");
        assert_eq!(s.partials(), 32 * 7 * 128 * 64);
        // the same split whatever the tokens
        for tokens in [9, 16, 33] {
            let t = MmaShape::of_products(
                &[18944, 18944],
                tokens,
                3584,
                132,
                true,
                ClusterRoom::default(),
            );
            assert_eq!((t.whole, t.splits, t.slice), (264, 7, 4), "{t:?}");
        }
        // whole waves only, or fewer row blocks than resident: nothing whole
        let exact = MmaShape::of(264 * 128, 64, 3584, 132, true);
        assert_eq!((exact.whole, exact.splits), (0, 1), "{exact:?}");
        let few = MmaShape::of(3584, 64, 3584, 132, true);
        assert_eq!(few.whole, 0, "{few:?}");
        assert_eq!(few.blocks(), few.row_blocks * few.splits);
        // a leftover of more than half a wave: two slices, the blocks past one wave half as long
        let many = MmaShape::of(364 * 128, 64, 640, 132, true);
        assert_eq!(
            (many.whole, many.splits, many.slice),
            (264, 2, 3),
            "{many:?}"
        );
        // the mma.sync kernel splits every row block or none
        for (out, inp) in [(37888, 3584), (3584, 18944)] {
            assert_eq!(MmaShape::of(out, 8, inp, 132, false).whole, 0);
        }
    }

    #[test]
    fn split_row_blocks_take_clusters_only_where_all_fit_at_once() {
        // a device keeping 32 clusters of 8 blocks resident, 34 of 7, 42 of 6 (two blocks an
        // SM on 132 SMs in GPCs of 16 and 18)
        let mut room = ClusterRoom::default();
        for (c, n) in [
            (2, 132),
            (3, 86),
            (4, 66),
            (5, 52),
            (6, 42),
            (7, 34),
            (8, 32),
        ] {
            room.0[c] = n;
        }
        let at = |out: usize, tokens: usize, inp: usize| {
            MmaShape::of_products(&[out], tokens, inp, 132, true, room)
        };
        // q, k and v at 7.6B shapes: 36 row blocks; 7 slices without clusters, 36 clusters of 7
        // do not fit, of 6 they do
        let qkv = at(4608, 64, 3584);
        assert_eq!(MmaShape::of(4608, 64, 3584, 132, true).splits, 7);
        assert!(qkv.cluster, "{qkv:?}");
        assert_eq!((qkv.splits, qkv.slice), (6, 5), "{qkv:?}");
        assert_eq!(qkv.partials(), 0);
        // o: 28 row blocks, 7 slices of 4 groups in clusters of 7
        let o = at(3584, 64, 3584);
        assert_eq!((o.cluster, o.splits, o.slice), (true, 7, 4), "{o:?}");
        // down: 148 groups, 9 slices without clusters, at most 8 in them
        let down = at(3584, 64, 18944);
        assert_eq!(MmaShape::of(3584, 64, 18944, 132, true).splits, 9);
        assert_eq!(
            (down.cluster, down.splits, down.slice),
            (true, 8, 19),
            "{down:?}"
        );
        // the same shape at every token count, and room in each block's shared memory for
        // its partial sums ([token][row], rows padded by CL_PAD = 4 in kernels/w8a8_mma.cu)
        for tokens in [1, 8, 9, 33, 64] {
            let t = at(4608, tokens, 3584);
            assert_eq!((t.cluster, t.splits, t.slice), (true, 6, 5), "{t:?}");
            let sums = (t.block_rows + 4) * 8 * t.nt * 4;
            assert!(sums <= t.shared_bytes(), "{t:?}: {sums} bytes of sums");
        }
        // whole row blocks (gate and up): no clusters, the split tail as before
        let gu = MmaShape::of_products(&[18944, 18944], 64, 3584, 132, true, room);
        assert_eq!((gu.cluster, gu.whole, gu.splits), (false, 264, 7), "{gu:?}");
        // unsplit, the mma.sync kernel, or no room: no clusters
        assert!(!at(256, 64, 128).cluster);
        assert!(!MmaShape::of_products(&[3584], 8, 3584, 132, false, room).cluster);
        assert!(!MmaShape::of(3584, 64, 3584, 132, true).cluster);
        // more row blocks than clusters of 2 fit: none
        let mut small = ClusterRoom::default();
        small.0[2] = 10;
        let s = MmaShape::of_products(&[3584], 64, 3584, 132, true, small);
        assert!(!s.cluster && s.splits == 7, "{s:?}");
    }

    #[test]
    fn the_ring_stages_are_the_kernels() {
        let define = W8A8_MMA_KERNEL_SRC
            .lines()
            .find_map(|l| l.trim().strip_prefix("#define W_STAGES "))
            .and_then(|v| v.trim().parse::<usize>().ok());
        assert_eq!(define, Some(WEIGHT_STAGES));
    }
}
