//! Verification mode of the FSDP backend ([`with_verification`]), computed on the
//! devices with [`lifecycle_cuda::VerifyKernels`]:
//!
//! - `plan` scans the master weights for NaN or infinite values and refuses them, naming the
//!   tensor, rank and element ([`FsdpError::NonFinite`]).
//! - Every buffer about to be offloaded (master, Adam m, v, as the memory policy says) is hashed
//!   per chunk of each tensor's shard on the copy stream, before its device→host copy; after the
//!   reload the new device buffer is hashed again and compared. A mismatch leaves that buffer
//!   offloaded and is reported with the rank, tensor and buffer ([`FsdpError::Corrupted`]).
//! - The rollout weights are hashed per tensor after every transfer and checked before they are
//!   released ([`FsdpError::RolloutCorrupted`]).
//!
//! [`with_verification`]: lifecycle_layout::settings::Configure::with_verification
//! [`FsdpError::NonFinite`]: crate::FsdpError::NonFinite
//! [`FsdpError::Corrupted`]: crate::FsdpError::Corrupted
//! [`FsdpError::RolloutCorrupted`]: crate::FsdpError::RolloutCorrupted

use lifecycle_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use lifecycle_cuda::{
    ChunkTable, CudaError, PendingHashes, RankCtx, WordSize, DEFAULT_CHUNK_WORDS,
};

use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_layout::RolloutEntry;

/// One of the training buffers that can be offloaded (the name every executor uses).
pub(crate) use lifecycle_state::TrainBuffer as Buffer;

/// Hashes of one rank's offloaded buffers: queued at offload, downloaded when the offload
/// finished, checked after the reload.
#[derive(Debug, Default)]
pub(crate) struct OffloadSums {
    pending: [Option<PendingHashes>; 3],
    sums: [Option<Vec<u64>>; 3],
}

impl OffloadSums {
    /// Forgets every hash (the buffers are on the device again, or a switch failed).
    pub(crate) fn clear(&mut self) {
        *self = OffloadSums::default();
    }

    /// Whether `buffer` has hashes to check at reload.
    pub(crate) fn has(&self, buffer: Buffer) -> bool {
        self.sums[buffer.index()].is_some()
    }
}

/// Chunks of every tensor's shard (padded rows included) in a rank's flat fp32 buffers; the
/// same on every rank.
pub(crate) fn shard_table(shards: &ShardLayout) -> ChunkTable {
    ChunkTable::new(
        shards
            .slots
            .iter()
            .map(|s| (s.offset, (s.padded_rows * s.cols) as u64)),
        DEFAULT_CHUNK_WORDS,
    )
}

/// Chunks of every rollout tensor in a rank's flat bf16 rollout buffer.
pub(crate) fn rollout_table(entries: &[RolloutEntry]) -> ChunkTable {
    ChunkTable::new(
        entries
            .iter()
            .map(|e| (e.offset() as u64, e.slots() as u64)),
        DEFAULT_CHUNK_WORDS,
    )
}

fn addr<T>(ctx: &RankCtx, s: &CudaSlice<T>) -> u64 {
    let (p, _sync) = s.device_ptr(&ctx.copy);
    p
}

/// Queues the hash of `buf` (about to be offloaded) on the copy stream, ahead of its copy.
pub(crate) fn queue_offload_hash(
    ctx: &RankCtx,
    sums: &mut OffloadSums,
    buffer: Buffer,
    buf: &CudaSlice<f32>,
    table: &ChunkTable,
) -> Result<(), CudaError> {
    check_len(table, buf.len(), ctx.rank, buffer.name())?;
    let k = ctx.verify_kernels()?;
    // SAFETY: the table lies inside `buf` (checked above); `buf` is only read until the copy
    // stream ran this kernel and the offload copy queued after it (the offload phase waits for
    // the stream before freeing it).
    let pending = unsafe { k.hash(&ctx.copy, addr(ctx, buf), WordSize::B32, table, ctx.rank)? };
    sums.pending[buffer.index()] = Some(pending);
    sums.sums[buffer.index()] = None;
    Ok(())
}

/// Downloads the hashes queued at offload (the copy stream is idle by then).
pub(crate) fn settle_offload_hashes(sums: &mut OffloadSums) -> Result<(), CudaError> {
    for (pending, sum) in sums.pending.iter_mut().zip(sums.sums.iter_mut()) {
        if let Some(p) = pending.take() {
            *sum = Some(p.download()?);
        }
    }
    Ok(())
}

/// A chunk whose hash differs: the tensor (index into the shard or rollout table's segments)
/// and both hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mismatch {
    pub(crate) tensor: usize,
    pub(crate) expected: u64,
    pub(crate) found: u64,
}

/// The first chunk whose hash differs between `expected` and `found`.
pub(crate) fn first_mismatch(
    table: &ChunkTable,
    expected: &[u64],
    found: &[u64],
) -> Option<Mismatch> {
    if expected.len() != found.len() {
        return Some(Mismatch {
            tensor: 0,
            expected: expected.len() as u64,
            found: found.len() as u64,
        });
    }
    expected
        .iter()
        .zip(found)
        .position(|(a, b)| a != b)
        .map(|i| Mismatch {
            tensor: table.owner(i),
            expected: expected[i],
            found: found[i],
        })
}

/// Hashes the reloaded `buf` (on the copy stream, after its host→device copy) and compares it
/// with the hashes taken at offload. The hashes are consumed when they match and kept when they
/// do not (the buffer then stays offloaded, and a retry fails the same way).
pub(crate) fn check_reloaded(
    ctx: &RankCtx,
    sums: &mut OffloadSums,
    buffer: Buffer,
    buf: &CudaSlice<f32>,
    table: &ChunkTable,
) -> Result<Option<Mismatch>, CudaError> {
    let Some(expected) = sums.sums[buffer.index()].as_ref() else {
        return Ok(None);
    };
    check_len(table, buf.len(), ctx.rank, buffer.name())?;
    let k = ctx.verify_kernels()?;
    // SAFETY: the table lies inside `buf`; `buf` is alive until the download below waited for
    // the copy stream; nothing writes it meanwhile.
    let found =
        unsafe { k.hash(&ctx.copy, addr(ctx, buf), WordSize::B32, table, ctx.rank)? }.download()?;
    let mismatch = first_mismatch(table, expected, &found);
    if mismatch.is_none() {
        sums.sums[buffer.index()] = None;
    }
    Ok(mismatch)
}

/// Hashes a rank's rollout buffer on the compute stream and downloads the hashes.
pub(crate) fn rollout_hashes(
    ctx: &RankCtx,
    buf: &CudaSlice<half::bf16>,
    table: &ChunkTable,
) -> Result<Vec<u64>, CudaError> {
    check_len(table, buf.len(), ctx.rank, "rollout weights")?;
    let k = ctx.verify_kernels()?;
    let (p, _sync) = buf.device_ptr(&ctx.compute);
    // SAFETY: the table lies inside `buf`; the buffer outlives the download below, which waits
    // for the compute stream; the transfer that wrote it finished before.
    unsafe { k.hash(&ctx.compute, p, WordSize::B16, table, ctx.rank)? }.download()
}

/// The smallest element index of `master` (a rank's flat fp32 master buffer) holding a NaN or
/// an infinity, with its value.
pub(crate) fn first_nonfinite(
    ctx: &RankCtx,
    master: &CudaSlice<f32>,
    table: &ChunkTable,
) -> Result<Option<(u64, f32)>, CudaError> {
    check_len(table, master.len(), ctx.rank, "master")?;
    let k = ctx.verify_kernels()?;
    let (p, _sync) = master.device_ptr(&ctx.compute);
    // SAFETY: the table lies inside `master`, alive and unwritten during the call (which waits
    // for the compute stream before returning).
    let Some(i) = (unsafe { k.first_nonfinite_f32(&ctx.compute, p, table, ctx.rank)? }) else {
        return Ok(None);
    };
    let at = i as usize;
    let value = ctx
        .compute
        .clone_dtoh(&master.slice(at..at + 1))
        .map_err(ctx.drv("reading a non-finite master weight", 4))?;
    Ok(Some((i, value.first().copied().unwrap_or(f32::NAN))))
}

fn check_len(table: &ChunkTable, len: usize, rank: usize, what: &str) -> Result<(), CudaError> {
    if table.end() > len as u64 {
        return Err(CudaError::Invalid(format!(
            "verification on rank {rank}: the {what} buffer holds {len} elements but its layout \
             covers {}",
            table.end()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_layout::FsdpLayout;

    #[test]
    fn shard_tables_cover_every_padded_shard_and_name_its_tensor() {
        let layout = FsdpLayout::new(
            2,
            [
                ("a".to_string(), vec![5, 3]),
                ("b".to_string(), vec![1]),
                ("c".to_string(), vec![4000, 600]),
            ],
        )
        .unwrap();
        let shards = ShardLayout::new(&layout);
        let t = shard_table(&shards);
        // a: 3 padded rows × 3; b: 1; c: 2000 × 600 = 1.2 M elements → 2 chunks of ≤ 1 Mi
        assert_eq!(t.len(), 1 + 1 + 2);
        assert_eq!(t.chunk(0), (shards.slots[0].offset, 9));
        assert_eq!(t.owner(3), 2);
        assert!(t.end() <= shards.rank_len);
        assert_eq!(t.segment_of(shards.slots[2].offset + 1_100_000), Some(2));
        let e = [1u64, 2, 3, 4];
        assert_eq!(first_mismatch(&t, &e, &e), None);
        let f = [1u64, 2, 3, 5];
        assert_eq!(
            first_mismatch(&t, &e, &f),
            Some(Mismatch {
                tensor: 2,
                expected: 4,
                found: 5
            })
        );
        assert_eq!(Buffer::from_name("adam_v"), Some(Buffer::AdamV));
        assert_eq!(Buffer::from_name("grad"), None);
    }

    #[test]
    fn rollout_tables_follow_the_entries() {
        let entries = vec![
            RolloutEntry::new("x", vec![2, 2], 0),
            RolloutEntry::new("y", vec![3], 64),
        ];
        let t = rollout_table(&entries);
        assert_eq!((t.len(), t.end()), (2, 67));
        assert_eq!(t.segment_of(65), Some(1));
    }
}
