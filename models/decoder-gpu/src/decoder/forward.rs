//! One rank's forward pass, in stages over one [`Pass`] (its scratch buffers and the addresses
//! it reads): [`Pass::embed`], then per layer [`Pass::attention`] and [`Pass::mlp`] (or the
//! mixture-of-experts layer of [`super::moe`]), then [`Pass::fork_kv`] and [`Pass::head`]; the
//! head's logits become what the caller asked for in [`pick`].
//!
//! Every stage queues its kernels, GEMMs and collectives in order on the rank's compute stream;
//! collectives are ordered with events both ways. Activations stay f32 and enter a product as
//! two bf16 rows (`hi`, `lo`): the split buffer `xs` holds `2n` rows.

use std::ops::Range;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};
use lifecycle_decoder::KvDtype;

use super::kv::kv_head_units;
use super::moe::{moe_layer, MoeScratch};
use super::rank::{all_reduce, all_reduce_in_place, order, Dims, RankBind, RankState};
use crate::blas::gemm;
use crate::kernels::{launch, launch_maybe_early, ptr, Arg};
use crate::w8a8::{Finish, QuantInto, W8a8Scratch};
use crate::weights::MatAt;

/// Inputs of one forward pass of one replica (the same on every rank of a group); sequence
/// indices are the replica's own cache slots.
pub(super) struct Step<'a> {
    pub(super) tokens: Vec<u32>,
    pub(super) seqs: Vec<u32>,
    pub(super) poss: Vec<u32>,
    /// Rows whose logits are wanted.
    pub(super) logit_rows: Vec<u32>,
    /// Cache slots per block of the cache (its layout).
    pub(super) batch: usize,
    /// Cache capacity in positions.
    pub(super) cap: usize,
    /// `[leader slot, slot, length]` per forked sequence: copied after the layers ran.
    pub(super) forks: Vec<u32>,
    /// What to bring back.
    pub(super) pick: Pick<'a>,
    /// A decode step (one row per sequence), which a graph may replay ([`StepGraphs`](super::graph::StepGraphs)).
    pub(super) decode: bool,
}

/// What a forward pass brings back to the host.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pick<'a> {
    /// Logits of the wanted rows.
    Logits,
    /// The argmax token of each wanted row (first index on ties).
    Argmax,
    /// A token per wanted row sampled from softmax(logits / temperature) with the uniform
    /// draw given for that row.
    Sample {
        temperature: f32,
        uniforms: &'a [f32],
    },
}

impl<'a> Pick<'a> {
    /// The pick for the wanted rows `want` of the whole batch (a replica's share).
    pub(super) fn rows(self, want: Range<usize>) -> Pick<'a> {
        match self {
            Pick::Sample {
                temperature,
                uniforms,
            } => Pick::Sample {
                temperature,
                uniforms: uniforms.get(want).unwrap_or(&[]),
            },
            other => other,
        }
    }
}

/// What a reporting rank brings back from a forward pass.
pub(super) enum StepOut {
    /// One row per wanted row.
    Logits(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
    Nothing,
}

/// Whether the stages run as they are queued or are being captured into a graph (where no
/// stage may wait for the device or copy from the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Capture {
    Eager,
    Capturing,
}

/// What the stages of one pass did that a captured graph could not replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Ran {
    /// A mixture-of-experts layer was routed on the host (one device→host copy per layer).
    pub(super) host_routed: bool,
}

/// The stages of one pass of `step` over `sc` (its inputs uploaded), in order on the rank's
/// compute stream: the embedding, the layers, the KV forks and, with rows wanted, the head.
pub(super) fn run_stages(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    step: &Step<'_>,
    sc: &mut Scratch,
    capture: Capture,
) -> Result<Ran, CudaError> {
    let mut pass = Pass::new(ctx, st, z, step, sc, capture)?;
    pass.embed()?;
    for l in 0..z.layers {
        pass.attention(l)?;
        pass.mlp(l)?;
    }
    pass.fork_kv()?;
    if z.m > 0 {
        pass.head()?;
    }
    Ok(pass.ran)
}

/// The scratch buffers of one pass (sized for its `n` rows by [`Scratch::new`]) and its inputs on
/// the device.
pub(super) struct Scratch {
    /// Hidden states `[n × h]`.
    x: CudaSlice<f32>,
    /// Split activations: `hi` and `lo` rows of the widest product input, `[2n × widest]`.
    xs: CudaSlice<u16>,
    /// GEMM outputs `[2n × widest output]`.
    y2: CudaSlice<f32>,
    /// The up product's outputs (unfused layouts).
    y2b: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// Row-parallel partial sums at T > 1.
    partial: Option<CudaSlice<f32>>,
    tokens: CudaSlice<u32>,
    seqs: CudaSlice<u32>,
    poss: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    /// The quantised activations of the W8A8 products (beyond the weight-streaming kernel's
    /// tokens).
    w8a8: Option<W8a8Scratch>,
    /// The mixture-of-experts layers' buffers (`None` for a dense model).
    moe: Option<MoeScratch>,
    /// The head's buffers (`None` when no rows are wanted).
    head: Option<HeadScratch>,
}

/// The head's buffers of a pass of `m` wanted rows: the split final hidden rows, the head
/// product, this rank's logits and, where the vocabulary is split or padded, the gathered and
/// the full logits `[m × vocab]`.
struct HeadScratch {
    xh: CudaSlice<u16>,
    yh: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    gathered: Option<CudaSlice<f32>>,
    full: Option<CudaSlice<f32>>,
}

/// One forward pass of one rank in progress: what every stage reads and writes. Its invariant,
/// which every stage's launches rely on: the weight addresses are the bound rollout buffer's
/// (offsets checked against its length at bind), the cache is sized for `step` (checked by
/// `reserve`), and every scratch buffer holds what the stages index for `z`'s sizes (made by
/// [`Scratch::new`] for them).
struct Pass<'a> {
    ctx: &'a RankCtx,
    st: &'a RankState,
    bind: &'a RankBind,
    z: &'a Dims,
    step: &'a Step<'a>,
    sc: &'a mut Scratch,
    cache: u64,
    capture: Capture,
    ran: Ran,
}

fn u32a(v: usize) -> Arg {
    Arg::U32(v as u32)
}

/// One block of 256 threads per row.
fn block_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Scratch {
    /// The scratch of a pass of `z`'s `n` rows and `m` wanted rows on this rank (its inputs
    /// still to upload: [`Scratch::upload`]).
    pub(super) fn new(ctx: &RankCtx, st: &RankState, z: &Dims) -> Result<Self, CudaError> {
        let s = &ctx.compute;
        let rank = ctx.rank;
        let (n, m, h, f) = (z.n, z.m, z.h, z.f);
        let (qw, kvw) = (z.qh * z.d, z.kvh * z.d);
        let widest = h.max(qw).max(f);
        // a fused product writes [q; k; v] or [gate; up] at once
        let out_widest = if z.fused {
            widest.max(qw + 2 * kvw).max(2 * f)
        } else {
            widest
        };
        let bind = st.bind.as_ref().ok_or_else(|| {
            CudaError::Invalid("the decoder is not bound to rollout weights".into())
        })?;
        let flags = (
            st.w8a8_scratch_for(n),
            st.device_routing && st.device_moe.is_some(),
        );
        let moe = MoeScratch::new(s, rank, (n, h, z.top_k), &bind.w, flags)?;
        let part = z.part;
        let split_or_padded = z.vocab_parallel || crate::vocab::padded(1, part, z.vocab);
        // SAFETY: every element of these buffers is written by a kernel, a GEMM, a collective
        // or an upload before it is read, as the stages do in order on this one stream.
        unsafe {
            let head = if m > 0 {
                Some(HeadScratch {
                    xh: alloc_device::<u16>(s, 2 * m * h, rank, "split final hidden rows")?,
                    yh: alloc_device::<f32>(s, 2 * m * part, rank, "head GEMM output")?,
                    logits: alloc_device::<f32>(s, m * part, rank, "logits")?,
                    gathered: if z.vocab_parallel {
                        Some(alloc_device::<f32>(
                            s,
                            z.tp * m * part,
                            rank,
                            "gathered logits",
                        )?)
                    } else {
                        None
                    },
                    full: if split_or_padded {
                        Some(alloc_device::<f32>(s, m * z.vocab, rank, "logits")?)
                    } else {
                        None
                    },
                })
            } else {
                None
            };
            Ok(Scratch {
                x: alloc_device::<f32>(s, n * h, rank, "hidden states")?,
                xs: alloc_device::<u16>(s, 2 * n * widest, rank, "split activations")?,
                y2: alloc_device::<f32>(s, 2 * n * out_widest, rank, "GEMM outputs")?,
                y2b: alloc_device::<f32>(
                    s,
                    if z.fused { 1 } else { 2 * n * f },
                    rank,
                    "GEMM outputs (up)",
                )?,
                q: alloc_device::<f32>(s, n * qw, rank, "queries")?,
                k: alloc_device::<f32>(s, n * kvw, rank, "keys")?,
                v: alloc_device::<f32>(s, n * kvw, rank, "values")?,
                partial: if z.tp > 1 {
                    Some(alloc_device::<f32>(
                        s,
                        n * h,
                        rank,
                        "row-parallel partial sums",
                    )?)
                } else {
                    None
                },
                tokens: alloc_device::<u32>(s, n, rank, "tokens")?,
                seqs: alloc_device::<u32>(s, n, rank, "sequence indices")?,
                poss: alloc_device::<u32>(s, n, rank, "positions")?,
                rows: alloc_device::<u32>(s, m, rank, "logit rows")?,
                w8a8: if st.w8a8_scratch_for(n) {
                    Some(W8a8Scratch::alloc(s, n, widest, rank)?)
                } else {
                    None
                },
                moe,
                head,
            })
        }
    }

    /// Copies `step`'s inputs (as many as the scratch was made for) into their buffers, in order
    /// on the compute stream.
    pub(super) fn upload(&mut self, ctx: &RankCtx, step: &Step<'_>) -> Result<(), CudaError> {
        let s = &ctx.compute;
        let ins: [(&[u32], &mut CudaSlice<u32>, &str); 4] = [
            (&step.tokens, &mut self.tokens, "uploading tokens"),
            (&step.seqs, &mut self.seqs, "uploading sequence indices"),
            (&step.poss, &mut self.poss, "uploading positions"),
            (&step.logit_rows, &mut self.rows, "uploading logit rows"),
        ];
        for (v, dst, what) in ins {
            if v.is_empty() {
                continue;
            }
            if v.len() != dst.len() {
                return Err(CudaError::Invalid(format!(
                    "{what}: {} values for a pass made for {}",
                    v.len(),
                    dst.len()
                )));
            }
            s.memcpy_htod(v, dst).map_err(ctx.drv(what, 0))?;
        }
        Ok(())
    }

    /// The full logits `[m × vocab]` the head writes; an error for a pass with no rows wanted.
    pub(super) fn logits(&self) -> Result<&CudaSlice<f32>, CudaError> {
        self.head
            .as_ref()
            .map(|h| h.full.as_ref().unwrap_or(&h.logits))
            .ok_or_else(|| CudaError::Invalid("logits of a pass with no rows wanted".into()))
    }
}

impl<'a> Pass<'a> {
    /// The pass of `step` over `sc` (made for `z` by [`Scratch::new`], its inputs uploaded).
    fn new(
        ctx: &'a RankCtx,
        st: &'a RankState,
        z: &'a Dims,
        step: &'a Step<'a>,
        sc: &'a mut Scratch,
        capture: Capture,
    ) -> Result<Self, CudaError> {
        let cache = st
            .cache
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no KV cache: call prefill first".into()))?;
        let bind = st.bind.as_ref().ok_or_else(|| {
            CudaError::Invalid("the decoder is not bound to rollout weights".into())
        })?;
        if sc.x.len() != z.n * z.h {
            return Err(CudaError::Invalid(format!(
                "a pass of {} rows over scratch made for {}",
                z.n,
                sc.x.len() / z.h.max(1)
            )));
        }
        Ok(Pass {
            ctx,
            st,
            bind,
            z,
            step,
            sc,
            cache: ptr(cache, &ctx.compute),
            capture,
            ran: Ran::default(),
        })
    }

    fn s(&self) -> &'a Arc<CudaStream> {
        &self.ctx.compute
    }

    /// The device address of `b` for this pass's stream.
    fn at<T>(&self, b: &CudaSlice<T>) -> u64 {
        ptr(b, self.s())
    }

    /// The device address of the bound weight at element offset `off`.
    fn wp(&self, off: u64) -> u64 {
        self.bind.base + 2 * off
    }

    /// Launches kernel `func` of this rank.
    ///
    /// # Safety
    /// `args` must be addresses of this pass (its scratch, cache and bound weights) and sizes
    /// that fit them, as the kernel's contract in `kernels.rs` states.
    unsafe fn kernel(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &[Arg],
        what: &str,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded to the caller.
        unsafe { launch(self.s(), func, cfg, args, self.ctx.rank, what) }
    }

    /// The elementwise launch shape of `count` elements.
    fn elementwise(&self, count: usize) -> LaunchConfig {
        self.st.k.elementwise(count as u64)
    }

    /// Embedding rows of the step's tokens into `x` (all-reduced when the vocabulary is
    /// split over the group: each rank gathers the rows it holds, zeros elsewhere).
    fn embed(&mut self) -> Result<(), CudaError> {
        let z = self.z;
        // rows per rank (the padded vocabulary's share in the fused layout); tokens are checked
        // against the real vocabulary, so padding rows are never gathered
        let part = z.part;
        let lo = if z.vocab_parallel {
            self.st.tp_rank * part
        } else {
            0
        };
        let args = [
            Arg::U64(self.wp(self.bind.w.embed)),
            Arg::U64(self.at(&self.sc.tokens)),
            Arg::U64(self.at(&self.sc.x)),
            u32a(z.n),
            u32a(z.h),
            u32a(lo),
            u32a(part),
        ];
        // SAFETY: the pass's addresses and sizes (its invariant).
        unsafe {
            self.kernel(
                &self.st.k.embed,
                self.elementwise(z.n * z.h),
                &args,
                "embed",
            )?
        };
        if z.vocab_parallel {
            all_reduce_in_place(self.ctx, self.st, &mut self.sc.x)?;
        }
        Ok(())
    }

    /// RMSNorm of `count` rows of `x` (all of them, or the rows listed at `rows_p`) with weight
    /// `w`, split into `hi` / `lo` rows of `xs`.
    fn norm(&self, w: u64, rows_p: u64, count: usize) -> Result<(), CudaError> {
        let args = [
            Arg::U64(self.at(&self.sc.x)),
            Arg::U64(self.wp(w)),
            Arg::U64(rows_p),
            Arg::U64(self.at(&self.sc.xs)),
            u32a(count),
            u32a(self.z.h),
            Arg::F32(self.z.eps),
        ];
        let k = &self.st.k;
        // SAFETY: the pass's addresses and sizes (its invariant).
        unsafe {
            self.kernel(
                &k.rms_norm_split,
                block_rows(count),
                &args,
                "rms_norm_split",
            )
        }
    }

    /// Where the kernel making the input of the W8A8 product by `w` (`out × inp`, over the
    /// pass's tokens) quantises it for a tensor-core kernel ([`RankState::fusable_layout`]):
    /// `None` where the product quantises its input itself (other paths, bf16 and weight-only
    /// weights, a pass without the W8A8 scratch).
    fn fused_quant(&self, w: MatAt, (out, inp): (usize, usize)) -> Option<QuantInto> {
        let sc = self.sc.w8a8.as_ref()?;
        let layout = self
            .st
            .fusable_layout(self.bind.base, w, (out, self.z.n, inp))?;
        Some(QuantInto {
            q: self.at(&sc.q),
            scales: self.at(&sc.scales),
            layout,
            tokens: self.z.n,
        })
    }

    /// RMSNorm of the pass's rows of `x` with weight `w` into `xs`, as [`Pass::norm`], for the
    /// product by `next` (`out × h`): where that product's tensor-core kernel reads the
    /// quantisation the norm can write ([`Pass::fused_quant`]), `rms_norm_quant` writes both and
    /// the scratch holds the product's input (`true`: call it with `same_input`).
    fn norm_for(&self, w: u64, next: Option<(MatAt, usize)>) -> Result<bool, CudaError> {
        let (n, h) = (self.z.n, self.z.h);
        // the row kept in shared memory (f32, within the default 48 KiB)
        let fits = 4 * h <= 48 << 10;
        let Some(qi) = next
            .filter(|_| fits)
            .and_then(|(m, out)| self.fused_quant(m, (out, h)))
        else {
            self.norm(w, 0, n)?;
            return Ok(false);
        };
        let [pad, q, sc, tok, grp, tiles] = qi.args(h)?;
        let args = [
            Arg::U64(self.at(&self.sc.x)),
            Arg::U64(self.wp(w)),
            Arg::U64(self.at(&self.sc.xs)),
            u32a(n),
            pad,
            u32a(h),
            Arg::F32(self.z.eps),
            q,
            sc,
            tok,
            grp,
            tiles,
        ];
        let cfg = LaunchConfig {
            grid_dim: (qi.padded().max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (4 * h) as u32,
        };
        // SAFETY: the pass's addresses and sizes (its invariant); the W8A8 scratch holds the
        // pass's padded tokens in either layout (W8a8Scratch::alloc).
        // (it waits for the kernel before it first thing: launched early where the device can)
        unsafe {
            launch_maybe_early(
                self.st.k.early,
                self.s(),
                &self.st.k.rms_norm_quant,
                cfg,
                &args,
                self.ctx.rank,
                "rms_norm_quant",
            )?
        };
        self.held(qi);
        Ok(true)
    }

    /// Records that the W8A8 scratch holds the current input quantised as `qi` says.
    fn held(&self, qi: QuantInto) {
        if let Some(sc) = self.sc.w8a8.as_ref() {
            sc.held.set(Some(qi.layout));
        }
    }

    /// `out[n × width] = y2[hi] + y2[lo] (+ bias)`: a column-parallel product's halves joined.
    fn combine_into(&self, out: u64, bias: Option<u64>, width: usize) -> Result<(), CudaError> {
        let args = [
            Arg::U64(self.at(&self.sc.y2)),
            Arg::U64(bias.map_or(0, |b| self.wp(b))),
            Arg::U64(0),
            Arg::U64(out),
            u32a(self.z.n),
            u32a(width),
        ];
        let cfg = self.elementwise(self.z.n * width);
        // SAFETY: the pass's addresses and sizes (its invariant).
        unsafe { self.kernel(&self.st.k.combine, cfg, &args, "combine") }
    }

    /// As [`Pass::combine_into`] for columns `col0 .. col0 + width` of a fused product of row
    /// pitch `ld`.
    fn combine_cols(
        &self,
        out: u64,
        bias: Option<u64>,
        (ld, col0, width): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let args = [
            Arg::U64(self.at(&self.sc.y2)),
            Arg::U64(bias.map_or(0, |b| self.wp(b))),
            Arg::U64(out),
            u32a(self.z.n),
            u32a(ld),
            u32a(col0),
            u32a(width),
        ];
        let cfg = self.elementwise(self.z.n * width);
        // SAFETY: the pass's addresses and sizes (its invariant).
        unsafe { self.kernel(&self.st.k.combine_cols, cfg, &args, "combine_cols") }
    }

    /// The row-parallel product of `xs` by `w` (`h × inp`) added to the residual `x`: written
    /// so by the W8A8 kernel itself where it takes the product on a rank that holds the whole
    /// sum (no tensor-parallel partial to all-reduce), else through `y2` and [`Pass::finish`].
    /// `again`: the W8A8 scratch holds `xs` quantised already (by the kernel that wrote it).
    ///
    /// # Safety
    /// `w` of `h × inp` inside the bound buffer; the pass's addresses and sizes (its invariant).
    unsafe fn row_parallel(&mut self, w: MatAt, inp: usize, again: bool) -> Result<(), CudaError> {
        let (n, h, rank) = (self.z.n, self.z.h, self.ctx.rank);
        let (xs, y2, x) = (
            self.at(&self.sc.xs),
            self.at(&self.sc.y2),
            self.at(&self.sc.x),
        );
        let fin = self.sc.partial.is_none().then_some(Finish {
            out: x,
            bias: None,
            res: Some(x),
        });
        let act = (self.sc.w8a8.as_ref(), again);
        let (s, base) = (self.s(), self.bind.base);
        // SAFETY: per the caller; x holds n × h f32.
        let done = unsafe {
            self.st
                .wgemm_to(s, base, w, xs, y2, (h, 2 * n, inp), act, fin, rank)?
        };
        if done {
            Ok(())
        } else {
            self.finish()
        }
    }

    /// A row-parallel product's output `y2 [2n × h]` added to the residual `x` (over the group:
    /// rank 0 adds the residual to its partial sum, then the all-reduce).
    fn finish(&mut self) -> Result<(), CudaError> {
        let (n, h) = (self.z.n, self.z.h);
        let (y2, x) = (self.at(&self.sc.y2), self.at(&self.sc.x));
        let cfg = self.elementwise(n * h);
        let k = &self.st.k;
        match &self.sc.partial {
            None => {
                let args = [
                    Arg::U64(y2),
                    Arg::U64(0),
                    Arg::U64(x),
                    Arg::U64(x),
                    u32a(n),
                    u32a(h),
                ];
                // SAFETY: the pass's addresses and sizes (its invariant).
                unsafe { self.kernel(&k.combine, cfg, &args, "combine") }
            }
            Some(part) => {
                // rank 0 adds the residual: x + Σ partials, the same on every rank
                let res = if self.st.tp_rank == 0 { x } else { 0 };
                let args = [
                    Arg::U64(y2),
                    Arg::U64(0),
                    Arg::U64(res),
                    Arg::U64(self.at(part)),
                    u32a(n),
                    u32a(h),
                ];
                // SAFETY: the pass's addresses and sizes (its invariant).
                unsafe { self.kernel(&k.combine, cfg, &args, "combine")? };
                all_reduce(self.ctx, self.st, part, &mut self.sc.x)
            }
        }
    }

    /// A position's width in one layer's K (or V) block, in the cache's 2-byte units.
    fn kv_width(&self) -> usize {
        self.z.kvh * kv_head_units(self.st.kv, self.z.d)
    }

    /// The addresses of layer `l`'s K and V cache blocks.
    fn cache_blocks(&self, l: usize) -> (u64, u64) {
        let layer = 2 * (self.step.batch * self.step.cap * self.kv_width()) as u64;
        let kc = self.cache + (2 * l as u64) * layer;
        (kc, kc + layer)
    }

    /// Layer `l`'s attention: input norm, q / k / v products (one fused GEMM or three), the
    /// per-head norms of Qwen3, RoPE and the cache store, attention over the cache, the output
    /// product and the residual.
    fn attention(&mut self, l: usize) -> Result<(), CudaError> {
        let (z, rank) = (self.z, self.ctx.rank);
        let (n, h, d, qh, kvh) = (z.n, z.h, z.d, z.qh, z.kvh);
        let (qw, kvw) = (qh * d, kvh * d);
        let lw = self.bind.w.layers[l];
        let base = self.bind.base;
        let (xs, y2) = (self.at(&self.sc.xs), self.at(&self.sc.y2));
        let (q, kb, vb) = (
            self.at(&self.sc.q),
            self.at(&self.sc.k),
            self.at(&self.sc.v),
        );
        let (kc, vc) = self.cache_blocks(l);
        let (s, st, k) = (self.s(), self.st, &self.st.k);
        let w8 = self.sc.w8a8.as_ref();
        let first = if z.fused {
            (lw.q_w, qw + 2 * kvw)
        } else {
            (lw.q_w, qw)
        };
        let quantised = self.norm_for(lw.input_norm, Some(first))?;
        // SAFETY (every GEMM and launch below): the pass's addresses and sizes (its invariant).
        unsafe {
            if z.fused {
                // one GEMM over [q; k; v] (k_w, v_w follow q_w in the fused tensor), then its
                // column blocks
                let ld = qw + 2 * kvw;
                st.wgemm(
                    s,
                    base,
                    lw.q_w,
                    xs,
                    y2,
                    (ld, 2 * n, h),
                    (w8, quantised),
                    rank,
                )?;
                self.combine_cols(q, lw.q_b, (ld, 0, qw))?;
                self.combine_cols(kb, lw.k_b, (ld, qw, kvw))?;
                self.combine_cols(vb, lw.v_b, (ld, qw + kvw, kvw))?;
            } else {
                // each product into its buffer with its bias: by the W8A8 kernels themselves
                // where they take them (the three in one launch where one kernel takes all),
                // else by combine
                let fin = |out, bias: Option<u64>| Finish {
                    out,
                    bias: bias.map(|b| self.wp(b)),
                    res: None,
                };
                let prods = [
                    (lw.q_w, qw, fin(q, lw.q_b)),
                    (lw.k_w, kvw, fin(kb, lw.k_b)),
                    (lw.v_w, kvw, fin(vb, lw.v_b)),
                ];
                let one = (w8, quantised);
                if !st.wgemm_group(s, base, (&prods, false), xs, (2 * n, h), one, rank)? {
                    for (i, (wm, width, f)) in prods.into_iter().enumerate() {
                        let bias = [lw.q_b, lw.k_b, lw.v_b][i];
                        let dims = (width, 2 * n, h);
                        let again = quantised || i > 0;
                        if !st.wgemm_to(s, base, wm, xs, y2, dims, (w8, again), Some(f), rank)? {
                            self.combine_into(f.out, bias, width)?;
                        }
                    }
                }
            }
            if let Some((qn, kn)) = lw.qk_norm {
                for (buf, w, heads) in [(q, qn, n * qh), (kb, kn, n * kvh)] {
                    let cfg = LaunchConfig {
                        grid_dim: (heads.max(1) as u32, 1, 1),
                        block_dim: (32 * d.div_ceil(32).clamp(1, 8) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let args = [
                        Arg::U64(buf),
                        Arg::U64(self.wp(w)),
                        u32a(d),
                        Arg::F32(z.eps),
                    ];
                    self.kernel(&k.head_norm, cfg, &args, "head_norm")?;
                }
            }
            let args = [
                Arg::U64(q),
                Arg::U64(kb),
                Arg::U64(vb),
                Arg::U64(kc),
                Arg::U64(vc),
                Arg::U64(self.at(&self.sc.seqs)),
                Arg::U64(self.at(&self.sc.poss)),
                Arg::U64(self.at(&st.inv_freq)),
                u32a(n),
                u32a(qh),
                u32a(kvh),
                u32a(d),
                u32a(self.step.cap),
            ];
            let (rope, cfg) = match st.kv {
                KvDtype::F32 => (&k.rope_store, self.elementwise(n * (qh + kvh) * d / 2)),
                KvDtype::Bf16 => (&k.rope_store_bf16, self.elementwise(n * (qh + kvh) * d / 2)),
                // a warp per (row, head), 8 per block
                KvDtype::Fp8 => (
                    &k.rope_store_fp8,
                    LaunchConfig {
                        grid_dim: ((n * (qh + kvh)).div_ceil(8).max(1) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    },
                ),
            };
            self.kernel(rope, cfg, &args, "rope_store")?;
            // 8 warps: the scores a position per warp, the weighted values in 256 / d groups;
            // where o's tensor-core kernel reads a quantisation and a head is one group of 128
            // inputs, the kernel also quantises its outputs (and the padded tokens' groups), and
            // writes no split output (o reads only the quantisation)
            let threads = 256;
            let fused = (d == 128)
                .then(|| self.fused_quant(lw.o_w, (h, qw)))
                .flatten();
            let (rows, out, quant) = match fused {
                Some(qi) => {
                    let [_, aq, asc, tok, grp, tiles] = qi.args(qw)?;
                    (qi.padded(), 0, [aq, asc, tok, grp, tiles])
                }
                None => {
                    let none = [Arg::U64(0), Arg::U64(0), u32a(0), u32a(0), u32a(0)];
                    (n, xs, none)
                }
            };
            let cfg = LaunchConfig {
                grid_dim: ((rows * qh) as u32, 1, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: ((d.max(threads) + self.step.cap) * 4) as u32,
            };
            let [aq, asc, tok, grp, tiles] = quant;
            let args = [
                Arg::U64(q),
                Arg::U64(kc),
                Arg::U64(vc),
                Arg::U64(self.at(&self.sc.seqs)),
                Arg::U64(self.at(&self.sc.poss)),
                Arg::U64(out),
                u32a(n),
                u32a(qh),
                u32a(kvh),
                u32a(d),
                u32a(self.step.cap),
                u32a(self.bind.w.share.q_base),
                u32a(z.group),
                u32a(self.bind.w.share.kv_base),
                Arg::F32(1.0 / (d as f32).sqrt()),
                aq,
                asc,
                tok,
                grp,
                tiles,
            ];
            let attention = match st.kv {
                KvDtype::F32 => &k.attention,
                KvDtype::Bf16 => &k.attention_bf16,
                KvDtype::Fp8 => &k.attention_fp8,
            };
            self.kernel(attention, cfg, &args, "attention")?;
            if let Some(qi) = fused {
                self.held(qi);
            }
            // SAFETY: o_w is h × qw; the pass's addresses and sizes (its invariant); with the
            // quantisation fused, the scratch holds o's input (held above).
            self.row_parallel(lw.o_w, qw, fused.is_some())
        }
    }

    /// Layer `l`'s feed-forward part: post-attention norm, then the SwiGLU MLP (gate and up
    /// products, fused or not, the down product and the residual) or the layer's mixture of
    /// experts.
    fn mlp(&mut self, l: usize) -> Result<(), CudaError> {
        let (z, rank) = (self.z, self.ctx.rank);
        let (n, h, f) = (z.n, z.h, z.f);
        let lw = self.bind.w.layers[l];
        let bind = self.bind;
        if let Some(moe) = &bind.w.moe[l] {
            self.norm(lw.post_norm, 0, n)?;
            return self.experts(l, moe);
        }
        let gate = (lw.gate_w, if z.fused { 2 * f } else { f });
        let quantised = self.norm_for(lw.post_norm, Some(gate))?;
        let base = self.bind.base;
        let (xs, y2, y2b) = (
            self.at(&self.sc.xs),
            self.at(&self.sc.y2),
            self.at(&self.sc.y2b),
        );
        let (s, st, k) = (self.s(), self.st, &self.st.k);
        let w8 = self.sc.w8a8.as_ref();
        // SAFETY (every GEMM and launch below): the pass's addresses and sizes (its invariant).
        unsafe {
            if z.fused {
                // one GEMM over [gate; up] (up_w follows gate_w in the fused tensor)
                st.wgemm(
                    s,
                    base,
                    lw.gate_w,
                    xs,
                    y2,
                    (2 * f, 2 * n, h),
                    (w8, quantised),
                    rank,
                )?;
                let args = [Arg::U64(y2), Arg::U64(xs), u32a(n), u32a(f)];
                let cfg = self.elementwise(n * f);
                self.kernel(&k.swiglu_fused_split, cfg, &args, "swiglu_fused_split")?;
            } else {
                // gate and up split into y2 and y2b: in one launch where one W8A8 kernel takes
                // both, else one by one
                let split = |out| Finish {
                    out,
                    bias: None,
                    res: None,
                };
                let prods = [(lw.gate_w, f, split(y2)), (lw.up_w, f, split(y2b))];
                let one = (w8, quantised);
                // the SwiGLU quantised with it where the down product's tensor-core kernel reads
                // its quantisation: then one launch of gate and up writes no lo rows (zeros),
                // which swiglu_quant does not read
                let fused = self.fused_quant(lw.down_w, (h, f));
                let zeros = fused.is_none();
                let grouped =
                    st.wgemm_group(s, base, (&prods, zeros), xs, (2 * n, h), one, rank)?;
                if !grouped {
                    st.wgemm(s, base, lw.gate_w, xs, y2, (f, 2 * n, h), one, rank)?;
                    st.wgemm(s, base, lw.up_w, xs, y2b, (f, 2 * n, h), (w8, true), rank)?;
                }
                let lo_rows = !grouped || zeros;
                if let Some(qi) = fused {
                    let [pad, q, sc, tok, grp, tiles] = qi.args(f)?;
                    // the split output unwritten: down reads the quantisation only (its
                    // tensor-core kernel, with the scratch holding its input)
                    let args = [
                        Arg::U64(y2),
                        Arg::U64(y2b),
                        Arg::U64(0),
                        u32a(n),
                        pad,
                        u32a(f),
                        q,
                        sc,
                        tok,
                        grp,
                        tiles,
                        Arg::U32(u32::from(lo_rows)),
                    ];
                    // a warp per (token, group of 128), 8 per block
                    let warps = qi.padded() * f.div_ceil(128);
                    let cfg = LaunchConfig {
                        grid_dim: (warps.div_ceil(8).max(1) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // (waits first thing: launched early where the device can)
                    launch_maybe_early(
                        k.early,
                        self.s(),
                        &k.swiglu_quant,
                        cfg,
                        &args,
                        self.ctx.rank,
                        "swiglu_quant",
                    )?;
                    self.held(qi);
                    // SAFETY: down_w is h × f; the scratch holds xs quantised (just above).
                    return self.row_parallel(lw.down_w, f, true);
                }
                let args = [Arg::U64(y2), Arg::U64(y2b), Arg::U64(xs), u32a(n), u32a(f)];
                let cfg = self.elementwise(n * f);
                self.kernel(&k.swiglu_split, cfg, &args, "swiglu_split")?;
            }
        }
        // SAFETY: down_w is h × f; the pass's addresses and sizes (its invariant).
        unsafe { self.row_parallel(lw.down_w, f, false) }
    }

    /// A mixture-of-experts layer ([`moe_layer`]): the experts' sum plus the residual (rank 0
    /// adds it), summed over the group.
    fn experts(&mut self, l: usize, moe: &crate::weights::MoeOffsets) -> Result<(), CudaError> {
        let (n, h) = (self.z.n, self.z.h);
        let (xs, x) = (self.at(&self.sc.xs), self.at(&self.sc.x));
        let scratch = self.sc.moe.as_mut().ok_or_else(|| {
            CudaError::Invalid("no scratch buffers for a mixture-of-experts layer".into())
        })?;
        let hosted = moe_layer(
            self.ctx,
            self.st,
            self.z,
            l,
            moe,
            scratch,
            xs,
            (self.bind.base, self.capture == Capture::Eager),
        )?;
        self.ran.host_routed |= hosted;
        let acc = ptr(scratch.acc(), &self.ctx.compute);
        let cfg = self.elementwise(n * h);
        let k = &self.st.k;
        match &self.sc.partial {
            None => {
                let args = [
                    Arg::U64(acc),
                    Arg::U64(x),
                    Arg::U64(x),
                    Arg::U64((n * h) as u64),
                ];
                // SAFETY: the pass's addresses and sizes (its invariant).
                unsafe { self.kernel(&k.add_rows, cfg, &args, "add_rows") }
            }
            Some(part) => {
                let res = if self.st.tp_rank == 0 { x } else { 0 };
                let args = [
                    Arg::U64(acc),
                    Arg::U64(res),
                    Arg::U64(self.at(part)),
                    Arg::U64((n * h) as u64),
                ];
                // SAFETY: the pass's addresses and sizes (its invariant).
                unsafe { self.kernel(&k.add_rows, cfg, &args, "add_rows")? };
                all_reduce(self.ctx, self.st, part, &mut self.sc.x)
            }
        }
    }

    /// Forked sequences: their leaders' KV rows (every layer's k and v, positions 0..prompt
    /// length) copied into their slots, ordered after the layers on this stream. The slots are
    /// below `step.batch` and the lengths at most the prompt's, which `reserve` checked against
    /// the cache's capacity: every copy stays inside the cache.
    fn fork_kv(&self) -> Result<(), CudaError> {
        let step = self.step;
        let forked = step.forks.len() / 3;
        if forked == 0 {
            return Ok(());
        }
        if self.capture == Capture::Capturing {
            return Err(CudaError::Invalid(
                "a captured pass cannot fork sequences (their table is uploaded per pass)".into(),
            ));
        }
        let z = self.z;
        let kvw = self.kv_width();
        let longest = step.forks.chunks_exact(3).map(|f| f[2]).max().unwrap_or(0);
        let fk = self
            .s()
            .clone_htod(&step.forks)
            .map_err(self.ctx.drv("uploading KV forks", 0))?;
        let blocks = 2 * z.layers;
        let args = [
            Arg::U64(self.cache),
            Arg::U64(self.at(&fk)),
            u32a(forked),
            u32a(blocks),
            u32a(step.batch),
            u32a(step.cap),
            u32a(kvw),
            Arg::U32(longest),
        ];
        let cfg = self.elementwise(forked * blocks * longest as usize * kvw);
        // SAFETY: the pass's cache and the forks' table just uploaded (kept alive until the
        // stream ran: `fk` is dropped after the launch is queued, and frees are stream-ordered).
        unsafe { self.kernel(&self.st.k.fork_kv, cfg, &args, "fork_kv") }
    }

    /// The final norm of the wanted rows and the head product: the full logits `[m × vocab]` in
    /// the scratch's head buffers (gathered over the group when the vocabulary is split, padding
    /// columns dropped).
    fn head(&mut self) -> Result<(), CudaError> {
        let (ctx, st, z) = (self.ctx, self.st, self.z);
        let (s, rank, k) = (self.s(), ctx.rank, &st.k);
        let (m, h, part) = (z.m, z.h, z.part);
        let hd = self
            .sc
            .head
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no head buffers for a pass with rows".into()))?;
        let (xh, yh, logits) = (self.at(&hd.xh), self.at(&hd.yh), self.at(&hd.logits));
        let full = hd.full.as_ref().map(|f| self.at(f));
        let missing = || CudaError::Invalid("no buffer for the full logits".into());
        // SAFETY (launches and GEMMs): the pass's addresses and sizes (its invariant: the head
        // buffers hold `z`'s wanted rows).
        unsafe {
            let args = [
                Arg::U64(self.at(&self.sc.x)),
                Arg::U64(self.wp(self.bind.w.final_norm)),
                Arg::U64(self.at(&self.sc.rows)),
                Arg::U64(xh),
                u32a(m),
                u32a(h),
                Arg::F32(z.eps),
            ];
            self.kernel(&k.rms_norm_split, block_rows(m), &args, "rms_norm_split")?;
            gemm(
                &st.blas,
                self.wp(self.bind.w.head),
                xh,
                yh,
                part,
                2 * m,
                h,
                rank,
            )?;
            let args = [
                Arg::U64(yh),
                Arg::U64(0),
                Arg::U64(0),
                Arg::U64(logits),
                u32a(m),
                u32a(part),
            ];
            self.kernel(&k.combine, self.elementwise(m * part), &args, "combine")?;
            // [T][m][part] on every rank when the vocabulary is split
            let gathered = if z.vocab_parallel {
                let hd = self.sc.head.as_mut().ok_or_else(missing)?;
                let gathered = hd.gathered.as_mut().ok_or_else(missing)?;
                let nccl = ctx.nccl_stream();
                order(ctx, &st.ev_compute, s, &nccl)?;
                ctx.comm.all_gather(&hd.logits, gathered).map_err(|e| {
                    CudaError::nccl(rank, "all-gather of vocabulary-parallel logits", e)
                })?;
                order(ctx, &st.ev_nccl, &nccl, s)?;
                Some(ptr(gathered, s))
            } else {
                None
            };
            // [T][m][part] → [m][vocab] without the padding columns (never sampled or picked)
            let gather_real = |from: u64, to: u64| {
                let args = [
                    Arg::U64(from),
                    Arg::U64(to),
                    u32a(m),
                    u32a(part),
                    u32a(z.vocab),
                ];
                let cfg = self.elementwise(m * z.vocab);
                self.kernel(&k.gather_vocab, cfg, &args, "gather_vocab")
            };
            if let Some(gathered) = gathered {
                // then [m][vocab]
                let full = full.ok_or_else(missing)?;
                if crate::vocab::padded(z.tp, part, z.vocab) {
                    gather_real(gathered, full)?;
                } else {
                    let args = [
                        Arg::U64(gathered),
                        Arg::U64(full),
                        u32a(z.tp),
                        u32a(m),
                        u32a(part),
                    ];
                    let cfg = self.elementwise(m * z.vocab);
                    self.kernel(&k.unshard, cfg, &args, "unshard")?;
                }
            } else if let Some(full) = full {
                // one rank holding padded rows: keep the real columns
                gather_real(logits, full)?;
            }
        }
        Ok(())
    }
}

/// What the caller asked of the full logits `[m × vocab]`: the argmax or sampled token of each
/// row (picked on the device, only the tokens downloaded), or the logits themselves; downloaded
/// through the SMs into the rank's mapped buffer ([`Downloads`](crate::download::Downloads)).
pub(super) fn pick(
    ctx: &RankCtx,
    st: &mut RankState,
    z: &Dims,
    pick: Pick<'_>,
    full: &CudaSlice<f32>,
) -> Result<StepOut, CudaError> {
    let (s, rank, m) = (&ctx.compute, ctx.rank, z.m);
    let sms = st.downloads_through_sms();
    let tokens_out = |toks: CudaSlice<u32>| -> Result<StepOut, CudaError> {
        let out = st
            .downloads
            .words(ctx, &st.k, s, ptr(&toks, s), m, sms, "downloading tokens")?;
        Ok(StepOut::Tokens(out))
    };
    match pick {
        Pick::Argmax => {
            // SAFETY: written whole by the argmax kernel queued right after on this stream.
            let toks = unsafe { alloc_device::<u32>(s, m, rank, "argmax tokens")? };
            let args = [
                Arg::U64(ptr(full, s)),
                Arg::U64(ptr(&toks, s)),
                u32a(z.vocab),
            ];
            // SAFETY: `full` holds m × vocab logits, `toks` m tokens; one block per row.
            unsafe {
                launch(
                    s,
                    &st.k.argmax_rows,
                    block_rows(m),
                    &args,
                    rank,
                    "argmax_rows",
                )?
            };
            tokens_out(toks)
        }
        Pick::Sample {
            temperature,
            uniforms,
        } => {
            if uniforms.len() != m {
                return Err(CudaError::Invalid(format!(
                    "{} uniform draws for {m} rows",
                    uniforms.len()
                )));
            }
            let uni = s
                .clone_htod(uniforms)
                .map_err(ctx.drv("uploading uniform draws", 0))?;
            // SAFETY: written whole by the sampling kernel queued right after on this stream.
            let toks = unsafe { alloc_device::<u32>(s, m, rank, "sampled tokens")? };
            let args = [
                Arg::U64(ptr(full, s)),
                Arg::U64(ptr(&uni, s)),
                Arg::U64(ptr(&toks, s)),
                u32a(z.vocab),
                Arg::F32(temperature),
            ];
            // SAFETY: `full` holds m × vocab logits, `uni` m draws, `toks` m tokens.
            unsafe {
                launch(
                    s,
                    &st.k.sample_rows,
                    block_rows(m),
                    &args,
                    rank,
                    "sample_rows",
                )?
            };
            tokens_out(toks)
        }
        Pick::Logits => {
            let len = m * z.vocab;
            let words =
                st.downloads
                    .words(ctx, &st.k, s, ptr(full, s), len, sms, "downloading logits")?;
            Ok(StepOut::Logits(
                words
                    .chunks_exact(z.vocab)
                    .map(|row| row.iter().map(|&w| f32::from_bits(w)).collect())
                    .collect(),
            ))
        }
    }
}
