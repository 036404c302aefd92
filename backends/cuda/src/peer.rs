//! Peer copies: ranks of one process write straight into each other's device memory with the
//! copy engines (`cuMemcpy2DAsync` between peer-mapped buffers), no NCCL, no staging, no SMs.
//!
//! On the 2×H200 machine a copy-engine write into the peer's memory runs at about 390 GB/s per
//! GPU in both directions at once, above NCCL's send/recv (about 350 GB/s at 4 GiB messages),
//! and keeps its rate while kernels load the GPU's memory. It needs every rank in one process
//! ([`ThreadRankPool::new`]), peer access between every pair of GPUs, and access to each
//! device's stream-ordered memory pool granted to its peers: [`ThreadRankPool::peer_access`]
//! sets all of it up once.

use std::mem::MaybeUninit;
use std::time::Instant;

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::placement::SharedGpu;
use crate::pool::{RankCtx, ThreadRankPool};
use crate::{CudaError, RankExecutor};

/// How a GPU backend moves bytes between ranks.
///
/// ```no_run
/// use lifecycle_cuda::{peer_copy_rate, ThreadRankPool, Transport};
///
/// let pool = ThreadRankPool::new(2)?;
/// // true on one machine whose GPUs map each other's memory (NVLink or PCIe peer access)
/// let peer = Transport::Auto.resolve(&pool)?;
/// if let Some(rate) = peer_copy_rate(&pool, 1 << 30, 5)? {
///     println!("peer copies: {peer}, {:.0} GB/s per rank", rate / 1e9);
/// }
/// # Ok::<(), lifecycle_cuda::CudaError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Peer copies when every rank lives in this process and every pair of GPUs has peer
    /// access ([`ThreadRankPool::peer_access`]); NCCL otherwise (one process per GPU). Always
    /// peer copies on a pool that places ranks on one GPU (it has no NCCL).
    #[default]
    Auto,
    /// NCCL send/recv (and collectives), whatever the pool; refused on a pool that places two
    /// ranks on one GPU ([`CudaError::NcclNeedsOneGpuPerRank`]).
    Nccl,
    /// Each sender's copy engines write its bytes straight into the receivers' buffers (no
    /// NCCL); planning fails when the pool cannot.
    PeerCopy,
}

impl Transport {
    /// Whether transfers on `pool` use peer copies: [`Transport::Auto`] asks the pool
    /// ([`ThreadRankPool::peer_access`]), [`Transport::PeerCopy`] requires it (an
    /// [`CudaError::Invalid`] saying why otherwise), [`Transport::Nccl`] never does. On a pool
    /// that places two ranks on one GPU ([`ThreadRankPool::shared_gpu`]) see
    /// [`Transport::resolve_with`].
    pub fn resolve(self, pool: &ThreadRankPool) -> Result<bool, CudaError> {
        self.resolve_with(pool.shared_gpu(), || pool.peer_access())
    }

    /// The decision of [`Transport::resolve`] from what it asks of a pool: `shared`, the first
    /// pair of ranks the pool places on one GPU ([`ThreadRankPool::shared_gpu`]), and
    /// `peer_access`, whether its ranks can write into each other's memory (called at most once,
    /// and not at all for [`Transport::Nccl`]).
    ///
    /// Without a shared GPU: `Auto` gives `peer_access()`, `PeerCopy` requires it, `Nccl` gives
    /// `false`. With one the pool has no NCCL communicators: `Nccl` is refused
    /// ([`SharedGpu::nccl_error`]), `Auto` and `PeerCopy` give peer copies, which need
    /// `peer_access()` (true when every rank shares one GPU: copies between them are
    /// device-local; ranks on different GPUs need the driver's peer access).
    ///
    /// ```
    /// use lifecycle_cuda::{RankPlacement, Transport};
    ///
    /// let shared = RankPlacement::on_devices(&[0, 0, 0])?.shared_gpu();
    /// assert!(Transport::Auto.resolve_with(shared, || Ok(true))?);
    /// let refused = Transport::Nccl.resolve_with(shared, || Ok(true)).unwrap_err();
    /// assert!(refused.to_string().contains("places ranks 0 and 1 on GPU 0"));
    /// // One rank per GPU: what the pool's peer access says.
    /// assert!(!Transport::Auto.resolve_with(None, || Ok(false))?);
    /// # Ok::<(), lifecycle_cuda::CudaError>(())
    /// ```
    pub fn resolve_with(
        self,
        shared: Option<SharedGpu>,
        peer_access: impl FnOnce() -> Result<bool, CudaError>,
    ) -> Result<bool, CudaError> {
        match (self, shared) {
            (Transport::Nccl, None) => Ok(false),
            (Transport::Nccl, Some(s)) => Err(s.nccl_error()),
            (Transport::Auto, None) => peer_access(),
            (Transport::PeerCopy, None) => {
                if peer_access()? {
                    Ok(true)
                } else {
                    Err(CudaError::Invalid(
                        "transport PeerCopy needs every rank in this process and peer access \
                         between every pair of GPUs, which this pool lacks: use Transport::Auto \
                         or Transport::Nccl"
                            .into(),
                    ))
                }
            }
            (Transport::Auto | Transport::PeerCopy, Some(s)) => {
                if peer_access()? {
                    Ok(true)
                } else {
                    Err(CudaError::Invalid(format!(
                        "this pool places ranks {} and {} on GPU {}, so it has no NCCL \
                         communicators and moves bytes with peer copies only, but some of its \
                         GPUs cannot access each other's memory: place the ranks on GPUs with \
                         peer access (or all on one GPU), or one rank per GPU for NCCL",
                        s.first, s.second, s.device
                    )))
                }
            }
        }
    }
}

/// Raw handles of one rank's device, sent between the pool's threads (the context as an
/// address: a process-wide handle, used only while the pool keeps every context alive).
#[derive(Debug, Clone, Copy)]
struct DeviceHandles {
    ctx: usize,
    device: sys::CUdevice,
}

impl ThreadRankPool {
    /// Whether ranks can write into each other's device memory: `true` once every rank of the
    /// world lives in this process and every pair of GPUs has peer access, which this call
    /// enables (contexts and memory pools) the first time. `false`, with nothing changed, when
    /// the pool drives only some ranks (one process per GPU) or a pair of GPUs cannot map each
    /// other's memory; errors are the driver's. Ranks on one GPU
    /// ([`RankPlacement`](crate::RankPlacement)) need nothing enabled between them: they share
    /// the GPU's context, and copies between their buffers are device-local.
    pub fn peer_access(&self) -> Result<bool, CudaError> {
        let mut state = self.peer_state().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(known) = *state {
            return Ok(known);
        }
        if self.local_ranks().len() != self.world() {
            *state = Some(false);
            return Ok(false);
        }
        let handles: Vec<DeviceHandles> = self.run(&|ctx| {
            Ok(DeviceHandles {
                ctx: ctx.ctx.cu_ctx() as usize,
                device: ctx.ctx.cu_device(),
            })
        })?;
        let can: Vec<bool> = self.run(&|ctx| {
            let me = ctx.ctx.cu_device();
            let mut all = true;
            for h in handles.iter().filter(|h| h.device != me) {
                let mut can = 0i32;
                // SAFETY: valid out-pointer; both are devices of this machine.
                unsafe { sys::cuDeviceCanAccessPeer(&mut can, me, h.device) }
                    .result()
                    .map_err(ctx.drv("asking for peer access", 0))?;
                all &= can != 0;
            }
            Ok(all)
        })?;
        if can.iter().any(|c| !c) {
            *state = Some(false);
            return Ok(false);
        }
        self.run(&|ctx| {
            let me = ctx.ctx.cu_device();
            for h in handles.iter().filter(|h| h.device != me) {
                // SAFETY: the peer context is alive (the pool holds it); this thread's context is
                // current (the pool binds it); flags must be 0.
                let r = unsafe { sys::cuCtxEnablePeerAccess(h.ctx as sys::CUcontext, 0) };
                if r != sys::CUresult::CUDA_SUCCESS
                    && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    return Err(CudaError::driver(
                        ctx.rank,
                        "enabling peer access",
                        0,
                        cudarc::driver::DriverError(r),
                    ));
                }
                // Memory from the peer's stream-ordered pool needs the pool's own grant.
                let pool = default_pool_of(h.device, ctx.rank)?;
                let desc = sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: me,
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                // SAFETY: one valid descriptor for a live pool.
                unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
                    .result()
                    .map_err(ctx.drv("granting a peer access to the memory pool", 0))?;
            }
            Ok(())
        })?;
        *state = Some(true);
        Ok(true)
    }
}

fn default_pool_of(device: sys::CUdevice, rank: usize) -> Result<sys::CUmemoryPool, CudaError> {
    let mut pool = MaybeUninit::uninit();
    // SAFETY: valid out-pointer; `device` is a device of this machine.
    unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), device) }
        .result()
        .map_err(|e| CudaError::driver(rank, "reading a peer's memory pool", 0, e))?;
    // SAFETY: initialised by the successful call above.
    Ok(unsafe { pool.assume_init() })
}

/// The driver's descriptor of a device-to-device 2-D copy of `rows` rows of `width` bytes, from
/// rows `src_pitch` bytes apart at `src` to rows `dst_pitch` bytes apart at `dst` (for
/// `cuMemcpy2DAsync`, as [`copy_2d`] issues it).
///
/// ```
/// let d = lifecycle_cuda::memcpy_2d_desc((0x1000, 256), (0x9000, 512), 128, 4);
/// assert_eq!((d.srcPitch, d.dstPitch, d.WidthInBytes, d.Height), (256, 512, 128, 4));
/// ```
pub fn memcpy_2d_desc(
    (src, src_pitch): (u64, usize),
    (dst, dst_pitch): (u64, usize),
    width: usize,
    rows: usize,
) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: rows,
    }
}

/// A 2-D copy of `rows` rows of `width` bytes on `stream`, rows `src_pitch` / `dst_pitch` bytes
/// apart, between device addresses of this rank or of its peers (the copy engines carry it over
/// NVLink when one side is a peer's). A single row is a plain device-to-device copy.
///
/// # Safety
/// Both regions must lie inside live device allocations that this rank may access (its own, or a
/// peer's after [`ThreadRankPool::peer_access`] returned `true`), stay alive and unwritten by
/// other work until the stream has run the copy, and pitches must be at least `width`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn copy_2d(
    ctx: &RankCtx,
    stream: &CudaStream,
    (dst, dst_pitch): (u64, usize),
    (src, src_pitch): (u64, usize),
    width: usize,
    rows: usize,
    what: &str,
) -> Result<(), CudaError> {
    let bytes = (width * rows) as u64;
    if bytes == 0 {
        return Ok(());
    }
    if rows == 1 || (src_pitch == width && dst_pitch == width) {
        // SAFETY: the caller's promise, for one contiguous region of `bytes`.
        return unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes as usize, stream.cu_stream())
        }
        .map_err(ctx.drv(what, bytes));
    }
    let c = memcpy_2d_desc((src, src_pitch), (dst, dst_pitch), width, rows);
    // SAFETY: the descriptor is valid for the call; the regions are the caller's promise.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) }
        .result()
        .map_err(ctx.drv(what, bytes))
}

/// The copy-engine peer-copy ceiling of `pool`: every rank writes `bytes` into the next rank's
/// memory at once (`iters` timed rounds after 2 warm-ups); the slowest rank's median rate in
/// bytes per second. `None` when the pool has no peer access ([`ThreadRankPool::peer_access`])
/// or a single rank.
pub fn peer_copy_rate(
    pool: &ThreadRankPool,
    bytes: usize,
    iters: usize,
) -> Result<Option<f64>, CudaError> {
    let world = pool.world();
    if world < 2 || !pool.peer_access()? {
        return Ok(None);
    }
    let mut bufs: Vec<(CudaSlice<u8>, CudaSlice<u8>)> = pool.run(&|ctx| {
        // SAFETY: contents are irrelevant to the timing and never read.
        let a = unsafe { crate::alloc_device::<u8>(&ctx.compute, bytes, ctx.rank, "peer src")? };
        // SAFETY: as above.
        let b = unsafe { crate::alloc_device::<u8>(&ctx.compute, bytes, ctx.rank, "peer dst")? };
        ctx.compute
            .synchronize()
            .map_err(ctx.drv("allocating peer-copy buffers", 0))?;
        Ok((a, b))
    })?;
    let dsts: Vec<u64> = pool.run_each(&mut bufs, &|ctx, (_, b)| {
        let (p, _sync) = b.device_ptr_mut(&ctx.compute);
        Ok(p)
    })?;
    let times = pool.run_each(&mut bufs, &|ctx, (a, _)| {
        let (src, _sync) = a.device_ptr(&ctx.compute);
        let to = dsts[(ctx.rank + 1) % world];
        let stream = ctx.nccl_stream();
        let mut ts = Vec::with_capacity(iters);
        for k in 0..iters + 2 {
            let t = Instant::now();
            // SAFETY: both buffers hold `bytes` and outlive the synchronisation below; peer
            // access is enabled; nothing else touches them.
            unsafe {
                copy_2d(
                    ctx,
                    &stream,
                    (to, bytes),
                    (src, bytes),
                    bytes,
                    1,
                    "peer copy",
                )?
            };
            stream
                .synchronize()
                .map_err(ctx.drv("timing a peer copy", bytes as u64))?;
            if k >= 2 {
                ts.push(t.elapsed().as_secs_f64());
            }
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts.get(ts.len() / 2).copied().unwrap_or(f64::NAN))
    })?;
    pool.run_each(&mut bufs, &|ctx, _| {
        ctx.nccl_stream()
            .synchronize()
            .map_err(ctx.drv("synchronizing", 0))
    })?;
    drop(bufs);
    let slowest = times.iter().cloned().fold(0.0, f64::max);
    Ok(Some(bytes as f64 / slowest))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::RankPlacement;

    fn shared(devices: &[usize]) -> Option<SharedGpu> {
        RankPlacement::on_devices(devices).unwrap().shared_gpu()
    }

    /// Resolves `t` and counts the calls of the peer-access probe.
    fn resolve(t: Transport, s: Option<SharedGpu>, peer: bool) -> (Result<bool, CudaError>, u32) {
        let calls = Cell::new(0);
        let r = t.resolve_with(s, || {
            calls.set(calls.get() + 1);
            Ok(peer)
        });
        (r, calls.get())
    }

    #[test]
    fn one_gpu_per_rank_resolves_as_the_peer_access_says() {
        for peer in [false, true] {
            let (auto, n) = resolve(Transport::Auto, shared(&[0, 1]), peer);
            assert_eq!((auto.unwrap(), n), (peer, 1));
            let (nccl, n) = resolve(Transport::Nccl, shared(&[0, 1]), peer);
            assert_eq!((nccl.unwrap(), n), (false, 0));
        }
        assert!(resolve(Transport::PeerCopy, None, true).0.unwrap());
        let e = resolve(Transport::PeerCopy, None, false).0.unwrap_err();
        assert!(e.to_string().contains("transport PeerCopy needs"), "{e}");
    }

    #[test]
    fn repeated_gpus_resolve_to_peer_copies_and_refuse_nccl() {
        for devices in [&[0, 0][..], &[0, 0, 0, 0], &[1, 0, 1]] {
            let s = shared(devices);
            assert!(s.is_some(), "{devices:?}");
            for t in [Transport::Auto, Transport::PeerCopy] {
                let (r, n) = resolve(t, s, true);
                assert_eq!((r.unwrap(), n), (true, 1), "{t:?} on {devices:?}");
            }
            let (r, n) = resolve(Transport::Nccl, s, true);
            assert_eq!(n, 0, "Nccl asks nothing of the pool");
            match r {
                Err(e @ CudaError::NcclNeedsOneGpuPerRank { .. }) => assert!(
                    e.to_string()
                        .starts_with("the NCCL transport needs one GPU per rank; this pool places"),
                    "{e}"
                ),
                other => panic!("{devices:?}: expected the NCCL refusal, got {other:?}"),
            }
        }
        let e = resolve(Transport::Nccl, shared(&[1, 0, 1]), true)
            .0
            .unwrap_err();
        assert!(
            e.to_string().contains("places ranks 0 and 2 on GPU 1"),
            "{e}"
        );
    }

    #[test]
    fn repeated_gpus_without_peer_access_have_no_transport() {
        for t in [Transport::Auto, Transport::PeerCopy] {
            let e = resolve(t, shared(&[0, 0, 1, 1]), false).0.unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("places ranks 0 and 1 on GPU 0") && msg.contains("peer access"),
                "{msg}"
            );
        }
    }

    #[test]
    fn probe_errors_pass_through() {
        for s in [None, shared(&[0, 0])] {
            let r = Transport::Auto.resolve_with(s, || Err(CudaError::Invalid("probe".into())));
            assert!(matches!(r, Err(CudaError::Invalid(m)) if m == "probe"));
        }
    }
}
