//! One rank's NCCL communicator, created **non-blocking** so that no NCCL call can hang its
//! thread: every wait on NCCL work is deadline-aware, and a rank that waited too long aborts its
//! communicator (`ncclCommAbort`) and returns [`CudaError::CollectiveTimeout`].
//!
//! cudarc 0.19's `Comm` is created blocking (`ncclCommInitRank`), cannot be built from a raw
//! handle, and aborts (panicking on error) in its `Drop`; [`NcclComm`] owns the raw handle
//! instead and offers the same operations (`send`, `recv`, `all_gather`, `all_reduce`, ...).
//!
//! With a non-blocking communicator an NCCL call may return `ncclInProgress` before its work is
//! on the stream (`ncclGroupEnd` always does: it launches the group from a helper thread), and
//! the communicator must not be used again until `ncclCommGetAsyncError` reports success.
//! [`NcclComm`]'s operations and [`RankCtx::group_end`](crate::RankCtx::group_end) wait for that
//! (with the deadline), so events recorded after them cover the NCCL work.
//!
//! The ranks of one pool share a [`CommHealth`]: the first rank that aborts records a
//! [`CommFault`], the others abort their communicators as soon as they see it, and every later
//! collective on the pool returns [`CudaError::CommAborted`] at once.

use std::cell::Cell;
use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{self, ncclResult_t};
use cudarc::nccl::{NcclType, ReduceOp};

use crate::deadline::{wait_with_deadline, WaitProbe};
use crate::placement::SharedGpu;
use crate::CudaError;

/// The environment variable that overrides the collective deadline, in seconds (decimals
/// allowed), e.g. `LIFECYCLE_NCCL_TIMEOUT_S=120`.
pub const TIMEOUT_ENV: &str = "LIFECYCLE_NCCL_TIMEOUT_S";

/// The environment variable that makes the communicators blocking (`1`) or non-blocking (`0`,
/// the default): `LIFECYCLE_NCCL_BLOCKING=1` for jobs dominated by many small collectives
/// (decoding), see [`CollectiveSettings::nonblocking`].
pub const BLOCKING_ENV: &str = "LIFECYCLE_NCCL_BLOCKING";

/// How a pool's NCCL communicators are created and how long a rank waits on NCCL work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveSettings {
    /// The longest a rank waits for NCCL work (creating the communicator, enqueueing a group,
    /// a stream with collectives on it) before it aborts its communicator and returns
    /// [`CudaError::CollectiveTimeout`]. Default: 10 minutes (a large model's offload takes
    /// seconds; a healthy collective never comes close).
    pub timeout: Duration,
    /// Create the communicators non-blocking (`blocking = 0`, the default): NCCL's CPU-side
    /// work (connection setup with a peer, group launch) runs on helper threads, so a peer that
    /// never shows up cannot hang the calling thread. The price is a helper thread per NCCL
    /// launch: on 2 H200s a 4 KB all-reduce took 75.9 µs back to back instead of 13.5 µs with
    /// blocking communicators (a grouped send + receive 91.9 µs instead of 13.2 µs) — noise for
    /// a switch's few large buckets, a real cost for a decoder's per-layer all-reduces. `false`
    /// creates blocking communicators: then waits on the GPU are still bounded by
    /// [`timeout`](CollectiveSettings::timeout), but NCCL's CPU-side work is not.
    pub nonblocking: bool,
}

impl Default for CollectiveSettings {
    fn default() -> Self {
        CollectiveSettings {
            timeout: Duration::from_secs(600),
            nonblocking: true,
        }
    }
}

impl CollectiveSettings {
    /// The defaults, with the deadline taken from [`TIMEOUT_ENV`] and the blocking mode from
    /// [`BLOCKING_ENV`] when they are set.
    pub fn from_env() -> Result<Self, CudaError> {
        let mut s = CollectiveSettings::default();
        if let Ok(v) = std::env::var(TIMEOUT_ENV) {
            s.timeout = parse_timeout(&v)?;
        }
        if let Ok(v) = std::env::var(BLOCKING_ENV) {
            s.nonblocking = !parse_blocking(&v)?;
        }
        Ok(s)
    }
}

/// Parses a deadline in seconds (`"600"`, `"2.5"`): positive and finite, else a typed error
/// naming [`TIMEOUT_ENV`].
///
/// ```
/// use std::time::Duration;
/// assert_eq!(lifecycle_cuda::parse_timeout("2.5")?, Duration::from_millis(2500));
/// assert!(lifecycle_cuda::parse_timeout("ten").is_err());
/// # Ok::<(), lifecycle_cuda::CudaError>(())
/// ```
pub fn parse_timeout(value: &str) -> Result<Duration, CudaError> {
    let bad = || {
        CudaError::Invalid(format!(
            "{TIMEOUT_ENV} must be a positive number of seconds (e.g. 600 or 2.5), found {value:?}"
        ))
    };
    let secs: f64 = value.trim().parse().map_err(|_| bad())?;
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses [`BLOCKING_ENV`]: `1` / `true` (blocking) or `0` / `false` (non-blocking).
pub fn parse_blocking(value: &str) -> Result<bool, CudaError> {
    match value.trim() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        other => Err(CudaError::Invalid(format!(
            "{BLOCKING_ENV} must be 1 (blocking NCCL communicators) or 0 (non-blocking), found \
             {other:?}"
        ))),
    }
}

/// Why a pool's communicators were aborted: the first rank that gave up and what it waited for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommFault {
    /// The rank that aborted first.
    pub rank: usize,
    /// What happened, e.g. "rank 0 timed out after 600.0 s waiting for the transfer".
    pub cause: String,
}

impl std::fmt::Display for CommFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.cause)
    }
}

/// State shared by the ranks of one pool: the deadline, the first fault, and a test hook.
#[derive(Debug)]
pub(crate) struct CommHealth {
    timeout_ns: AtomicU64,
    faulted: AtomicBool,
    fault: Mutex<Option<CommFault>>,
    stall: Mutex<Option<(usize, Duration)>>,
}

impl CommHealth {
    pub(crate) fn new(timeout: Duration) -> Self {
        let h = CommHealth {
            timeout_ns: AtomicU64::new(0),
            faulted: AtomicBool::new(false),
            fault: Mutex::new(None),
            stall: Mutex::new(None),
        };
        h.set_timeout(timeout);
        h
    }

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn set_timeout(&self, timeout: Duration) {
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        // The guarded values are plain data: a panic while holding the lock leaves them valid.
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pool's fault, if any rank aborted.
    pub(crate) fn fault(&self) -> Option<CommFault> {
        if !self.faulted.load(Ordering::Acquire) {
            return None;
        }
        Self::lock(&self.fault).clone()
    }

    pub(crate) fn is_faulted(&self) -> bool {
        self.faulted.load(Ordering::Acquire)
    }

    /// Records `cause` as the pool's fault unless one is recorded already.
    pub(crate) fn record(&self, rank: usize, cause: &str) {
        let mut f = Self::lock(&self.fault);
        if f.is_none() {
            *f = Some(CommFault {
                rank,
                cause: cause.to_string(),
            });
        }
        self.faulted.store(true, Ordering::Release);
    }

    pub(crate) fn arm_stall(&self, rank: usize, duration: Duration) {
        *Self::lock(&self.stall) = Some((rank, duration));
    }

    fn take_stall(&self, rank: usize) -> Option<Duration> {
        let mut s = Self::lock(&self.stall);
        match *s {
            Some((r, d)) if r == rank => {
                *s = None;
                Some(d)
            }
            _ => None,
        }
    }
}

thread_local! {
    /// NCCL group depth of this thread, counted by [`group_start`] / [`group_end`].
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
}

fn in_group() -> bool {
    GROUP_DEPTH.with(|d| d.get() > 0)
}

/// `ncclGroupStart`, counted (aborts are deferred to the end of the group).
pub(crate) fn group_start(rank: usize) -> Result<(), CudaError> {
    // SAFETY: ncclGroupStart takes no arguments and only changes thread-local NCCL state.
    let r = unsafe { sys::ncclGroupStart() };
    match r {
        ncclResult_t::ncclSuccess => {
            GROUP_DEPTH.with(|d| d.set(d.get() + 1));
            Ok(())
        }
        e => Err(nccl_error(rank, "ncclGroupStart", e)),
    }
}

fn nccl_error(rank: usize, op: &str, r: ncclResult_t) -> CudaError {
    CudaError::Nccl {
        rank,
        op: op.to_string(),
        detail: format!("{r:?}"),
    }
}

/// `NCCL_CONFIG_INITIALIZER` of the NCCL 2.30 header cudarc's bindings follow: every field
/// "undefined" (NCCL's defaults), with the struct's size, magic and version. NCCL reads at most
/// its own struct's size and ignores fields newer than itself, so this works with NCCL ≥ 2.17.
pub(crate) fn config_initializer(nonblocking: bool) -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10_000 + 30 * 100,
        blocking: if nonblocking { 0 } else { 1 },
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// One rank's NCCL communicator (raw handle) and the stream its collectives run on. `!Send`: it
/// lives and dies on its rank's thread.
///
/// On a pool that places two ranks on one GPU ([`RankPlacement`](crate::RankPlacement)) the
/// communicator is *unavailable* ([`NcclComm::is_available`] is `false`): it was never created,
/// its stream still exists (peer copies run on it), and every operation returns
/// [`CudaError::NcclNeedsOneGpuPerRank`] without calling NCCL.
pub struct NcclComm {
    /// Null once aborted, and for an unavailable communicator.
    raw: Cell<sys::ncclComm_t>,
    /// Why there is no communicator: two ranks of the pool share a GPU.
    unavailable: Option<SharedGpu>,
    /// An abort asked for inside a group, run when the group ends.
    abort_due: Cell<bool>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    health: Arc<CommHealth>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("aborted", &self.is_aborted())
            .field("unavailable", &self.unavailable)
            .finish()
    }
}

/// What the state of a communicator says.
enum CommState {
    Ready,
    InProgress,
    Failed(String),
}

impl NcclComm {
    /// Creates rank `rank` of `world` from the unique id `id` with `ncclCommInitRankConfig`
    /// (non-blocking per `nonblocking`) and waits, with the pool's deadline, until it is ready.
    pub(crate) fn init(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: [c_char; 128],
        health: Arc<CommHealth>,
        nonblocking: bool,
    ) -> Result<Self, CudaError> {
        let invalid = |what: &str, v: usize| {
            CudaError::Invalid(format!("NCCL takes the {what} as an i32; found {v}"))
        };
        let nranks = i32::try_from(world).map_err(|_| invalid("world size", world))?;
        let me = i32::try_from(rank).map_err(|_| invalid("rank", rank))?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CudaError::driver(rank, "binding the context", 0, e))?;
        let mut config = config_initializer(nonblocking);
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call; the unique id is passed by value;
        // NCCL reads at most its own config struct's size (see `config_initializer`). The
        // device is the one whose context is current on this thread (bound above).
        let r = unsafe {
            sys::ncclCommInitRankConfig(
                &mut raw,
                nranks,
                sys::ncclUniqueId { internal: id },
                me,
                &mut config,
            )
        };
        if !matches!(r, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) || raw.is_null() {
            if !raw.is_null() {
                // SAFETY: a handle NCCL returned; aborting frees it, and it is not used again.
                unsafe { sys::ncclCommAbort(raw) };
            }
            return Err(nccl_error(rank, "ncclCommInitRankConfig", r));
        }
        let comm = NcclComm {
            raw: Cell::new(raw),
            unavailable: None,
            abort_due: Cell::new(false),
            stream,
            rank,
            world,
            health,
        };
        comm.wait_ready("creating the NCCL communicator")?;
        Ok(comm)
    }

    /// A communicator that was never created because ranks `shared.first` and `shared.second`
    /// share GPU `shared.device` (NCCL refuses that): its operations return
    /// [`SharedGpu::nccl_error`]; `stream` is still the rank's stream for network work.
    pub(crate) fn unavailable(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        health: Arc<CommHealth>,
        shared: SharedGpu,
    ) -> Self {
        NcclComm {
            raw: Cell::new(std::ptr::null_mut()),
            unavailable: Some(shared),
            abort_due: Cell::new(false),
            stream,
            rank,
            world,
            health,
        }
    }

    /// Whether this rank has an NCCL communicator: `false` on a pool that places two ranks on
    /// one GPU, whose NCCL operations all return [`CudaError::NcclNeedsOneGpuPerRank`].
    pub fn is_available(&self) -> bool {
        self.unavailable.is_none()
    }

    /// `Ok` when this rank has a communicator, else [`CudaError::NcclNeedsOneGpuPerRank`].
    pub fn require_available(&self) -> Result<(), CudaError> {
        match self.unavailable {
            None => Ok(()),
            Some(shared) => Err(shared.nccl_error()),
        }
    }

    /// The stream collectives run on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Whether this communicator was aborted (after a timeout or an NCCL error on any rank of
    /// the pool); every collective then returns [`CudaError::CommAborted`]. An unavailable
    /// communicator ([`NcclComm::is_available`]) was never created, so never aborted.
    pub fn is_aborted(&self) -> bool {
        self.is_available() && (self.raw.get().is_null() || self.abort_due.get())
    }

    pub(crate) fn health(&self) -> &Arc<CommHealth> {
        &self.health
    }

    fn state(&self) -> CommState {
        let raw = self.raw.get();
        if raw.is_null() {
            return CommState::Failed("the communicator was aborted".into());
        }
        let mut s = ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator of this thread (null once aborted); `s` is a
        // valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(raw, &mut s) };
        if r != ncclResult_t::ncclSuccess {
            return CommState::Failed(format!("ncclCommGetAsyncError returned {r:?}"));
        }
        match s {
            ncclResult_t::ncclSuccess => CommState::Ready,
            ncclResult_t::ncclInProgress => CommState::InProgress,
            e => CommState::Failed(format!("{e:?}")),
        }
    }

    /// Aborts the communicator (once) and records `cause` as the pool's fault. Inside an NCCL
    /// group the abort runs when the group ends.
    pub(crate) fn abort(&self, cause: &str) {
        self.health.record(self.rank, cause);
        if in_group() {
            self.abort_due.set(true);
            return;
        }
        let raw = self.raw.replace(std::ptr::null_mut());
        self.abort_due.set(false);
        if !raw.is_null() {
            // SAFETY: `raw` is live and, now replaced by null, never used again. Outside a group
            // ncclCommAbort runs to completion: it stops the device kernels and helper threads
            // and frees the communicator.
            unsafe { sys::ncclCommAbort(raw) };
        }
    }

    /// Waits (with the pool's deadline) until earlier calls' work is enqueued (state no longer
    /// `ncclInProgress`).
    fn wait_ready(&self, op: &str) -> Result<(), CudaError> {
        let mut probe = ReadyProbe {
            comm: self,
            error: None,
        };
        wait_with_deadline(&mut probe, self.health.timeout(), self.rank, op)
    }

    /// The checks every operation starts with: a live communicator, the test stall, a ready
    /// communicator.
    fn live(&self, op: &str) -> Result<sys::ncclComm_t, CudaError> {
        self.require_available()?;
        if let Some(d) = self.health.take_stall(self.rank) {
            let start = Instant::now();
            while start.elapsed() < d && !self.health.is_faulted() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if self.is_aborted() || self.health.is_faulted() {
            let cause = self
                .health
                .fault()
                .map_or_else(|| "this rank aborted it".to_string(), |f| f.cause);
            return Err(CudaError::CommAborted {
                rank: self.rank,
                op: op.to_string(),
                cause,
            });
        }
        if !matches!(self.state(), CommState::Ready) {
            self.wait_ready(op)?;
        }
        Ok(self.raw.get())
    }

    /// Runs one NCCL operation: checks first, then waits for its work to be enqueued when it
    /// returns `ncclInProgress` outside a group.
    fn enqueue(
        &self,
        op: &str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> ncclResult_t,
    ) -> Result<(), CudaError> {
        let raw = self.live(op)?;
        let r = call(raw, self.stream.cu_stream() as sys::cudaStream_t);
        match r {
            ncclResult_t::ncclSuccess => Ok(()),
            ncclResult_t::ncclInProgress if in_group() => Ok(()),
            ncclResult_t::ncclInProgress => self.wait_ready(op),
            e => Err(nccl_error(self.rank, op, e)),
        }
    }

    /// Sends `data` to `peer` (point-to-point; pair with the peer's [`NcclComm::recv`], usually
    /// inside a group).
    pub fn send<S: DevicePtr<T>, T: NcclType>(&self, data: &S, peer: i32) -> Result<(), CudaError> {
        let (src, _record) = data.device_ptr(&self.stream);
        let n = data.len();
        self.enqueue("ncclSend", |comm, stream| {
            // SAFETY: `src` addresses `n` elements of `T` on this communicator's device, kept
            // alive by the borrow of `data` (callers keep it alive until the stream ran the
            // send); the datatype matches `T`.
            unsafe { sys::ncclSend(src as _, n, T::as_nccl_type(), peer, comm, stream) }
        })
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<R: DevicePtrMut<T>, T: NcclType>(
        &self,
        buf: &mut R,
        peer: i32,
    ) -> Result<(), CudaError> {
        let n = buf.len();
        let (dst, _record) = buf.device_ptr_mut(&self.stream);
        self.enqueue("ncclRecv", |comm, stream| {
            // SAFETY: `dst` addresses `n` writable elements of `T` on this device, borrowed
            // mutably for the call; the datatype matches `T`.
            unsafe { sys::ncclRecv(dst as _, n, T::as_nccl_type(), peer, comm, stream) }
        })
    }

    /// All-gather: every rank's `send` (same length on every rank) into `recv` (world × as
    /// long), in rank order.
    pub fn all_gather<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<(), CudaError> {
        self.require_available()?;
        let n = send.len();
        if recv.len() != n * self.world {
            return Err(CudaError::Invalid(format!(
                "all-gather on rank {}: the receive buffer holds {} elements, {} ranks × {} \
                 sent need {}",
                self.rank,
                recv.len(),
                self.world,
                n,
                n * self.world
            )));
        }
        let (src, _r1) = send.device_ptr(&self.stream);
        let (dst, _r2) = recv.device_ptr_mut(&self.stream);
        self.enqueue("ncclAllGather", |comm, stream| {
            // SAFETY: `src` holds `n` and `dst` `world × n` elements of `T` (checked above) on
            // this device, borrowed for the call; the datatype matches `T`.
            unsafe { sys::ncclAllGather(src as _, dst as _, n, T::as_nccl_type(), comm, stream) }
        })
    }

    /// All-reduce of `send` into `recv` (same length) with `op`.
    pub fn all_reduce<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
    ) -> Result<(), CudaError> {
        self.require_available()?;
        let n = send.len();
        if recv.len() != n {
            return Err(CudaError::Invalid(format!(
                "all-reduce on rank {}: the receive buffer holds {} elements, the send buffer {}",
                self.rank,
                recv.len(),
                n
            )));
        }
        let red = reduce_op(op);
        let (src, _r1) = send.device_ptr(&self.stream);
        let (dst, _r2) = recv.device_ptr_mut(&self.stream);
        self.enqueue("ncclAllReduce", |comm, stream| {
            // SAFETY: both buffers hold `n` elements of `T` on this device, borrowed for the
            // call; the datatype matches `T`.
            unsafe {
                sys::ncclAllReduce(src as _, dst as _, n, T::as_nccl_type(), red, comm, stream)
            }
        })
    }

    /// In-place all-reduce of `buf` with `op`.
    pub fn all_reduce_in_place<R: DevicePtrMut<T>, T: NcclType>(
        &self,
        buf: &mut R,
        op: &ReduceOp,
    ) -> Result<(), CudaError> {
        let n = buf.len();
        let red = reduce_op(op);
        let (p, _r) = buf.device_ptr_mut(&self.stream);
        self.enqueue("ncclAllReduce (in place)", |comm, stream| {
            // SAFETY: `p` holds `n` elements of `T` on this device, borrowed mutably for the
            // call; in-place all-reduce (send == recv) is supported by NCCL.
            unsafe { sys::ncclAllReduce(p as _, p as _, n, T::as_nccl_type(), red, comm, stream) }
        })
    }

    /// Broadcast of `buf` from `root` to every rank, in place.
    pub fn broadcast_in_place<R: DevicePtrMut<T>, T: NcclType>(
        &self,
        buf: &mut R,
        root: i32,
    ) -> Result<(), CudaError> {
        let n = buf.len();
        let (p, _r) = buf.device_ptr_mut(&self.stream);
        self.enqueue("ncclBroadcast", |comm, stream| {
            // SAFETY: `p` holds `n` elements of `T` on this device, borrowed mutably for the
            // call; in-place broadcast (send == recv) is supported by NCCL.
            unsafe { sys::ncclBroadcast(p as _, p as _, n, T::as_nccl_type(), root, comm, stream) }
        })
    }

    /// `ncclGroupEnd`, then waits until the group's work is enqueued (the group is launched by
    /// a helper thread on non-blocking communicators); runs an abort deferred inside the group.
    pub(crate) fn group_end(&self) -> Result<(), CudaError> {
        // No communicator: no group was started either (`RankCtx::group_start` refuses too).
        self.require_available()?;
        // SAFETY: ncclGroupEnd takes no arguments; it launches the thread's group.
        let r = unsafe { sys::ncclGroupEnd() };
        GROUP_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        if self.abort_due.get() && !in_group() {
            let cause = self
                .health
                .fault()
                .map_or_else(|| "aborted inside a group".to_string(), |f| f.cause);
            self.abort(&cause);
        }
        match r {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => {}
            e => return Err(nccl_error(self.rank, "ncclGroupEnd", e)),
        }
        if in_group() {
            return Ok(());
        }
        if !self.raw.get().is_null() && self.health.is_faulted() {
            let cause = self.health.fault().map_or_else(String::new, |f| f.cause);
            self.abort(&cause);
        }
        if self.raw.get().is_null() {
            return Err(CudaError::CommAborted {
                rank: self.rank,
                op: "ncclGroupEnd".into(),
                cause: self
                    .health
                    .fault()
                    .map_or_else(|| "this rank aborted it".to_string(), |f| f.cause),
            });
        }
        self.wait_ready("enqueueing an NCCL group (ncclGroupEnd)")
    }

    /// The asynchronous error of a live communicator, `None` while healthy, in progress or
    /// aborted.
    pub(crate) fn async_error(&self) -> Option<String> {
        match self.state() {
            CommState::Failed(d) if !self.raw.get().is_null() => Some(d),
            _ => None,
        }
    }

    /// Whether NCCL is still enqueueing earlier work (a non-blocking group launch).
    pub(crate) fn in_progress(&self) -> bool {
        matches!(self.state(), CommState::InProgress)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let raw = self.raw.replace(std::ptr::null_mut());
        if !raw.is_null() {
            // SAFETY: `raw` is live and never used again. Aborting (as cudarc's `Comm` does on
            // drop) frees it without waiting for peers; its result is ignored: nothing can be
            // done about a failure while dropping.
            unsafe { sys::ncclCommAbort(raw) };
        }
    }
}

fn reduce_op(op: &ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

/// Polls the communicator's state until earlier calls' work is enqueued.
struct ReadyProbe<'a> {
    comm: &'a NcclComm,
    error: Option<String>,
}

impl WaitProbe for ReadyProbe<'_> {
    fn finished(&mut self) -> Result<bool, CudaError> {
        match self.comm.state() {
            CommState::Ready => Ok(true),
            CommState::InProgress => Ok(false),
            CommState::Failed(d) => {
                if self.comm.raw.get().is_null() {
                    // Aborted: nothing left to enqueue; the caller's next check reports it.
                    return Ok(true);
                }
                self.error = Some(d);
                Ok(false)
            }
        }
    }
    fn comm_error(&mut self) -> Option<String> {
        self.error.take()
    }
    fn pool_fault(&self) -> Option<String> {
        self.comm.health.fault().map(|f| f.cause)
    }
    fn abort(&mut self, cause: &str) {
        self.comm.abort(cause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_as_positive_seconds() {
        assert_eq!(parse_timeout("600").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_timeout(" 0.25 ").unwrap(), Duration::from_millis(250));
        for bad in ["", "0", "-3", "ten", "inf", "NaN", "1e12"] {
            let e = parse_timeout(bad).unwrap_err().to_string();
            assert!(
                e.contains(TIMEOUT_ENV) && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn the_blocking_switch_parses_strictly() {
        assert!(parse_blocking("1").unwrap());
        assert!(!parse_blocking(" false ").unwrap());
        let e = parse_blocking("yes").unwrap_err().to_string();
        assert!(e.contains(BLOCKING_ENV) && e.contains("\"yes\""), "{e}");
    }

    #[test]
    fn the_config_initializer_asks_for_nccl_defaults() {
        let c = config_initializer(true);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 23_000, 0));
        assert_eq!(
            (c.minCTAs, c.maxCTAs, c.nvlsCTAs),
            (i32::MIN, i32::MIN, i32::MIN)
        );
        assert!(c.netName.is_null() && c.commName.is_null());
        assert_eq!(config_initializer(false).blocking, 1);
    }

    #[test]
    fn the_first_fault_wins_and_stalls_are_one_shot() {
        let h = CommHealth::new(Duration::from_secs(3));
        assert_eq!(h.timeout(), Duration::from_secs(3));
        assert!(h.fault().is_none());
        h.record(0, "rank 0 timed out");
        h.record(1, "rank 1 saw it");
        assert_eq!(
            h.fault(),
            Some(CommFault {
                rank: 0,
                cause: "rank 0 timed out".into()
            })
        );
        h.arm_stall(1, Duration::from_secs(5));
        assert_eq!(h.take_stall(0), None);
        assert_eq!(h.take_stall(1), Some(Duration::from_secs(5)));
        assert_eq!(h.take_stall(1), None);
        h.set_timeout(Duration::ZERO);
        assert_eq!(h.timeout(), Duration::from_nanos(1));
    }
}
