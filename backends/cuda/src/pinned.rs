//! Pinned host memory for offloaded training state, kept between switches.
//!
//! Pinning host memory is slow (the driver maps and locks every page; tens of GB take tens of
//! seconds), so it is done once: a [`PinnedPool`] keeps page-locked chunks per rank, an offloaded
//! buffer borrows as many chunks as its bytes need ([`HostCopy`]) and gives them back when it is
//! reloaded. Any buffer can use any chunk large enough for its piece, so states of different
//! layouts (and backends sharing the pool: FSDP and Megatron alike) reuse the same memory.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::{alloc_pinned, CudaError, RankCtx};
use cudarc::driver::{CudaStream, PinnedHostSlice};

/// Default chunk size: 1 GiB.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 30;

/// Page-locked host chunks per rank, reused by every offload (see the module docs).
///
/// ```
/// use lifecycle_cuda::PinnedPool;
/// let pool = PinnedPool::new(64 << 20, 4);
/// assert_eq!(pool.cached_bytes(0), 0);
/// assert_eq!(pool.pieces(200 << 20), vec![64 << 20, 64 << 20, 64 << 20, 8 << 20]);
/// ```
pub struct PinnedPool {
    chunk_bytes: usize,
    threads: usize,
    free: Mutex<HashMap<usize, Vec<PinnedHostSlice<u8>>>>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("chunk_bytes", &self.chunk_bytes)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Default for PinnedPool {
    fn default() -> Self {
        // One thread per rank: concurrent pinning calls of one process contend (on a 2×H200
        // machine, 4 threads per rank pinned 1.75 GB/s in all, one thread per rank about 2.6).
        PinnedPool::new(DEFAULT_CHUNK_BYTES, 1)
    }
}

/// An offloaded buffer's bytes in pinned chunks: piece `i` holds bytes `[i·C, min((i+1)·C, n))`
/// of the buffer (`C` the pool's chunk size) in a chunk of at least that length.
pub struct HostCopy {
    pieces: Vec<(PinnedHostSlice<u8>, usize)>,
    bytes: usize,
}

impl PinnedPool {
    /// A pool cutting buffers into chunks of `chunk_bytes` (at least 1 MiB), allocating missing
    /// chunks with up to `threads` threads per rank.
    pub fn new(chunk_bytes: usize, threads: usize) -> Self {
        PinnedPool {
            chunk_bytes: chunk_bytes.max(1 << 20),
            threads: threads.max(1),
            free: Mutex::new(HashMap::new()),
        }
    }

    /// The chunk size.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The piece lengths a buffer of `bytes` bytes is cut into.
    pub fn pieces(&self, bytes: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(bytes.div_ceil(self.chunk_bytes));
        let mut left = bytes;
        while left > 0 {
            let n = left.min(self.chunk_bytes);
            out.push(n);
            left -= n;
        }
        out
    }

    /// Bytes of pinned chunks cached for `rank` (not lent to an offloaded buffer).
    pub fn cached_bytes(&self, rank: usize) -> u64 {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.get(&rank)
            .map_or(0, |v| v.iter().map(|c| c.len() as u64).sum())
    }

    /// Frees every cached chunk (chunks lent to offloaded buffers stay with them).
    pub fn clear(&self) {
        let drained: Vec<_> = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.drain().collect()
        };
        drop(drained);
    }

    /// Chunks for a buffer of `bytes` bytes on `ctx`'s rank: cached chunks first (the smallest
    /// that fits each piece), the rest allocated with up to `threads` threads. On failure every
    /// chunk taken goes back to the pool.
    pub fn take(&self, ctx: &RankCtx, bytes: usize, what: &str) -> Result<HostCopy, CudaError> {
        let sizes = self.pieces(bytes);
        let mut got: Vec<Option<PinnedHostSlice<u8>>> = (0..sizes.len()).map(|_| None).collect();
        {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            let cached = free.entry(ctx.rank).or_default();
            // Largest pieces first, so small tails do not take full chunks needed by full pieces.
            for (i, &n) in sizes.iter().enumerate() {
                let best = cached
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.len() >= n)
                    .min_by_key(|(_, c)| c.len())
                    .map(|(j, _)| j);
                if let Some(j) = best {
                    got[i] = Some(cached.swap_remove(j));
                }
            }
        }
        let missing: Vec<(usize, usize)> = got
            .iter()
            .enumerate()
            .filter(|(_, g)| g.is_none())
            .map(|(i, _)| (i, round_chunk(sizes[i], self.chunk_bytes)))
            .collect();
        let mut failure = None;
        if !missing.is_empty() {
            let results = alloc_parallel(&ctx.copy, ctx.rank, &missing, self.threads, what);
            for (i, r) in results {
                match r {
                    Ok(c) => got[i] = Some(c),
                    Err(e) => {
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        if failure.is_none() && got.iter().any(Option::is_none) {
            failure = Some(CudaError::Worker {
                rank: ctx.rank,
                detail: format!("a thread allocating pinned memory for {what} failed"),
            });
        }
        if let Some(e) = failure {
            self.give_chunks(ctx.rank, got.into_iter().flatten());
            return Err(e);
        }
        let pieces = got.into_iter().flatten().zip(sizes).collect();
        Ok(HostCopy { pieces, bytes })
    }

    /// Returns the chunks of `copy` to `rank`'s cache. The caller must have synchronised every
    /// stream that copied to or from them.
    pub fn give(&self, rank: usize, copy: HostCopy) {
        self.give_chunks(rank, copy.pieces.into_iter().map(|(c, _)| c));
    }

    fn give_chunks(&self, rank: usize, chunks: impl Iterator<Item = PinnedHostSlice<u8>>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.entry(rank).or_default().extend(chunks);
    }
}

/// The capacity allocated for a piece: full chunks exactly, tails rounded up to 1 MiB.
fn round_chunk(n: usize, chunk: usize) -> usize {
    n.div_ceil(1 << 20)
        .saturating_mul(1 << 20)
        .min(chunk)
        .max(n)
}

type Allocated = Vec<(usize, Result<PinnedHostSlice<u8>, CudaError>)>;

/// Allocates `jobs` (piece index, capacity) with up to `threads` threads (the driver's pinning
/// work runs in parallel where it can).
fn alloc_parallel(
    stream: &std::sync::Arc<CudaStream>,
    rank: usize,
    jobs: &[(usize, usize)],
    threads: usize,
    what: &str,
) -> Allocated {
    let threads = threads.clamp(1, jobs.len().max(1));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    jobs.iter()
                        .skip(t)
                        .step_by(threads)
                        .map(|&(i, cap)| {
                            // SAFETY: uninitialised pinned memory; a chunk's bytes are read only
                            // after a device→host copy wrote them (HostCopy keeps the lengths).
                            (i, unsafe { alloc_pinned::<u8>(stream, cap, rank, what) })
                        })
                        .collect::<Allocated>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

impl HostCopy {
    /// Bytes of the buffer.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues device→host copies of the whole buffer from device address `src` on `stream`.
    ///
    /// # Safety
    /// `src` must point to at least [`HostCopy::bytes`] readable bytes of the stream's device,
    /// alive and unwritten until the stream has run the copies; the chunks must not be read or
    /// given back before that.
    pub unsafe fn download_from(
        &mut self,
        src: u64,
        stream: &CudaStream,
        rank: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        let mut off = 0u64;
        for (chunk, n) in &mut self.pieces {
            let host = chunk
                .as_mut_slice()
                .map_err(|e| CudaError::driver(rank, what, *n as u64, e))?;
            // SAFETY: the host range is inside the chunk (len >= n), which lives in this copy
            // until the caller synchronises the stream; the device range is the caller's promise.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[..*n],
                    src + off,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| CudaError::driver(rank, what, *n as u64, e))?;
            off += *n as u64;
        }
        Ok(())
    }

    /// Queues host→device copies of the whole buffer to device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must point to at least [`HostCopy::bytes`] writable bytes of the stream's device,
    /// not used by other work until the stream has run the copies; the chunks must hold the
    /// buffer (a finished [`HostCopy::download_from`]) and stay alive until then.
    pub unsafe fn upload_to(
        &self,
        dst: u64,
        stream: &CudaStream,
        rank: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        let mut off = 0u64;
        for (chunk, n) in &self.pieces {
            let host = chunk
                .as_slice()
                .map_err(|e| CudaError::driver(rank, what, *n as u64, e))?;
            // SAFETY: as for `download_from`, in the other direction.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst + off,
                    &host[..*n],
                    stream.cu_stream(),
                )
            }
            .map_err(|e| CudaError::driver(rank, what, *n as u64, e))?;
            off += *n as u64;
        }
        Ok(())
    }

    /// Byte `index` of the buffer, to change on the host (fault injection in tests); `None` past
    /// the end. The stream that wrote the chunks must be synchronised.
    pub fn byte_mut(&mut self, index: usize, rank: usize) -> Result<Option<&mut u8>, CudaError> {
        let mut start = 0;
        for (chunk, n) in &mut self.pieces {
            if index < start + *n {
                let host = chunk
                    .as_mut_slice()
                    .map_err(|e| CudaError::driver(rank, "reading an offloaded buffer", 0, e))?;
                return Ok(host.get_mut(index - start));
            }
            start += *n;
        }
        Ok(None)
    }

    /// The buffer's bytes, read on the host. The stream that wrote them must be synchronised.
    pub fn read(&self, rank: usize, what: &str) -> Result<Vec<u8>, CudaError> {
        let mut out = Vec::with_capacity(self.bytes);
        for (chunk, n) in &self.pieces {
            let host = chunk
                .as_slice()
                .map_err(|e| CudaError::driver(rank, what, *n as u64, e))?;
            out.extend_from_slice(&host[..*n]);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_buffer() {
        let pool = PinnedPool::new(4 << 20, 2);
        for bytes in [0usize, 1, 4 << 20, (4 << 20) + 1, 37 << 20] {
            let p = pool.pieces(bytes);
            assert_eq!(p.iter().sum::<usize>(), bytes);
            assert!(p.iter().all(|&n| n > 0 && n <= 4 << 20));
        }
        assert_eq!(PinnedPool::new(10, 1).chunk_bytes(), 1 << 20);
    }

    #[test]
    fn tails_round_to_a_mebibyte_within_the_chunk() {
        let c = 256 << 20;
        assert_eq!(round_chunk(c, c), c);
        assert_eq!(round_chunk(1, c), 1 << 20);
        assert_eq!(round_chunk((3 << 20) + 5, c), 4 << 20);
        assert_eq!(round_chunk(c - 5, c), c);
    }
}
