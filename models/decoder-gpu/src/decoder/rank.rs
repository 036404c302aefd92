//! What every stage of a rank's forward pass shares: the rank's resources ([`RankState`]: cuBLAS
//! handle, kernels, bound weights, KV cache), the pass's sizes ([`Dims`]), and the collectives
//! of the tensor-parallel group.

use std::cell::Cell;
use std::sync::Arc;

use lifecycle_cuda::cudarc::cublas::CudaBlas;
use lifecycle_cuda::cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use lifecycle_cuda::cudarc::nccl::ReduceOp;
use lifecycle_cuda::{CudaError, FreeingRoom, RankCtx};

use super::moe::table::DeviceExperts;
use crate::blas::gemm;
use crate::download::Downloads;
use crate::fp8::{fp8_gemm, Fp8Kernels, Fp8Scratch, Fp8Weight, GEMV_TOKENS};
use crate::kernels::{ptr, DecoderKernels};
use crate::w8a8::{
    bf16_mma_reads, fusable_layout, w8a8_gemm, w8a8_gemm_group, ActLayout, Finish, MmaKernels,
    MmaProduct, W8a8Gemm, W8a8Limits, W8a8Scratch, W8a8Through, MAX_PRODUCTS,
};
use crate::weights::{MatAt, RankOffsets};
use lifecycle_decoder::KvDtype;
use lifecycle_layout::fp8::Fp8Compute;

/// Where one rank reads its weights: the device address of its flat bf16 rollout buffer and the
/// checked offsets in it.
#[derive(Debug, Clone)]
pub(crate) struct RankBind {
    pub(crate) base: u64,
    pub(crate) w: RankOffsets,
    /// The LoRA adapters' scaling `s` (1 without adapters) and the largest rank `r` of the
    /// adapters the offsets hold (0: none).
    pub(crate) lora: (f32, usize),
}

/// One rank's resources: cuBLAS handle, kernels, weight addresses, KV cache.
pub(crate) struct RankState {
    /// This rank's place in its tensor-parallel group (`rank mod T`).
    pub(crate) tp_rank: usize,
    /// The replica (share of the batch) this rank decodes: 0 in a tensor-parallel group.
    pub(crate) replica: usize,
    /// Whether this rank brings back the pass's output (the first local rank of a group, every
    /// replica).
    pub(crate) reports: bool,
    pub(crate) blas: CudaBlas,
    pub(crate) k: DecoderKernels,
    /// The weights this rank reads; `None` while unbound (an engine asleep).
    pub(crate) bind: Option<RankBind>,
    /// The merged LoRA mode's private copy of the rollout buffer (`decoder::merge`).
    pub(crate) merged: Option<CudaSlice<u16>>,
    pub(crate) inv_freq: CudaSlice<f32>,
    /// `[layer][k | v][page][KV_PAGE_POSITIONS][kv_heads]` heads of `kv` in 2-byte units
    /// ([`kv_head_units`](crate::decoder::kv::kv_head_units): an f32 element is two, an fp8 head
    /// its e4m3 bytes and scale), `None` before the first prefill (or while an engine sleeps).
    pub(crate) cache: Option<CudaSlice<u16>>,
    /// The page table of this rank's replica (`PageTables`), uploaded before each pass after
    /// the host changed it; `None` with no cache.
    pub(crate) table: Option<CudaSlice<u32>>,
    /// The element type of the cache (checked by `check_kv` when set).
    pub(crate) kv: KvDtype,
    pub(crate) ev_compute: CudaEvent,
    pub(crate) ev_nccl: CudaEvent,
    /// Mapped host buffer every download of a pass goes through (written by the SMs).
    pub(crate) downloads: Downloads,
    /// The fp8 matrix kernels, loaded when weights with fp8 matrices are first bound.
    pub(crate) fp8: Option<Fp8Kernels>,
    /// bf16 scratch of the fp8 prefill products (hi and lo of the largest fp8 matrix), held
    /// while bound to fp8 weights.
    pub(crate) dequant: Option<CudaSlice<u16>>,
    /// f32 activations of the fp8 decode products (`GEMV_TOKENS` rows of the widest matrix).
    pub(crate) x32: Option<CudaSlice<f32>>,
    /// Whether `x32` holds the current input joined (set by a weight-only product that joined
    /// it, cleared by the first product of a new input and by W8A8 products, which write their
    /// dequantised activations there).
    pub(crate) x32_joined: Cell<bool>,
    /// How the fp8 products compute ([`Fp8Compute`]; weight-only by default).
    pub(crate) fp8_compute: Fp8Compute,
    /// The block-scaled fp8 GEMM of the W8A8 products, made when weights with fp8 matrices are
    /// bound in W8A8 mode.
    pub(crate) w8a8: Option<W8a8Gemm>,
    /// Token counts up to which a W8A8 product runs the weight-streaming kernel (on the
    /// dequantised quantised activations), then the tensor-core kernel, before the
    /// block-scaled GEMM.
    pub(crate) w8a8_limits: W8a8Limits,
    /// The tensor-core kernels of the bf16 products of a few tokens ([`MmaKernels::bf16`]),
    /// loaded at the first bind on devices of compute capability 8.9 and later (`None`
    /// elsewhere, or where they did not load: cuBLAS takes those products).
    pub(crate) bf16_mma: Option<MmaKernels>,
    /// Tokens (0 to [`BF16_MMA_TOKENS`](crate::w8a8::BF16_MMA_TOKENS)) up to which a bf16
    /// product runs [`RankState::bf16_mma`] rather than cuBLAS.
    pub(crate) bf16_mma_tokens: usize,
    /// Whether the bf16 experts of a mixture-of-experts layer run in blocks, one batched GEMM
    /// per product ([`super::moe`]; the default), or one GEMM per expert.
    pub(crate) grouped: bool,
    /// Rows from which a LoRA group's `A` and `B` products run on tensor cores (`lora_a_tiles`,
    /// `lora_b_tiles`), below which `lora_a` and `lora_b` take them
    /// ([`GpuDecoder::set_lora_tile_rows`](crate::GpuDecoder::set_lora_tile_rows)).
    pub(crate) lora_tile_rows: usize,
    /// Whether a LoRA group's `A` products ride the launch of their base products where the
    /// bf16 tensor-core kernel takes it ([`GpuDecoder::set_lora_riders`](crate::GpuDecoder::set_lora_riders)),
    /// rather than `lora_a` before it.
    pub(crate) lora_riders: bool,
    /// The device routing of the mixture-of-experts layers (kernels and expert table), made at
    /// bind for a model with MoE layers the kernel can route.
    pub(crate) device_moe: Option<DeviceExperts>,
    /// Whether passes of at most [`DEVICE_ROWS`](super::moe::DEVICE_ROWS) rows route
    /// their MoE layers on the device (the default) or download the router's logits.
    pub(crate) device_routing: bool,
    /// While bound to weights whose switch still frees training memory (an overlapped offload):
    /// the frees the KV cache's allocations wait for.
    pub(crate) room: Option<Arc<FreeingRoom>>,
}

impl RankState {
    /// Whether this pass's downloads go through the SMs: while the switch that made the bound
    /// weights still offloads beside the rollout ([`Downloads`]).
    pub(crate) fn downloads_through_sms(&self) -> bool {
        self.room.as_ref().is_some_and(|r| !r.settled())
    }

    /// Whether this rank's fp8 products quantise the activations ([`Fp8Compute::W8A8`]) and a
    /// pass of `tokens` tokens needs their scratch ([`W8a8Scratch`]): more tokens than the
    /// weight-streaming kernel takes.
    pub(crate) fn w8a8_scratch_for(&self, tokens: usize) -> bool {
        self.fp8_compute == Fp8Compute::W8A8 && self.fp8.is_some() && tokens > self.w8a8_limits.gemv
    }

    /// The layout in which the W8A8 product of `tokens` tokens by `w` (`out × inp`, in the
    /// bound buffer at `base`) reads its quantised activations, where a tensor-core kernel takes
    /// it ([`fusable_layout`]): the kernel that makes its input may quantise it there. `None`
    /// for bf16 and weight-only fp8 weights and the other W8A8 paths.
    pub(crate) fn fusable_layout(
        &self,
        base: u64,
        w: MatAt,
        (out, tokens, inp): (usize, usize, usize),
    ) -> Option<ActLayout> {
        if self.fp8_compute != Fp8Compute::W8A8 || !self.w8a8_scratch_for(tokens) {
            return None;
        }
        let weight = fp8_weight(base, w)?;
        fusable_layout(
            self.w8a8.as_ref()?,
            &weight,
            (out, tokens, inp),
            self.w8a8_limits,
        )
    }

    /// The products of one input `x` (`rows` split rows of `inp`) by each `(w, out, fin)` of
    /// `prods` (weights of the bound buffer at `base`), each writing its [`Finish`], in one
    /// launch of a W8A8 tensor-core kernel where they all take the same one
    /// ([`w8a8_gemm_group`]): `true`. `false` where they do not (bf16 or weight-only weights,
    /// other paths, a pass without the W8A8 scratch), nothing done: the caller runs them one by
    /// one ([`RankState::wgemm_to`]). With `split`, each product's output is written split
    /// (as [`RankState::wgemm`] writes it: `rows / 2` rows, then as many zeros, at its
    /// [`Finish::out`]). `riders` (products of the same input, such as a LoRA group's `A`
    /// matrices) join the launch where the bf16 tensor-core kernel takes it; given where it
    /// does not, an error ([`RankState::bf16_takes`] says beforehand).
    ///
    /// # Safety
    /// As [`RankState::wgemm_to`] for each product; with `split`, each output holds `rows`
    /// rows; each rider's matrix holds its rows of `inp` bf16 and its output its `rows` rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn wgemm_group(
        &self,
        s: &Arc<CudaStream>,
        base: u64,
        (prods, split): (&[(MatAt, usize, Finish)], bool),
        x: u64,
        (rows, inp): (usize, usize),
        (act, same_input): (Option<&W8a8Scratch>, bool),
        riders: &[MmaProduct],
        rank: usize,
    ) -> Result<bool, CudaError> {
        let bf16 = (prods.len() + riders.len() <= MAX_PRODUCTS)
            .then(|| self.bf16_takes(base, prods.iter().map(|p| (p.0, p.1)), rows, inp))
            .flatten();
        if let Some(mma) = bf16 {
            if !same_input {
                self.x32_joined.set(false);
            }
            let list: Vec<MmaProduct> = prods
                .iter()
                .map(|&(w, out, fin)| fin.product(bf16_weight(base, w, inp), out))
                .chain(riders.iter().copied())
                .collect();
            // SAFETY: forwarded to the caller (each matrix the bound entry's, checked at bind;
            // each rider's per the caller).
            unsafe { mma.bf16(s, &list, x, split, (rows / 2, inp), rank)? };
            return Ok(true);
        }
        no_riders(riders)?;
        let (Some(act), Some(lt), Some(k)) = (act, self.w8a8.as_ref(), self.fp8.as_ref()) else {
            return Ok(false);
        };
        if self.fp8_compute != Fp8Compute::W8A8 {
            return Ok(false);
        }
        let Some(list) = prods
            .iter()
            .map(|&(w, out, fin)| fp8_weight(base, w).map(|f| (f, out, fin)))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(false);
        };
        let through = W8a8Through {
            x32: None,
            act: Some((ptr(&act.q, s), ptr(&act.scales, s), &act.held)),
            same_input,
        };
        // SAFETY: forwarded to the caller (each matrix the bound entry's, checked at bind).
        let done = unsafe {
            w8a8_gemm_group(
                s,
                lt,
                k,
                &list,
                x,
                (rows, inp),
                (through, split),
                self.w8a8_limits,
                rank,
            )?
        };
        if done {
            self.x32_joined.set(false);
        }
        Ok(done)
    }

    /// `y[rows × out] = x[rows × inp] · wᵀ` for weight `w` of the bound buffer at `base`:
    /// [`gemm`] for bf16, [`fp8_gemm`] for fp8 weight-only, [`w8a8_gemm`] for W8A8 (through
    /// `act`, the pass's quantised-activation scratch, when [`RankState::w8a8_scratch_for`]
    /// says so; `same_input` when `x` is the previous product's input, unchanged since, so
    /// that its quantisation is used again).
    ///
    /// # Safety
    /// As [`gemm`]: `w` inside the bound rollout buffer, `x` and `y` holding the sizes given,
    /// `act` at least `rows / 2` tokens of `inp` inputs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn wgemm(
        &self,
        s: &Arc<CudaStream>,
        base: u64,
        w: MatAt,
        x: u64,
        y: u64,
        dims: (usize, usize, usize),
        act: (Option<&W8a8Scratch>, bool),
        rank: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.wgemm_to(s, base, w, x, y, dims, act, (None, &[]), rank) }.map(|_| ())
    }

    /// As [`RankState::wgemm`], and where `fin` is given and a W8A8 tensor-core kernel takes
    /// the product, that kernel writes [`Finish`]'s output itself (`y` untouched): `true`;
    /// otherwise `y` holds the split output, for the caller to finish: `false`. `riders` join
    /// the launch as [`RankState::wgemm_group`]'s do.
    ///
    /// # Safety
    /// As [`RankState::wgemm`], and `fin`'s buffers of its sizes (`rows / 2` rows of `out`);
    /// the riders as [`RankState::wgemm_group`] states.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn wgemm_to(
        &self,
        s: &Arc<CudaStream>,
        base: u64,
        w: MatAt,
        x: u64,
        y: u64,
        (out, rows, inp): (usize, usize, usize),
        (act, same_input): (Option<&W8a8Scratch>, bool),
        (fin, riders): (Option<Finish>, &[MmaProduct]),
        rank: usize,
    ) -> Result<bool, CudaError> {
        // a new input: what the scratch holds of the last one is stale (cleared before the bf16
        // products too, whose input a later fp8 product may share)
        if !same_input {
            self.x32_joined.set(false);
            if let Some(a) = act {
                a.held.set(None);
            }
        }
        let bf16 = (riders.len() < MAX_PRODUCTS)
            .then(|| self.bf16_takes(base, [(w, out)].into_iter(), rows, inp))
            .flatten();
        if let Some(mma) = bf16 {
            let weight = bf16_weight(base, w, inp);
            let (p, zero_lo) = match fin {
                Some(f) => (f.product(weight, out), false),
                None => (Finish::split(y).product(weight, out), true),
            };
            let list: Vec<MmaProduct> = std::iter::once(p).chain(riders.iter().copied()).collect();
            // SAFETY: forwarded to the caller (y holds `rows` rows of `out`: the split output;
            // each rider's buffers per the caller).
            unsafe { mma.bf16(s, &list, x, zero_lo, (rows / 2, inp), rank)? };
            return Ok(fin.is_some());
        }
        no_riders(riders)?;
        let Some(weight) = fp8_weight(base, w) else {
            // SAFETY: forwarded to the caller.
            return unsafe { gemm(&self.blas, base + 2 * w.off, x, y, out, rows, inp, rank) }
                .map(|()| false);
        };
        let k = self.fp8.as_ref().ok_or_else(|| {
            CudaError::Invalid("fp8 weights bound without the fp8 kernels".into())
        })?;
        let x32 = self.x32.as_ref().map(|d| ptr(d, s));
        if self.fp8_compute == Fp8Compute::W8A8 {
            self.x32_joined.set(false);
            let lt = self.w8a8.as_ref().ok_or_else(|| {
                CudaError::Invalid("W8A8 fp8 weights bound without their GEMM".into())
            })?;
            let through = W8a8Through {
                x32,
                act: act.map(|a| (ptr(&a.q, s), ptr(&a.scales, s), &a.held)),
                same_input,
            };
            // SAFETY: as below; `act` per the caller.
            return unsafe {
                w8a8_gemm(
                    s,
                    lt,
                    k,
                    weight,
                    x,
                    y,
                    (out, rows, inp),
                    through,
                    fin,
                    self.w8a8_limits,
                    rank,
                )
            };
        }
        let scratch = Fp8Scratch {
            x32,
            dequant: self.dequant.as_ref().map(|d| ptr(d, s)),
        };
        // the weight-streaming path joins the input into x32: once per input
        let gemv = rows.is_multiple_of(2) && rows / 2 <= GEMV_TOKENS;
        let joined = gemv && self.x32_joined.get();
        // SAFETY: the matrix and its scales are the bound entry's (checked against the buffer
        // length at bind); the scratch was sized at bind for the largest fp8 matrix, and with
        // `joined` x32 holds this input (joined by the previous product of it); x and y per the
        // caller.
        unsafe {
            fp8_gemm(
                s,
                &self.blas,
                k,
                weight,
                x,
                y,
                (out, rows, inp),
                (scratch, joined),
                rank,
            )?;
        }
        if gemv {
            self.x32_joined.set(true);
        }
        Ok(false)
    }
}

impl RankState {
    /// The bf16 tensor-core kernels where they take the products of `prods` (each `(matrix,
    /// rows)` of the bound buffer at `base`) over `rows` split rows of `inp`: every matrix bf16
    /// and readable by them ([`bf16_mma_reads`]), the tokens (`rows / 2`) within
    /// [`RankState::bf16_mma_tokens`].
    pub(crate) fn bf16_takes(
        &self,
        base: u64,
        mut prods: impl Iterator<Item = (MatAt, usize)>,
        rows: usize,
        inp: usize,
    ) -> Option<&MmaKernels> {
        let tokens = rows / 2;
        let mma = self.bf16_mma.as_ref()?;
        let ok = rows.is_multiple_of(2)
            && tokens >= 1
            && tokens <= self.bf16_mma_tokens
            && prods.all(|(w, out)| {
                out > 0 && w.fp8.is_none() && bf16_mma_reads(&bf16_weight(base, w, inp), inp)
            });
        ok.then_some(mma)
    }
}

/// Refuses riders where the launch they were to join is not the bf16 tensor-core kernel's: their
/// products would be lost.
fn no_riders(riders: &[MmaProduct]) -> Result<(), CudaError> {
    if riders.is_empty() {
        return Ok(());
    }
    Err(CudaError::Invalid(format!(
        "{} products were to ride a bf16 tensor-core launch that did not take the product",
        riders.len()
    )))
}

/// The bf16 matrix of entry `w` of the bound buffer at `base` (`inp` columns) as the tensor-core
/// kernels take it: its first row's address, no scales.
pub(crate) fn bf16_weight(base: u64, w: MatAt, inp: usize) -> Fp8Weight {
    Fp8Weight {
        data: base + 2 * w.off,
        scales: 0,
        row0: 0,
        cols: inp as u64,
    }
}

/// The fp8 matrix of entry `w` of the bound buffer at `base`, if it is one.
pub(super) fn fp8_weight(base: u64, w: MatAt) -> Option<Fp8Weight> {
    w.fp8.map(|f| Fp8Weight {
        data: base + 2 * w.off,
        scales: base + 2 * f.scales,
        row0: f.row0,
        cols: f.cols,
    })
}

/// Sizes of one forward pass.
pub(crate) struct Dims {
    pub(crate) n: usize,
    pub(crate) m: usize,
    pub(crate) h: usize,
    pub(crate) d: usize,
    pub(crate) qh: usize,
    pub(crate) kvh: usize,
    pub(crate) f: usize,
    pub(crate) vocab: usize,
    /// Embedding / head rows per rank (padding included).
    pub(crate) part: usize,
    pub(crate) tp: usize,
    pub(crate) layers: usize,
    pub(crate) eps: f32,
    pub(crate) group: usize,
    pub(crate) vocab_parallel: bool,
    pub(crate) fused: bool,
    /// Routing of the mixture-of-experts layers.
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
}

/// Makes `waiter` wait for the work queued so far on `on`, through `event`.
pub(crate) fn order(
    ctx: &RankCtx,
    event: &CudaEvent,
    on: &CudaStream,
    waiter: &CudaStream,
) -> Result<(), CudaError> {
    event.record(on).map_err(ctx.drv("recording an event", 0))?;
    waiter
        .wait(event)
        .map_err(ctx.drv("waiting on an event", 0))
}

/// All-reduce (sum) of `send` into `recv` over the TP group, ordered after and before the
/// compute stream's work.
pub(crate) fn all_reduce(
    ctx: &RankCtx,
    st: &RankState,
    send: &CudaSlice<f32>,
    recv: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let nccl = ctx.nccl_stream();
    order(ctx, &st.ev_compute, &ctx.compute, &nccl)?;
    ctx.comm
        .all_reduce(send, recv, &ReduceOp::Sum)
        .map_err(|e| CudaError::nccl(ctx.rank, "all-reduce of row-parallel outputs", e))?;
    order(ctx, &st.ev_nccl, &nccl, &ctx.compute)
}

/// In-place all-reduce (sum) of `buf` over the TP group.
pub(crate) fn all_reduce_in_place(
    ctx: &RankCtx,
    st: &RankState,
    buf: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let nccl = ctx.nccl_stream();
    order(ctx, &st.ev_compute, &ctx.compute, &nccl)?;
    ctx.comm
        .all_reduce_in_place(buf, &ReduceOp::Sum)
        .map_err(|e| CudaError::nccl(ctx.rank, "all-reduce of embedding rows", e))?;
    order(ctx, &st.ev_nccl, &nccl, &ctx.compute)
}
