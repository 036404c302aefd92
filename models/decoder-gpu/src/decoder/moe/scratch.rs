//! The device buffers of one pass's mixture-of-experts layers ([`MoeScratch`]), the device
//! routing's among them ([`RouteScratch`]).

use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream};
use lifecycle_cuda::{alloc_device, CudaError};

use super::table::{DEVICE_ROWS, MAX_EXPERTS, MAX_TOP_K};
use crate::w8a8::W8a8Scratch;
use crate::weights::{MoeOffsets, RankOffsets};

/// The most bytes of down products (`[2 · rows × hidden]` f32) the grouped path's scratch may
/// take beyond what one expert's rows need: 64 MiB.
const GROUPED_SCRATCH_BYTES: usize = 64 << 20;

/// Device scratch of the mixture-of-experts layers of one pass (`None` for dense models), for
/// `rows` routed rows at once: at least every row reaching one expert (`n`), up to every routed
/// row (`n · top-k`) within [`GROUPED_SCRATCH_BYTES`].
pub(crate) struct MoeScratch {
    /// Routed rows the buffers below hold.
    pub(super) rows: usize,
    /// Router products `[2n × experts]` and router logits `[n × experts]`.
    pub(super) router2: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    /// The routed rows, split `[2 · rows × h]`.
    pub(super) xg: CudaSlice<u16>,
    /// Gate and up products `[2 · rows × ffn]`, the SwiGLU output split `[2 · rows × ffn]`.
    pub(super) g2: CudaSlice<f32>,
    pub(super) u2: CudaSlice<f32>,
    pub(super) act: CudaSlice<u16>,
    /// Down products `[2 · rows × h]`.
    pub(super) y2: CudaSlice<f32>,
    /// The weighted sum of the experts' outputs `[n × h]`.
    pub(super) acc: CudaSlice<f32>,
    /// f32 activations of the weight-streaming expert products `[rows × max(h, ffn)]` (fp8
    /// experts, or a pass routed on the device).
    pub(super) x32: Option<CudaSlice<f32>>,
    /// The device routing's buffers, for a pass it routes ([`RouteScratch::new`]).
    pub(super) route: Option<RouteScratch>,
    /// The quantised activations of W8A8 expert products beyond the weight-streaming kernel's
    /// tokens (`[rows × max(h, ffn)]`).
    pub(super) w8a8: Option<W8a8Scratch>,
}

impl MoeScratch {
    pub(crate) fn new(
        s: &Arc<CudaStream>,
        rank: usize,
        (n, h, top_k): (usize, usize, usize),
        w: &RankOffsets,
        (w8a8, device): (bool, bool),
    ) -> Result<Option<Self>, CudaError> {
        let layers: Vec<&MoeOffsets> = w.moe.iter().flatten().collect();
        let Some(first) = layers.first() else {
            return Ok(None);
        };
        let experts = first.experts.len();
        let ffn = layers
            .iter()
            .flat_map(|m| {
                m.experts
                    .iter()
                    .flatten()
                    .chain(m.shared.iter().map(|s| &s.expert))
            })
            .map(|e| e.ffn)
            .max()
            .unwrap_or(1)
            .max(1);
        let rows = (n * top_k.max(1))
            .min(GROUPED_SCRATCH_BYTES / (8 * h.max(1)))
            .max(n);
        let fp8 = layers
            .iter()
            .flat_map(|m| m.experts.iter().flatten())
            .any(|e| e.gate.fp8.is_some());
        let route = if device {
            // W8A8 fp8 experts (the tensor cores') are routed in chunks where the pass is longer
            RouteScratch::new(s, rank, (n, top_k, experts, rows), fp8 && w8a8)?
        } else {
            None
        };
        // SAFETY: each buffer is written (GEMM, kernel or memset) before it is read, in order on
        // this stream, in `moe_layer`.
        unsafe {
            Ok(Some(MoeScratch {
                rows,
                router2: alloc_device(s, 2 * n * experts, rank, "router products")?,
                logits: alloc_device(s, n * experts, rank, "router logits")?,
                xg: alloc_device(s, 2 * rows * h, rank, "routed rows")?,
                g2: alloc_device(s, 2 * rows * ffn, rank, "expert gate products")?,
                u2: alloc_device(s, 2 * rows * ffn, rank, "expert up products")?,
                act: alloc_device(s, 2 * rows * ffn, rank, "expert activations")?,
                y2: alloc_device(s, 2 * rows * h, rank, "expert down products")?,
                acc: alloc_device(s, n * h, rank, "expert sums")?,
                x32: if fp8 || route.is_some() {
                    Some(alloc_device(
                        s,
                        rows * h.max(ffn),
                        rank,
                        "fp8 expert activations",
                    )?)
                } else {
                    None
                },
                w8a8: if fp8 && w8a8 {
                    Some(W8a8Scratch::alloc(s, rows, h.max(ffn), rank)?)
                } else {
                    None
                },
                route,
            }))
        }
    }

    /// The weighted sum of the experts' outputs of the last layer, `[n × h]` f32.
    pub(crate) fn acc(&self) -> &CudaSlice<f32> {
        &self.acc
    }
}

/// The per-pass buffers of the device routing: each token's slots, the slots' tokens, the
/// product table; sized for the `rows` rows of one routing (the pass's, or a chunk's), their
/// `cap = rows · k` slots and the most pieces.
pub(super) struct RouteScratch {
    /// The most rows one routing takes: the pass's rows, or (a pass routed in chunks) a chunk's.
    pub(super) rows: usize,
    pub(super) problems: usize,
    /// Each pick's expert, weight and slot (`3 · cap` words).
    pub(super) picks: CudaSlice<u32>,
    pub(super) slot_tok: CudaSlice<u32>,
    pub(super) csr: CudaSlice<u32>,
    pub(super) pos: CudaSlice<u32>,
    pub(super) wt: CudaSlice<f32>,
    pub(super) table: CudaSlice<u64>,
}

impl RouteScratch {
    /// The buffers for a pass of `n` rows routed `top_k` ways over `experts`, when the device
    /// routes it: whole where `n ≤ DEVICE_ROWS` and `n · top_k ≤ rows` (the scratch's routed
    /// rows), else, with `chunks`, in chunks of `min(DEVICE_ROWS, rows / top_k)` rows; `top_k ≤
    /// 16` and `experts ≤ 1024`. `None` otherwise.
    pub(super) fn new(
        s: &Arc<CudaStream>,
        rank: usize,
        (n, top_k, experts, rows): (usize, usize, usize, usize),
        chunks: bool,
    ) -> Result<Option<Self>, CudaError> {
        if n == 0 || top_k == 0 || top_k > MAX_TOP_K || experts > MAX_EXPERTS {
            return Ok(None);
        }
        let per = if n <= DEVICE_ROWS && n * top_k <= rows {
            n
        } else if chunks {
            DEVICE_ROWS.min(rows / top_k)
        } else {
            0
        };
        if per == 0 {
            return Ok(None);
        }
        let cap = per * top_k;
        let problems = experts.min(cap) + cap / 8;
        // SAFETY: moe_route writes every entry the later kernels read (the slots' tokens up to
        // `cap`, the token lists, every table entry up to `problems`) before they run, in order
        // on this stream.
        unsafe {
            Ok(Some(RouteScratch {
                rows: per,
                problems,
                picks: alloc_device(s, 3 * cap, rank, "routing picks")?,
                slot_tok: alloc_device(s, cap, rank, "routed slots' tokens")?,
                csr: alloc_device(s, per + 1, rank, "token lists")?,
                pos: alloc_device(s, cap, rank, "token lists' slots")?,
                wt: alloc_device(s, cap, rank, "token lists' weights")?,
                table: alloc_device(s, 3 * problems * 8, rank, "expert product table")?,
            }))
        }
    }
}
