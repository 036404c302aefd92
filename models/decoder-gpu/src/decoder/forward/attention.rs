//! A layer's attention: q / k / v products, rotary, the KV cache's write and read, the output
//! product; and the KV forks of a pass.

use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_cuda::CudaError;
use lifecycle_decoder::KvDtype;

use super::{u32a, Capture, Pass};
use crate::decoder::kv::kv_head_units;
use crate::decoder::pages::KV_PAGE_POSITIONS;
use crate::kernels::Arg;
use crate::w8a8::Finish;

impl<'a> Pass<'a> {
    /// A position's width in one layer's K (or V) block, in the cache's 2-byte units.
    fn kv_width(&self) -> usize {
        self.z.kvh * kv_head_units(self.st.kv, self.z.d)
    }

    /// The addresses of layer `l`'s K and V cache blocks.
    fn cache_blocks(&self, l: usize) -> (u64, u64) {
        let layer = 2 * (self.step.pages * KV_PAGE_POSITIONS * self.kv_width()) as u64;
        let kc = self.cache + (2 * l as u64) * layer;
        (kc, kc + layer)
    }

    /// Layer `l`'s attention: input norm, q / k / v products (one fused GEMM or three), the
    /// per-head norms of Qwen3, RoPE and the cache store, attention over the cache, the output
    /// product and the residual.
    pub(super) fn attention(&mut self, l: usize) -> Result<(), CudaError> {
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
        let joined = self.joined_rows(&[(lw.q_w, qw), (lw.k_w, kvw), (lw.v_w, kvw)]);
        let first = if joined {
            (lw.q_w, qw + 2 * kvw)
        } else {
            (lw.q_w, qw)
        };
        let quantised = self.norm_for(lw.input_norm, Some(first))?;
        // the adapters' branches: added to their column blocks of the joined product's split
        // output before they are joined, else where each product wrote its output
        let ld = qw + 2 * kvw;
        let group = if joined {
            let blocks = [(0, qw), (qw, kvw), (qw + kvw, kvw)];
            self.branches(&lw.lora[..3], |i| {
                let (col0, width) = blocks[i];
                (y2 + 4 * col0 as u64, width, ld, true)
            })
        } else {
            let outs = [(q, qw), (kb, kvw), (vb, kvw)];
            self.branches(&lw.lora[..3], |i| {
                let (dest, width) = outs[i];
                (dest, width, width, false)
            })
        };
        // SAFETY (every GEMM and launch below): the pass's addresses and sizes (its invariant).
        unsafe {
            // the branches' A products first, beside the base products (they read xs alone),
            // or riding their launch
            let bases = if joined {
                vec![(lw.q_w, ld)]
            } else {
                vec![(lw.q_w, qw), (lw.k_w, kvw), (lw.v_w, kvw)]
            };
            let down = self.lora_down(h, &group, &bases)?;
            if joined {
                // one GEMM over [q; k; v] (k_w, v_w follow q_w in the fused tensor, or one
                // after the other in the buffer), then its column blocks
                st.wgemm_to(
                    s,
                    base,
                    lw.q_w,
                    xs,
                    y2,
                    (ld, 2 * n, h),
                    (w8, quantised),
                    (None, down.riders()),
                    rank,
                )?;
                self.lora_up(h, &group, &down)?;
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
                let riders = down.riders();
                if !st.wgemm_group(s, base, (&prods, false), xs, (2 * n, h), one, riders, rank)? {
                    for (i, (wm, width, f)) in prods.into_iter().enumerate() {
                        let bias = [lw.q_b, lw.k_b, lw.v_b][i];
                        let dims = (width, 2 * n, h);
                        let act = (w8, quantised || i > 0);
                        let fin = (Some(f), &[][..]);
                        if !st.wgemm_to(s, base, wm, xs, y2, dims, act, fin, rank)? {
                            self.combine_into(f.out, bias, width)?;
                        }
                    }
                }
            }
            if !joined {
                // each product wrote its buffer: the adapters' branches added there
                self.lora_up(h, &group, &down)?;
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
                Arg::U64(self.table),
                u32a(self.step.pps),
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
            let threads = crate::kernels::ATTENTION_THREADS;
            // (not where o has an adapter, whose branch reads the split output)
            let fused = (d == 128 && lw.lora[3].is_none())
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
            let [aq, asc, tok, grp, tiles_arg] = quant;
            let place = [
                Arg::U64(q),
                Arg::U64(kc),
                Arg::U64(vc),
                Arg::U64(self.at(&self.sc.seqs)),
                Arg::U64(self.at(&self.sc.poss)),
            ];
            let heads = [
                u32a(n),
                u32a(qh),
                u32a(kvh),
                u32a(d),
                Arg::U64(self.table),
                u32a(self.step.pps),
                u32a(self.bind.w.share.q_base),
                u32a(z.group),
                u32a(self.bind.w.share.kv_base),
                Arg::F32(1.0 / (d as f32).sqrt()),
            ];
            if let Some(split) = &self.sc.split {
                // the cache in chunks (every K / V row read once for its query heads), then
                // the chunks joined per row and query head
                let plan = split.plan;
                let (po, pml) = (self.at(&split.o), self.at(&split.ml));
                let chunking = [u32a(plan.chunk), u32a(plan.splits)];
                let args: Vec<Arg> = place
                    .into_iter()
                    .chain([Arg::U64(po), Arg::U64(pml)])
                    .chain(heads)
                    .chain(chunking)
                    .collect();
                let attention = match st.kv {
                    KvDtype::F32 => &k.attention_split,
                    KvDtype::Bf16 => &k.attention_split_bf16,
                    KvDtype::Fp8 => &k.attention_split_fp8,
                };
                let (cfg, block_heads) = plan.split_launch(n, kvh, z.group, d, k.sm_count as usize);
                // the device's multiprocessors: a row long enough to fill them takes every head
                // of its kv head a block whatever `block_heads` says
                let spread = Arg::U32(k.sm_count);
                let args: Vec<Arg> = args
                    .into_iter()
                    .chain([Arg::U32(block_heads), spread])
                    .collect();
                self.kernel(attention, cfg, &args, "attention_split")?;
                let args = [
                    Arg::U64(po),
                    Arg::U64(pml),
                    Arg::U64(self.at(&self.sc.poss)),
                    Arg::U64(out),
                    u32a(n),
                    u32a(qh),
                    u32a(d),
                    u32a(plan.chunk),
                    u32a(plan.splits),
                    aq,
                    asc,
                    tok,
                    grp,
                    tiles_arg,
                ];
                let cfg = LaunchConfig {
                    grid_dim: ((rows * qh) as u32, 1, 1),
                    block_dim: (d.next_multiple_of(32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.kernel(&k.attention_join, cfg, &args, "attention_join")?;
            } else {
                // a prefill: a block per (tile of rows of one sequence, query head), each K / V
                // page read once for the tile's rows, blocks past the tiles padding the
                // quantised output's padded tokens; heads too wide for tiles: a block per (row,
                // query head)
                let cap = self.step.pps * KV_PAGE_POSITIONS;
                let tiled = self.sc.tiles.as_ref().map(|(t, c)| (self.at(t), *c));
                let (blocks, shared) = match tiled {
                    Some((_, count)) => {
                        (count + rows - n, crate::kernels::tile_shared_bytes(cap, d))
                    }
                    None => (rows, crate::kernels::attention_shared_bytes(cap, d)),
                };
                let cfg = LaunchConfig {
                    grid_dim: ((blocks * qh) as u32, 1, 1),
                    block_dim: (threads as u32, 1, 1),
                    shared_mem_bytes: shared as u32,
                };
                let tile_args = tiled.map(|(at, count)| [Arg::U64(at), u32a(count)]);
                let args: Vec<Arg> = place
                    .into_iter()
                    .chain([Arg::U64(out)])
                    .chain(heads)
                    .chain(tile_args.into_iter().flatten())
                    .chain([aq, asc, tok, grp, tiles_arg])
                    .collect();
                let (attention, what) = match (st.kv, tiled.is_some()) {
                    (KvDtype::F32, true) => (&k.attention_tiled, "attention_tiled"),
                    (KvDtype::Bf16, true) => (&k.attention_tiled_bf16, "attention_tiled"),
                    (KvDtype::Fp8, true) => (&k.attention_tiled_fp8, "attention_tiled"),
                    (KvDtype::F32, false) => (&k.attention, "attention"),
                    (KvDtype::Bf16, false) => (&k.attention_bf16, "attention"),
                    (KvDtype::Fp8, false) => (&k.attention_fp8, "attention"),
                };
                self.kernel(attention, cfg, &args, what)?;
            }
            if let Some(qi) = fused {
                self.held(qi);
            }
            // SAFETY: o_w is h × qw; the pass's addresses and sizes (its invariant); with the
            // quantisation fused, the scratch holds o's input (held above).
            self.row_parallel(lw.o_w, qw, fused.is_some(), lw.lora[3])
        }
    }

    /// Forked sequences: the pages of their prompts they do not share with their leaders
    /// (`step.copies`, every layer's k and v) copied, ordered after the layers on this stream.
    /// The pages lie in the cache (`PageTables` names no other).
    pub(super) fn fork_kv(&self) -> Result<(), CudaError> {
        let step = self.step;
        let pairs = step.copies.len() / 2;
        if pairs == 0 {
            return Ok(());
        }
        if self.capture == Capture::Capturing {
            return Err(CudaError::Invalid(
                "a captured pass cannot fork sequences (their pages are uploaded per pass)".into(),
            ));
        }
        let kvw = self.kv_width();
        let fk = self
            .s()
            .clone_htod(&step.copies)
            .map_err(self.ctx.drv("uploading KV page copies", 0))?;
        let blocks = 2 * self.z.layers;
        let args = [
            Arg::U64(self.cache),
            Arg::U64(self.at(&fk)),
            u32a(pairs),
            u32a(blocks),
            Arg::U64((step.pages * KV_PAGE_POSITIONS * kvw) as u64),
            u32a(kvw),
        ];
        let cfg = self.elementwise(pairs * blocks * KV_PAGE_POSITIONS * kvw);
        // SAFETY: the pass's cache and the pairs just uploaded (kept alive until the stream
        // ran: `fk` is dropped after the launch is queued, and frees are stream-ordered).
        unsafe { self.kernel(&self.st.k.copy_pages, cfg, &args, "copy_pages") }
    }
}
