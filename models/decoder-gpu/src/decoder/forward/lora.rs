//! A layer's LoRA branches: `s·(x·Aᵀ)·Bᵀ` beside each adapted base product, unmerged, on the
//! split bf16 input the base product read (`xs`: `hi` rows, then `lo` rows), in f32 as PEFT adds
//! it. Each branch is two cuBLAS products and one kernel: `t2 = xs·Aᵀ` (`[2n × r]`), `lora_mid`
//! joins its halves, scales them by `s` and splits them again, and `B`'s product adds its split
//! output to the base's split output before that is joined (or, where the base product wrote its
//! joined output itself, `combine` adds it there).

use lifecycle_cuda::CudaError;

use super::{u32a, Pass};
use crate::blas::{gemm, gemm_ld};
use crate::kernels::Arg;
use crate::weights::LoraAt;

impl<'a> Pass<'a> {
    /// The branch of adapter `at` over `xs` (`[2n × inp]`) into the split output rows at `y`
    /// (`[2n × out]` f32, rows `ldc` apart): added to what they hold with `beta` 1 (the base
    /// product's split output, before it is joined), written with `beta` 0.
    ///
    /// # Safety
    /// `at` is an adapter of the bound offsets whose `A` is `r × inp` and `B` `out × r`; `xs`
    /// holds the pass's split input of `inp` columns; `y` holds `(2n − 1) · ldc + out` f32.
    pub(super) unsafe fn lora_branch(
        &self,
        at: LoraAt,
        inp: usize,
        (y, out, ldc): (u64, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        let (n, rank, st) = (self.z.n, self.ctx.rank, self.st);
        let sc = self.sc.lora.as_ref().ok_or_else(|| {
            CudaError::Invalid("a LoRA branch in a pass without its scratch".into())
        })?;
        let (scaling, most) = self.bind.lora;
        if at.r > most {
            return Err(CudaError::Invalid(format!(
                "a LoRA branch of rank {} in a pass made for rank {most}",
                at.r
            )));
        }
        let (xs, t2, ts) = (self.at(&self.sc.xs), self.at(&sc.t2), self.at(&sc.ts));
        // SAFETY: per the caller (A of r × inp, xs of 2n × inp); t2 holds 2n × r f32 (at.r ≤
        // the scratch's rank, checked above).
        unsafe { gemm(&st.blas, self.wp(at.a), xs, t2, at.r, 2 * n, inp, rank)? };
        let args = [
            Arg::U64(t2),
            Arg::U64(ts),
            u32a(n),
            u32a(at.r),
            Arg::F32(scaling),
        ];
        // SAFETY: t2 and ts hold 2n × at.r elements (the scratch's rank bounds at.r).
        unsafe {
            self.kernel(
                &st.k.lora_mid,
                self.elementwise(n * at.r),
                &args,
                "lora_mid",
            )?
        };
        let dims = (out, 2 * n, at.r);
        // SAFETY: per the caller (B of out × r, y's rows); ts holds 2n × at.r bf16.
        unsafe { gemm_ld(&st.blas, self.wp(at.b), ts, y, dims, ldc, beta, rank) }
    }

    /// The branch of adapter `at` added to `dest` (`[n × out]` f32, the joined output the base
    /// product wrote): through `y2`, then `combine` with `dest` as its residual.
    ///
    /// # Safety
    /// As [`Pass::lora_branch`]; `dest` holds `n × out` f32 and `y2` is free (the base product
    /// is joined).
    pub(super) unsafe fn lora_after(
        &self,
        at: LoraAt,
        inp: usize,
        dest: u64,
        out: usize,
    ) -> Result<(), CudaError> {
        let y2 = self.at(&self.sc.y2);
        // SAFETY: per the caller; y2 holds 2n rows of the widest output.
        unsafe { self.lora_branch(at, inp, (y2, out, out), 0.0)? };
        let args = [
            Arg::U64(y2),
            Arg::U64(0),
            Arg::U64(dest),
            Arg::U64(dest),
            u32a(self.z.n),
            u32a(out),
        ];
        let cfg = self.elementwise(self.z.n * out);
        // SAFETY: y2 holds the branch's 2n × out split output, dest n × out (the caller).
        unsafe { self.kernel(&self.st.k.combine, cfg, &args, "combine") }
    }
}
