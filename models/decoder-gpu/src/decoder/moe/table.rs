//! The device routing's kernel and limits, and the expert table of every layer.
//!
//! The expert table (per MoE layer and expert: held, and the addresses of gate, up and down)
//! is uploaded once per bind ([`DeviceExperts::bind`]).

use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream};
use lifecycle_cuda::{CudaError, KernelSet, RankCtx};

use crate::fp8::Fp8Kernels;
use crate::kernels::ptr;
use crate::weights::RankOffsets;

/// The most rows a pass may have for its mixture-of-experts layers to be routed on the device
/// ([`GpuDecoder::set_device_routing`](crate::GpuDecoder::set_device_routing)).
///
/// ```
/// assert_eq!(lifecycle_decoder_gpu::MOE_DEVICE_ROWS, 256);
/// ```
pub const DEVICE_ROWS: usize = 256;

/// The most experts per layer and picks per row the routing kernel holds.
pub(super) const MAX_EXPERTS: usize = 1024;

pub(super) const MAX_TOP_K: usize = 16;

/// Words per expert in the expert table: held, then (matrix, scales, first row) for gate, up
/// and down.
pub(super) const EXPERT_WORDS: usize = 10;

/// CUDA C source of the device routing kernels (no headers).
pub const MOE_KERNEL_SRC: &str = include_str!("../../../../../kernels/decoder_moe.cu");

/// [`MOE_KERNEL_SRC`] as a kernel set.
pub const MOE_KERNELS: KernelSet =
    KernelSet::new("lifecycle_decoder_gpu MoE kernels", MOE_KERNEL_SRC);

/// One rank's device routing: its kernel and the expert table of every layer.
pub(crate) struct DeviceExperts {
    pub(super) route: CudaFunction,
    /// The weight-streaming table kernels and the joins (the fp8 kernel set, loaded for bf16
    /// experts too).
    pub(super) kernels: Fp8Kernels,
    /// `[layer][expert][EXPERT_WORDS]` (zeros for dense layers).
    pub(super) experts_table: CudaSlice<u64>,
    pub(super) experts: usize,
}

impl DeviceExperts {
    /// The device address of the expert table.
    pub(crate) fn table_at(&self, s: &Arc<CudaStream>) -> u64 {
        ptr(&self.experts_table, s)
    }

    /// The expert table of `w`'s MoE layers at the bound buffer's address `base`, uploaded on
    /// the compute stream, and the kernels; `None` for a dense model, or one whose layers the
    /// kernel cannot route (more than 1024 experts, or layers of different expert counts).
    pub(crate) fn bind(
        ctx: &RankCtx,
        w: &RankOffsets,
        base: u64,
    ) -> Result<Option<Self>, CudaError> {
        let Some(first) = w.moe.iter().flatten().next() else {
            return Ok(None);
        };
        let experts = first.experts.len();
        let uniform = w.moe.iter().flatten().all(|m| m.experts.len() == experts);
        if experts == 0 || experts > MAX_EXPERTS || !uniform {
            return Ok(None);
        }
        let mut words = vec![0u64; w.moe.len() * experts * EXPERT_WORDS];
        for (l, m) in w.moe.iter().enumerate() {
            let Some(m) = m else { continue };
            for (e, x) in m.experts.iter().enumerate() {
                let Some(x) = x else { continue };
                let at = (l * experts + e) * EXPERT_WORDS;
                words[at] = 1;
                for (j, mat) in [x.gate, x.up, x.down].into_iter().enumerate() {
                    words[at + 1 + 3 * j] = base + 2 * mat.off;
                    if let Some(q) = mat.fp8 {
                        words[at + 2 + 3 * j] = base + 2 * q.scales;
                        words[at + 3 + 3 * j] = q.row0;
                    }
                }
            }
        }
        let route = ctx.module(&MOE_KERNELS)?.function("moe_route")?;
        let kernels = Fp8Kernels::load(ctx)?;
        let experts_table = ctx
            .compute
            .clone_htod(&words)
            .map_err(ctx.drv("uploading the MoE expert table", 8 * words.len() as u64))?;
        Ok(Some(DeviceExperts {
            route,
            kernels,
            experts_table,
            experts,
        }))
    }
}
