//! The training buffers a switch reads and moves, as the [switch driver](super) sees them: a
//! small trait per rank ([`RankBuffers`]) over buffers that offload ([`Offloadable`]), whoever
//! owns their device memory.

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;

use crate::{CudaError, OffloadBuffer, PinnedPool, RankCtx, SourceBuf, StreamTimeline};

/// What a buffer is to the memory policy: moved out with
/// [`MemoryPolicy::offload_params`](lifecycle_core::MemoryPolicy::offload_params) or with
/// [`MemoryPolicy::offload_optimizer`](lifecycle_core::MemoryPolicy::offload_optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferClass {
    /// Parameters (master weights, bf16 parameters, main params).
    Params,
    /// Optimizer state (Adam m, v).
    Optimizer,
}

impl BufferClass {
    /// Whether `memory` moves buffers of this class out during rollout.
    pub fn offloaded_by(self, memory: lifecycle_core::MemoryPolicy) -> bool {
        match self {
            BufferClass::Params => memory.offload_params,
            BufferClass::Optimizer => memory.offload_optimizer,
        }
    }
}

/// One training buffer that a switch may offload to pinned host memory and reload: on the device
/// (authoritative when present) and/or in pinned chunks of a [`PinnedPool`]. Implemented by
/// [`OffloadBuffer`] (memory the backend allocated) and [`LentOffload`](super::LentOffload)
/// (memory a caller lent).
pub trait Offloadable: Send {
    /// Bytes of the buffer.
    fn bytes(&self) -> usize;

    /// Whether the device copy is absent (the pinned copy is authoritative).
    fn is_offloaded(&self) -> bool;

    /// Takes the pinned chunks an offload needs from `pinned`, unless held; copies nothing.
    fn reserve_host(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
    ) -> Result<(), CudaError>;

    /// Queues the device→host copy on the copy stream, marked on `tl` as an offload span named
    /// `what`. Returns the bytes queued (0 when already offloaded).
    fn start_offload(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError>;

    /// Gives up the device copy once the offload copy finished (the caller synchronised the copy
    /// stream). Returns the bytes that left the device (0 without a pinned copy).
    fn drop_device(&mut self, ctx: &RankCtx) -> Result<u64, CudaError>;

    /// Whether [`Offloadable::free_after_copy`] can give the device copy up in stream order
    /// (memory this process allocated from the device's pool). The default: no (memory a caller
    /// lent is freed by its owner).
    fn frees_in_stream_order(&self) -> bool {
        false
    }

    /// Queues the free of the device copy on the copy stream behind its offload copy, without
    /// waiting (an overlapped offload). Returns the bytes that leave the device. The default
    /// refuses: only buffers whose [`Offloadable::frees_in_stream_order`] is true are asked.
    ///
    /// # Safety
    /// The offload copy was queued on `ctx.copy` and no work of another stream on the device
    /// copy is pending.
    unsafe fn free_after_copy(&mut self, ctx: &RankCtx) -> Result<u64, CudaError> {
        Err(CudaError::Invalid(format!(
            "rank {}: this buffer cannot be freed in stream order",
            ctx.rank
        )))
    }

    /// Queues the host→device copy of an offloaded buffer on the copy stream, marked on `tl` as a
    /// reload span named `what`. Returns the bytes (0 when on the device).
    fn start_reload(
        &mut self,
        ctx: &RankCtx,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError>;

    /// Drops a reloaded device copy that failed its check: the pinned copy stays authoritative.
    fn discard_device(&mut self, ctx: &RankCtx) -> Result<(), CudaError>;

    /// Gives the pinned chunks back once the device copy is authoritative (streams synchronised).
    fn release_host(&mut self, rank: usize, pinned: &PinnedPool);
}

impl<T: DeviceRepr + Send> Offloadable for OffloadBuffer<T> {
    fn bytes(&self) -> usize {
        OffloadBuffer::bytes(self)
    }

    fn is_offloaded(&self) -> bool {
        OffloadBuffer::is_offloaded(self)
    }

    fn reserve_host(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
    ) -> Result<(), CudaError> {
        OffloadBuffer::reserve_host(self, ctx, pinned, what)
    }

    fn start_offload(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        OffloadBuffer::start_offload(self, ctx, pinned, what, tl)
    }

    fn drop_device(&mut self, _ctx: &RankCtx) -> Result<u64, CudaError> {
        // Frees are stream-ordered: the memory returns to the pool without a wait.
        Ok(OffloadBuffer::drop_device(self))
    }

    fn frees_in_stream_order(&self) -> bool {
        true
    }

    unsafe fn free_after_copy(&mut self, ctx: &RankCtx) -> Result<u64, CudaError> {
        // SAFETY: the caller's promise.
        unsafe { OffloadBuffer::free_after_copy(self, ctx) }
    }

    fn start_reload(
        &mut self,
        ctx: &RankCtx,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        OffloadBuffer::start_reload(self, ctx, what, tl)
    }

    fn discard_device(&mut self, _ctx: &RankCtx) -> Result<(), CudaError> {
        OffloadBuffer::discard_device(self);
        Ok(())
    }

    fn release_host(&mut self, rank: usize, pinned: &PinnedPool) {
        OffloadBuffer::release_host(self, rank, pinned)
    }
}

/// One buffer of a rank that an offload may move, as [`RankBuffers::movable`] lists it.
pub struct Movable<'a> {
    /// The buffer's name in errors, spans and verification (`"master"`, `"adam_m"`, …).
    pub name: &'static str,
    /// Which memory-policy switch moves it.
    pub class: BufferClass,
    /// The buffer.
    pub buf: &'a mut dyn Offloadable,
}

impl<'a> Movable<'a> {
    /// `buf`, called `name`, moved with `class`.
    pub fn new(name: &'static str, class: BufferClass, buf: &'a mut dyn Offloadable) -> Self {
        Movable { name, class, buf }
    }
}

/// One rank's training buffers as the switch driver sees them: the buffer the plan reads, the
/// buffers an offload moves, and the scratch memory (gradients) that rollout mode does not keep.
///
/// Implemented by each backend's rank state over memory it allocated, and by
/// [`LentRank`](super::LentRank) over device memory a caller lent (PyTorch's FSDP2 shards).
///
/// ```
/// use lifecycle_cuda::driver::{BufferClass, Movable, RankBuffers};
/// use lifecycle_cuda::{CudaError, OffloadBuffer, RankCtx, SourceBuf};
///
/// /// A rank that trains fp32 masters with one Adam moment.
/// struct MyRank {
///     master: OffloadBuffer<f32>,
///     moment: OffloadBuffer<f32>,
/// }
///
/// impl RankBuffers for MyRank {
///     fn source(&self) -> Result<SourceBuf<'_>, CudaError> {
///         let m = self.master.device().ok_or_else(|| {
///             CudaError::Invalid("the master weights are offloaded".into())
///         })?;
///         Ok(SourceBuf::F32(m))
///     }
///     fn movable(&mut self) -> Vec<Movable<'_>> {
///         vec![
///             Movable::new("moment", BufferClass::Optimizer, &mut self.moment),
///             Movable::new("master", BufferClass::Params, &mut self.master),
///         ]
///     }
/// }
/// ```
pub trait RankBuffers: Send {
    /// The training buffer the rank's steps read (it must be on the device).
    fn source(&self) -> Result<SourceBuf<'_>, CudaError>;

    /// Where each training tensor's shard starts in [`RankBuffers::source`] (elements), when
    /// not where the plan's flat layout puts it (a caller's per-tensor allocations, lent:
    /// [`LentRank`](super::LentRank)); `None`, the default: the plan's layout.
    fn source_offsets(&self) -> Option<&[u64]> {
        None
    }

    /// The buffers an offload may move, in the order their copies are queued (the buffer the
    /// plan reads last, so the casts read it while it is copied).
    fn movable(&mut self) -> Vec<Movable<'_>>;

    /// Frees what rollout mode does not keep (gradients), once the transfer finished. Returns
    /// the bytes freed. The default keeps nothing apart.
    fn release_scratch(&mut self, _ctx: &RankCtx) -> Result<u64, CudaError> {
        Ok(0)
    }

    /// Restores what [`RankBuffers::release_scratch`] freed (zeroed gradients), at exit.
    fn restore_scratch(&mut self, _ctx: &RankCtx) -> Result<(), CudaError> {
        Ok(())
    }

    /// Orders the switch's streams after the owner's pending work on these buffers (a caller's
    /// stream). The default: nothing to wait for (the backend's own work is ordered already).
    fn wait_for_owner(&self, _ctx: &RankCtx) -> Result<(), CudaError> {
        Ok(())
    }

    /// Orders the owner's later work after the switch's work on these buffers.
    fn hand_back(&self, _ctx: &RankCtx) -> Result<(), CudaError> {
        Ok(())
    }

    /// Whether any movable buffer is offloaded.
    fn any_offloaded(&mut self) -> bool {
        self.movable().iter().any(|m| m.buf.is_offloaded())
    }
}

/// Frees an optional gradient buffer: the usual [`RankBuffers::release_scratch`].
pub fn free_grads<T: DeviceRepr>(grads: &mut Option<CudaSlice<T>>) -> u64 {
    grads
        .take()
        .map_or(0, |g| (g.len() * std::mem::size_of::<T>()) as u64)
}

/// Allocates zeroed gradients of `len` elements unless present: the usual
/// [`RankBuffers::restore_scratch`].
pub fn restore_grads(
    ctx: &RankCtx,
    grads: &mut Option<CudaSlice<f32>>,
    len: usize,
) -> Result<(), CudaError> {
    if grads.is_none() {
        *grads = Some(crate::alloc_zeros(
            &ctx.compute,
            len,
            ctx.rank,
            "gradients",
        )?);
    }
    Ok(())
}

/// The rollout buffer type every driver transfer writes.
pub type RollSlice = CudaSlice<bf16>;
