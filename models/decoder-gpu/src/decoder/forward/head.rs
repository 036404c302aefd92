//! The head: the final norm, the vocabulary product and its gather; then what the caller asked of
//! the logits ([`pick`]).

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_decoder::Picked;

use super::{block_rows, u32a, Pass, Pick, RowPick, StepOut};
use crate::blas::gemm;
use crate::decoder::rank::{bf16_weight, order, Dims, RankState};
use crate::kernels::{launch, ptr, Arg};
use crate::w8a8::Finish;
use crate::weights::MatAt;

/// Threads per row of `pick_rows` (its `PICK_THREADS`).
const PICK_THREADS: u32 = 512;

/// What the caller asked of the full logits `[m × vocab]`: the argmax or sampled token of each
/// row (picked on the device, only the tokens downloaded), or the logits themselves; downloaded
/// through the SMs into the rank's mapped buffer ([`Downloads`](crate::download::Downloads)).
pub(crate) fn pick(
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
        Pick::Rows(rows) => {
            if rows.len() != m {
                return Err(CudaError::Invalid(format!(
                    "{} row picks for {m} rows",
                    rows.len()
                )));
            }
            let table = s
                .clone_htod(&RowPick::words(rows))
                .map_err(ctx.drv("uploading the rows' picks", 0))?;
            // SAFETY: written whole by the pick kernel queued right after on this stream.
            let picked = unsafe { alloc_device::<u32>(s, 4 * m, rank, "picked tokens")? };
            let args = [
                Arg::U64(ptr(full, s)),
                Arg::U64(ptr(&table, s)),
                Arg::U64(ptr(&picked, s)),
                u32a(z.vocab),
                u32a(m),
            ];
            let cfg = LaunchConfig {
                grid_dim: (m.max(1) as u32, 1, 1),
                block_dim: (PICK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `full` holds m × vocab logits, `table` 4 words per row, `picked` 4m words
            // (tokens, then three log-probabilities per row); one block per row.
            unsafe { launch(s, &st.k.pick_rows, cfg, &args, rank, "pick_rows")? };
            let words = st.downloads.words(
                ctx,
                &st.k,
                s,
                ptr(&picked, s),
                4 * m,
                sms,
                "downloading picked tokens",
            )?;
            let f = |w: u32| f32::from_bits(w);
            Ok(StepOut::Picked(
                (0..m)
                    .map(|r| Picked {
                        token: words[r],
                        logprob: f(words[m + r]),
                        raw_logprob: f(words[2 * m + r]),
                        truncated_logprob: f(words[3 * m + r]),
                    })
                    .collect(),
            ))
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

impl<'a> Pass<'a> {
    /// The final norm of the wanted rows and the head product: the full logits `[m × vocab]` in
    /// the scratch's head buffers (gathered over the group when the vocabulary is split, padding
    /// columns dropped).
    pub(super) fn head(&mut self) -> Result<(), CudaError> {
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
            // the logits straight from the tensor-core kernel where it takes the product, else
            // cuBLAS's split product joined
            let head_w = MatAt::bf16(self.bind.w.head);
            let base = self.bind.base;
            if let Some(mma) = st.bf16_takes(base, [(head_w, part)].into_iter(), 2 * m, h) {
                let p = Finish::split(logits).product(bf16_weight(base, head_w, h), part);
                mma.bf16(s, &[p], xh, false, (m, h), rank)?;
            } else {
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
            }
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
