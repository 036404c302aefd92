//! Pinned host memory for offloaded training state, kept between switches.
//!
//! Pinning host memory is slow, so it is done once: a [`PinnedPool`] keeps page-locked chunks
//! per rank, an offloaded buffer borrows as many chunks as its bytes need ([`HostCopy`]) and
//! gives them back when it is reloaded. Any buffer can use any chunk large enough for its piece,
//! so states of different layouts (and backends sharing the pool: FSDP and Megatron alike) reuse
//! the same memory.
//!
//! A chunk is memory the process faults in itself, from several threads at once, then registers
//! with the driver (`cuMemHostRegister`): on one H200 machine 16 threads pinned 17.2 GB this way
//! in 1.46 s (11.7 GB/s), where the driver's own page-locked allocation (`cuMemHostAlloc`) took
//! 6.1–9.0 s from 1 to 16 threads (1.9–2.8 GB/s), and copies into either run at the same
//! 55 GB/s (`pin_probe`, BENCHMARKS.md).

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::{CudaError, RankCtx};
use cudarc::driver::{CudaContext, CudaStream};

/// Alignment of a chunk (the huge-page size, so the kernel may back it with huge pages).
const CHUNK_ALIGN: usize = 2 << 20;
/// The page size a chunk is faulted in by.
const PAGE: usize = 4096;

/// Page-locked host memory of one chunk: allocated and faulted in by the process, registered
/// with the driver; unregistered and freed on drop.
struct PinnedChunk {
    ptr: NonNull<u8>,
    layout: Layout,
    ctx: Arc<CudaContext>,
}

// SAFETY: the chunk owns its allocation exclusively (no aliasing pointer exists outside it), and
// the driver's registration is valid from any thread of the process.
unsafe impl Send for PinnedChunk {}
// SAFETY: shared access only reads (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedChunk {}

impl PinnedChunk {
    /// `len` bytes of pinned host memory: allocated, faulted in (a write per page), registered.
    fn new(ctx: &Arc<CudaContext>, len: usize, rank: usize, what: &str) -> Result<Self, CudaError> {
        let failed = |detail: String| CudaError::PinnedAlloc {
            rank,
            bytes: len as u64,
            what: what.to_string(),
            detail,
        };
        let layout =
            Layout::from_size_align(len.max(1), CHUNK_ALIGN).map_err(|e| failed(e.to_string()))?;
        // SAFETY: a non-zero size; freed in Drop with the same layout.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) })
            .ok_or_else(|| failed("the host allocation failed (out of memory)".into()))?;
        let base = ptr.as_ptr();
        for off in (0..layout.size()).step_by(PAGE) {
            // SAFETY: inside the allocation; faulting the page in before the driver pins it.
            unsafe { std::ptr::write_volatile(base.add(off), 0) };
        }
        let free = |ptr: NonNull<u8>| {
            // SAFETY: allocated above with `layout`, not registered.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
        };
        if let Err(e) = ctx.bind_to_thread() {
            free(ptr);
            return Err(failed(format!("binding the context: {e:?}")));
        }
        // SAFETY: a live allocation of `layout.size()` bytes; unregistered in Drop before it is
        // freed; flags 0 (cacheable, not portable-mapped).
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(base.cast(), layout.size(), 0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            free(ptr);
            return Err(failed(format!("cuMemHostRegister: {r:?}")));
        }
        Ok(PinnedChunk {
            ptr,
            layout,
            ctx: ctx.clone(),
        })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation holds `len` initialised bytes (faulted in as zeros), owned here.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }
}

impl Drop for PinnedChunk {
    fn drop(&mut self) {
        // A failure to bind or unregister leaves the pages locked until the process exits;
        // the memory is still freed only after the driver let go of it.
        let unregistered = self.ctx.bind_to_thread().is_ok()
            // SAFETY: registered in `new`; no copy uses it any more (the pool's contract).
            && unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) }
                == cudarc::driver::sys::CUresult::CUDA_SUCCESS;
        if unregistered {
            // SAFETY: allocated in `new` with this layout, no longer registered.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

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
    free: Mutex<HashMap<usize, Vec<PinnedChunk>>>,
    /// Background reservations in progress, by rank ([`PinnedPool::reserve_in_background`]).
    pending: Mutex<HashMap<usize, usize>>,
    /// Signalled whenever a background reservation of a rank ends.
    settled: Condvar,
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
        PinnedPool::new(DEFAULT_CHUNK_BYTES, PinnedPool::default_threads())
    }
}

/// An offloaded buffer's bytes in pinned chunks: piece `i` holds bytes `[i·C, min((i+1)·C, n))`
/// of the buffer (`C` the pool's chunk size) in a chunk of at least that length.
pub struct HostCopy {
    pieces: Vec<(PinnedChunk, usize)>,
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
            pending: Mutex::new(HashMap::new()),
            settled: Condvar::new(),
        }
    }

    /// Threads a pool pins with by default: one per CPU, at most 16 (faulting pages in scales
    /// with threads: 2.0 GB/s from one, 11.7 GB/s from 16 on one H200 machine).
    pub fn default_threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
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
    ///
    /// A background reservation of the rank in progress ([`PinnedPool::reserve_in_background`])
    /// is waited for first, so that its chunks are used rather than pinned twice.
    pub fn take(&self, ctx: &RankCtx, bytes: usize, what: &str) -> Result<HostCopy, CudaError> {
        self.wait_settled(ctx.rank);
        let sizes = self.pieces(bytes);
        let mut got: Vec<Option<PinnedChunk>> = (0..sizes.len()).map(|_| None).collect();
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
            let results = alloc_parallel(&ctx.ctx, ctx.rank, &missing, self.threads, what);
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

    /// Pins, into `rank`'s cache, the chunks that offloads of buffers of `buffers` bytes (one
    /// entry per buffer) take, less those the cache already holds; `ctx` is the rank's device
    /// context. Returns the bytes pinned. On failure the chunks pinned so far stay cached (they
    /// are valid) and the error says what could not be pinned.
    pub fn reserve(
        &self,
        ctx: &Arc<CudaContext>,
        rank: usize,
        buffers: &[usize],
        what: &str,
    ) -> Result<u64, CudaError> {
        let missing = self.missing(rank, buffers);
        if missing.is_empty() {
            return Ok(0);
        }
        let jobs: Vec<(usize, usize)> = missing.into_iter().enumerate().collect();
        let results = alloc_parallel(ctx, rank, &jobs, self.threads, what);
        let mut failure = None;
        let mut pinned = 0u64;
        let mut got = Vec::with_capacity(results.len());
        for (_, r) in results {
            match r {
                Ok(c) => {
                    pinned += c.len() as u64;
                    got.push(c);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if failure.is_none() && got.len() < jobs.len() {
            failure = Some(CudaError::Worker {
                rank,
                detail: format!("a thread pinning host memory for {what} failed"),
            });
        }
        self.give_chunks(rank, got.into_iter());
        match failure {
            Some(e) => Err(e),
            None => Ok(pinned),
        }
    }

    /// Starts [`PinnedPool::reserve`] for every rank of `ranks` on a thread of its own (the ranks
    /// one after the other, each with the pool's threads), so that pinning, which the operating
    /// system's page faults bound, runs off the critical path: from setup, overlapping whatever
    /// the program does before its first offload. A [`PinnedPool::take`] of a rank waits for the
    /// rank's reservation to end, then uses its chunks. The handle says when it ended and what
    /// it pinned; dropping it lets the reservation run on.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use lifecycle_cuda::PinnedPool;
    /// // nothing to pin: the reservation ends at once, having pinned nothing
    /// let pool = Arc::new(PinnedPool::default());
    /// let r = pool.reserve_in_background(Vec::new(), "the offload");
    /// assert_eq!(r.wait()?.bytes, 0);
    /// # Ok::<(), lifecycle_cuda::CudaError>(())
    /// ```
    pub fn reserve_in_background(
        self: &Arc<Self>,
        ranks: Vec<RankReservation>,
        what: &str,
    ) -> PinnedReservation {
        {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            for r in &ranks {
                *pending.entry(r.rank).or_default() += 1;
            }
        }
        let pool = Arc::clone(self);
        let what = what.to_string();
        let start = Instant::now();
        let marked: Vec<usize> = ranks.iter().map(|r| r.rank).collect();
        let spawned = std::thread::Builder::new()
            .name("pinned-reservation".into())
            .spawn(move || {
                // Every rank's pending mark ends however the thread ends (a panic included):
                // each guard is dropped once its rank is done, the rest on unwinding.
                let mut guards: Vec<Settle<'_>> = ranks
                    .iter()
                    .map(|r| Settle {
                        pool: &pool,
                        rank: r.rank,
                    })
                    .collect();
                let mut bytes = 0u64;
                let mut failure = None;
                for r in &ranks {
                    if failure.is_none() {
                        match pool.reserve(&r.ctx, r.rank, &r.buffers, &what) {
                            Ok(n) => bytes += n,
                            Err(e) => failure = Some(e),
                        }
                    }
                    drop(guards.remove(0));
                }
                match failure {
                    Some(e) => Err(e),
                    None => Ok(Reserved {
                        bytes,
                        seconds: start.elapsed().as_secs_f64(),
                    }),
                }
            });
        match spawned {
            Ok(handle) => PinnedReservation {
                handle: Some(handle),
                failed: None,
            },
            Err(e) => {
                for rank in marked {
                    drop(Settle { pool: self, rank });
                }
                PinnedReservation {
                    handle: None,
                    failed: Some(format!("starting the thread that pins host memory: {e}")),
                }
            }
        }
    }

    /// Capacities of the chunks offloads of `buffers` take that `rank`'s cache cannot give
    /// (matched as [`PinnedPool::take`] matches: the smallest cached chunk that fits).
    fn missing(&self, rank: usize, buffers: &[usize]) -> Vec<usize> {
        let mut caps: Vec<usize> = buffers
            .iter()
            .flat_map(|&b| self.pieces(b))
            .map(|n| round_chunk(n, self.chunk_bytes))
            .collect();
        caps.sort_unstable_by(|a, b| b.cmp(a));
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let mut lens: Vec<usize> = free
            .get(&rank)
            .map_or_else(Vec::new, |v| v.iter().map(PinnedChunk::len).collect());
        caps.into_iter()
            .filter(|&cap| {
                let best = lens
                    .iter()
                    .enumerate()
                    .filter(|&(_, &l)| l >= cap)
                    .min_by_key(|&(_, &l)| l)
                    .map(|(j, _)| j);
                match best {
                    Some(j) => {
                        lens.swap_remove(j);
                        false
                    }
                    None => true,
                }
            })
            .collect()
    }

    /// Blocks while a background reservation of `rank` runs.
    fn wait_settled(&self, rank: usize) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        while pending.get(&rank).copied().unwrap_or(0) > 0 {
            pending = self
                .settled
                .wait(pending)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Returns the chunks of `copy` to `rank`'s cache. The caller must have synchronised every
    /// stream that copied to or from them.
    pub fn give(&self, rank: usize, copy: HostCopy) {
        self.give_chunks(rank, copy.pieces.into_iter().map(|(c, _)| c));
    }

    fn give_chunks(&self, rank: usize, chunks: impl Iterator<Item = PinnedChunk>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.entry(rank).or_default().extend(chunks);
    }
}

/// One rank's part of a [`PinnedPool::reserve_in_background`]: its device context, its rank,
/// and the bytes of each buffer its offloads will move.
#[derive(Clone)]
pub struct RankReservation {
    /// The rank's device context (the chunks are registered with it).
    pub ctx: Arc<CudaContext>,
    /// The rank (the pool's cache key).
    pub rank: usize,
    /// Bytes of each buffer an offload of the rank moves.
    pub buffers: Vec<usize>,
}

impl std::fmt::Debug for RankReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankReservation")
            .field("rank", &self.rank)
            .field("buffers", &self.buffers)
            .finish_non_exhaustive()
    }
}

/// What a background reservation pinned, and how long it took from its start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reserved {
    /// Bytes pinned (chunks the cache already held are not counted).
    pub bytes: u64,
    /// Seconds from the start of the reservation to its end.
    pub seconds: f64,
}

/// A background reservation of pinned memory ([`PinnedPool::reserve_in_background`]).
#[derive(Debug)]
pub struct PinnedReservation {
    handle: Option<JoinHandle<Result<Reserved, CudaError>>>,
    /// Why the reservation could not start (its thread was not created).
    failed: Option<String>,
}

impl PinnedReservation {
    /// Whether the reservation has ended.
    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the reservation to end: what it pinned, or the first error.
    pub fn wait(mut self) -> Result<Reserved, CudaError> {
        if let Some(why) = self.failed.take() {
            return Err(CudaError::Invalid(why));
        }
        match self.handle.take() {
            None => Ok(Reserved {
                bytes: 0,
                seconds: 0.0,
            }),
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(CudaError::Invalid(
                    "the thread reserving pinned memory panicked".into(),
                ))
            }),
        }
    }
}

/// Ends a rank's pending mark of a background reservation when dropped.
struct Settle<'a> {
    pool: &'a PinnedPool,
    rank: usize,
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        let mut pending = self.pool.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = pending.get_mut(&self.rank) {
            *n = n.saturating_sub(1);
        }
        drop(pending);
        self.pool.settled.notify_all();
    }
}

/// The capacity allocated for a piece: full chunks exactly, tails rounded up to 1 MiB.
fn round_chunk(n: usize, chunk: usize) -> usize {
    n.div_ceil(1 << 20)
        .saturating_mul(1 << 20)
        .min(chunk)
        .max(n)
}

type Allocated = Vec<(usize, Result<PinnedChunk, CudaError>)>;

/// Allocates `jobs` (piece index, capacity) with up to `threads` threads (each faults its chunks
/// in and registers them; the kernel's page faults run in parallel).
fn alloc_parallel(
    ctx: &Arc<CudaContext>,
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
                        .map(|&(i, cap)| (i, PinnedChunk::new(ctx, cap, rank, what)))
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
            let host = chunk.as_mut_slice();
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
            let host = chunk.as_slice();
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
    pub fn byte_mut(&mut self, index: usize, _rank: usize) -> Result<Option<&mut u8>, CudaError> {
        let mut start = 0;
        for (chunk, n) in &mut self.pieces {
            if index < start + *n {
                return Ok(chunk.as_mut_slice().get_mut(index - start));
            }
            start += *n;
        }
        Ok(None)
    }

    /// The buffer's bytes, read on the host. The stream that wrote them must be synchronised.
    pub fn read(&self, _rank: usize, _what: &str) -> Result<Vec<u8>, CudaError> {
        let mut out = Vec::with_capacity(self.bytes);
        for (chunk, n) in &self.pieces {
            out.extend_from_slice(&chunk.as_slice()[..*n]);
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
    fn a_reservation_pins_the_chunks_the_offloads_take() {
        let pool = PinnedPool::new(4 << 20, 2);
        // an empty cache: every piece's chunk, tails rounded up to 1 MiB, largest first
        assert_eq!(
            pool.missing(0, &[(9 << 20) + 5, 1 << 20]),
            vec![4 << 20, 4 << 20, 2 << 20, 1 << 20]
        );
        assert!(pool.missing(3, &[]).is_empty());
        // no reservation pending: nothing to wait for
        pool.wait_settled(0);
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
