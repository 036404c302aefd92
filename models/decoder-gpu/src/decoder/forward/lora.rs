//! A layer's LoRA branches: `s·(x·Aᵀ)·Bᵀ` beside each adapted base product, unmerged, on the
//! split bf16 input the base product read (`xs`: `hi` rows, then `lo` rows), in f32 as PEFT adds
//! it, a group of branches at a time (q / k / v, o, gate / up, down: the targets that read one
//! input).
//!
//! A pass of few rows ([`few_rows`], a decode step of a batch of up to 64) runs a group in two
//! kernels: `lora_a` (up to 8 rows) or `lora_a_tiles` (more, on tensor cores), the `A` products
//! of every target of the group (`t = s·x·Aᵀ`, split over chunks of the input and added in a
//! fixed order; queued before the base products, which read the same input and start beside
//! it), and `lora_b` (or, from as many rows as `lora_a_tiles`, `lora_b_tiles` on tensor cores:
//! `t` split into bf16 hi and lo rows), the `B` products added where the base products' outputs
//! are. With
//! riders on ([`GpuDecoder::set_lora_riders`](crate::GpuDecoder::set_lora_riders)) and the base
//! products on the bf16 tensor-core kernel, the `A` matrices are more products of that launch
//! instead of `lora_a` ([`Down::Riding`]), and `lora_b` scales their sums. A pass of
//! many rows (a prefill) runs each branch as two cuBLAS products and one kernel: `t2 = xs·Aᵀ`
//! (`[2n × r]`), `lora_mid` joins its halves, scales them by `s` and splits them again, and
//! `B`'s product adds its split output to the base's split output before that is joined (or,
//! where the base product wrote its joined output itself, `combine` adds it there).

use lifecycle_cuda::cudarc::driver::{CudaSlice, LaunchConfig};
use lifecycle_cuda::{alloc_device, alloc_zeros, CudaError, RankCtx};

use super::{u32a, Pass};
use crate::blas::{gemm, gemm_ld};
use crate::fp8::Fp8Weight;
use crate::kernels::Arg;
use crate::w8a8::{bf16_mma_reads, MmaProduct, MAX_PRODUCTS};
use crate::weights::{LoraAt, MatAt};

/// The most rows `lora_a` takes where tensor cores are not there (x's rows 8 at a time, read
/// again for each row of `A`), beyond which cuBLAS products do. Measured at 7.6B shapes with
/// r = 64 on all seven linear types (H100): `lora_a` with `lora_b` beat the cuBLAS products up
/// to 8 rows and lost beyond (0.81 / 0.72 / 0.54× the adapter-free decode at 16 / 32 / 64
/// rows, against the cuBLAS products' 0.81 / 0.81 / 0.82×).
const MAX_ROWS: usize = 8;

/// The rows from which `lora_a_tiles` takes a group's `A` products by default (beyond
/// [`MAX_ROWS`]; [`GpuDecoder::set_lora_tile_rows`](crate::GpuDecoder::set_lora_tile_rows)).
pub(in crate::decoder) const LORA_TILE_ROWS_DEFAULT: usize = MAX_ROWS + 1;

/// The most rows a pass runs its branches in two kernels (`lora_a` or `lora_a_tiles`, then
/// `lora_b`), beyond which cuBLAS products do: `lora_a_tiles` takes the split input's `2n` rows
/// 16 a warp, eight warps a block.
const MAX_TILE_ROWS: usize = 64;

/// The most bytes of `t` a `lora_b` block copies into its shared memory (a target's `n × r`
/// f32): the default 48 KiB a block.
const MAX_T_BYTES: usize = 48 << 10;

/// The most chunks `lora_a` splits an input into ([`chunk`]).
const MAX_CHUNKS: usize = 16;

/// Whether a pass of `n` rows with adapters of rank up to `r` runs its branches in two kernels
/// a group (`lora_a` or, on a device with bf16 tensor cores (`mma`), `lora_a_tiles`; then
/// `lora_b`), not cuBLAS products.
fn few_rows(n: usize, r: usize, mma: bool) -> bool {
    let rows = if mma { MAX_TILE_ROWS } else { MAX_ROWS };
    n <= rows && n * r * 4 <= MAX_T_BYTES
}

/// Whether `lora_a_tiles` takes a group's `A` products: at least `from` rows, on a device
/// with bf16 tensor cores, an input of whole 16-column steps, and `xs` and every `A` 4-byte
/// aligned (its loads are pairs of bf16).
fn tiles(n: usize, from: usize, inp: usize, mma: bool, addresses: &[u64]) -> bool {
    n >= from && mma && inp.is_multiple_of(16) && addresses.iter().all(|a| a % 4 == 0)
}

/// The columns of `B` a `lora_b_tiles` block takes (its `LORA_B_WARPS` warps, 8 columns each).
const B_TILE_COLUMNS: usize = 32;

/// The shared memory `lora_b_tiles` stages a target's `n × r` of `t` in, as bf16 `hi` and `lo`
/// rows: `2 · ⌈n / 16⌉ · 16` rows of `16 ⌈r / 16⌉ + 8` elements.
fn b_tile_bytes(n: usize, r: usize) -> usize {
    2 * n.div_ceil(16) * 16 * (r.div_ceil(16) * 16 + 8) * 2
}

/// Whether `lora_b_tiles` takes a group's `B` products (rank `r`, its `B`s at `addresses`): as
/// [`tiles`] says for the rows (from `from`, tensor cores), `r` even and every `B` 4-byte
/// aligned (its rows read in pairs), the staged `t` within [`MAX_T_BYTES`].
fn b_tiles(n: usize, from: usize, r: usize, mma: bool, addresses: &[u64]) -> bool {
    n >= from
        && mma
        && r.is_multiple_of(2)
        && addresses.iter().all(|a| a % 4 == 0)
        && b_tile_bytes(n, r) <= MAX_T_BYTES
}

/// The lanes of a warp `lora_b` gives a column of `B` (`w × r`): enough for a 16-byte load each
/// to cover the row (`r / 8`), a power of two, at most 32.
fn lanes_per_column(r: usize) -> usize {
    r.div_ceil(8).next_power_of_two().min(32)
}

/// The columns of an input of `inp` that one `lora_a` block sums: a multiple of 256 (a warp's
/// 8-wide loads), at most [`MAX_CHUNKS`] chunks.
fn chunk(inp: usize) -> usize {
    256 * inp.div_ceil(256 * MAX_CHUNKS).max(1)
}

/// The LoRA branches' buffers of a pass, for adapters of rank up to `r` ([`few_rows`] says
/// which).
pub(super) enum LoraScratch {
    /// A pass of many rows, each branch two cuBLAS products: the `A` product of the split input
    /// `t2 [2n × r]` and its scaled sum split again, `ts [2n × r]`, the input of the `B`
    /// product.
    Products {
        t2: CudaSlice<f32>,
        ts: CudaSlice<u16>,
    },
    /// A pass of few rows, a group of branches in two kernels (`lora_a` or `lora_a_tiles`,
    /// `lora_b`): the chunks' sums of the `A` products `[chunks × 2n × 3r]`, their scaled total
    /// `t [n × 3r]` (or, where they ride the base products' launch, each target's `x·Aᵀ` in
    /// its own `[2n × r]`: `t` holds `2n × 3r`), and `lora_a`'s counters of finished chunks
    /// (zero between launches).
    Rows {
        part: CudaSlice<f32>,
        t: CudaSlice<f32>,
        counters: CudaSlice<u32>,
    },
}

impl LoraScratch {
    /// The buffers of a pass of `n` rows for adapters of rank up to `r` (`None` for `r` = 0) on
    /// a device with bf16 tensor cores or not (`mma`).
    pub(super) fn new(
        ctx: &RankCtx,
        n: usize,
        r: usize,
        mma: bool,
    ) -> Result<Option<Self>, CudaError> {
        let (s, rank) = (&ctx.compute, ctx.rank);
        if r == 0 {
            return Ok(None);
        }
        // SAFETY: every element of part, t, t2 and ts is written by a kernel or a GEMM before
        // it is read (lora_down, lora_branch), in order on this one stream.
        unsafe {
            if few_rows(n, r, mma) {
                // a group is at most three targets (q / k / v), of at most MAX_CHUNKS chunks
                // (lora_a_tiles keeps the split rows' sums apart: 2n)
                let chunk_sums = MAX_CHUNKS * 2 * n * 3 * r;
                return Ok(Some(LoraScratch::Rows {
                    part: alloc_device::<f32>(s, chunk_sums, rank, "LoRA chunk sums")?,
                    t: alloc_device::<f32>(s, 2 * n * 3 * r, rank, "LoRA A products")?,
                    counters: alloc_zeros::<u32>(s, 3 * r.div_ceil(8), rank, "LoRA counters")?,
                }));
            }
            Ok(Some(LoraScratch::Products {
                t2: alloc_device::<f32>(s, 2 * n * r, rank, "LoRA A products")?,
                ts: alloc_device::<u16>(s, 2 * n * r, rank, "LoRA B inputs")?,
            }))
        }
    }
}

/// How a group's `A` products run ([`Pass::lora_down`]), which [`Pass::lora_up`] follows.
pub(super) enum Down {
    /// Nowhere yet: no group, or a pass of many rows, whose branches [`Pass::lora_up`] runs in
    /// cuBLAS products.
    Products,
    /// `lora_a` or `lora_a_tiles` wrote `t = s·x·Aᵀ` of every target side by side (`[n × R]`,
    /// `R` the group's targets times `r`).
    Kernel,
    /// These products ride the base products' launch ([`Down::riders`]): each target's `x·Aᵀ`
    /// (unscaled) in its own `[2n × r]` of `t`, the target's first `n` rows.
    Riding(Vec<MmaProduct>),
}

impl Down {
    /// The products that join the base products' launch (none but for [`Down::Riding`]).
    pub(super) fn riders(&self) -> &[MmaProduct] {
        match self {
            Down::Riding(p) => p,
            _ => &[],
        }
    }
}

/// Where an adapter's branch adds its output: `n` rows of `width` f32, `ld` apart, at `dest`;
/// `split`: the `hi` rows of the base product's split output (joined after), else the joined
/// output the base product wrote itself (`ld` = `width`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Branch {
    pub(super) at: LoraAt,
    pub(super) dest: u64,
    pub(super) width: usize,
    pub(super) ld: usize,
    pub(super) split: bool,
}

impl<'a> Pass<'a> {
    /// The branches of the adapters held in `slots` (a group's targets, in order), each
    /// adding where `place(i)` says for slot `i`: `(dest, width, ld, split)` as [`Branch`]'s.
    pub(super) fn branches(
        &self,
        slots: &[Option<LoraAt>],
        place: impl Fn(usize) -> (u64, usize, usize, bool),
    ) -> Vec<Branch> {
        slots
            .iter()
            .enumerate()
            .filter_map(|(i, at)| {
                let (dest, width, ld, split) = place(i);
                at.map(|at| Branch {
                    at,
                    dest,
                    width,
                    ld,
                    split,
                })
            })
            .collect()
    }

    /// The rank of `group`'s adapters, checked against the pass's scratch: `None` for an empty
    /// group.
    fn group_rank(&self, group: &[Branch]) -> Result<Option<usize>, CudaError> {
        let Some(first) = group.first() else {
            return Ok(None);
        };
        if self.sc.lora.is_none() {
            return Err(CudaError::Invalid(
                "a LoRA branch in a pass without its scratch".into(),
            ));
        }
        let most = self.bind.lora.1;
        let r = first.at.r;
        if group.len() > 3 || group.iter().any(|b| b.at.r != r) || r > most {
            return Err(CudaError::Invalid(format!(
                "a LoRA group of {} branches of ranks {:?} in a pass made for three of rank {most}",
                group.len(),
                group.iter().map(|b| b.at.r).collect::<Vec<_>>()
            )));
        }
        Ok(Some(r))
    }

    /// The first half of `group`'s branches where the pass runs them in `lora_a` / `lora_b`
    /// ([`few_rows`]): the `A` products, as riders of the launch of `base` (the group's base
    /// products: each matrix and its rows) where [`Pass::riders`] says so ([`Down::Riding`]:
    /// pass [`Down::riders`] to that launch), else `lora_a` ([`Down::Kernel`]: `t = s·x·Aᵀ`),
    /// which reads only `xs` and writes only the scratch, so it may run before the base product
    /// that reads the same input; it lets the grid after it start at once (a base product
    /// launched early requests its weights meanwhile). A pass of many rows runs its branches in
    /// [`Pass::lora_up`] alone ([`Down::Products`]). Only the branches' adapters are read here
    /// (not their destinations).
    ///
    /// # Safety
    /// Each branch's adapter is of the bound offsets, its `A` of `r × inp`; `xs` holds the
    /// pass's split input of `inp` columns.
    pub(super) unsafe fn lora_down(
        &self,
        inp: usize,
        group: &[Branch],
        base: &[(MatAt, usize)],
    ) -> Result<Down, CudaError> {
        let Some(r) = self.group_rank(group)? else {
            return Ok(Down::Products);
        };
        let Some(LoraScratch::Rows { part, t, counters }) = self.sc.lora.as_ref() else {
            return Ok(Down::Products);
        };
        if let Some(riders) = self.riders(inp, group, base, self.at(t)) {
            return Ok(Down::Riding(riders));
        }
        let scaling = self.bind.lora.0;
        let targets = group.len();
        let (n, k, xs) = (self.z.n, &self.st.k, self.at(&self.sc.xs));
        let t = self.at(t);
        // each of the three target slots' value (0 where the group has fewer targets)
        let slots = |f: &dyn Fn(&Branch) -> u64| [0, 1, 2].map(|i| group.get(i).map_or(0, f));
        let cols = chunk(inp);
        let [a0, a1, a2] = slots(&|b| self.wp(b.at.a));
        let on_tiles = tiles(
            n,
            self.st.lora_tile_rows,
            inp,
            k.tensor_cores,
            &[xs, a0, a1, a2],
        );
        let args = [
            Arg::U64(xs),
            u32a(n),
            u32a(inp),
            Arg::U64(a0),
            Arg::U64(a1),
            Arg::U64(a2),
            u32a(r),
            u32a(cols),
            Arg::F32(scaling),
            Arg::U64(self.at(part)),
            Arg::U64(t),
            Arg::U64(self.at(counters)),
        ];
        // lora_a: a warp per row of A (8 a block); lora_a_tiles: a block per 16 rows of A; a
        // block per chunk of the input
        let (func, rows, what) = if on_tiles {
            (&k.lora_a_tiles, 16, "lora_a_tiles")
        } else {
            (&k.lora_a, 8, "lora_a")
        };
        let cfg = LaunchConfig {
            grid_dim: (
                r.div_ceil(rows) as u32,
                targets as u32,
                inp.div_ceil(cols) as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: per the caller (A's, xs); part holds MAX_CHUNKS × 2n × 3r f32 (inp.div_ceil(
        // cols) ≤ MAX_CHUNKS, targets ≤ 3, r ≤ the scratch's rank), t n × 3r, counters
        // 3 · ⌈r / 8⌉ u32; lora_a_tiles only for n ≤ 64 (few_rows made this scratch), inp a
        // multiple of 16 and 4-byte aligned xs and A's (tiles).
        unsafe { self.kernel(func, cfg, &args, what)? };
        Ok(Down::Kernel)
    }

    /// `group`'s `A` products as riders of the launch of its base products `base` (each matrix
    /// and its rows, over the pass's split input of `inp` columns), each writing its target's
    /// `[2n × r]` block of `t` (the scratch's: `2n × 3r` f32): where riders are on, the bf16
    /// tensor-core kernel takes that launch ([`RankState::bf16_takes`](crate::decoder::rank::RankState::bf16_takes)),
    /// it has room for them ([`MAX_PRODUCTS`]) and reads every `A` ([`bf16_mma_reads`]).
    fn riders(
        &self,
        inp: usize,
        group: &[Branch],
        base: &[(MatAt, usize)],
        t: u64,
    ) -> Option<Vec<MmaProduct>> {
        let rows = 2 * self.z.n;
        if !self.st.lora_riders || base.is_empty() || base.len() + group.len() > MAX_PRODUCTS {
            return None;
        }
        self.st
            .bf16_takes(self.bind.base, base.iter().copied(), rows, inp)?;
        group
            .iter()
            .enumerate()
            .map(|(g, b)| {
                let w = Fp8Weight {
                    data: self.wp(b.at.a),
                    scales: 0,
                    row0: 0,
                    cols: inp as u64,
                };
                bf16_mma_reads(&w, inp).then_some(MmaProduct {
                    w,
                    out: b.at.r,
                    y: t + 4 * (g * rows * b.at.r) as u64,
                    bias: 0,
                    res: 0,
                })
            })
            .collect()
    }

    /// `group`'s branches added where their base products' outputs are: after their `A`
    /// products ran as `down` says ([`Pass::lora_down`]; riders in the base products' launch,
    /// which ran), `lora_b`, the `B` products; otherwise every branch in full, as cuBLAS
    /// products ([`Pass::lora_branch`]).
    ///
    /// # Safety
    /// Each branch's adapter is of the bound offsets, its `A` of `r × inp` and `B` of
    /// `width × r`; `xs` holds the pass's split input of `inp` columns (the one `lora_down`
    /// read, where it ran); each `dest` holds `(n − 1) · ld + width` f32 (a split one `2n`
    /// rows), and, where one is not split, `y2` is free.
    pub(super) unsafe fn lora_up(
        &self,
        inp: usize,
        group: &[Branch],
        down: &Down,
    ) -> Result<(), CudaError> {
        let Some(r) = self.group_rank(group)? else {
            return Ok(());
        };
        let (n, targets) = (self.z.n, group.len());
        // where each target's n × r of t lies (a row, a target apart) and its scale
        let rows = match (self.sc.lora.as_ref(), down) {
            (Some(LoraScratch::Rows { t, .. }), Down::Kernel) => Some((t, targets * r, r, 1.0)),
            (Some(LoraScratch::Rows { t, .. }), Down::Riding(_)) => {
                Some((t, r, 2 * n * r, self.bind.lora.0))
            }
            _ => None,
        };
        let Some((t, t_row, t_target, scale)) = rows else {
            for b in group {
                // SAFETY: per the caller.
                unsafe {
                    if b.split {
                        self.lora_branch(b.at, inp, (b.dest, b.width, b.ld), 1.0)?;
                    } else {
                        self.lora_after(b.at, inp, b.dest, b.width)?;
                    }
                }
            }
            return Ok(());
        };
        let k = &self.st.k;
        let t = self.at(t);
        let slots = |f: &dyn Fn(&Branch) -> u64| [0, 1, 2].map(|i| group.get(i).map_or(0, f));
        let [b0, b1, b2] = slots(&|b| self.wp(b.at.b));
        let [d0, d1, d2] = slots(&|b| b.dest);
        let [w0, w1, w2] = slots(&|b| b.width as u64);
        let [l0, l1, l2] = slots(&|b| b.ld as u64);
        let args = [
            Arg::U64(t),
            u32a(n),
            u32a(r),
            Arg::U64(b0),
            Arg::U64(b1),
            Arg::U64(b2),
            Arg::U64(d0),
            Arg::U64(d1),
            Arg::U64(d2),
            Arg::U32(w0 as u32),
            Arg::U32(w1 as u32),
            Arg::U32(w2 as u32),
            Arg::U32(l0 as u32),
            Arg::U32(l1 as u32),
            Arg::U32(l2 as u32),
        ];
        let widest = group.iter().map(|b| b.width).max().unwrap_or(0);
        let p = lanes_per_column(r);
        let on_tiles = b_tiles(n, self.st.lora_tile_rows, r, k.tensor_cores, &[b0, b1, b2]);
        let (func, cfg, what) = if on_tiles {
            // 8 columns a warp, 4 warps a block, a target per grid row; the target's t split
            // into bf16 rows in shared memory
            let cfg = LaunchConfig {
                grid_dim: (
                    widest.div_ceil(B_TILE_COLUMNS).max(1) as u32,
                    targets as u32,
                    1,
                ),
                block_dim: (128, 1, 1),
                shared_mem_bytes: b_tile_bytes(n, r) as u32,
            };
            (&k.lora_b_tiles, cfg, "lora_b_tiles")
        } else {
            // p lanes a column (32 / p columns a warp), 4 warps a block, a target per grid row,
            // the target's n × r of t in shared memory
            let cfg = LaunchConfig {
                grid_dim: (widest.div_ceil(4 * 32 / p).max(1) as u32, targets as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: (n * r * 4) as u32,
            };
            (&k.lora_b, cfg, "lora_b")
        };
        let tail = [u32a(p), Arg::F32(scale), u32a(t_row), u32a(t_target)];
        let args = [args.as_slice(), &tail].concat();
        // SAFETY: per the caller (B's, dests); t holds 2n × targets·r f32, each target's n × r
        // written where t_row and t_target say (by lora_down's kernel or the riders), n · r f32
        // within MAX_T_BYTES (few_rows made this scratch); p a power of two ≤ 32; lora_b_tiles
        // only for n ≤ 64 (few_rows), r even and 4-byte aligned B's, its shared memory within
        // MAX_T_BYTES (b_tiles).
        unsafe { self.kernel(func, cfg, &args, what) }
    }

    /// The branch of adapter `at` over `xs` (`[2n × inp]`) into the split output rows at `y`
    /// (`[2n × out]` f32, rows `ldc` apart): added to what they hold with `beta` 1 (the base
    /// product's split output, before it is joined), written with `beta` 0.
    ///
    /// # Safety
    /// `at` is an adapter of the bound offsets whose `A` is `r × inp` and `B` `out × r`; `xs`
    /// holds the pass's split input of `inp` columns; `y` holds `(2n − 1) · ldc + out` f32.
    unsafe fn lora_branch(
        &self,
        at: LoraAt,
        inp: usize,
        (y, out, ldc): (u64, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        let (n, rank, st) = (self.z.n, self.ctx.rank, self.st);
        let Some(LoraScratch::Products { t2, ts }) = self.sc.lora.as_ref() else {
            return Err(CudaError::Invalid(
                "a LoRA branch's products in a pass without their scratch".into(),
            ));
        };
        let (scaling, most) = self.bind.lora;
        if at.r > most {
            return Err(CudaError::Invalid(format!(
                "a LoRA branch of rank {} in a pass made for rank {most}",
                at.r
            )));
        }
        let (xs, t2, ts) = (self.at(&self.sc.xs), self.at(t2), self.at(ts));
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
    unsafe fn lora_after(
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

#[cfg(test)]
mod tests {
    use super::{b_tile_bytes, b_tiles, chunk, few_rows, lanes_per_column, tiles, MAX_CHUNKS};

    #[test]
    fn chunks_are_whole_warp_loads_and_at_most_the_scratchs() {
        for inp in [
            1,
            64,
            255,
            256,
            640,
            3584,
            4096,
            4097,
            18944,
            29568,
            1 << 20,
        ] {
            let c = chunk(inp);
            assert_eq!(c % 256, 0, "{inp}");
            assert!(inp.div_ceil(c) <= MAX_CHUNKS, "{inp}: {c}");
        }
        assert!(few_rows(1, 64, false) && few_rows(8, 64, false) && !few_rows(9, 64, false));
        assert!(few_rows(64, 64, true) && !few_rows(65, 64, true) && !few_rows(64, 256, true));
        let from = super::LORA_TILE_ROWS_DEFAULT;
        assert!(tiles(9, from, 3584, true, &[0, 4]) && !tiles(8, from, 3584, true, &[0]));
        assert!(tiles(3, 3, 3584, true, &[0]) && !tiles(16, 17, 3584, true, &[0]));
        assert!(!tiles(16, from, 3592, true, &[0]) && !tiles(16, from, 3584, true, &[2]));
        assert!(!tiles(16, from, 3584, false, &[0]));
        // lora_b_tiles: rows from `from`, r even, B's 4-byte aligned, t staged within 48 KiB
        assert!(b_tiles(64, from, 64, true, &[0, 4, 8]) && !b_tiles(8, from, 64, true, &[0]));
        assert!(!b_tiles(16, from, 63, true, &[0]) && !b_tiles(16, from, 64, true, &[2]));
        assert!(!b_tiles(16, from, 64, false, &[0]) && !b_tiles(64, from, 192, true, &[0]));
        assert_eq!(b_tile_bytes(64, 64), 2 * 64 * 72 * 2);
        assert_eq!(b_tile_bytes(9, 8), 2 * 16 * 24 * 2);
        for (r, p) in [
            (1, 1),
            (8, 1),
            (9, 2),
            (16, 2),
            (24, 4),
            (64, 8),
            (256, 32),
            (1024, 32),
        ] {
            assert_eq!(lanes_per_column(r), p, "{r}");
        }
    }
}
