//! A layer's MLP: gate / up, SwiGLU and down, or the mixture-of-experts layer
//! ([`crate::decoder::moe`]).

use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_cuda::CudaError;

use super::{u32a, Capture, Pass};
use crate::decoder::moe::moe_layer;
use crate::decoder::rank::all_reduce;
use crate::kernels::{launch_maybe_early, ptr, Arg};
use crate::w8a8::Finish;

impl<'a> Pass<'a> {
    /// Layer `l`'s feed-forward part: post-attention norm, then the SwiGLU MLP (gate and up
    /// products, fused or not, the down product and the residual) or the layer's mixture of
    /// experts.
    pub(super) fn mlp(&mut self, l: usize) -> Result<(), CudaError> {
        let (z, rank) = (self.z, self.ctx.rank);
        let (n, h, f) = (z.n, z.h, z.f);
        let lw = self.bind.w.layers[l];
        let bind = self.bind;
        if let Some(moe) = &bind.w.moe[l] {
            self.norm(lw.post_norm, 0, n)?;
            return self.experts(l, moe);
        }
        let joined = self.joined_rows(&[(lw.gate_w, f), (lw.up_w, f)]);
        let gate = (lw.gate_w, if joined { 2 * f } else { f });
        let quantised = self.norm_for(lw.post_norm, Some(gate))?;
        let base = self.bind.base;
        let (xs, y2, y2b) = (
            self.at(&self.sc.xs),
            self.at(&self.sc.y2),
            self.at(&self.sc.y2b),
        );
        let (s, st, k) = (self.s(), self.st, &self.st.k);
        let w8 = self.sc.w8a8.as_ref();
        // the adapters' branches added to the gate and up blocks (of the joined product's
        // split output, or of each product's) before the SwiGLU
        let group = if joined {
            self.branches(&lw.lora[4..6], |i| {
                (y2 + 4 * (i * f) as u64, f, 2 * f, true)
            })
        } else {
            self.branches(&lw.lora[4..6], |i| ([y2, y2b][i], f, f, true))
        };
        // SAFETY (every GEMM and launch below): the pass's addresses and sizes (its invariant).
        unsafe {
            // the branches' A products first, beside the base products (they read xs alone),
            // or riding their launch
            let bases = if joined {
                vec![(lw.gate_w, 2 * f)]
            } else {
                vec![(lw.gate_w, f), (lw.up_w, f)]
            };
            let down = self.lora_down(h, &group, &bases)?;
            if joined {
                // one GEMM over [gate; up] (up_w follows gate_w in the fused tensor, or in the
                // buffer)
                st.wgemm_to(
                    s,
                    base,
                    lw.gate_w,
                    xs,
                    y2,
                    (2 * f, 2 * n, h),
                    (w8, quantised),
                    (None, down.riders()),
                    rank,
                )?;
                self.lora_up(h, &group, &down)?;
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
                // (not where gate, up or down has an adapter: their branches read and add to
                // the split rows)
                let adapted = lw.lora[4..].iter().any(Option::is_some);
                let fused = self.fused_quant(lw.down_w, (h, f)).filter(|_| !adapted);
                let zeros = fused.is_none();
                let riders = down.riders();
                let grouped =
                    st.wgemm_group(s, base, (&prods, zeros), xs, (2 * n, h), one, riders, rank)?;
                if !grouped {
                    st.wgemm(s, base, lw.gate_w, xs, y2, (f, 2 * n, h), one, rank)?;
                    st.wgemm(s, base, lw.up_w, xs, y2b, (f, 2 * n, h), (w8, true), rank)?;
                }
                self.lora_up(h, &group, &down)?;
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
                    return self.row_parallel(lw.down_w, f, true, None);
                }
                let args = [Arg::U64(y2), Arg::U64(y2b), Arg::U64(xs), u32a(n), u32a(f)];
                let cfg = self.elementwise(n * f);
                self.kernel(&k.swiglu_split, cfg, &args, "swiglu_split")?;
            }
        }
        // SAFETY: down_w is h × f; the pass's addresses and sizes (its invariant).
        unsafe { self.row_parallel(lw.down_w, f, false, lw.lora[6]) }
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
}
