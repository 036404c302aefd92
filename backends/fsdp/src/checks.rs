//! The backend's verification duties (see [`crate::verify`] for the device hashes): non-finite
//! masters refused at plan time, offload and rollout hashes recorded and checked, and a bit-flip
//! hook that shows the checks fire.

use half::bf16;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::driver::RankBuffers;
use lifecycle_cuda::{ChunkTable, RankExecutor, RolloutBuffer, SourceBuf, DEFAULT_CHUNK_WORDS};
use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_layout::RolloutEntry;

use crate::backend::{FsdpBackend, RolloutSums};
use crate::verify;
use crate::FsdpError;

impl<S: crate::buffers::FsdpBuffers> FsdpBackend<S> {
    /// Flips bit `bit` of element `index` of rollout tensor `tensor` on local rank `rank` (the
    /// global rank in the single-process mode), in device memory: fault injection for testing
    /// verification mode. Returns whether a bit was flipped (false when `rank` or `index` is out
    /// of range); an unknown tensor is an error.
    pub fn inject_rollout_bit_flip(
        &self,
        rollout: &mut RolloutBuffer,
        rank: usize,
        tensor: &str,
        index: usize,
        bit: u32,
    ) -> Result<bool, FsdpError> {
        if rank >= rollout.local_ranks().len() {
            return Ok(false);
        }
        let entry = rollout
            .rank_entry(rank, tensor)
            .ok_or_else(|| FsdpError::Tensor {
                name: tensor.to_string(),
                problem: format!("no such tensor in the rollout weights of local rank {rank}"),
            })?;
        if index >= entry.numel() {
            return Ok(false);
        }
        let at = entry.offset() + index;
        let mut items: Vec<(usize, &mut CudaSlice<bf16>)> =
            rollout.buffers_mut().iter_mut().enumerate().collect();
        self.pool.run_each(&mut items, &|ctx, (i, buf)| {
            if *i != rank {
                return Ok(());
            }
            let mut one = buf.slice_mut(at..at + 1);
            let old = ctx
                .compute
                .clone_dtoh(&one)
                .map_err(ctx.drv("reading a rollout weight", 2))?;
            let flipped: Vec<bf16> = old
                .iter()
                .map(|x| bf16::from_bits(x.to_bits() ^ (1 << (bit % 16))))
                .collect();
            ctx.compute
                .memcpy_htod(&flipped, &mut one)
                .map_err(ctx.drv("writing a rollout weight", 2))?;
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))
        })?;
        Ok(true)
    }

    /// Every master weight that `ranks` (of flat layout `shards`) hold on the devices must be
    /// finite: scanned where each rank's shards are (the flat layout's offsets, or a lent
    /// rank's own: [`RankBuffers::source_offsets`]), the first NaN or infinity named by tensor,
    /// rank and element.
    pub(crate) fn check_finite_ranks<B: RankBuffers + Sync>(
        &self,
        ranks: &[B],
        shards: &ShardLayout,
    ) -> Result<(), FsdpError> {
        let locals = self.pool.local_ranks().to_vec();
        // per local rank: each tensor's (first element, elements held) where its shard is
        let segments: Vec<Vec<(u64, u64)>> = ranks
            .iter()
            .zip(&locals)
            .map(|(r, &rank)| {
                let at = r.source_offsets();
                let seg = |(i, slot): (usize, &lifecycle_layout::fsdp::ShardSlot)| {
                    let n = (shards.held_rows(i, rank).len() * slot.cols) as u64;
                    (at.and_then(|a| a.get(i).copied()).unwrap_or(slot.offset), n)
                };
                shards.slots.iter().enumerate().map(seg).collect()
            })
            .collect();
        let tables: Vec<ChunkTable> = segments
            .iter()
            .map(|s| ChunkTable::new(s.iter().copied(), DEFAULT_CHUNK_WORDS))
            .collect();
        let mut items: Vec<(&B, &ChunkTable)> = ranks.iter().zip(&tables).collect();
        let found = self
            .pool
            .run_each(&mut items, &|ctx, (rt, table)| match rt.source() {
                Ok(SourceBuf::F32(m)) => verify::first_nonfinite(ctx, m, table),
                _ => Ok(None),
            })?;
        for (local, f) in found.into_iter().enumerate() {
            let Some((at, value)) = f else { continue };
            let (i, start) = tables[local]
                .segment_of(at)
                .map(|i| (i, segments[local][i].0))
                .ok_or_else(|| {
                    FsdpError::Config(format!(
                        "a non-finite value at element {at} lies outside every tensor"
                    ))
                })?;
            return Err(FsdpError::NonFinite {
                tensor: shards.slots[i].name.clone(),
                rank: locals[local],
                index: at - start,
                value,
            });
        }
        Ok(())
    }

    /// `e`, or, when a cast or quantisation of the transfer read a NaN or an infinity
    /// ([`CudaError::NonFinite`](lifecycle_cuda::CudaError::NonFinite)), the tensor, rank and
    /// element that hold it ([`FsdpError::NonFinite`], from a scan of `ranks` run only then).
    pub(crate) fn name_nonfinite<B: RankBuffers + Sync>(
        &self,
        e: FsdpError,
        ranks: &[B],
        shards: &ShardLayout,
    ) -> FsdpError {
        if !matches!(
            e,
            FsdpError::Cuda(lifecycle_cuda::CudaError::NonFinite { .. })
        ) {
            return e;
        }
        match self.check_finite_ranks(ranks, shards) {
            Err(named @ FsdpError::NonFinite { .. }) => named,
            _ => e,
        }
    }

    /// Verification mode: hashes the rollout weights just written.
    pub(crate) fn record_rollout_sums(
        &mut self,
        rolls: &[CudaSlice<bf16>],
        entries: &[Vec<RolloutEntry>],
    ) -> Result<(), FsdpError> {
        let tables: Vec<_> = entries.iter().map(|e| verify::rollout_table(e)).collect();
        let mut items: Vec<(&CudaSlice<bf16>, &lifecycle_cuda::ChunkTable)> =
            rolls.iter().zip(&tables).collect();
        let sums = self.pool.run_each(&mut items, &|ctx, (buf, table)| {
            verify::rollout_hashes(ctx, buf, table)
        })?;
        self.rollout_sums = Some(RolloutSums {
            tables,
            names: entries
                .iter()
                .map(|e| e.iter().map(|e| e.name().to_string()).collect())
                .collect(),
            sums,
        });
        Ok(())
    }

    /// Verification mode: checks the rollout weights about to be released against the hashes
    /// taken after their transfer (and forgets those).
    pub(crate) fn check_rollout_sums(&mut self, rollout: &RolloutBuffer) -> Result<(), FsdpError> {
        let Some(rs) = self.rollout_sums.take() else {
            return Ok(());
        };
        if !self.options.verify || rs.sums.len() != rollout.local_ranks().len() {
            return Ok(());
        }
        let mut items: Vec<(&CudaSlice<bf16>, &lifecycle_cuda::ChunkTable)> =
            rollout.buffers().iter().zip(&rs.tables).collect();
        let found = self.pool.run_each(&mut items, &|ctx, (buf, table)| {
            verify::rollout_hashes(ctx, buf, table)
        })?;
        for (i, (expected, found)) in rs.sums.iter().zip(&found).enumerate() {
            if let Some(m) = verify::first_mismatch(&rs.tables[i], expected, found) {
                return Err(FsdpError::RolloutCorrupted {
                    rank: self.pool.local_ranks()[i],
                    tensor: rs.names[i].get(m.tensor).cloned().unwrap_or_default(),
                });
            }
        }
        Ok(())
    }
}
