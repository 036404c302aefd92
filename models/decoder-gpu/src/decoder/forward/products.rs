//! The products of a pass and what feeds them: RMS norms (quantising for the next product where a
//! W8A8 kernel takes it), the hi / lo combine, row-parallel products and their all-reduce.

use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_cuda::CudaError;

use super::{block_rows, u32a, Pass};
use crate::decoder::rank::all_reduce;
use crate::kernels::{launch_maybe_early, Arg};
use crate::w8a8::{Finish, QuantInto};
use crate::weights::{LoraAt, MatAt};

impl<'a> Pass<'a> {
    /// RMSNorm of `count` rows of `x` (all of them, or the rows listed at `rows_p`) with weight
    /// `w`, split into `hi` / `lo` rows of `xs`.
    pub(super) fn norm(&self, w: u64, rows_p: u64, count: usize) -> Result<(), CudaError> {
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

    /// Where the kernel making the input of the W8A8 product by `w` (`out × inp`, over the pass's
    /// tokens) quantises it for a tensor-core kernel
    /// ([`RankState::fusable_layout`](crate::decoder::rank::RankState::fusable_layout)): `None`
    /// where the product quantises its input itself (other paths, bf16 and weight-only weights, a
    /// pass without the W8A8 scratch).
    pub(super) fn fused_quant(&self, w: MatAt, (out, inp): (usize, usize)) -> Option<QuantInto> {
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
    pub(super) fn norm_for(&self, w: u64, next: Option<(MatAt, usize)>) -> Result<bool, CudaError> {
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

    /// Whether the matrices `parts` (each `(matrix, rows)`, all `h` wide) are one matrix of
    /// the bound buffer, each part's rows right after the previous part's, so one product takes
    /// them: the fused layout's `[q; k; v]` and `[gate; up]`, or bf16 matrices stored one after
    /// the other (Hugging Face's gate and up; q, k and v without biases between them).
    pub(super) fn joined_rows(&self, parts: &[(MatAt, usize)]) -> bool {
        if self.z.fused {
            return true;
        }
        parts.iter().all(|(m, _)| m.fp8.is_none())
            && parts
                .windows(2)
                .all(|w| w[1].0 == w[0].0.skip_rows(w[0].1, self.z.h))
    }

    /// Records that the W8A8 scratch holds the current input quantised as `qi` says.
    pub(super) fn held(&self, qi: QuantInto) {
        if let Some(sc) = self.sc.w8a8.as_ref() {
            sc.held.set(Some(qi.layout));
        }
    }

    /// `out[n × width] = y2[hi] + y2[lo] (+ bias)`: a column-parallel product's halves joined.
    pub(super) fn combine_into(
        &self,
        out: u64,
        bias: Option<u64>,
        width: usize,
    ) -> Result<(), CudaError> {
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
    pub(super) fn combine_cols(
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
    /// With `lora`, the adapter's branch ([`Pass::lora_branch`]) is added beside the product.
    ///
    /// # Safety
    /// `w` of `h × inp` inside the bound buffer, `lora` an adapter of it; the pass's addresses
    /// and sizes (its invariant).
    pub(super) unsafe fn row_parallel(
        &mut self,
        w: MatAt,
        inp: usize,
        again: bool,
        lora: Option<LoraAt>,
    ) -> Result<(), CudaError> {
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
        // the adapter's A product first, beside the base product (it reads xs alone; where its
        // B product adds is known once the base product ran), or riding its launch
        let down = {
            let group = self.branches(&[lora], |_| (0, h, h, true));
            // SAFETY: the adapter of this base (h × inp); xs holds its input.
            unsafe { self.lora_down(inp, &group, &[(w, h)])? }
        };
        let ends = (fin, down.riders());
        // SAFETY: per the caller; x holds n × h f32; the riders write the LoRA scratch.
        let done = unsafe {
            self.st
                .wgemm_to(s, base, w, xs, y2, (h, 2 * n, inp), act, ends, rank)?
        };
        // the adapter's branch (its A split on the inputs like the base: a partial sum at T > 1)
        // added to the base's split output before it is joined, or, where the kernel wrote x,
        // to x
        let (dest, split) = if done { (x, false) } else { (y2, true) };
        let group = self.branches(&[lora], |_| (dest, h, h, split));
        // SAFETY: the adapter of this base (h × inp); xs holds its input; x n × h f32, y2 the
        // base's 2n × h split output where the kernel did not write x (then y2 is free).
        unsafe { self.lora_up(inp, &group, &down)? };
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
}
