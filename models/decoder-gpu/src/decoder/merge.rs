//! The merged LoRA mode ([`LoraMode::Merged`]): a rank's decoder reads a private bf16 copy of its
//! rollout buffer in which every adapted base matrix holds `W + s·B·A`, made at every bind (the
//! copy, then one `lora_merge` kernel per adapted matrix: the sum in f32, rounded to bf16 once); its
//! products are then those of a model without adapters.

use half::bf16;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use super::rank::RankState;
use lifecycle_cuda::cudarc::driver::LaunchConfig;

use crate::kernels::{launch, ptr, Arg};
use crate::weights::{MatAt, RankOffsets};

/// How the decoder applies a rollout's LoRA adapters. Unmerged is the default, chosen by
/// measurement (H100, 7.6B shapes, r = 64 on all seven linear types, 2026-12-08): merged
/// decodes at 0.99–1.05× the adapter-free model where unmerged ran at 0.86–0.92× (batches
/// 1–8), but it holds a second bf16 copy of the base (+15.6 GB at 7.6B), merges at every bind
/// after an adapter update (25.1 ms at 4 layers: about 0.18 s at 28, against a 0.655 ms adapter
/// refresh), and cannot run over a base read in place
/// ([`GpuEngine::share_base`](crate::GpuEngine::share_base)).
/// Long rollouts on a model that fits twice may take the merged mode.
///
/// ```
/// use lifecycle_decoder_gpu::LoraMode;
/// assert_eq!(LoraMode::default(), LoraMode::Unmerged);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraMode {
    /// Beside the base products, `s·(x·Aᵀ)·Bᵀ` added to each (the default): the base is read
    /// where the switch put it, and no second copy of it is held.
    #[default]
    Unmerged,
    /// Merged into a private bf16 copy of the rollout weights whenever the decoder binds to
    /// them: the products of a model without adapters, for a second copy of the rollout weights
    /// and a merge (the copy and one product per adapted matrix) at every bind.
    Merged,
}

impl std::str::FromStr for LoraMode {
    type Err = String;

    /// `unmerged` or `merged`.
    ///
    /// ```
    /// use lifecycle_decoder_gpu::LoraMode;
    /// assert_eq!("merged".parse::<LoraMode>(), Ok(LoraMode::Merged));
    /// assert!("fused".parse::<LoraMode>().unwrap_err().contains("unmerged or merged"));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "unmerged" => Ok(LoraMode::Unmerged),
            "merged" => Ok(LoraMode::Merged),
            other => Err(format!("LoRA mode `{other}`: expected unmerged or merged")),
        }
    }
}

/// `lora_merge`'s columns a block (a thread each) and rows a block (`LORA_MERGE_ROWS`).
const MERGE_COLS: usize = 256;
const MERGE_ROWS: usize = 32;

/// One rank's `(out, inp)` of each adapted linear, in `LoraTarget::ALL`'s order (q, k, v, o,
/// gate, up, down): `h` hidden, heads of `d`, `qh` query and `kvh` kv heads and `f`
/// intermediate rows on the rank.
pub(super) fn target_shapes(
    h: usize,
    d: usize,
    (qh, kvh): (usize, usize),
    f: usize,
) -> [(usize, usize); 7] {
    let (qw, kvw) = (qh * d, kvh * d);
    [(qw, h), (kvw, h), (kvw, h), (h, qw), (f, h), (f, h), (h, f)]
}

/// The base matrix of target `i` (`LoraTarget::ALL`'s order) of a layer.
fn base_of(l: &crate::weights::LayerOffsets, i: usize) -> MatAt {
    [l.q_w, l.k_w, l.v_w, l.o_w, l.gate_w, l.up_w, l.down_w][i]
}

/// Copies `buf` (`len` elements) into the rank's private copy and merges every adapter of `w`
/// into its base matrix there, with scaling `s`; `shapes` per [`target_shapes`]. Returns the
/// copy's address and `w` without its adapters. Queued on the compute stream.
pub(super) fn merge_rank(
    ctx: &RankCtx,
    st: &mut RankState,
    (buf, len): (&CudaSlice<bf16>, usize),
    w: &RankOffsets,
    shapes: [(usize, usize); 7],
    s: f32,
) -> Result<(u64, RankOffsets), CudaError> {
    let stream = &ctx.compute;
    if st.merged.as_ref().is_none_or(|m| m.len() < len) {
        st.merged = None;
        // SAFETY: the copy below writes all `len` elements before anything reads them.
        st.merged = Some(unsafe {
            alloc_device::<u16>(stream, len, ctx.rank, "the merged LoRA rollout copy")?
        });
    }
    let merged = st
        .merged
        .as_ref()
        .map(|m| ptr(m, stream))
        .ok_or_else(|| CudaError::Invalid("the merged LoRA copy was not allocated".into()))?;
    let (from, bytes) = (ptr(buf, stream), 2 * len);
    // SAFETY: buf holds len bf16 and the copy at least len u16; in order on the compute stream.
    unsafe {
        lifecycle_cuda::cudarc::driver::result::memcpy_dtod_async(
            merged,
            from,
            bytes,
            stream.cu_stream(),
        )
    }
    .map_err(ctx.drv("copying the rollout for the merged LoRA mode", bytes as u64))?;
    let mut out = w.clone();
    for layer in &mut out.layers {
        let adapters = std::mem::take(&mut layer.lora);
        for (i, at) in adapters.into_iter().enumerate() {
            let Some(at) = at else { continue };
            let base = base_of(layer, i);
            if base.fp8.is_some() {
                return Err(CudaError::Invalid(
                    "a LoRA merge into an fp8 matrix: the merged mode takes bf16 bases".into(),
                ));
            }
            let at_copy = |off: u64| merged + 2 * off;
            let (rows, cols) = shapes[i];
            let dim = |v: usize| {
                u32::try_from(v).map_err(|_| {
                    CudaError::Invalid(format!("a LoRA merge of dimension {v} > u32::MAX"))
                })
            };
            let args = [
                Arg::U64(at_copy(base.off)),
                Arg::U64(at_copy(at.a)),
                Arg::U64(at_copy(at.b)),
                Arg::U32(dim(rows)?),
                Arg::U32(dim(cols)?),
                Arg::U32(dim(at.r)?),
                Arg::F32(s),
            ];
            let cfg = LaunchConfig {
                grid_dim: (
                    dim(cols.div_ceil(MERGE_COLS))?,
                    dim(rows.div_ceil(MERGE_ROWS))?,
                    1,
                ),
                block_dim: (MERGE_COLS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: lora_merge's parameters in order; the offsets lie inside the buffer the
            // plan checked (min_len ≤ len), so inside the copy: the base's rows × cols from its
            // first used row, A r × cols, B rows × r (the rows of this rank).
            unsafe { launch(stream, &st.k.lora_merge, cfg, &args, ctx.rank, "lora_merge")? };
        }
    }
    Ok((merged, out))
}
