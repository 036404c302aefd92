//! Ranks: one persistent thread per rank, each owning its context, streams, kernels and NCCL
//! communicator ([`NcclComm`] is `!Send`, so it never leaves its thread). Ranks run one per GPU,
//! or several on one GPU ([`RankPlacement`]); a pool with ranks sharing a GPU has no NCCL
//! communicators (NCCL refuses two ranks of one communicator on one GPU).
//!
//! The [`RankExecutor`] trait is the seam where a multi-process launcher (one rank per process)
//! plugs in later: backends only ever run per-rank closures through it.
//!
//! Waits on NCCL work are bounded: [`RankCtx::wait`], [`RankCtx::sync_all`] and
//! [`RankCtx::group_end`] poll with the pool's deadline ([`CollectiveSettings`]) and abort the
//! communicator when it passes, so a stalled or dead peer ends in
//! [`CudaError::CollectiveTimeout`] on the ranks that waited for it, never in a hang.

use std::cell::{OnceCell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::Id;

use crate::comm::{group_start, CollectiveSettings, CommFault, CommHealth, NcclComm};
use crate::deadline::{wait_with_deadline, WaitProbe};
use crate::handoff::{recv_soon, ANSWER_WINDOW, NEXT_JOB_WINDOW};
use crate::kernels::{compile_kernels, Kernels};
use crate::modules::{KernelSet, LoadedModule, ModuleCache};
use crate::placement::{RankPlacement, SharedGpu};
use crate::verify::VerifyKernels;
use crate::{check_environment, CudaError};

/// Everything one rank's work needs on its own thread.
pub struct RankCtx {
    /// This rank, `0..world`.
    pub rank: usize,
    /// W.
    pub world: usize,
    /// The device context (event tracking disabled: callers order streams with explicit events).
    pub ctx: Arc<CudaContext>,
    /// Stream for casts and local copies, at the greatest priority (it feeds the network).
    pub compute: Arc<CudaStream>,
    /// A second compute stream for work independent of `compute` (local casts that must not
    /// queue behind waits for the network), at the lowest priority.
    pub aux: Arc<CudaStream>,
    /// Stream for host↔device copies (offload / reload), so they overlap NVLink work.
    pub copy: Arc<CudaStream>,
    /// The NCCL communicator (non-blocking by default); its stream is a third stream
    /// dedicated to collectives (and to peer copies). Unavailable
    /// ([`NcclComm::is_available`]) on a pool whose ranks share a GPU.
    pub comm: NcclComm,
    /// Kernels loaded into this context.
    pub kernels: Kernels,
    /// Verification kernels, compiled and loaded on first use.
    verify: OnceCell<VerifyKernels>,
    /// The word the casts and quantisations set when they read a NaN or an infinity
    /// ([`RankCtx::nonfinite_flag`]), allocated zeroed on first use.
    nonfinite: RefCell<Option<CudaSlice<u32>>>,
    /// Kernel sets loaded into this context.
    modules: ModuleCache,
}

impl RankCtx {
    /// The communicator's stream.
    pub fn nccl_stream(&self) -> Arc<CudaStream> {
        self.comm.stream()
    }

    /// Maps a driver error of this rank.
    pub fn drv(
        &self,
        op: &str,
        bytes: u64,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + use<> {
        let rank = self.rank;
        let op = op.to_string();
        move |e| CudaError::driver(rank, op, bytes, e)
    }

    /// Free and total device memory of this rank's GPU, in bytes (the driver's
    /// `cuMemGetInfo`: memory other processes and other ranks of the GPU hold is not free).
    pub fn device_memory(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(self.drv("reading free device memory", 0))?;
        Ok((free as u64, total as u64))
    }

    /// A new event on this rank's context (timing disabled, cheap).
    pub fn event(&self) -> Result<CudaEvent, CudaError> {
        self.ctx
            .new_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(self.drv("creating an event", 0))
    }

    /// Makes `waiter` wait for all work queued so far on `on`.
    pub fn order(&self, on: &CudaStream, waiter: &CudaStream) -> Result<(), CudaError> {
        let e = self.event()?;
        e.record(on).map_err(self.drv("recording an event", 0))?;
        waiter.wait(&e).map_err(self.drv("waiting on an event", 0))
    }

    /// Returns the memory cached in this device's stream-ordered pool to the driver (so other
    /// processes or allocators can use it). The next allocations map memory again, which costs
    /// roughly 2–3 ms per GB on an H200.
    pub fn trim_pool(&self) -> Result<(), CudaError> {
        self.sync_all()?;
        let pool = default_pool(&self.ctx, self.rank)?;
        // SAFETY: `pool` is this device's default memory pool, valid for the context's lifetime.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) }
            .result()
            .map_err(self.drv("trimming the memory pool", 0))
    }

    /// Blocks until the compute, auxiliary, copy and NCCL streams are idle, with the pool's
    /// deadline (see [`RankCtx::wait`]).
    pub fn sync_all(&self) -> Result<(), CudaError> {
        let nccl = self.comm.stream();
        self.wait(
            &[&self.compute, &self.aux, &self.copy, &nccl],
            "synchronizing the rank's streams",
        )
    }

    /// Blocks until `streams` are idle, polling with the pool's deadline
    /// ([`RankCtx::collective_timeout`]) instead of synchronising, so NCCL work waiting for a
    /// stalled or dead peer cannot hang this thread:
    /// - past the deadline this rank's communicator is aborted and the pool marked faulted:
    ///   [`CudaError::CollectiveTimeout`] naming the rank, `op` and the deadline;
    /// - an asynchronous NCCL error aborts it too: [`CudaError::Nccl`];
    /// - when another rank of the pool aborted while NCCL work of this rank was pending on the
    ///   awaited streams, this rank aborts as well: [`CudaError::CommAborted`].
    ///
    /// Streams with no NCCL work (copies, casts) are awaited the same way, so the deadline bounds
    /// every wait of the backends.
    pub fn wait(&self, streams: &[&CudaStream], op: &str) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(self.drv("binding the context", 0))?;
        let nccl = self.comm.stream();
        let mut probe = StreamsProbe {
            ctx: self,
            streams,
            nccl_awaited: streams.iter().any(|s| s.cu_stream() == nccl.cu_stream()),
            nccl_idle: true,
        };
        wait_with_deadline(&mut probe, self.collective_timeout(), self.rank, op)
    }

    /// `ncclGroupStart` (pair with [`RankCtx::group_end`]). On a pool whose ranks share a GPU
    /// (no communicator) it starts nothing and returns [`CudaError::NcclNeedsOneGpuPerRank`].
    pub fn group_start(&self) -> Result<(), CudaError> {
        self.comm.require_available()?;
        group_start(self.rank)
    }

    /// `ncclGroupEnd`, then waits (with the deadline) until the group's work is on the NCCL
    /// stream: a non-blocking communicator launches the group from a helper thread and returns
    /// `ncclInProgress`, so an event recorded right after a bare `ncclGroupEnd` would not cover
    /// the group's work.
    pub fn group_end(&self) -> Result<(), CudaError> {
        self.comm.group_end()
    }

    /// The deadline of every wait on NCCL work ([`CollectiveSettings::timeout`]).
    pub fn collective_timeout(&self) -> Duration {
        self.comm.health().timeout()
    }

    /// The verification kernels (device hashes, non-finite scan), compiled with NVRTC and
    /// loaded into this context on first use.
    pub fn verify_kernels(&self) -> Result<&VerifyKernels, CudaError> {
        if let Some(k) = self.verify.get() {
            return Ok(k);
        }
        let k = VerifyKernels::load(self)?;
        Ok(self.verify.get_or_init(|| k))
    }

    /// The device address of this rank's non-finite flag: the casts and quantisations of a
    /// program run set it to 1 when a value they read is a NaN or an infinity, in the same pass
    /// (no scan of their own). Read it with [`RankCtx::take_nonfinite`] once that work is done.
    pub fn nonfinite_flag(&self) -> Result<u64, CudaError> {
        let mut cell = self.nonfinite.borrow_mut();
        if cell.is_none() {
            let f = self
                .compute
                .alloc_zeros::<u32>(1)
                .map_err(self.drv("allocating the non-finite flag", 4))?;
            // zeroed before any other stream's kernel may set it
            self.compute
                .synchronize()
                .map_err(self.drv("allocating the non-finite flag", 4))?;
            *cell = Some(f);
        }
        match cell.as_ref() {
            Some(f) => Ok(self.addr(f)),
            None => Err(CudaError::Invalid(
                "the non-finite flag was not allocated".into(),
            )),
        }
    }

    /// Whether a kernel set the non-finite flag since the last call, which clears it (waits for
    /// the compute stream: call it once the work that may set the flag is done).
    pub fn take_nonfinite(&self) -> Result<bool, CudaError> {
        let mut cell = self.nonfinite.borrow_mut();
        let Some(f) = cell.as_mut() else {
            return Ok(false);
        };
        // the quantisations run on the auxiliary stream
        self.aux
            .synchronize()
            .map_err(self.drv("reading the non-finite flag", 4))?;
        let word = self
            .compute
            .clone_dtoh(f)
            .map_err(self.drv("reading the non-finite flag", 4))?;
        if word.first().copied().unwrap_or(0) == 0 {
            return Ok(false);
        }
        self.compute
            .memset_zeros(f)
            .map_err(self.drv("clearing the non-finite flag", 4))?;
        self.compute
            .synchronize()
            .map_err(self.drv("clearing the non-finite flag", 4))?;
        Ok(true)
    }

    /// `set` loaded into this rank's context: compiled once per process and architecture, loaded
    /// once per context, then shared by every caller.
    pub fn module(&self, set: &KernelSet) -> Result<Arc<LoadedModule>, CudaError> {
        self.modules
            .get(&self.ctx, set, self.rank, self.kernels.sm_count())
    }

    /// Streaming multiprocessors of this rank's device (read once, when the rank started).
    pub fn sm_count(&self) -> u32 {
        self.kernels.sm_count()
    }
}

/// Polls a rank's streams (and its communicator's state) for [`RankCtx::wait`].
struct StreamsProbe<'a> {
    ctx: &'a RankCtx,
    streams: &'a [&'a CudaStream],
    nccl_awaited: bool,
    nccl_idle: bool,
}

impl WaitProbe for StreamsProbe<'_> {
    fn finished(&mut self) -> Result<bool, CudaError> {
        use cudarc::driver::sys::{cuStreamQuery, CUresult};
        let nccl = self.ctx.comm.stream().cu_stream();
        let mut all = true;
        for s in self.streams {
            // SAFETY: the stream handle belongs to this rank's live context (the `CudaStream`
            // is borrowed for the call); cuStreamQuery only reads its state.
            let r = unsafe { cuStreamQuery(s.cu_stream()) };
            let idle = match r {
                CUresult::CUDA_SUCCESS => true,
                CUresult::CUDA_ERROR_NOT_READY => false,
                e => {
                    return Err(CudaError::driver(
                        self.ctx.rank,
                        "querying a stream",
                        0,
                        cudarc::driver::DriverError(e),
                    ))
                }
            };
            if s.cu_stream() == nccl {
                self.nccl_idle = idle;
            }
            all &= idle;
        }
        // NCCL may still be enqueueing work (a non-blocking group launch) onto its stream.
        if self.nccl_awaited && self.ctx.comm.in_progress() {
            self.nccl_idle = false;
            return Ok(false);
        }
        Ok(all)
    }

    fn comm_error(&mut self) -> Option<String> {
        self.ctx.comm.async_error()
    }

    fn pool_fault(&self) -> Option<String> {
        let comm = &self.ctx.comm;
        if comm.is_aborted() || !comm.is_available() {
            // No NCCL work of this rank can wait for a peer: wait for the copies and kernels.
            return None;
        }
        let fault = comm.health().fault()?;
        if self.nccl_awaited && !self.nccl_idle {
            // NCCL work of this rank is pending and may need the rank that gave up.
            return Some(fault.cause);
        }
        // Nothing of NCCL pending here: give the communicator up quietly (later collectives
        // fail at once) and keep waiting for the copies and kernels.
        comm.abort(&fault.cause);
        None
    }

    fn abort(&mut self, cause: &str) {
        self.ctx.comm.abort(cause);
    }
}

/// A per-rank closure run by a [`RankExecutor`].
pub type RankFn<'f, T, R> = dyn Fn(&RankCtx, &mut T) -> Result<R, CudaError> + Sync + 'f;

/// Runs per-rank work where each rank's resources live: the seam between backends and the way
/// ranks are launched (threads of one process now, processes later).
pub trait RankExecutor {
    /// W: ranks in the whole job.
    fn world(&self) -> usize;

    /// The global ranks this process drives, in the order `run_each` takes its items: `0..W` in
    /// the single-process mode, one rank per process when launched like PyTorch.
    fn local_ranks(&self) -> &[usize];

    /// Runs `f(ctx, &mut items[i])` on local rank `local_ranks()[i]` for every `i` concurrently
    /// and returns the results in that order; the first error (by rank) wins, after every rank
    /// finished. `ctx.rank` is the global rank.
    fn run_each<T: Send, R: Send>(
        &self,
        items: &mut [T],
        f: &RankFn<'_, T, R>,
    ) -> Result<Vec<R>, CudaError>;

    /// Runs `f(ctx)` on every local rank.
    fn run<R: Send>(
        &self,
        f: &(dyn Fn(&RankCtx) -> Result<R, CudaError> + Sync),
    ) -> Result<Vec<R>, CudaError> {
        let mut unit = vec![(); self.local_ranks().len()];
        self.run_each(&mut unit, &|ctx, _| f(ctx))
    }
}

type Job = Box<dyn FnOnce(&RankCtx) + Send + 'static>;

struct Worker {
    jobs: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

/// One persistent thread per rank this process drives: ranks `0..world` on devices `0..world`
/// ([`ThreadRankPool::new`], the single-process mode), ranks `0..world` on the GPUs of a
/// [`RankPlacement`] ([`ThreadRankPool::on_devices`], [`ThreadRankPool::with_placement`]; GPUs
/// may repeat), or this process's one rank on its local GPU ([`ThreadRankPool::for_process`],
/// launched like PyTorch with torchrun, Slurm or `lifecycle-launch`).
///
/// Each thread creates its context, streams (compute, copy, NCCL), loads the NVRTC kernels and
/// creates its own non-blocking NCCL communicator from one NCCL `Id` (made by the pool, or by
/// rank 0 and shared over the TCP rendezvous). Work handed to the threads and their answers are
/// polled for before anyone blocks (a rank thread for 2 ms after each job, the caller for 32 ms),
/// so the few hand-overs of a switch cost microseconds, not a scheduler wake-up each.
///
/// # Several ranks on one GPU
/// NCCL refuses two ranks of one communicator on one GPU, so a pool whose placement repeats a
/// GPU creates no communicators ([`ThreadRankPool::shared_gpu`] names the first such pair): its
/// ranks share the GPU's primary context, each with its own thread, streams and buffers, and
/// move bytes with peer copies only (copies between ranks on one GPU are device-local; ranks on
/// different GPUs need peer access, see [`ThreadRankPool::peer_access`]).
/// [`Transport::Auto`](crate::Transport::Auto) resolves to peer copies there,
/// [`Transport::Nccl`](crate::Transport::Nccl) and every NCCL operation are refused with
/// [`CudaError::NcclNeedsOneGpuPerRank`]. This runs the multi-rank logic of the backends on a
/// machine with fewer GPUs than ranks; it measures nothing about the links.
///
/// ```no_run
/// use lifecycle_cuda::{RankExecutor, ThreadRankPool, Transport};
///
/// // Three ranks on GPU 0.
/// let pool = ThreadRankPool::on_devices(&[0, 0, 0])?;
/// assert_eq!(pool.world(), 3);
/// assert!(pool.shared_gpu().is_some());
/// assert!(Transport::Auto.resolve(&pool)?); // peer copies
/// assert!(Transport::Nccl.resolve(&pool).is_err());
/// # Ok::<(), lifecycle_cuda::CudaError>(())
/// ```
///
/// # When a peer stalls or dies
/// Every wait on NCCL work is bounded by [`CollectiveSettings::timeout`] (10 minutes by
/// default; the environment variable `LIFECYCLE_NCCL_TIMEOUT_S` overrides it in [`new`] and
/// [`for_process`], [`set_collective_timeout`] at run time; `LIFECYCLE_NCCL_BLOCKING=1` makes
/// the communicators blocking, see [`CollectiveSettings::nonblocking`]). Past it the waiting rank aborts
/// its communicator and returns [`CudaError::CollectiveTimeout`]; the other ranks of the pool
/// abort theirs as soon as they see it ([`CudaError::CommAborted`]). From then on
/// [`comm_fault`] says why, every collective fails at once with [`CudaError::CommAborted`]
/// (rebuild the pool), and work without collectives (reloading or downloading the training
/// state) still runs, so a backend can restore its state before the pool is replaced.
///
/// [`new`]: ThreadRankPool::new
/// [`for_process`]: ThreadRankPool::for_process
/// [`set_collective_timeout`]: ThreadRankPool::set_collective_timeout
/// [`comm_fault`]: ThreadRankPool::comm_fault
pub struct ThreadRankPool {
    workers: Vec<Worker>,
    world: usize,
    ranks: Vec<usize>,
    /// The GPU of each local rank, in the order of `ranks`.
    devices: Vec<usize>,
    /// The first pair of ranks on one GPU: the pool then has no NCCL communicators.
    shared: Option<SharedGpu>,
    health: Arc<CommHealth>,
    /// Whether peer access is set up (`None` until [`ThreadRankPool::peer_access`] ran).
    peer: std::sync::Mutex<Option<bool>>,
}

impl std::fmt::Debug for ThreadRankPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadRankPool")
            .field("world", &self.world)
            .field("ranks", &self.ranks)
            .field("devices", &self.devices)
            .field("shared", &self.shared)
            .finish()
    }
}

impl ThreadRankPool {
    /// Checks the environment ([`check_environment`]), then starts `world` ranks on GPUs
    /// `0..world`, with [`CollectiveSettings::from_env`]. Fewer GPUs than `world` is
    /// [`CudaError::TooFewGpus`].
    pub fn new(world: usize) -> Result<Self, CudaError> {
        Self::with_settings(world, CollectiveSettings::from_env()?)
    }

    /// [`ThreadRankPool::new`] with explicit collective settings.
    pub fn with_settings(world: usize, settings: CollectiveSettings) -> Result<Self, CudaError> {
        Self::with_placement(RankPlacement::one_per_gpu(world)?, settings)
    }

    /// Ranks `0..devices.len()`, rank `r` on GPU `devices[r]` (GPUs may repeat: see
    /// [several ranks on one GPU](ThreadRankPool#several-ranks-on-one-gpu)), with
    /// [`CollectiveSettings::from_env`]. Errors as [`ThreadRankPool::with_placement`].
    pub fn on_devices(devices: &[usize]) -> Result<Self, CudaError> {
        Self::with_placement(
            RankPlacement::on_devices(devices)?,
            CollectiveSettings::from_env()?,
        )
    }

    /// Checks the environment ([`check_environment`]) and the placement against the visible
    /// GPUs ([`RankPlacement::check`]), then starts one rank per entry of `placement`. Every rank
    /// gets an NCCL communicator when each has a GPU of its own; none does when a GPU repeats
    /// ([`ThreadRankPool::shared_gpu`]).
    pub fn with_placement(
        placement: RankPlacement,
        settings: CollectiveSettings,
    ) -> Result<Self, CudaError> {
        let env = check_environment(1)?;
        placement.check(env.devices)?;
        let comms = match placement.shared_gpu() {
            Some(shared) => Comms::Unavailable(shared),
            None => {
                let id =
                    Id::new().map_err(|e| CudaError::nccl(0, "creating the NCCL unique id", e))?;
                Comms::Nccl(*id.internal())
            }
        };
        let assignments: Vec<(usize, usize)> =
            placement.devices().iter().copied().enumerate().collect();
        Self::start(placement.world(), assignments, comms, settings)
    }

    /// The GPU of each local rank, in the order of [`RankExecutor::local_ranks`].
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The first pair of ranks this pool places on one GPU; `None` when every rank has a GPU of
    /// its own. A pool with such a pair has no NCCL communicators.
    pub fn shared_gpu(&self) -> Option<SharedGpu> {
        self.shared
    }

    /// `Ok` when the ranks have NCCL communicators; [`CudaError::NcclNeedsOneGpuPerRank`] on a
    /// pool whose ranks share a GPU. Backends call it before choosing work that needs NCCL.
    pub fn require_nccl(&self) -> Result<(), CudaError> {
        match self.shared {
            None => Ok(()),
            Some(shared) => Err(shared.nccl_error()),
        }
    }

    /// The cached answer of [`ThreadRankPool::peer_access`].
    pub(crate) fn peer_state(&self) -> &std::sync::Mutex<Option<bool>> {
        &self.peer
    }

    /// The deadline of every wait on NCCL work.
    pub fn collective_timeout(&self) -> Duration {
        self.health.timeout()
    }

    /// Changes the deadline of every wait on NCCL work, from the next wait on.
    pub fn set_collective_timeout(&self, timeout: Duration) {
        self.health.set_timeout(timeout);
    }

    /// Why the pool's communicators were aborted (`None` while they are healthy). Once set, every
    /// collective returns [`CudaError::CommAborted`]: rebuild the pool.
    pub fn comm_fault(&self) -> Option<CommFault> {
        self.health.fault()
    }

    /// **Test hook** (fault injection): the next NCCL operation that `rank` issues first sleeps
    /// for `duration`, as a rank that hangs before its part of a collective would; its peers
    /// then wait on NCCL work that cannot finish. The sleep ends early once the pool's
    /// communicators are aborted (so a test's run returns after the peers' deadline), after
    /// which the operation fails with [`CudaError::CommAborted`]. Nothing else changes.
    pub fn inject_stall(&self, rank: usize, duration: Duration) {
        self.health.arm_stall(rank, duration);
    }

    /// The rank of this process in a job launched like PyTorch: global rank `env.rank` of
    /// `env.world_size` on local GPU `env.local_rank`. Rank 0 makes the NCCL id and shares it over
    /// the TCP rendezvous at `MASTER_ADDR:MASTER_PORT`; every rank waits at most `timeout` for it.
    ///
    /// Collective settings come from [`CollectiveSettings::from_env`].
    pub fn for_process(
        env: &lifecycle_dist::RankEnv,
        timeout: std::time::Duration,
    ) -> Result<Self, CudaError> {
        Self::for_process_with(env, timeout, CollectiveSettings::from_env()?)
    }

    /// [`ThreadRankPool::for_process`] with explicit collective settings.
    pub fn for_process_with(
        env: &lifecycle_dist::RankEnv,
        timeout: std::time::Duration,
        settings: CollectiveSettings,
    ) -> Result<Self, CudaError> {
        if env.world_size == 0 {
            return Err(CudaError::ZeroWorld);
        }
        check_environment(env.local_rank + 1)?;
        let root_id = if env.rank == 0 {
            let id = Id::new().map_err(|e| CudaError::nccl(0, "creating the NCCL unique id", e))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let bytes = lifecycle_dist::share_from_root(env, || root_id, timeout)?;
        let mut internal = [0 as core::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(CudaError::Invalid(format!(
                "the rendezvous delivered {} bytes, an NCCL unique id has {}",
                bytes.len(),
                internal.len()
            )));
        }
        for (dst, &b) in internal.iter_mut().zip(&bytes) {
            *dst = b as core::ffi::c_char;
        }
        Self::start(
            env.world_size,
            vec![(env.rank, env.local_rank)],
            Comms::Nccl(internal),
            settings,
        )
    }

    /// Starts one worker thread per `(global rank, device)` assignment.
    fn start(
        world: usize,
        assignments: Vec<(usize, usize)>,
        comms: Comms,
        settings: CollectiveSettings,
    ) -> Result<Self, CudaError> {
        let health = Arc::new(CommHealth::new(settings.timeout));
        let first_device = assignments.first().map_or(0, |a| a.1);
        let ptx_ctx = CudaContext::new(first_device)
            .map_err(|e| CudaError::driver(0, "creating a context", 0, e))?;
        let (major, minor) = ptx_ctx
            .compute_capability()
            .map_err(|e| CudaError::driver(0, "reading the compute capability", 0, e))?;
        let ptx = compile_kernels(major, minor)?;
        let (ready_tx, ready_rx) = channel::<(usize, Result<(), CudaError>)>();
        let mut workers = Vec::with_capacity(assignments.len());
        for &(rank, device) in &assignments {
            let (jtx, jrx) = channel::<Job>();
            let ready = ready_tx.clone();
            let ptx = ptx.clone();
            let health = health.clone();
            let nonblocking = settings.nonblocking;
            let handle = std::thread::Builder::new()
                .name(format!("lifecycle-rank-{rank}"))
                .spawn(move || {
                    let init = init_rank(rank, device, world, comms, ptx, &health, nonblocking);
                    match init {
                        Ok(ctx) => {
                            let _ = ready.send((rank, Ok(())));
                            drop(ready);
                            worker_loop(ctx, jrx);
                        }
                        Err(e) => {
                            // The other ranks' communicator setup waits for this one: let them
                            // give up now rather than at the deadline.
                            health.record(rank, &format!("rank {rank} failed to start: {e}"));
                            let _ = ready.send((rank, Err(e)));
                        }
                    }
                })
                .map_err(|e| CudaError::Worker {
                    rank,
                    detail: format!("could not spawn the thread: {e}"),
                })?;
            workers.push(Worker {
                jobs: Some(jtx),
                handle: Some(handle),
            });
        }
        drop(ready_tx);
        let ranks = assignments.iter().map(|a| a.0).collect();
        let devices = assignments.iter().map(|a| a.1).collect();
        let shared = match comms {
            Comms::Unavailable(s) => Some(s),
            Comms::Nccl(_) => None,
        };
        let pool = ThreadRankPool {
            workers,
            world,
            ranks,
            devices,
            shared,
            health,
            peer: std::sync::Mutex::new(None),
        };
        let mut first_err = None;
        for _ in 0..assignments.len() {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((_, Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(CudaError::Worker {
                        rank: 0,
                        detail: "a rank thread exited during setup".into(),
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(pool),
        }
    }
}

/// How the ranks of a pool get their communicators.
#[derive(Clone, Copy)]
enum Comms {
    /// From this NCCL unique id.
    Nccl([core::ffi::c_char; 128]),
    /// Not at all: these two ranks share a GPU.
    Unavailable(SharedGpu),
}

fn init_rank(
    rank: usize,
    device: usize,
    world: usize,
    comms: Comms,
    ptx: cudarc::nvrtc::Ptx,
    health: &Arc<CommHealth>,
    nonblocking: bool,
) -> Result<RankCtx, CudaError> {
    let ctx = CudaContext::new(device)
        .map_err(|e| CudaError::driver(rank, "creating a context", 0, e))?;
    // SAFETY: every buffer made on this context is ordered across streams by explicit events
    // recorded by the backends (`RankCtx::order`), and freed only after the streams using it were
    // synchronised; no slice is written by two streams at once.
    unsafe { ctx.disable_event_tracking() };
    keep_pool_mapped(&ctx, rank)?;
    // Stream priorities: the streams that feed the network (staged casts on `compute`, the NCCL
    // stream) get the greatest priority, so their blocks are scheduled ahead of the bulk local
    // casts on `aux` whenever both have work; the copy engine stream is unaffected.
    let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
        .map_err(|e| CudaError::driver(rank, "reading the stream priority range", 0, e))?;
    let mk = |what: &str, priority: i32| {
        ctx.new_stream_with_priority(priority)
            .map_err(|e| CudaError::driver(rank, format!("creating the {what} stream"), 0, e))
    };
    let compute = mk("compute", greatest)?;
    let aux = mk("auxiliary compute", least)?;
    let copy = mk("copy", least)?;
    let nccl = mk("NCCL", greatest)?;
    let kernels = Kernels::load(&compute, ptx, rank)?;
    let comm = match comms {
        Comms::Nccl(id) => NcclComm::init(nccl, rank, world, id, health.clone(), nonblocking)?,
        Comms::Unavailable(shared) => {
            NcclComm::unavailable(nccl, rank, world, health.clone(), shared)
        }
    };
    Ok(RankCtx {
        rank,
        world,
        ctx,
        compute,
        aux,
        copy,
        comm,
        kernels,
        verify: OnceCell::new(),
        nonfinite: RefCell::new(None),
        modules: ModuleCache::default(),
    })
}

fn default_pool(
    ctx: &Arc<CudaContext>,
    rank: usize,
) -> Result<cudarc::driver::sys::CUmemoryPool, CudaError> {
    ctx.bind_to_thread()
        .map_err(|e| CudaError::driver(rank, "binding the context", 0, e))?;
    let mut pool = std::mem::MaybeUninit::uninit();
    // SAFETY: `pool` is a valid out-pointer; the device handle comes from a live context.
    unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()) }
        .result()
        .map_err(|e| CudaError::driver(rank, "reading the default memory pool", 0, e))?;
    // SAFETY: initialised by the successful call above.
    Ok(unsafe { pool.assume_init() })
}

/// Sets up the device's stream-ordered pool:
/// - freed memory stays mapped (release threshold = max), as PyTorch's caching allocator does:
///   freeing the rollout weights or the offloaded training state and allocating them again then
///   reuses mapped pages instead of unmapping and remapping tens of GB per switch
///   ([`RankCtx::trim_pool`] gives the memory back to the driver on demand);
/// - an allocation never takes memory whose free is still pending on another stream by making
///   its own stream wait for that stream (the driver's "internal dependencies", off): an
///   overlapped offload frees the training state on the copy stream while the rollout runs, and
///   such a wait would stall the rollout behind the whole offload. Memory freed on another stream
///   is reused once the allocating stream is ordered after the free (event dependencies, which a
///   [`FreeingRoom`](crate::FreeingRoom) provides) or once the free has run.
fn keep_pool_mapped(ctx: &Arc<CudaContext>, rank: usize) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUmemPool_attribute as Attr;
    let pool = default_pool(ctx, rank)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a pointer to a u64 (cuuint64_t), valid for the call.
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| CudaError::driver(rank, "setting the memory pool's release threshold", 0, e))?;
    let mut off: i32 = 0;
    // SAFETY: the attribute takes a pointer to an int, valid for the call.
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&mut off as *mut i32).cast(),
        )
    }
    .result()
    .map_err(|e| {
        CudaError::driver(
            rank,
            "turning off the memory pool's internal dependencies",
            0,
            e,
        )
    })
}

fn worker_loop(ctx: RankCtx, jobs: Receiver<Job>) {
    while let Ok(job) = recv_soon(&jobs, NEXT_JOB_WINDOW) {
        job(&ctx);
    }
    let _ = ctx.sync_all();
}

impl RankExecutor for ThreadRankPool {
    fn world(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn run_each<T: Send, R: Send>(
        &self,
        items: &mut [T],
        f: &RankFn<'_, T, R>,
    ) -> Result<Vec<R>, CudaError> {
        let local = self.ranks.len();
        if items.len() != local {
            return Err(CudaError::Invalid(format!(
                "run_each needs one item per local rank: {} items for {} ranks",
                items.len(),
                local
            )));
        }
        let (done_tx, done_rx) = channel::<(usize, Result<R, CudaError>)>();
        let mut sent = 0usize;
        let mut results: Vec<Option<Result<R, CudaError>>> = (0..local).map(|_| None).collect();
        for (i, (item, worker)) in items.iter_mut().zip(&self.workers).enumerate() {
            let rank = self.ranks[i];
            let done = done_tx.clone();
            let job: Box<dyn FnOnce(&RankCtx) + Send + '_> = Box::new(move |ctx: &RankCtx| {
                let out = std::panic::catch_unwind(AssertUnwindSafe(|| f(ctx, item)));
                let out = out.unwrap_or_else(|p| {
                    let detail = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "panic".into());
                    Err(CudaError::Worker { rank, detail })
                });
                let _ = done.send((i, out));
            });
            // SAFETY: the job borrows `items` and `f` for the lifetime of this call only. We
            // erase that lifetime to send it to the persistent worker, and do not return before
            // every job sent has finished: each job's last act is sending on `done`, after which
            // it touches no borrowed data, and we wait below for one message per sent job. A job
            // that cannot be sent comes back inside the `SendError` and is dropped here.
            let job: Job =
                unsafe { std::mem::transmute::<Box<dyn FnOnce(&RankCtx) + Send + '_>, Job>(job) };
            let sender = worker.jobs.as_ref();
            match sender.map(|s| s.send(job)) {
                Some(Ok(())) => sent += 1,
                _ => {
                    results[i] = Some(Err(CudaError::Worker {
                        rank,
                        detail: "the rank thread is gone".into(),
                    }))
                }
            }
        }
        drop(done_tx);
        for _ in 0..sent {
            match recv_soon(&done_rx, ANSWER_WINDOW) {
                Ok((i, r)) => results[i] = Some(r),
                // Every sender is dropped only after its job ran or was dropped unrun.
                Err(_) => break,
            }
        }
        let mut out = Vec::with_capacity(local);
        for (i, r) in results.into_iter().enumerate() {
            let rank = self.ranks[i];
            match r {
                Some(Ok(v)) => out.push(v),
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(CudaError::Worker {
                        rank,
                        detail: "the rank thread stopped before answering".into(),
                    })
                }
            }
        }
        Ok(out)
    }
}

impl Drop for ThreadRankPool {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs.take();
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}
