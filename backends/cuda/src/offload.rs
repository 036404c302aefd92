//! [`OffloadBuffer`]: a device buffer that offloads to pinned host memory of a [`PinnedPool`] and
//! reloads, with the copies on the copy stream marked as spans.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;
use lifecycle_core::{Link, Phase};

use crate::{alloc_device, CudaError, HostCopy, PinnedPool, RankCtx, StreamTimeline};

/// One training buffer of a rank that offloads: on the device (authoritative when present) and/or
/// in pinned host chunks of a [`PinnedPool`] (authoritative while the device copy is absent; a
/// stale copy otherwise, given back at the next reload). Every executor's offload and reload go
/// through it.
pub struct OffloadBuffer<T> {
    len: usize,
    dev: Option<CudaSlice<T>>,
    host: Option<HostCopy>,
}

impl<T> Default for OffloadBuffer<T> {
    /// An empty buffer (no elements, nothing on the device or the host), to be replaced by
    /// [`OffloadBuffer::on_device`].
    fn default() -> Self {
        OffloadBuffer {
            len: 0,
            dev: None,
            host: None,
        }
    }
}

impl<T: DeviceRepr> OffloadBuffer<T> {
    /// A buffer of `len` elements held in `dev` (which may be longer: allocations can be padded).
    pub fn on_device(dev: CudaSlice<T>, len: usize) -> Self {
        OffloadBuffer {
            len,
            dev: Some(dev),
            host: None,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device copy, when on the device.
    pub fn device(&self) -> Option<&CudaSlice<T>> {
        self.dev.as_ref()
    }

    /// The device copy, to rewrite in place, when on the device.
    pub fn device_mut(&mut self) -> Option<&mut CudaSlice<T>> {
        self.dev.as_mut()
    }

    /// Whether the device copy is absent (the pinned copy is authoritative).
    pub fn is_offloaded(&self) -> bool {
        self.dev.is_none()
    }

    /// The pinned host copy while one is held (offloaded, or stale until the next reload).
    pub fn host_mut(&mut self) -> Option<&mut HostCopy> {
        self.host.as_mut()
    }

    /// Bytes of pinned memory this buffer holds.
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::bytes)
    }

    /// Drops a device copy that must not be used (a reload that failed its check): the pinned
    /// copy stays authoritative, so a retry reloads it again. No effect without a pinned copy.
    pub fn discard_device(&mut self) {
        if self.host.is_some() {
            self.dev = None;
        }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Takes the pinned chunks an offload of this buffer needs from `pinned` (cached chunks first),
    /// unless it holds them already; nothing is copied. Lets an executor take every buffer's chunks
    /// before it queues any copy, so that running out of pinned memory changes nothing.
    pub fn reserve_host(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
    ) -> Result<(), CudaError> {
        if self.host.is_none() {
            self.host = Some(pinned.take(ctx, self.bytes(), what)?);
        }
        Ok(())
    }

    /// Queues the device→host copy of this buffer on the copy stream (pinned chunks taken from
    /// `pinned` first), marked on `tl` as an offload span named `what`. Returns the bytes
    /// queued; 0 when already offloaded.
    pub fn start_offload(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        if self.dev.is_none() {
            return Ok(0);
        }
        self.reserve_host(ctx, pinned, what)?;
        let Some(dev) = self.dev.as_ref() else {
            return Ok(0);
        };
        let (src, _sync) = dev.device_ptr(&ctx.copy);
        let bytes = self.bytes() as u64;
        if let Some(host) = self.host.as_mut() {
            // SAFETY: `dev` holds at least `len` elements (= host.bytes()) and is only read until
            // the caller synchronises the copy stream (finish_offload) before freeing it.
            unsafe { copy_out(ctx, host, src, what, tl)? };
        }
        Ok(bytes)
    }

    /// Queues the free of the device copy on the copy stream, behind its offload copy
    /// ([`OffloadBuffer::start_offload`]), without waiting: the memory goes back to the device's
    /// pool when the copy stream reaches the free. Returns the bytes freed (0 without a pinned
    /// copy or a device copy).
    ///
    /// # Safety
    /// The device copy's offload was queued on `ctx.copy`, and no work on another stream that
    /// reads or writes it is pending (the caller synchronised the rank's other streams since
    /// their last use of it).
    pub unsafe fn free_after_copy(&mut self, ctx: &RankCtx) -> Result<u64, CudaError> {
        if self.host.is_none() {
            return Ok(0);
        }
        let Some(dev) = self.dev.take() else {
            return Ok(0);
        };
        let bytes = self.bytes() as u64;
        let ptr = dev.leak();
        // SAFETY: `ptr` came from the stream-ordered pool of this rank's context and is no
        // longer owned by a slice; the copy stream frees it after its queued offload copy, and
        // the caller's promise rules out other pending work on it.
        unsafe { cudarc::driver::result::free_async(ptr, ctx.copy.cu_stream()) }
            .map_err(ctx.drv("freeing an offloaded buffer on the copy stream", bytes))?;
        Ok(bytes)
    }

    /// Frees the device copy (after the offload copies finished: the caller synchronised).
    pub fn drop_device(&mut self) -> u64 {
        if self.host.is_some() && self.dev.take().is_some() {
            self.bytes() as u64
        } else {
            0
        }
    }

    /// Queues the host→device copy of an offloaded buffer on the copy stream, marked on `tl` as
    /// a reload span named `what`. Returns the bytes.
    pub fn start_reload(
        &mut self,
        ctx: &RankCtx,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        if self.dev.is_some() {
            return Ok(0);
        }
        let host = self.host.as_ref().ok_or_else(|| {
            CudaError::Invalid(format!(
                "{what} of rank {} is neither on the device nor on the host",
                ctx.rank
            ))
        })?;
        if host.bytes() != self.bytes() {
            return Err(CudaError::Invalid(format!(
                "{what} of rank {}: the host copy holds {} bytes, the buffer {}",
                ctx.rank,
                host.bytes(),
                self.bytes()
            )));
        }
        // SAFETY: fully written by the host→device copy queued right after on the same stream.
        let mut dev = unsafe { alloc_device::<T>(&ctx.copy, self.len, ctx.rank, what)? };
        let dst = {
            let (dst, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dev, &ctx.copy);
            dst
        };
        let bytes = self.bytes() as u64;
        // SAFETY: `dev` holds `len` elements = host.bytes(); the chunks stay in `self.host` until
        // the caller synchronised the copy stream and gave them back.
        unsafe { copy_in(ctx, host, dst, what, tl)? };
        self.dev = Some(dev);
        Ok(bytes)
    }

    /// Gives the host chunks back once the device copy is authoritative (streams synchronised).
    pub fn release_host(&mut self, rank: usize, pinned: &PinnedPool) {
        if self.dev.is_some()
            && let Some(h) = self.host.take()
        {
            pinned.give(rank, h);
        }
    }

    /// The buffer's elements on the host, from the device or from the pinned copy (streams
    /// synchronised by the caller).
    pub fn download(&self, ctx: &RankCtx, what: &str) -> Result<Vec<T>, CudaError>
    where
        T: Default + Copy + FromLe,
    {
        match (&self.dev, &self.host) {
            (Some(d), _) => {
                let mut v = ctx.compute.clone_dtoh(d).map_err(ctx.drv(what, 0))?;
                v.truncate(self.len);
                Ok(v)
            }
            (None, Some(h)) => {
                let bytes = h.read(ctx.rank, what)?;
                Ok(bytes
                    .chunks_exact(std::mem::size_of::<T>())
                    .map(T::from_le)
                    .collect())
            }
            (None, None) => Err(CudaError::Invalid(format!(
                "{what}: neither on the device nor on the host"
            ))),
        }
    }
}

/// Queues the device→host copy of `host.bytes()` bytes at `src` into `host` on the copy
/// stream, marked on `tl` as an offload span named `what` (the span is the copy alone: the
/// pinned chunks are taken before). Every offload of a training buffer goes through it.
///
/// # Safety
/// As [`HostCopy::download_from`]: `src` holds `host.bytes()` readable bytes of the rank's
/// device, alive and unwritten until the copy stream ran the copy.
pub(crate) unsafe fn copy_out(
    ctx: &RankCtx,
    host: &mut HostCopy,
    src: u64,
    what: &str,
    tl: &mut StreamTimeline,
) -> Result<(), CudaError> {
    let mark = tl.begin(ctx, &ctx.copy)?;
    // SAFETY: the caller's promise.
    unsafe { host.download_from(src, &ctx.copy, ctx.rank, what)? };
    let (bytes, link) = (host.bytes() as u64, Some(Link::DeviceToHost));
    tl.end(
        ctx,
        &ctx.copy,
        mark,
        Phase::Offload,
        what,
        "copy",
        bytes,
        link,
    )
}

/// Queues the host→device copy of `host` into `host.bytes()` bytes at `dst` on the copy stream,
/// marked on `tl` as a reload span named `what`. Every reload of a training buffer goes through
/// it.
///
/// # Safety
/// As [`HostCopy::upload_to`]: `dst` holds `host.bytes()` writable bytes of the rank's device,
/// not used by other work until the copy stream ran the copy; `host` holds the buffer and stays
/// alive until then.
pub(crate) unsafe fn copy_in(
    ctx: &RankCtx,
    host: &HostCopy,
    dst: u64,
    what: &str,
    tl: &mut StreamTimeline,
) -> Result<(), CudaError> {
    let mark = tl.begin(ctx, &ctx.copy)?;
    // SAFETY: the caller's promise.
    unsafe { host.upload_to(dst, &ctx.copy, ctx.rank, what)? };
    let (bytes, link) = (host.bytes() as u64, Some(Link::HostToDevice));
    tl.end(
        ctx,
        &ctx.copy,
        mark,
        Phase::Reload,
        what,
        "copy",
        bytes,
        link,
    )
}

/// Element types read back from the little-endian bytes of a pinned copy.
pub trait FromLe {
    /// The value of the first `size_of::<Self>()` bytes of `b`.
    fn from_le(b: &[u8]) -> Self;
}

impl FromLe for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl FromLe for bf16 {
    fn from_le(b: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}
