//! The FSDP backend's verification as the switch driver's [`SwitchHooks`]: hashes of what leaves
//! the device, checked when it returns ([`crate::verify`] computes them).

use lifecycle_core::MemoryPolicy;
use lifecycle_cuda::driver::{Corruption, SwitchHooks};
use lifecycle_cuda::{ChunkTable, CudaError, RankCtx};

use crate::state::{RankTrain, MOVABLE};
use crate::verify::{self, Buffer};

/// The FSDP backend's hooks: verification (hashes of what leaves the device, checked when it
/// returns).
pub struct FsdpHooks<'a> {
    /// Verification mode: the chunks of every tensor's shard.
    pub(crate) verify: Option<ChunkTable>,
    /// The state's shard layout: its slots name the tensors of corruption reports (borrowed,
    /// not copied: an MoE layout has thousands of names, and a switch builds its hooks each
    /// time).
    pub(crate) shards: &'a lifecycle_layout::fsdp::ShardLayout,
}

impl SwitchHooks<RankTrain> for FsdpHooks<'_> {
    fn before_offload(
        &self,
        ctx: &RankCtx,
        rt: &mut RankTrain,
        memory: MemoryPolicy,
    ) -> Result<(), CudaError> {
        let Some(table) = &self.verify else {
            return Ok(());
        };
        rt.sums.clear();
        for b in Buffer::ALL {
            let offloads = match b {
                Buffer::Master => memory.offload_params,
                Buffer::AdamM | Buffer::AdamV => memory.offload_optimizer,
            };
            if !offloads {
                continue;
            }
            let (buf, sums) = rt.buffer_and_sums(b);
            if let Some(d) = buf.device() {
                verify::queue_offload_hash(ctx, sums, b, d, table)?;
            }
        }
        Ok(())
    }

    fn offload_settled(&self, _ctx: &RankCtx, rt: &mut RankTrain) -> Result<(), CudaError> {
        verify::settle_offload_hashes(&mut rt.sums)
    }

    fn check_reloaded(
        &self,
        ctx: &RankCtx,
        rt: &mut RankTrain,
        reloaded: &[bool],
    ) -> Result<Vec<(usize, Corruption)>, CudaError> {
        let Some(table) = &self.verify else {
            return Ok(Vec::new());
        };
        let mut found = Vec::new();
        // In the order errors have always been reported: master, Adam m, Adam v.
        for b in Buffer::ALL {
            let Some(i) = MOVABLE.iter().position(|&x| x == b) else {
                continue;
            };
            if !(reloaded.get(i).copied().unwrap_or(false) && rt.sums.has(b)) {
                continue;
            }
            let (buf, sums) = rt.buffer_and_sums(b);
            let Some(d) = buf.device() else {
                continue;
            };
            if let Some(m) = verify::check_reloaded(ctx, sums, b, d, table)? {
                let tensor = self
                    .shards
                    .slots
                    .get(m.tensor)
                    .map(|s| s.name.clone())
                    .unwrap_or_default();
                let c = Corruption {
                    buffer: b.name(),
                    tensor,
                    expected: m.expected,
                    found: m.found,
                };
                found.push((i, c));
            }
        }
        Ok(found)
    }
}
