//! The scratch buffers of one pass and its inputs on the device ([`Scratch`]).

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use super::lora::LoraScratch;
use super::tiles::prefill_tiles;
use super::Step;
use crate::decoder::moe::MoeScratch;
use crate::decoder::rank::{Dims, RankState};
use crate::kernels::{SplitAttention, TILED_MAX_HEAD};
use crate::w8a8::W8a8Scratch;

/// The scratch buffers of one pass (sized for its `n` rows by [`Scratch::new`]) and its inputs on
/// the device.
pub(crate) struct Scratch {
    /// Hidden states `[n × h]`.
    pub(super) x: CudaSlice<f32>,
    /// Split activations: `hi` and `lo` rows of the widest product input, `[2n × widest]`.
    pub(super) xs: CudaSlice<u16>,
    /// GEMM outputs `[2n × widest output]`.
    pub(super) y2: CudaSlice<f32>,
    /// The up product's outputs (unfused layouts).
    pub(super) y2b: CudaSlice<f32>,
    pub(super) q: CudaSlice<f32>,
    pub(super) k: CudaSlice<f32>,
    pub(super) v: CudaSlice<f32>,
    /// Row-parallel partial sums at T > 1.
    pub(super) partial: Option<CudaSlice<f32>>,
    pub(super) tokens: CudaSlice<u32>,
    pub(super) seqs: CudaSlice<u32>,
    pub(super) poss: CudaSlice<u32>,
    pub(super) rows: CudaSlice<u32>,
    /// The quantised activations of the W8A8 products (beyond the weight-streaming kernel's
    /// tokens).
    pub(super) w8a8: Option<W8a8Scratch>,
    /// The mixture-of-experts layers' buffers (`None` for a dense model).
    pub(super) moe: Option<MoeScratch>,
    /// The head's buffers (`None` when no rows are wanted).
    pub(super) head: Option<HeadScratch>,
    /// A decode step's attention split over the cache, and its partial sums (`None`: one block
    /// per row and query head over the whole cache).
    pub(super) split: Option<SplitScratch>,
    /// A pass not split: its rows' tiles for `attention_tiled*` (`[first row, rows]` each,
    /// [`prefill_tiles`], uploaded with the step) and how many; `None` where the heads are too
    /// wide for them or the attention is split.
    pub(super) tiles: Option<(CudaSlice<u32>, usize)>,
    /// The LoRA branches' buffers (`None` without adapters).
    pub(super) lora: Option<LoraScratch>,
}

/// The partial sums of a split attention ([`SplitAttention`]): per row, query head and chunk,
/// the output sum `[n × qh × splits × d]` and the score maximum and sum `[n × qh × splits × 2]`.
pub(super) struct SplitScratch {
    pub(super) plan: SplitAttention,
    pub(super) o: CudaSlice<f32>,
    pub(super) ml: CudaSlice<f32>,
}

/// The head's buffers of a pass of `m` wanted rows: the split final hidden rows, the head
/// product, this rank's logits and, where the vocabulary is split or padded, the gathered and
/// the full logits `[m × vocab]`.
pub(super) struct HeadScratch {
    pub(super) xh: CudaSlice<u16>,
    pub(super) yh: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) gathered: Option<CudaSlice<f32>>,
    pub(super) full: Option<CudaSlice<f32>>,
}

impl Scratch {
    /// The scratch of a pass of `z`'s `n` rows and `m` wanted rows on this rank for `step` (its
    /// inputs still to upload: [`Scratch::upload`]).
    pub(crate) fn new(
        ctx: &RankCtx,
        st: &RankState,
        z: &Dims,
        step: &Step<'_>,
    ) -> Result<Self, CudaError> {
        let s = &ctx.compute;
        let rank = ctx.rank;
        let (n, m, h, f) = (z.n, z.m, z.h, z.f);
        let (qw, kvw) = (z.qh * z.d, z.kvh * z.d);
        let widest = h.max(qw).max(f);
        // a joined product writes [q; k; v] or [gate; up] at once (the fused layout's, or
        // matrices stored one after the other: Pass::joined_rows)
        let out_widest = widest.max(qw + 2 * kvw).max(2 * f);
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
            let split = match split_attention(step, z) {
                Some(plan) => {
                    let heads = n * z.qh * plan.splits;
                    Some(SplitScratch {
                        plan,
                        o: alloc_device::<f32>(s, heads * z.d, rank, "attention partial sums")?,
                        ml: alloc_device::<f32>(s, heads * 2, rank, "attention partial maxima")?,
                    })
                }
                None => None,
            };
            let tiles = if split.is_none() && z.d <= TILED_MAX_HEAD {
                Some((
                    alloc_device::<u32>(s, 2 * n.max(1), rank, "attention tiles")?,
                    0,
                ))
            } else {
                None
            };
            let lora = LoraScratch::new(ctx, n, bind.lora.1, st.k.tensor_cores)?;
            Ok(Scratch {
                split,
                tiles,
                lora,
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
    pub(crate) fn upload(&mut self, ctx: &RankCtx, step: &Step<'_>) -> Result<(), CudaError> {
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
        if let Some((dst, count)) = &mut self.tiles {
            let tiles = prefill_tiles(&step.seqs, &step.poss);
            if tiles.len() > dst.len() {
                return Err(CudaError::Invalid(format!(
                    "{} attention tiles for a pass made for {}",
                    tiles.len() / 2,
                    dst.len() / 2
                )));
            }
            if !tiles.is_empty() {
                let mut head = dst.slice_mut(..tiles.len());
                s.memcpy_htod(&tiles, &mut head)
                    .map_err(ctx.drv("uploading attention tiles", 0))?;
            }
            *count = tiles.len() / 2;
        }
        Ok(())
    }

    /// The full logits `[m × vocab]` the head writes; an error for a pass with no rows wanted.
    pub(crate) fn logits(&self) -> Result<&CudaSlice<f32>, CudaError> {
        self.head
            .as_ref()
            .map(|h| h.full.as_ref().unwrap_or(&h.logits))
            .ok_or_else(|| CudaError::Invalid("logits of a pass with no rows wanted".into()))
    }
}

/// The most bytes of partial sums a pass other than a decode step splits its attention for.
const SPLIT_BYTES: usize = 64 << 20;

/// Whether `step`'s attention is split over the cache (where the kernels take the heads): for
/// every decode step (one row a sequence, so a row's attention never depends on its step), and
/// for other passes (a prefill, a prefill beside decode rows) whose partial sums stay within
/// [`SPLIT_BYTES`]; long prefills keep a block per row and query head.
pub(super) fn split_attention(step: &Step<'_>, z: &Dims) -> Option<SplitAttention> {
    let plan = SplitAttention::for_cache(step.pps * crate::decoder::pages::KV_PAGE_POSITIONS, z.d)?;
    let bytes = z.n * z.qh * plan.splits * (z.d + 2) * 4;
    (step.decode || bytes <= SPLIT_BYTES).then_some(plan)
}
