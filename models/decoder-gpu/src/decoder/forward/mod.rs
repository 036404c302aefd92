//! One rank's forward pass, in stages over one [`Pass`] (its scratch buffers and the addresses
//! it reads): [`Pass::embed`], then per layer [`Pass::attention`] and [`Pass::mlp`] (or the
//! mixture-of-experts layer of [`super::moe`]), then [`Pass::fork_kv`] and [`Pass::head`]; the
//! head's logits become what the caller asked for in [`pick`].
//!
//! Every stage queues its kernels, GEMMs and collectives in order on the rank's compute stream;
//! collectives are ordered with events both ways. Activations stay f32 and enter a product as
//! two bf16 rows (`hi`, `lo`): the split buffer `xs` holds `2n` rows.

mod attention;
mod head;
mod lora;
mod mlp;
mod products;
mod scratch;
#[cfg(test)]
mod split_tests;
#[cfg(test)]
mod tiled_tests;
mod tiles;

pub(super) use head::pick;
pub(super) use lora::LORA_TILE_ROWS_DEFAULT;
pub(super) use scratch::Scratch;

use std::ops::Range;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{CudaError, RankCtx};

use super::rank::{all_reduce_in_place, Dims, RankBind, RankState};
use crate::kernels::{launch, ptr, Arg};

/// Inputs of one forward pass of one replica (the same on every rank of a group); sequence
/// indices are rows of the replica's page table.
pub(super) struct Step<'a> {
    pub(super) tokens: Vec<u32>,
    pub(super) seqs: Vec<u32>,
    pub(super) poss: Vec<u32>,
    /// Rows whose logits are wanted.
    pub(super) logit_rows: Vec<u32>,
    /// `[leader row, row, length]` per forked sequence: the pages of its first `length`
    /// positions that it does not share with its leader are copied after the layers ran.
    pub(super) forks: Vec<u32>,
    /// What to bring back.
    pub(super) pick: Pick<'a>,
    /// A decode step (one row per sequence), which a graph may replay
    /// ([`StepGraphs`](crate::decoder::graph::StepGraphs)).
    pub(super) decode: bool,
    /// The cache as `Core::forward` sets it: pages of a layer block, pages of a table row, and
    /// the forks' page copies (`[from, to]` pairs).
    pub(super) pages: usize,
    pub(super) pps: usize,
    pub(super) copies: Vec<u32>,
}

impl<'a> Step<'a> {
    /// A pass of `tokens` at `(seqs, poss)`, wanting `logit_rows`, forking `forks`.
    pub(super) fn new(
        (tokens, seqs, poss): (Vec<u32>, Vec<u32>, Vec<u32>),
        logit_rows: Vec<u32>,
        forks: Vec<u32>,
        pick: Pick<'a>,
        decode: bool,
    ) -> Self {
        Step {
            tokens,
            seqs,
            poss,
            logit_rows,
            forks,
            pick,
            decode,
            pages: 0,
            pps: 0,
            copies: Vec::new(),
        }
    }
}

/// How one row picks its token on the device: the four words `pick_rows` reads per row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowPick {
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    pub top_p: f32,
    pub uniform: f32,
}

impl RowPick {
    /// The row's settings as `lifecycle_decoder::pick` takes them.
    pub(crate) fn of(args: &lifecycle_decoder::PickArgs<'_>) -> Self {
        RowPick {
            temperature: args.params.temperature,
            top_k: args.params.top_k.unwrap_or(0),
            top_p: args.params.top_p,
            uniform: args.uniform,
        }
    }

    /// A greedy row (padding rows of a step).
    pub(crate) const GREEDY: RowPick = RowPick {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        uniform: 0.0,
    };

    /// The words of `pick_rows`'s table.
    pub(crate) fn words(rows: &[RowPick]) -> Vec<u32> {
        rows.iter()
            .flat_map(|r| {
                [
                    r.temperature.to_bits(),
                    r.top_k,
                    r.top_p.to_bits(),
                    r.uniform.to_bits(),
                ]
            })
            .collect()
    }
}

/// What a forward pass brings back to the host.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pick<'a> {
    /// Logits of the wanted rows.
    Logits,
    /// The argmax token of each wanted row (first index on ties).
    Argmax,
    /// A token and its log-probabilities per wanted row, picked as its [`RowPick`] says.
    Rows(&'a [RowPick]),
}

impl<'a> Pick<'a> {
    /// The pick for the wanted rows `want` of the whole batch (a replica's share).
    pub(super) fn rows(self, want: Range<usize>) -> Pick<'a> {
        match self {
            Pick::Rows(rows) => Pick::Rows(rows.get(want).unwrap_or(&[])),
            other => other,
        }
    }
}

/// What a reporting rank brings back from a forward pass.
pub(super) enum StepOut {
    /// One row per wanted row.
    Logits(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
    Picked(Vec<lifecycle_decoder::Picked>),
    Nothing,
}

impl StepOut {
    /// Rows brought back.
    pub(super) fn len(&self) -> usize {
        match self {
            StepOut::Logits(l) => l.len(),
            StepOut::Tokens(t) => t.len(),
            StepOut::Picked(p) => p.len(),
            StepOut::Nothing => 0,
        }
    }

    /// `self` followed by `next` (replicas in sequence order); an error when they differ in
    /// kind.
    pub(super) fn then(self, next: StepOut) -> Result<StepOut, CudaError> {
        Ok(match (self, next) {
            (a, StepOut::Nothing) => a,
            (StepOut::Nothing, b) => b,
            (StepOut::Logits(mut a), StepOut::Logits(b)) => {
                a.extend(b);
                StepOut::Logits(a)
            }
            (StepOut::Tokens(mut a), StepOut::Tokens(b)) => {
                a.extend(b);
                StepOut::Tokens(a)
            }
            (StepOut::Picked(mut a), StepOut::Picked(b)) => {
                a.extend(b);
                StepOut::Picked(a)
            }
            _ => {
                return Err(CudaError::Invalid(
                    "replicas brought back different kinds of rows".into(),
                ))
            }
        })
    }
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

/// One forward pass of one rank in progress: what every stage reads and writes. Its invariant,
/// which every stage's launches rely on: the weight addresses are the bound rollout buffer's
/// (offsets checked against its length at bind), the cache and its page table are sized for
/// `step` (checked by `reserve`, the table's pages within the cache by `PageTables`), and every scratch buffer holds what the stages index for `z`'s sizes (made by
/// [`Scratch::new`] for them).
struct Pass<'a> {
    ctx: &'a RankCtx,
    st: &'a RankState,
    bind: &'a RankBind,
    z: &'a Dims,
    step: &'a Step<'a>,
    sc: &'a mut Scratch,
    cache: u64,
    /// The page table `[rows][step.pps]` of this rank's replica.
    table: u64,
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
        let table = st
            .table
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no KV page table: call prefill first".into()))?;
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
            table: ptr(table, &ctx.compute),
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
}
