//! Training buffers the backend does not own: device memory lent by a caller (PyTorch's FSDP2
//! shards, another framework's optimizer state), with the caller's CUDA stream.
//!
//! The driver reads a lent source in place (zero-copy), offloads lent buffers into its pinned
//! pool, and asks the owner ([`LentMemory`]) to release the device memory after the copy and to
//! give it back (perhaps at another address) before the reload: PyTorch's
//! `untyped_storage().resize_(0)` and back. Work on the caller's stream before the switch is
//! awaited by the switch's streams, and the caller's stream waits for the switch's work.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::bf16;

use super::buffers::{BufferClass, Movable, Offloadable, RankBuffers};
use crate::offload::{copy_in, copy_out};
use crate::{CudaError, HostCopy, PinnedPool, RankCtx, SourceBuf, StreamTimeline};

/// A device slice whose memory belongs to someone else: used as a [`CudaSlice`], never freed.
struct Borrowed<T: DeviceRepr>(Option<CudaSlice<T>>);

impl<T: DeviceRepr> Borrowed<T> {
    /// # Safety
    /// `ptr` must point to `len` elements of `T` on `stream`'s device, alive and not written by
    /// others while this value exists.
    unsafe fn new(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Self {
        // SAFETY: the caller's promise; the slice is leaked (not freed) on drop.
        Borrowed(Some(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) }))
    }

    fn get(&self) -> Option<&CudaSlice<T>> {
        self.0.as_ref()
    }
}

impl<T: DeviceRepr> Drop for Borrowed<T> {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            // The memory is the owner's: forget it without freeing.
            let _ = s.leak();
        }
    }
}

/// The caller's CUDA stream (a `CUstream` handle, as `torch.cuda.current_stream().cuda_stream`
/// gives it; 0 is the legacy default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentStream(pub u64);

impl LentStream {
    fn handle(self) -> cudarc::driver::sys::CUstream {
        self.0 as cudarc::driver::sys::CUstream
    }

    /// Makes `waiters` wait for the work queued so far on this stream.
    fn order_before(self, ctx: &RankCtx, waiters: &[&CudaStream]) -> Result<(), CudaError> {
        let event = ctx.event()?;
        // SAFETY: the handle is the caller's live stream on this device (LentRank::new's
        // contract); the event is alive until the waits below are queued.
        unsafe { cudarc::driver::result::event::record(event.cu_event(), self.handle()) }
            .map_err(ctx.drv("recording an event on the caller's stream", 0))?;
        for w in waiters {
            w.wait(&event)
                .map_err(ctx.drv("waiting for the caller's stream", 0))?;
        }
        Ok(())
    }

    /// Makes this stream wait for the work queued so far on `streams`.
    fn order_after(self, ctx: &RankCtx, streams: &[&CudaStream]) -> Result<(), CudaError> {
        for s in streams {
            let event = ctx.event()?;
            event
                .record(s)
                .map_err(ctx.drv("recording an event for the caller's stream", 0))?;
            // SAFETY: as in `order_before`; the event was recorded above.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    self.handle(),
                    event.cu_event(),
                    cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(ctx.drv("making the caller's stream wait for the switch", 0))?;
        }
        Ok(())
    }
}

/// The owner of a lent buffer's device memory, asked to release it once its contents are in
/// pinned host memory and to give memory back before they return.
pub trait LentMemory: Send + Sync {
    /// The contents are safe on the host (the offload copy finished): the device memory at `ptr`
    /// may be released (e.g. `untyped_storage().resize_(0)`).
    fn release(&mut self, rank: usize, ptr: u64) -> Result<(), CudaError>;

    /// Device memory of `bytes` bytes for the contents to return to; its address (it may differ
    /// from the released one).
    fn restore(&mut self, rank: usize, bytes: usize) -> Result<u64, CudaError>;
}

/// The buffer a lent rank's plan reads, in place.
pub enum LentSource {
    /// fp32 shards (FSDP masters).
    F32 {
        /// Device address.
        ptr: u64,
        /// Elements.
        len: usize,
    },
    /// fp32 tensors that are separate allocations (PyTorch FSDP2's per-parameter shards): each
    /// `(address, elements)`, read in place as one source whose base is the lowest address (the
    /// element offsets from it are [`LentRank::source_offsets`], which a plan rebases its reads
    /// onto; the memory between the tensors is never read or written).
    F32Tensors(Vec<(u64, usize)>),
    /// bf16 parameters.
    Bf16 {
        /// Device address.
        ptr: u64,
        /// Elements.
        len: usize,
    },
    /// bf16 tensors that are views into buffers the caller keeps (Megatron-Core's parameters in
    /// its DDP buffers, in whatever order and padding they lie there): each `(address,
    /// elements)`, read in place as one source from the lowest address, as
    /// [`LentSource::F32Tensors`].
    Bf16Tensors(Vec<(u64, usize)>),
}

enum SourceSlice {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
}

/// One lent buffer an offload may move: the driver copies it into its pinned pool, then asks the
/// owner ([`LentMemory`]) to release the device memory, and to give it back (perhaps at another
/// address) before the reload.
pub struct LentOffload {
    name: &'static str,
    class: BufferClass,
    bytes: usize,
    ptr: Option<u64>,
    host: Option<HostCopy>,
    owner: Box<dyn LentMemory>,
}

impl LentOffload {
    /// A lent buffer of `bytes` bytes at device address `ptr`, called `name`, moved out with
    /// `class`; `owner` releases and restores its memory.
    pub fn new(
        name: &'static str,
        class: BufferClass,
        ptr: u64,
        bytes: usize,
        owner: Box<dyn LentMemory>,
    ) -> Self {
        LentOffload {
            name,
            class,
            bytes,
            ptr: Some(ptr),
            host: None,
            owner,
        }
    }

    /// The device address while on the device.
    pub fn device_ptr(&self) -> Option<u64> {
        self.ptr
    }

    /// Bytes of pinned memory it holds.
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::bytes)
    }
}

impl Offloadable for LentOffload {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn is_offloaded(&self) -> bool {
        self.ptr.is_none()
    }

    fn reserve_host(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
    ) -> Result<(), CudaError> {
        if self.host.is_none() {
            self.host = Some(pinned.take(ctx, self.bytes, what)?);
        }
        Ok(())
    }

    fn start_offload(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        let Some(src) = self.ptr else {
            return Ok(0);
        };
        self.reserve_host(ctx, pinned, what)?;
        if let Some(host) = self.host.as_mut() {
            // SAFETY: `src` holds `bytes` bytes (LentOffload::new's contract, the owner keeps it
            // until `release`, which runs after the copy stream finished).
            unsafe { copy_out(ctx, host, src, what, tl)? };
        }
        Ok(self.bytes as u64)
    }

    fn drop_device(&mut self, ctx: &RankCtx) -> Result<u64, CudaError> {
        match (self.ptr, &self.host) {
            (Some(p), Some(_)) => {
                self.owner.release(ctx.rank, p)?;
                self.ptr = None;
                Ok(self.bytes as u64)
            }
            _ => Ok(0),
        }
    }

    fn start_reload(
        &mut self,
        ctx: &RankCtx,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        if self.ptr.is_some() {
            return Ok(0);
        }
        let host = self.host.as_ref().ok_or_else(|| {
            CudaError::Invalid(format!(
                "{what} of rank {} is neither on the device nor on the host",
                ctx.rank
            ))
        })?;
        let dst = self.owner.restore(ctx.rank, self.bytes)?;
        // SAFETY: the owner gave `bytes` writable bytes at `dst`; the chunks stay in `self.host`
        // until the caller synchronised the copy stream and gave them back.
        unsafe { copy_in(ctx, host, dst, what, tl)? };
        let bytes = self.bytes as u64;
        self.ptr = Some(dst);
        Ok(bytes)
    }

    fn discard_device(&mut self, ctx: &RankCtx) -> Result<(), CudaError> {
        if let (Some(p), Some(_)) = (self.ptr, &self.host) {
            self.owner.release(ctx.rank, p)?;
            self.ptr = None;
        }
        Ok(())
    }

    fn release_host(&mut self, rank: usize, pinned: &PinnedPool) {
        if self.ptr.is_some()
            && let Some(h) = self.host.take()
        {
            pinned.give(rank, h);
        }
    }
}

/// One rank's training buffers lent by a caller: the source the plan reads in place, the
/// buffers an offload may move, and the caller's stream. The driver reads the source in place;
/// work queued on the caller's stream before a switch is awaited by the switch's streams, and
/// the caller's stream waits for the switch's work.
pub struct LentRank {
    source: SourceSlice,
    /// With [`LentSource::F32Tensors`] or [`LentSource::Bf16Tensors`]: each tensor's first
    /// element from the source's base.
    offsets: Option<Vec<u64>>,
    offload: Vec<LentOffload>,
    stream: Option<LentStream>,
}

impl LentRank {
    /// The lent buffers of the rank `ctx` drives: `source` read in place, `offload` moved by the
    /// memory policy (in the order their copies are queued), `stream` the caller's stream.
    /// The source must not be among `offload` (offload its owner's copy with a [`LentOffload`]
    /// of the same address instead, released only after the transfer read it).
    ///
    /// # Safety
    /// Every address must be device memory of `ctx`'s GPU of the stated size, alive (and the
    /// source not written) until this value is dropped, except what the owner releases when
    /// asked; `stream`, when given, a live stream of that device.
    pub unsafe fn new(
        ctx: &RankCtx,
        source: LentSource,
        offload: Vec<LentOffload>,
        stream: Option<LentStream>,
    ) -> Result<Self, CudaError> {
        let mut offsets = None;
        let source = match source {
            LentSource::F32 { ptr, len } => {
                check_ptr(ctx, ptr, len * 4, "the lent fp32 source")?;
                // SAFETY: the caller's promise.
                SourceSlice::F32(unsafe { Borrowed::new(&ctx.compute, ptr, len) })
            }
            LentSource::F32Tensors(tensors) => {
                let (base, at, len) = tensor_offsets(ctx, &tensors, 4)?;
                offsets = Some(at);
                // SAFETY: the range spans the lent tensors (the caller's promise for each) and
                // the memory between them, which is not ours: nothing reads or writes it, since
                // every read of the source is rebased into a tensor and validated against it
                // before a program runs (RankSteps::rebase_source).
                SourceSlice::F32(unsafe { Borrowed::new(&ctx.compute, base, len) })
            }
            LentSource::Bf16 { ptr, len } => {
                check_ptr(ctx, ptr, len * 2, "the lent bf16 source")?;
                // SAFETY: the caller's promise.
                SourceSlice::Bf16(unsafe { Borrowed::new(&ctx.compute, ptr, len) })
            }
            LentSource::Bf16Tensors(tensors) => {
                let (base, at, len) = tensor_offsets(ctx, &tensors, 2)?;
                offsets = Some(at);
                // SAFETY: as for F32Tensors: the range spans the lent tensors and the memory
                // between them, which nothing reads or writes (every read rebased into a tensor
                // and validated against it: RankSteps::rebase_source).
                SourceSlice::Bf16(unsafe { Borrowed::new(&ctx.compute, base, len) })
            }
        };
        for o in &offload {
            if let Some(p) = o.ptr {
                check_ptr(ctx, p, o.bytes, o.name)?;
            }
        }
        Ok(LentRank {
            source,
            offsets,
            offload,
            stream,
        })
    }

    /// With a [`LentSource::F32Tensors`] or [`LentSource::Bf16Tensors`] source: each tensor's
    /// first element, counted in the source's elements from the lowest address (what a plan's
    /// reads are rebased onto).
    pub fn source_offsets(&self) -> Option<&[u64]> {
        self.offsets.as_deref()
    }

    /// The lent buffers an offload may move.
    pub fn offload(&self) -> &[LentOffload] {
        &self.offload
    }
}

/// The base address of lent `tensors` of `elem`-byte elements (the lowest), each tensor's element
/// offset from it and the elements up to the end of the last; empty tensors sit at offset 0.
fn tensor_offsets(
    ctx: &RankCtx,
    tensors: &[(u64, usize)],
    elem: u64,
) -> Result<(u64, Vec<u64>, usize), CudaError> {
    for (i, &(p, n)) in tensors.iter().enumerate() {
        check_ptr(ctx, p, n * elem as usize, &format!("lent tensor {i}"))?;
    }
    let base = tensors
        .iter()
        .filter(|t| t.1 > 0)
        .map(|t| t.0)
        .min()
        .unwrap_or(0);
    let mut at = Vec::with_capacity(tensors.len());
    let mut end = 0u64;
    for (i, &(p, n)) in tensors.iter().enumerate() {
        if n == 0 {
            at.push(0);
            continue;
        }
        let d = p - base;
        if d % elem != 0 {
            return Err(CudaError::Invalid(format!(
                "rank {}: lent tensor {i} at {p:#x} is not {elem}-byte aligned against the lowest \
                 lent address {base:#x}: the tensors are read as one source",
                ctx.rank
            )));
        }
        at.push(d / elem);
        end = end.max(d / elem + n as u64);
    }
    let len = usize::try_from(end).map_err(|_| {
        CudaError::Invalid(format!("rank {}: the lent tensors span too much", ctx.rank))
    })?;
    Ok((base, at, len))
}

fn check_ptr(ctx: &RankCtx, ptr: u64, bytes: usize, what: &str) -> Result<(), CudaError> {
    if ptr == 0 && bytes > 0 {
        return Err(CudaError::Invalid(format!(
            "rank {}: {what} has a null device address for {bytes} bytes",
            ctx.rank
        )));
    }
    Ok(())
}

impl RankBuffers for LentRank {
    fn source(&self) -> Result<SourceBuf<'_>, CudaError> {
        let missing = || CudaError::Invalid("the lent source is not on the device".into());
        Ok(match &self.source {
            SourceSlice::F32(s) => SourceBuf::F32(s.get().ok_or_else(missing)?),
            SourceSlice::Bf16(s) => SourceBuf::Bf16(s.get().ok_or_else(missing)?),
        })
    }

    fn source_offsets(&self) -> Option<&[u64]> {
        LentRank::source_offsets(self)
    }

    fn movable(&mut self) -> Vec<Movable<'_>> {
        self.offload
            .iter_mut()
            .map(|o| {
                let (name, class) = (o.name, o.class);
                Movable::new(name, class, o as &mut dyn Offloadable)
            })
            .collect()
    }

    fn wait_for_owner(&self, ctx: &RankCtx) -> Result<(), CudaError> {
        match self.stream {
            Some(s) => s.order_before(ctx, &[&ctx.compute, &ctx.aux, &ctx.copy]),
            None => Ok(()),
        }
    }

    fn hand_back(&self, ctx: &RankCtx) -> Result<(), CudaError> {
        match self.stream {
            Some(s) => s.order_after(ctx, &[&ctx.compute, &ctx.aux, &ctx.copy]),
            None => Ok(()),
        }
    }
}
