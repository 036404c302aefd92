//! What a pass downloads (tokens, logits, router logits) goes through one page-locked buffer per
//! rank, mapped into the device's address space: copied by a copy engine, or, while an offload
//! overlaps the rollout, written by the SMs (a kernel). The copy engines serve device-to-host
//! copies first come, first served across streams (measured on an H200 by `overlap_probe`: a
//! 4 KiB download queued behind an 8 GiB offload waits for all of it, however the offload is
//! cut), so a download by copy would stall the rollout behind the offload; the SMs' writes are
//! not queued there (14–23 µs for 128 B while the offload fills the link).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lifecycle_cuda::cudarc::driver::{sys, CudaStream, PinnedHostSlice};
use lifecycle_cuda::{CudaError, RankCtx};

use crate::kernels::{launch, Arg, DecoderKernels};

/// Page-locked host memory mapped into the device's address space, grown on demand.
pub(crate) struct MappedHost {
    host: PinnedHostSlice<u32>,
    /// The device's address of `host`.
    dev: u64,
}

/// A rank's mapped download buffer, kept between passes (allocating page-locked memory is slow,
/// and freeing it synchronises the device), how many downloads waited for the device and for
/// how long.
#[derive(Default)]
pub(crate) struct Downloads {
    buffer: Mutex<Option<MappedHost>>,
    waits: AtomicUsize,
    /// Nanoseconds the host spent in those waits.
    waited_ns: AtomicU64,
}

impl std::fmt::Debug for Downloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Downloads")
    }
}

impl MappedHost {
    fn new(ctx: &RankCtx, words: usize) -> Result<Self, CudaError> {
        // SAFETY: written by the device before the host reads it (download_words).
        let host = unsafe {
            ctx.ctx
                .alloc_pinned_with_flags::<u32>(words.max(1), sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(|e| CudaError::PinnedAlloc {
            rank: ctx.rank,
            bytes: 4 * words as u64,
            what: "the mapped download buffer".into(),
            detail: format!("{:?}", e.0),
        })?;
        let mut dev = 0;
        // SAFETY: `host` was allocated with CU_MEMHOSTALLOC_DEVICEMAP in this context (bound to
        // this thread by the allocation); `dev` is a valid out-pointer.
        unsafe {
            let ptr = host
                .as_ptr()
                .map_err(ctx.drv("reading the mapped buffer", 0))?;
            sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut _, 0)
        }
        .result()
        .map_err(ctx.drv("mapping the download buffer", 4 * words as u64))?;
        Ok(MappedHost { host, dev })
    }
}

impl Downloads {
    /// Downloads so far: each waited for the work queued before it on its stream (the host
    /// synchronisations of the passes).
    pub(crate) fn waits(&self) -> usize {
        self.waits.load(Ordering::Relaxed)
    }

    /// The time the host spent in those waits (from the wait's start to the device's last
    /// queued work done).
    pub(crate) fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }

    /// Copies `words` 32-bit words at device address `src` (valid for that many reads on
    /// `stream`) to the host, after the work queued on `stream`, by a copy engine or, with
    /// `through_sms` (an offload's copies run beside the pass), by a kernel; waits for it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn words(
        &self,
        ctx: &RankCtx,
        k: &DecoderKernels,
        stream: &std::sync::Arc<CudaStream>,
        src: u64,
        words: usize,
        through_sms: bool,
        what: &str,
    ) -> Result<Vec<u32>, CudaError> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let mut slot = self
            .buffer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.as_ref().is_none_or(|m| m.host.len() < words) {
            // the old buffer's free synchronises the device: only while growing
            *slot = None;
            *slot = Some(MappedHost::new(ctx, words.next_power_of_two())?);
        }
        let mapped = slot
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no mapped download buffer".into()))?;
        if through_sms {
            let args = [Arg::U64(src), Arg::U64(mapped.dev), Arg::U64(words as u64)];
            // SAFETY: `src` holds `words` words (the caller's promise); the mapped buffer holds
            // at least `words` and stays alive until the stream is synchronised below.
            unsafe {
                launch(
                    stream,
                    &k.copy_words,
                    k.elementwise(words as u64),
                    &args,
                    ctx.rank,
                    "copy_words",
                )?
            };
        } else {
            let host = mapped.host.as_ptr().map_err(ctx.drv(what, 0))?;
            // SAFETY: as above; the destination is page-locked memory of at least `words`
            // words, alive until the stream is synchronised below.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host as *mut _, src, 4 * words, stream.cu_stream())
            }
            .result()
            .map_err(ctx.drv(what, 4 * words as u64))?;
        }
        let waiting = Instant::now();
        stream
            .synchronize()
            .map_err(ctx.drv(what, 4 * words as u64))?;
        let ns = u64::try_from(waiting.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        // SAFETY: the kernel or copy that wrote the first `words` words has completed (stream
        // synchronised); nothing else writes the buffer while the lock is held.
        let ptr = mapped.host.as_ptr().map_err(ctx.drv(what, 0))?;
        Ok(unsafe { std::slice::from_raw_parts(ptr, words) }.to_vec())
    }
}
